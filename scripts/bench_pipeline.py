"""Pipeline bubble, step time and activation memory of each schedule, measured against theory.

    DS_ACCELERATOR=cpu python scripts/bench_pipeline.py                  # pp=2, m=1..16, 3 repeats
    DS_ACCELERATOR=cpu python scripts/bench_pipeline.py --pp 2 4 --width 512 --repeats 5
    DS_ACCELERATOR=cpu python scripts/bench_pipeline.py --schedules 1f1b zero_bubble --micro 8 \
        --steps 1 --repeats 1 --width 32 --layers 4 --seq 8      # a smoke run, seconds

For each pipeline size ``p`` (``p`` gloo processes, one thread each), each schedule of the
pipeline plugin (``--schedules``) and each number of micro-batches ``m`` (``--micro``), it builds
a GPT (``--layers`` blocks, width ``--width``, ``--seq`` tokens, ``--micro-batch`` sequences per
micro-batch) split by the plugin (``balance=layers``), runs one warm-up step and ``--steps``
measured steps through the same ``torch.distributed.pipelining`` schedule the plugin uses. The
whole sweep runs ``--repeats`` times, interleaved (every case once, then every case again), so a
change in the machine's load hits every schedule alike. It prints the load average at the start
and the end, and a markdown table of medians over the repetitions:

- ``bubble``: the idle fraction of each rank over a step, ``1 - busy / step time``, where
  *busy* sums the wall time of this rank's forward / backward / weight-backward calls
  (timestamps around ``PipelineStage.forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk``); per repetition the mean over ranks (of each rank's mean over
  the steps) and the worst rank, then the median over repetitions.
- ``theory``: ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v·m+p-1)`` for interleaved 1F1B with
  ``v`` stages per rank; for the zero-bubble schedules the ZB-H1 estimate ``(p-1)/(3m+p-1)``
  (equal forward, input-backward and weight-backward times), with ``v`` as for interleaving.
- ``step ms``: the slowest rank's median step time, median over repetitions.
- ``in flight``: the most (stage, micro-batch) activations a rank holds at once (forwards done
  minus the backwards that free them: the full backward, or the weight backward for the
  zero-bubble schedules), per rank; ``act MiB``: the peak of the same count weighted by the bytes
  one micro-batch saves for backward in that stage (measured with ``saved_tensors_hooks``,
  weights excluded). 1F1B keeps at most ``p - rank`` in flight where GPipe keeps all ``m``.
  These do not depend on the load.

``n/a`` marks a combination torch refuses (1F1B needs ``m >= p``). A ``p`` above the machine's
core count is refused (exit 2) unless ``--oversubscribe``: ranks sharing a core show each other's
compute as bubble, so such timings are not figures.
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
from plait.plugins.pipeline.schedules import SCHEDULES, make_schedule, stage_to_rank
from plait.plugins.pipeline.split import build_stage_modules, split_stages
from plait.testing import spawn

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


def activation_bytes(chunk, x: torch.Tensor, first: bool, shape: dict) -> int:
    """Bytes one micro-batch saves for backward in ``chunk`` (weights not counted)."""
    weights = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    hidden = torch.randn(x.shape[0], shape["seq"], shape["width"], requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk(x if first else hidden)
    return sum(saved.values())


def measure(rank: int, world: int, schedule: str, m: int, steps: int, shape: dict):
    """One (schedule, m) case on this rank: ``(bubble, step s, in flight, act bytes)``, the
    bubble the mean and the step time the median over ``steps`` measured steps after a
    warm-up; None where torch refuses the combination."""
    from torch.distributed.pipelining import PipelineStage

    n_stages = world * VIRTUAL[schedule]
    placement = stage_to_rank(world, n_stages, SCHEDULES[schedule][2])
    torch.manual_seed(0)
    model = GPT(n_layer=shape["layers"], n_embd=shape["width"], n_head=4, block_size=shape["seq"])
    split = split_stages(model, n_stages, "layers")
    mine = [s for s in range(n_stages) if placement[s] == rank]
    stage_modules = build_stage_modules(model, split, mine)
    stages = [PipelineStage(c, i, n_stages, torch.device("cpu")) for i, c in stage_modules.chunks]
    try:
        sched = make_schedule(schedule, stages, m, loss_fn)
    except ValueError:
        return None
    batch = shape["micro_batch"]
    x = torch.randint(0, 256, (batch * m, shape["seq"]))
    y = torch.randint(0, 256, (batch * m, shape["seq"]))
    sizes = {i: activation_bytes(c, x[:batch], i == 0, shape) for i, c in stage_modules.chunks}
    recorder = Recorder(schedule in ("zero_bubble", "zbv"), sizes)
    for stage in stages:
        recorder.wrap(stage)
    bubbles, times, peaks = [], [], []
    for step in range(steps + 1):
        recorder.reset()
        dist.barrier()
        started = time.perf_counter()
        sched.step(x, target=y, losses=[], return_outputs=False)
        elapsed = time.perf_counter() - started
        stage_modules.zero_grad(set_to_none=True)
        if step:  # the first step is a warm-up (shape inference, allocation)
            bubbles.append(1 - recorder.busy / elapsed)
            times.append(elapsed)
            peaks.append((recorder.peak, recorder.peak_bytes))
    return (statistics.mean(bubbles), statistics.median(times), *max(peaks))


def bench_rank(
    rank: int,
    world: int,
    schedules: list[str],
    micro: list[int],
    steps: int,
    repeats: int,
    shape: dict,
    out_dir: str,
) -> None:
    """Every case ``repeats`` times, interleaved: the whole sweep once, then again, so that a
    change in the machine's load hits every schedule alike."""
    torch.set_num_threads(1)
    results: dict[tuple[str, int], list] = {(s, m): [] for s in schedules for m in micro}
    for _ in range(repeats):
        for schedule in schedules:
            for m in micro:
                results[(schedule, m)].append(measure(rank, world, schedule, m, steps, shape))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def report(p: int, schedules: list[str], micro: list[int], repeats: int, out_dir: str) -> None:
    """Per case, the median over the repetitions of: the bubble's mean over ranks, the worst
    rank's bubble, and the step time (the slowest rank's); activations from the first."""
    per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(p)]
    print(f"\n### pp = {p} (median of {repeats} interleaved repetition(s))\n")
    print(
        "| schedule | m | bubble: mean / worst rank | theory | step ms | in flight per rank | "
        "act MiB per rank |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for schedule in schedules:
        for m in micro:
            runs = [rows[(schedule, m)] for rows in per_rank]  # [rank][repetition]
            if runs[0][0] is None:
                print(
                    f"| {schedule} | {m} | n/a | {theory(schedule, p, m):.3f} | n/a | n/a | n/a |"
                )
                continue
            reps = list(zip(*runs))  # [repetition][rank]
            mean = statistics.median(statistics.mean(r[0] for r in rep) for rep in reps)
            worst = statistics.median(max(r[0] for r in rep) for rep in reps)
            step_ms = 1e3 * statistics.median(max(r[1] for r in rep) for rep in reps)
            flights = " / ".join(str(r[2]) for r in reps[0])
            mib = " / ".join(f"{r[3] / 2**20:.1f}" for r in reps[0])
            print(
                f"| {schedule} | {m} | {mean:.3f} / {worst:.3f} | {theory(schedule, p, m):.3f} "
                f"| {step_ms:.1f} | {flights} | {mib} |"
            )
    sys.stdout.flush()


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2])
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    parser.add_argument("--steps", type=int, default=3, help="measured steps per case")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved repetitions of the whole sweep; medians are printed",
    )
    parser.add_argument("--width", type=int, default=128, help="model.n_embd")
    parser.add_argument("--layers", type=int, default=8, help="model.n_layer")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow more ranks than CPU cores (their timings are not figures)",
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if max(args.pp) > cores and not args.oversubscribe:
        print(
            f"bench_pipeline: --pp {max(args.pp)} needs {max(args.pp)} cores, this machine has "
            f"{cores}: a rank waiting for a peer that shares its core shows that wait as "
            "bubble. Use a smaller --pp, or --oversubscribe for a run whose timings you will "
            "not report",
            file=sys.stderr,
        )
        return 2
    import tempfile

    shape = {
        "layers": args.layers,
        "width": args.width,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
    }
    print(
        f"GPT {args.layers} blocks, width {args.width}, seq {args.seq}, {args.micro_batch} "
        f"sequences per micro-batch; {args.steps} measured steps after 1 warm-up per case, "
        f"{args.repeats} interleaved repetition(s); gloo, 1 thread per rank; {cores} CPU "
        f"cores; load average {load_average()} (1, 5, 15 min) at the start"
    )
    for p in args.pp:
        with tempfile.TemporaryDirectory() as out_dir:
            spawn(
                bench_rank, p, args.schedules, args.micro, args.steps, args.repeats, shape, out_dir
            )
            report(p, args.schedules, args.micro, args.repeats, out_dir)
    print(f"\nload average {load_average()} (1, 5, 15 min) at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
