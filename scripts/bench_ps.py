"""Parameter servers against all-reduce, local SGD and DiLoCo, with and without a straggler.

    DS_ACCELERATOR=cpu python scripts/bench_ps.py
    DS_ACCELERATOR=cpu python scripts/bench_ps.py --steps 40 --workers 2 --mid   # bigger model
    sudo DS_ACCELERATOR=cpu python scripts/bench_ps.py --rate 100mbit   # links between nodes
    DS_ACCELERATOR=cpu python scripts/bench_ps.py --strategies async_ps --no-stragglers \
        --steps 3 --warmup 1 --batch 4 --device-ms 0                  # a smoke run, one job

Each strategy trains the same model on ``--workers`` workers (plus one server for the parameter
servers) for ``--steps`` steps, first with every worker at full speed, then with the last worker
slowed 2x: before each forward pass it sleeps one more step (DDP's mean step without straggler,
measured first in the same command). It prints, per strategy and case:

- throughput: samples/s summed over the workers, each worker's own steps over its own time
  (after ``--warmup`` steps; for lockstep strategies this is the global batch per step time);
- the ratio of the straggler case to the no-straggler case (the target: async PS and local SGD
  keep >= 0.9x, sync DDP drops to about 0.5x);
- the loss reached after a fixed wall time: the logging worker's last loss logged before
  ``--budget`` seconds (default: the time DDP without straggler took).

Emulated device time (``--device-ms``, default 100; straggler table only): every worker sleeps
that long before each forward pass, the time a step would spend on its accelerator. On a cluster
each worker computes on its own device; here all workers share the host's cores, so a straggler
that sleeps hands its core to the others and hides its own slowness (without emulation, DDP
measured *faster* with the straggler than without). With the step dominated by device time the
workers no longer compete for the CPU and a 2x straggler is 2x. ``--device-ms 0`` measures the
CPU alone.

With N workers and one at half speed, asynchronous training can keep at most (N - 0.5) / N of
the no-straggler throughput (0.75x at N = 2, 0.92x at N = 6), and lockstep training (DDP, sync PS)
falls to 0.5x; local SGD waits for the straggler at every averaging, so a *persistent* straggler
holds it near 0.5x too. The third case, a moving straggler (each step one worker is 2x slow, a
different one each step), is what local SGD hides: lockstep training still waits every step
(0.5x), local SGD once per H steps for the worker slowed most often in them (about
H / (H + ceil(H / N)), 0.8x at H = 4), and async PS loses 1 / (N + 1) (0.86x at N = 6).

With ``--rate`` it measures the link instead of the straggler: every process runs as its own
"node" (``scripts/netns_cluster.py``: network namespaces on a bridge; needs root), so every push,
reply and all-reduce crosses a veth link between nodes, first free, then limited by ``tc``'s
``tbf`` to ``--rate`` (the parameter servers on a node of their own, as they are deployed). Per
strategy it prints the throughput on each link and its ratio (samples/s: the global batch over
the mean slowest-rank step time after ``--warmup`` steps; async PS: the workers' own samples/s
summed), the loss after the budget (the step times summed as the clock), and the bytes the
logging worker's link carried per step (tx + rx).

All runs are made by this one command, so ratios compare like with like on a shared machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from plait import hookimpl
from plait.testing import StepClock, link_bytes_per_step, read_metrics, run_training

STRATEGIES = {
    "ddp (all-reduce)": ["strategy=ddp"],
    "sync PS": ["strategy=parameter_server", "strategy.mode=sync"],
    "async PS": ["strategy=parameter_server", "strategy.mode=async", "strategy.max_staleness=4"],
    "local SGD (H=4)": ["strategy=local_sgd", "strategy.sync_every=4"],
    "DiLoCo (H=4)": ["strategy=diloco", "strategy.sync_every=4"],
}
# --strategies: the short name of each
SHORT = dict(zip(("ddp", "sync_ps", "async_ps", "local_sgd", "diloco"), STRATEGIES))
CASES = ("no straggler", "straggler 2x", "moving straggler")
MID = ["model.n_layer=4", "model.n_embd=256", "model.n_head=4"]


class EmulatedDevice:
    """Every training rank sleeps ``seconds`` before each forward pass (device time); global rank
    ``straggler`` sleeps ``extra`` more. With ``moving=(first, n)`` the straggler moves instead:
    at its k-th forward pass worker ``first + k % n`` sleeps ``extra`` more (one slow worker per
    step, a different one each step: stragglers that come and go)."""

    def __init__(
        self,
        seconds: float,
        straggler: int = -1,
        extra: float = 0.0,
        moving: tuple[int, int] | None = None,
    ):
        self.seconds, self.straggler, self.extra, self.moving = seconds, straggler, extra, moving

    @hookimpl
    def plait_apply_tensor_parallel(self, model, topology):
        if self.moving:
            first, n = self.moving
            passes = itertools.count()
            model.register_forward_pre_hook(
                lambda module, args: time.sleep(
                    self.seconds + (self.extra if next(passes) % n == topology.rank - first else 0)
                )
            )
            return
        pause = self.seconds + (self.extra if topology.rank == self.straggler else 0.0)
        if pause:
            model.register_forward_pre_hook(lambda module, args: time.sleep(pause))


def servers(overrides: list[str]) -> int:
    return int("strategy=parameter_server" in overrides)


def run(
    root: Path, name: str, overrides: list[str], args, slow_seconds: float, moving: bool = False
) -> dict:
    workers, extra = args.workers, servers(overrides)
    run_dir = root / name
    clock = root / f"{name}.clock"
    device = EmulatedDevice(
        args.device_ms / 1e3,
        straggler=extra + workers - 1,
        extra=slow_seconds,
        moving=(extra, workers) if moving else None,
    )
    plugins = [StepClock(clock), device]
    started = time.perf_counter()
    run_training(
        run_dir,
        [
            *args.common,
            *overrides,
            f"launcher.nproc_per_node={workers + extra}",
            f"train.batch_size={args.batch}",
            f"train.steps={args.steps}",
        ],
        plugins=plugins,
    )
    stamps = [float(line) for line in clock.read_text().split()]
    metrics = read_metrics(run_dir)
    last = metrics[-1]
    per_worker = [
        v for k, v in last.items() if k.startswith("ps/worker") and k.endswith("/samples_per_s")
    ]
    if per_worker and "strategy.mode=async" in overrides:  # workers at their own pace
        throughput = sum(per_worker)
    else:
        timed = stamps[args.warmup :]
        throughput = args.batch * (len(timed) - 1) / (timed[-1] - timed[0])
    return {
        "throughput": throughput,
        "stamps": stamps,
        "losses": {m["step"]: m["loss"] for m in metrics},
        "wall_s": time.perf_counter() - started,
    }


def loss_at(result: dict, budget: float) -> float:
    start = result["stamps"][0]
    seen = [
        loss
        for step, loss in sorted(result["losses"].items())
        if result["stamps"][step - 1] - start <= budget
    ]
    return seen[-1] if seen else float("nan")


def full_speed_step_seconds(result: dict, args) -> float:
    """The mean step of a run without straggler (after ``--warmup``): what the straggler sleeps
    on top of its own step to be 2x slower. Measured on the job itself, not on one process
    alone: here the workers share the host's cores, so a step is the device time plus the
    compute they contend for (a solo step's sleep made the straggler only ~1.35x slower)."""
    stamps = result["stamps"][args.warmup :]
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def run_on_nodes(root: Path, name: str, overrides: list[str], args, rate: str | None) -> dict:
    """One process per namespace "node", each node's link limited to ``rate`` (None: free)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from netns_cluster import run_job

    processes = args.workers + servers(overrides)
    summary = run_job(
        processes,
        1,
        [
            *args.common,
            *overrides,
            f"train.batch_size={args.batch}",
            f"train.steps={args.steps}",
            f"run.root={root}",
            f"run.name={name}",
            "+plugins=[plait.testing:link_counter]",
        ],
        rate=rate,
    )
    if any(summary["exit_codes"]):
        raise SystemExit(f"bench_ps: plait train failed: {summary}")
    metrics = read_metrics(root / name)
    step_s = [m["step_time_s/max"] for m in metrics]
    per_worker = [
        v
        for k, v in metrics[-1].items()
        if k.startswith("ps/worker") and k.endswith("/samples_per_s")
    ]
    if per_worker and "strategy.mode=async" in overrides:
        throughput = sum(per_worker)
    else:
        throughput = args.batch / statistics.mean(step_s[args.warmup :])
    return {
        "throughput": throughput,
        "stamps": list(itertools.accumulate(step_s)),
        "losses": {m["step"]: m["loss"] for m in metrics},
        "link_mb_per_step": link_bytes_per_step(root / name, args.warmup) / 1e6,
    }


def link_table(args, strategies: dict[str, list[str]]) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in strategies.items():  # free and limited alternate per strategy
            for rate in (None, args.rate):
                tag = f"{name}-{rate or 'free'}".replace(" ", "_").replace("(", "").replace(")", "")
                results[(name, rate)] = run_on_nodes(
                    Path(tmp), tag.replace("=", ""), overrides, args, rate
                )
    first = results[(next(iter(strategies)), None)]  # DDP unless left out
    budget = args.budget or first["stamps"][-1] - first["stamps"][0]
    print(
        f"\n{args.workers} workers, each on its own node (+1 node for the server), global batch "
        f"{args.batch}, {args.steps} steps; links free and at {args.rate}; loss after "
        f"{budget:.1f} s of training\n"
    )
    print(
        f"| strategy | samples/s, free | samples/s, {args.rate} | ratio | loss @ {budget:.0f} s, "
        f"free | loss @ {budget:.0f} s, {args.rate} | MB per step on the logging worker's link |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in strategies:
        free, slow = results[(name, None)], results[(name, args.rate)]
        print(
            f"| {name} | {free['throughput']:.1f} | {slow['throughput']:.1f} | "
            f"{slow['throughput'] / free['throughput']:.2f}x | {loss_at(free, budget):.3f} | "
            f"{loss_at(slow, budget):.3f} | {slow['link_mb_per_step']:.2f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({f"{k[0]}|{k[1] or 'free'}": v for k, v in results.items()})
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--mid", action="store_true", help="a 4-layer, 256-wide GPT")
    parser.add_argument(
        "--device-ms",
        type=float,
        default=100.0,
        help="emulated device time per forward pass on every worker (0: none)",
    )
    parser.add_argument("--budget", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--rate", default=None, help="measure links instead of a straggler: tbf rate, e.g. 100mbit"
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=list(SHORT),
        default=list(SHORT),
        help="the strategies to run (the loss budget is the first one's time)",
    )
    parser.add_argument(
        "--stragglers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-stragglers: the no-straggler case only",
    )
    args = parser.parse_args()
    strategies = {SHORT[s]: STRATEGIES[SHORT[s]] for s in args.strategies}
    cases = CASES if args.stragglers else CASES[:1]
    args.common = [
        "model=gpt_tiny",
        "tracker=none",
        "device=cpu",
        "train.seq_len=64",
        "optimizer.warmup_steps=2",
        "train.log_every=1",
        *(MID if args.mid else []),
    ]
    if args.rate:
        link_table(args, strategies)
        return
    # On every logged step the core reduces step time and memory over the step group, a
    # collective: logging every step would hold local SGD and DiLoCo in lockstep, so this table
    # logs every 4th step, where their replicas meet anyway (H=4).
    args.common = [*args.common, "train.log_every=4"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results, delay = {}, None
        for name, overrides in strategies.items():  # each strategy's cases back to back
            for case in cases:
                if delay is None and case != "no straggler":  # after DDP's full-speed run
                    delay = full_speed_step_seconds(results[(name, "no straggler")], args)
                    print(
                        f"device time {args.device_ms:.0f} ms per forward on every worker; "
                        f"straggler: the last worker sleeps {delay * 1e3:.0f} ms more (one "
                        f"full-speed step of {name}: 2x slower)"
                    )
                tag = f"{name}|{case}".replace(" ", "_").replace("(", "").replace(")", "")
                tag = tag.replace("|", "-").replace("=", "")
                seconds = delay if case != "no straggler" else 0.0
                results[(name, case)] = run(
                    root, tag, overrides, args, seconds, moving=case == "moving straggler"
                )
    first = results[(next(iter(strategies)), "no straggler")]  # DDP unless left out
    budget = args.budget or first["stamps"][-1] - first["stamps"][0]
    print(
        f"\n{args.workers} workers, global batch {args.batch}, {args.steps} steps; loss after "
        f"{budget:.1f} s of training\n"
    )
    print(
        f"| strategy | samples/s | straggler 2x: samples/s | ratio | moving straggler: "
        f"samples/s | ratio | loss @ {budget:.0f} s | straggler 2x | moving |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in strategies:
        base = results[(name, "no straggler")]
        row = [f"{base['throughput']:.1f}"]
        for case in CASES[1:]:
            got = results.get((name, case))
            row += (
                [f"{got['throughput']:.1f}", f"{got['throughput'] / base['throughput']:.2f}x"]
                if got
                else ["-", "-"]
            )
        losses = [
            f"{loss_at(results[(name, c)], budget):.3f}" if (name, c) in results else "-"
            for c in CASES
        ]
        print(f"| {name} | {' | '.join(row)} | {' | '.join(losses)} |")
    if args.json:
        args.json.write_text(json.dumps({f"{k[0]}|{k[1]}": v for k, v in results.items()}))


if __name__ == "__main__":
    main()
