"""Parameter servers against all-reduce, local SGD and DiLoCo, with and without a straggler.

    DS_ACCELERATOR=cpu python scripts/bench_ps.py
    DS_ACCELERATOR=cpu python scripts/bench_ps.py --steps 40 --workers 2 --mid   # bigger model

Each strategy trains the same model on ``--workers`` workers (plus one server for the parameter
servers) for ``--steps`` steps, first with every worker at full speed, then with the last worker
slowed about 2x (``plait.testing.SlowRank``: before each forward pass it sleeps one local step's
compute time, measured first on one process). It prints, per strategy and case:

- throughput: samples/s summed over the workers, each worker's own steps over its own time
  (after ``--warmup`` steps; for lockstep strategies this is the global batch per step time);
- the ratio of the straggler case to the no-straggler case (the target: async PS and local SGD
  keep >= 0.9x, sync DDP drops to about 0.5x);
- the loss reached after a fixed wall time: the logging worker's last loss logged before
  ``--budget`` seconds (default: the time DDP without straggler took).

All runs are made by this one command, so ratios compare like with like on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from plait.testing import SlowRank, StepClock, read_metrics, run_training

STRATEGIES = {
    "ddp (all-reduce)": ["strategy=ddp"],
    "sync PS": ["strategy=parameter_server", "strategy.mode=sync"],
    "async PS": ["strategy=parameter_server", "strategy.mode=async", "strategy.max_staleness=4"],
    "local SGD (H=4)": ["strategy=local_sgd", "strategy.sync_every=4"],
    "DiLoCo (H=4)": ["strategy=diloco", "strategy.sync_every=4"],
}
MID = ["model.n_layer=4", "model.n_embd=256", "model.n_head=4"]


def servers(overrides: list[str]) -> int:
    return int("strategy=parameter_server" in overrides)


def run(root: Path, name: str, overrides: list[str], args, slow_seconds: float) -> dict:
    workers, extra = args.workers, servers(overrides)
    run_dir = root / name
    clock = root / f"{name}.clock"
    plugins = [StepClock(clock)]
    if slow_seconds:
        plugins.append(SlowRank(rank=extra + workers - 1, seconds=slow_seconds))
    started = time.perf_counter()
    run_training(run_dir, [*args.common, *overrides, f"launcher.nproc_per_node={workers + extra}",
                           f"train.batch_size={args.batch}", f"train.steps={args.steps}"],
                 plugins=plugins)
    stamps = [float(line) for line in clock.read_text().split()]
    metrics = read_metrics(run_dir)
    last = metrics[-1]
    per_worker = [v for k, v in last.items() if k.startswith("ps/worker") and k.endswith("/samples_per_s")]
    if per_worker and "strategy.mode=async" in overrides:  # workers at their own pace
        throughput = sum(per_worker)
    else:
        timed = stamps[args.warmup:]
        throughput = args.batch * (len(timed) - 1) / (timed[-1] - timed[0])
    return {"throughput": throughput, "stamps": stamps, "losses": [m["loss"] for m in metrics],
            "wall_s": time.perf_counter() - started}


def loss_at(result: dict, budget: float) -> float:
    start = result["stamps"][0]
    seen = [loss for t, loss in zip(result["stamps"], result["losses"]) if t - start <= budget]
    return seen[-1] if seen else float("nan")


def local_step_seconds(root: Path, args) -> float:
    """One worker's compute per micro-batch forward+backward: what SlowRank sleeps to slow it 2x."""
    clock = root / "solo.clock"
    run_training(root / "solo", [*args.common, "launcher.nproc_per_node=1",
                                 f"train.batch_size={args.batch // args.workers}",
                                 f"train.steps={args.steps}"], plugins=[StepClock(clock)])
    stamps = [float(line) for line in clock.read_text().split()][args.warmup:]
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--mid", action="store_true", help="a 4-layer, 256-wide GPT")
    parser.add_argument("--budget", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.common = ["model=gpt_tiny", "tracker=none", "device=cpu", "train.seq_len=64",
                   "optimizer.warmup_steps=2", "train.log_every=1", *(MID if args.mid else [])]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        delay = local_step_seconds(root, args)
        print(f"straggler: the last worker sleeps {delay * 1e3:.0f} ms before each forward "
              "(one local step's time: about 2x slower)")
        results = {}
        for case, seconds in (("no straggler", 0.0), ("straggler 2x", delay)):
            for name, overrides in STRATEGIES.items():
                tag = f"{name}|{case}".replace(" ", "_").replace("(", "").replace(")", "")
                tag = tag.replace("|", "-").replace("=", "")
                results[(name, case)] = run(root, tag, overrides, args, seconds)
    budget = args.budget or (results[("ddp (all-reduce)", "no straggler")]["stamps"][-1]
                             - results[("ddp (all-reduce)", "no straggler")]["stamps"][0])
    print(f"\n{args.workers} workers, global batch {args.batch}, {args.steps} steps; loss after "
          f"{budget:.1f} s of training\n")
    print(f"| strategy | samples/s | samples/s, straggler | ratio | loss @ {budget:.0f} s | "
          "loss @ budget, straggler |")
    print("|---|---|---|---|---|---|")
    for name in STRATEGIES:
        base, slow = results[(name, "no straggler")], results[(name, "straggler 2x")]
        print(f"| {name} | {base['throughput']:.1f} | {slow['throughput']:.1f} | "
              f"{slow['throughput'] / base['throughput']:.2f}x | {loss_at(base, budget):.3f} | "
              f"{loss_at(slow, budget):.3f} |")
    if args.json:
        args.json.write_text(json.dumps({f"{k[0]}|{k[1]}": v for k, v in results.items()}))


if __name__ == "__main__":
    main()
