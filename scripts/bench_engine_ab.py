"""plait's engine and the plain loop's step side by side in the same processes, timed in
alternating blocks: what plait's step costs, with the host's speed shared alike.

    DS_ACCELERATOR=cpu python scripts/bench_engine_ab.py --rows fsdp ddp --blocks 20
    DS_ACCELERATOR=cpu python scripts/bench_engine_ab.py --rows zero1 --save turns/

``bench_parity.py`` compares whole commands, each a fresh set of processes; on this shared host
a process keeps a speed of its own for its life (the ninth session measured the plain loop
against itself at 0.74-1.26 in a single pair), so a row's ratio moves by several percent
between sessions. Here both sides live in the same ``--nproc`` processes (gloo): plait's engine
built by plait's own hooks as ``plait train`` builds it (the strategy's ``plait_build_engine``,
the model materialized by its plugin, plait's optimizer, the step guard's
``plait_check_step``), and the row's plain step from ``parity_loops.py`` (:data:`STEPS`: DDP,
``deepspeed.initialize``, ``fully_shard``, the experts' ``all_to_all_single`` dispatch), on the
same model, settings and batches (``bench_parity.py``'s), with the allocator ``--allocator``
names (plait's ``launcher.allocator``, preloaded in both sides' processes alike). After
``--warmup`` steps of each, they take turns of ``--block-steps`` steps, ``--blocks`` times each
(ABBA order), every turn started by a barrier; a step's time includes reading its loss (plait's
``StepOutput.loss``, the plain ``loss.item()``). What is not here: plait's loop around the
engine (loader, hooks, metrics), which ``bench_parity.py`` measures.

It prints, per row, each side's median step time, the median of the turns' ratios plain/plait
(each plait turn against the mean of the plain turns within two turns of it) with a 95% bootstrap
interval, and the load average before and after; ``--save DIR`` keeps each row's turns
(``DIR/<row>.json``: ``[side, wall seconds, CPU seconds]`` per step, in the order they ran).
Beside the wall clock it gives rank 0's process CPU time per step (all its threads) the same
way: what each side computes, which the host's speed moves less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

from bench_parity import load, plain_spec, plait_overrides, summary  # noqa: E402
from parity_loops import STEPS, batches  # noqa: E402

from plait.host_memory import preload, with_preload  # noqa: E402
from plait.testing import spawn  # noqa: E402


def plait_engine(cfg):
    """plait's engine for ``cfg``, built by the selected plugins' hooks as ``plait train`` builds
    it (``plait.train.build_engine``)."""
    from plait.plugin_manager import keep_selected, make_plugin_manager
    from plait.topology import Topology
    from plait.train import build_engine, seed_everything

    hook = keep_selected(make_plugin_manager(cfg), cfg).hook
    topology = Topology.initialize(cfg)
    seed_everything(cfg.seed)
    engine, _, _ = build_engine(cfg, hook, topology)
    return engine


def ab_rank(rank: int, world_size: int, overrides: list, spec: dict, args: dict, out: str):
    import torch
    import torch.distributed as dist

    from plait.testing import compose

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    cfg = compose(overrides)
    engine = plait_engine(cfg)
    plain = STEPS[spec["loop"]](spec, torch.device("cpu"))
    data = batches(spec, rank, world_size, torch.device("cpu"))
    window = [next(data) for _ in range(4)]  # the same few batches for both sides, in turn
    lr = cfg.optimizer.lr
    steps = {
        "plait": lambda x, y: engine.train_step([(x, y)], lr).loss,
        "plain": lambda x, y: plain(x, y, lr).item(),
    }
    seen = 0

    def run(side: str, n: int) -> tuple[str, float, float]:
        """``(side, wall seconds, process CPU seconds)`` per step over ``n`` steps."""
        nonlocal seen
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            steps[side](*window[seen % len(window)])
            seen += 1
        return side, (time.perf_counter() - start) / n, (time.process_time() - cpu) / n

    for side in steps:
        run(side, args["warmup"])
    turns: list[tuple[str, float, float]] = []
    for block in range(args["blocks"]):
        order = list(steps) if block % 2 == 0 else list(reversed(steps))  # ABBA
        turns += [run(side, args["block_steps"]) for side in order]
    if rank == 0:
        Path(out).write_text(json.dumps(turns))


def turn_ratios(turns: list, column: int = 1) -> list[float]:
    """Each plait turn's plain/plait ratio against the mean of the plain turns beside it, of
    ``column`` (1: wall seconds per step, 2: CPU seconds per step)."""
    ratios = []
    for i, turn in enumerate(turns):
        if turn[0] != "plait":
            continue
        beside = [t[column] for t in turns[max(0, i - 2) : i + 3] if t[0] == "plain"]
        ratios.append(statistics.fmean(beside) / turn[column])
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(STEPS), default=["fsdp", "ddp"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=20, help="turns of each side")
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--allocator", default="auto", help="plait's launcher.allocator")
    parser.add_argument("--save", type=Path, help="write each row's turns into this folder")
    args = parser.parse_args()
    os.environ.update(with_preload(dict(os.environ), preload(args.allocator)))  # the children's
    # bench_parity.py's settings for a CPU row, so both benchmarks train the same thing
    parity = argparse.Namespace(
        **vars(args),
        device="cpu",
        precision="fp32",
        steps=args.warmup + 2 * args.blocks * args.block_steps,
        microbatches=1,
        model="gpt",
        plait_overrides=[],
    )
    print(
        f"# {args.nproc} processes, GPT {args.n_layer} x {args.n_embd}, batch {args.batch_size}"
        f" x {args.seq_len}; {args.blocks} turns of {args.block_steps} steps per side; "
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}"
    )
    print(
        "| row | step s plait | step s plain | plain/plait: turns median [95%] (range) "
        "| CPU s/step plait | plain | plain/plait: turns median [95%] | load |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in args.rows:
        with tempfile.TemporaryDirectory() as tmp:
            overrides = plait_overrides(parity, row, Path(tmp) / "run")
            spec = plain_spec(parity, row, overrides)
            out = Path(tmp) / "turns.json"
            before = load()
            options = {k: getattr(args, k) for k in ("blocks", "block_steps", "warmup")}
            spawn(ab_rank, args.nproc, overrides, spec, options, str(out))
            turns = json.loads(out.read_text())
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            (args.save / f"{row}.json").write_text(json.dumps(turns))
        wall, cpu = (
            {s: [t[c] for t in turns if t[0] == s] for s in ("plait", "plain")} for c in (1, 2)
        )
        print(
            f"| {row} | {statistics.median(wall['plait']):.4f} | "
            f"{statistics.median(wall['plain']):.4f} | {summary(turn_ratios(turns))} | "
            f"{statistics.median(cpu['plait']):.4f} | {statistics.median(cpu['plain']):.4f} | "
            f"{summary(turn_ratios(turns, 2))} | {before} / {load()} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
