"""Pipeline bubble and activation memory of each schedule, measured against theory.

    DS_ACCELERATOR=cpu python scripts/bench_pipeline.py            # pp = 2 and 4, m = 1..16
    DS_ACCELERATOR=cpu python scripts/bench_pipeline.py --pp 2 --micro 4 8 --steps 2

For each pipeline size ``p`` (``p`` gloo processes, one thread each), each schedule of the
pipeline plugin and each number of micro-batches ``m``, it builds a GPT (8 blocks, width 128
or ``--width``, sequence 64, 4 sequences per micro-batch) split by the plugin
(``balance=layers``), runs one warm-up step and ``--steps`` measured steps through the same
``torch.distributed.pipelining`` schedule the plugin uses, and prints a markdown table:

- ``bubble``: the idle fraction of each stage over a step, ``1 - busy / step time``, where
  *busy* sums the wall time of this rank's forward / backward / weight-backward calls
  (timestamps around ``PipelineStage.forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk``); mean over ranks and steps, and the worst rank.
- ``theory``: ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v·m+p-1)`` for interleaved 1F1B with
  ``v`` stages per rank; for the zero-bubble schedules the ZB-H1 estimate ``(p-1)/(3m+p-1)``
  (equal forward, input-backward and weight-backward times), with ``v`` as for interleaving.
- ``in flight``: the most (stage, micro-batch) activations a rank holds at once (forwards done
  minus the backwards that free them: the full backward, or the weight backward for the
  zero-bubble schedules), per rank; ``act MiB``: the peak of the same count weighted by the bytes
  one micro-batch saves for backward in that stage (measured once with ``saved_tensors_hooks``,
  weights excluded). 1F1B keeps at most ``p - rank`` in flight where GPipe keeps all ``m``.

``n/a`` marks a combination torch refuses (1F1B needs ``m >= p``). The machine this ran on for
``docs/benchmarks.md`` has 2 cores, so ``p = 4`` is oversubscribed and its timings are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.plugins.models.gpt import GPT
from plait.plugins.pipeline import SCHEDULES, make_schedule, stage_to_rank
from plait.plugins.pipeline.split import build_stage_modules, split_stages
from plait.testing import spawn

N_LAYER, SEQ, MICRO_BATCH = 8, 64, 4
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1, "zbv": 2}


def theory(schedule: str, p: int, m: int) -> float:
    v = VIRTUAL[schedule]
    work = 3 * m if schedule in ("zero_bubble", "zbv") else m
    return (p - 1) / (v * work + p - 1)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


class Recorder:
    """Wraps a rank's stages' compute calls: busy seconds, and the (stage, micro-batch)
    activations held for backward, counted and in bytes."""

    def __init__(self, split_backward: bool, bytes_per_stage: dict[int, int]):
        self.split_backward = split_backward
        self.bytes_per_stage = bytes_per_stage
        self.reset()

    def reset(self) -> None:
        self.busy = 0.0
        self.held = self.held_bytes = self.peak = self.peak_bytes = 0

    def wrap(self, stage) -> None:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, self._timed(name, getattr(stage, name), stage.stage_index))

    def _timed(self, name, call, stage_index):
        def run(*args, **kwargs):
            started = time.perf_counter()
            out = call(*args, **kwargs)
            self.busy += time.perf_counter() - started
            sign = 0
            if name == "forward_one_chunk":
                sign = 1
            elif name == "backward_weight_one_chunk" or not self.split_backward:
                sign = -1
            self.held += sign
            self.held_bytes += sign * self.bytes_per_stage[stage_index]
            self.peak = max(self.peak, self.held)
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            return out
        return run


def activation_bytes(chunk, x: torch.Tensor, first: bool, width: int) -> int:
    """Bytes one micro-batch saves for backward in ``chunk`` (weights not counted)."""
    weights = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    hidden = torch.randn(x.shape[0], SEQ, width, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk(x if first else hidden)
    return sum(saved.values())


def bench_rank(rank: int, world: int, micro: list[int], steps: int, width: int,
               out_dir: str) -> None:
    torch.set_num_threads(1)
    rows = []
    for schedule in SCHEDULES:
        v = VIRTUAL[schedule]
        n_stages = world * v
        placement = stage_to_rank(world, n_stages, SCHEDULES[schedule][2])
        for m in micro:
            torch.manual_seed(0)
            model = GPT(n_layer=N_LAYER, n_embd=width, n_head=4, block_size=SEQ)
            split = split_stages(model, n_stages, "layers")
            mine = [s for s in range(n_stages) if placement[s] == rank]
            stage_modules = build_stage_modules(model, split, mine)
            from torch.distributed.pipelining import PipelineStage

            stages = [PipelineStage(c, i, n_stages, torch.device("cpu"))
                      for i, c in stage_modules.chunks]
            try:
                sched = make_schedule(schedule, stages, m, loss_fn)
            except ValueError:
                rows.append((schedule, m, None))
                continue
            x = torch.randint(0, 256, (MICRO_BATCH * m, SEQ))
            y = torch.randint(0, 256, (MICRO_BATCH * m, SEQ))
            sizes = {i: activation_bytes(c, x[:MICRO_BATCH], i == 0, width)
                     for i, c in stage_modules.chunks}
            recorder = Recorder(schedule in ("zero_bubble", "zbv"), sizes)
            for stage in stages:
                recorder.wrap(stage)
            bubbles, peaks = [], []
            for step in range(steps + 1):
                recorder.reset()
                dist.barrier()
                started = time.perf_counter()
                sched.step(x, target=y, losses=[], return_outputs=False)
                elapsed = time.perf_counter() - started
                stage_modules.zero_grad(set_to_none=True)
                if step:  # the first step is a warm-up (shape inference, allocation)
                    bubbles.append(1 - recorder.busy / elapsed)
                    peaks.append((recorder.peak, recorder.peak_bytes))
            rows.append((schedule, m, (statistics.mean(bubbles), *max(peaks))))
    torch.save(rows, os.path.join(out_dir, f"rank{rank}.pt"))


def report(p: int, micro: list[int], out_dir: str) -> None:
    per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(p)]
    print(f"\n### pp = {p}\n")
    print("| schedule | m | bubble (mean / worst rank) | theory | in flight per rank | "
          "act MiB per rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, (schedule, m, result) in enumerate(per_rank[0]):
        if result is None:
            print(f"| {schedule} | {m} | n/a | {theory(schedule, p, m):.3f} | n/a | n/a |")
            continue
        results = [rows[k][2] for rows in per_rank]
        bubbles = [r[0] for r in results]
        flights = " / ".join(str(r[1]) for r in results)
        mib = " / ".join(f"{r[2] / 2**20:.1f}" for r in results)
        print(f"| {schedule} | {m} | {statistics.mean(bubbles):.3f} / {max(bubbles):.3f} | "
              f"{theory(schedule, p, m):.3f} | {flights} | {mib} |")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=128, help="model.n_embd")
    args = parser.parse_args()
    import tempfile

    print(f"GPT {N_LAYER} blocks, width {args.width}, seq {SEQ}, {MICRO_BATCH} sequences per "
          f"micro-batch; {args.steps} measured steps after 1 warm-up; gloo, 1 thread per rank; "
          f"{os.cpu_count()} CPU cores")
    for p in args.pp:
        with tempfile.TemporaryDirectory() as out_dir:
            spawn(bench_rank, p, args.micro, args.steps, args.width, out_dir)
            report(p, args.micro, out_dir)


if __name__ == "__main__":
    main()
