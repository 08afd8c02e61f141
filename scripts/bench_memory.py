"""Per-rank peak memory and step time of plait's GPT under activation checkpointing, and under
ZeRO-1 with pipeline stages, each against its baseline in the same command.

    DS_ACCELERATOR=cpu python scripts/bench_memory.py                      # both comparisons
    DS_ACCELERATOR=cpu python scripts/bench_memory.py --only recompute --steps 6
    DS_ACCELERATOR=cpu python scripts/bench_memory.py --only recompute --cases 2 --tiny \
        --steps 2 --warmup 1                       # a smoke run: 1-layer models, figures moot
    DS_ACCELERATOR=cpu python scripts/bench_memory.py --budget-mib 1200 --layouts ddp zero1_pp2
                                                     # largest n_layer per layout, by bisection

Every case is a real ``plait train`` run (``launcher=local``, gloo, CPU). Comparisons:

- ``recompute``: ``strategy=ddp`` on 2 processes, ``train.activation_checkpointing=none``
  (baseline) | ``full`` | ``selective``; a GPT whose activations outweigh its model states
  (long sequences, narrow layers).
- ``zero1_pp``: ``parallel.pp=2`` x dp=2 on 4 processes, plain pipeline (``strategy=ddp``: each
  dp rank keeps the whole stage's optimizer states; baseline) | ``strategy=zero1`` (DeepSpeed's
  ZeRO-1 partitions them over the stage's dp group) | ``strategy=zero1`` with full recompute; a
  GPT whose model states outweigh its activations (wide layers, short sequences).

What is measured, per run (on CUDA plait logs ``torch.cuda.max_memory_allocated`` instead):

- ``peak MiB``: plait's ``peak_memory_bytes/max``, the largest peak resident set size over the
  ranks (``getrusage`` ``ru_maxrss``). CPU torch keeps no allocator statistics, so this is the
  process's, imports included;
- ``above start MiB``: that peak less the logging rank's resident size just before its model was
  built (``plait.testing.MemoryProbe``): what the model, its gradients, the optimizer states and
  the activations added. The ratios of this column are the ones to choose a layout by;
- ``optimizer MiB``: the optimizer-state bytes the ZeRO engine measured on its largest rank
  (DeepSpeed's partitions; ``-`` for DDP engines, which report none);
- ``step s``: median over the steps after ``--warmup`` of the slowest rank's step time;
- ``recomputes``: module forwards run again in backwards per step (0 without recompute).

Each figure's ratio is against the comparison's first case. The ranks share the machine's
cores, so step times show the cost of recompute on this CPU, not the speed of a real cluster;
memory figures do not depend on the load.

``--budget-mib B`` bisects ``model.n_layer`` (1 .. ``--max-layers``) for each ``--layouts`` case
(ddp, zero1, zero2, zero3, fsdp, tp2, pp2, zero1_pp2, zero1_pp2_tp2, tp2_pp2, each also
``+full``) on the ``zero1_pp`` model, keeping the largest whose peak above start fits in B MiB per
rank, and prints its parameter count and the ratio against ddp. ``--dp N`` runs the data-parallel
layouts on N processes (tp2/pp2 take N processes too, dp filling the rest), ``--precision bf16``
trains in bf16, ``--allocator`` sets ``launcher.allocator`` (the workers' host allocator: the
largest model that fits depends on it) and ``--decommit-above`` ``launcher.decommit_above``.

``--job-mib M`` (root, Linux cgroup v1 or v2) answers the user's question instead: the whole job
(launcher and every worker) runs in a memory cgroup capped at M MiB, swap off, and either finishes
or is OOM-killed; the bisection keeps the largest n_layer that finishes, and prints the kernel's
peak for the job (``memory.max_usage_in_bytes`` / ``memory.peak``) beside the per-rank figure.

    sudo DS_ACCELERATOR=cpu python scripts/bench_memory.py --dp 4 --job-mib 4096 \
        --layouts ddp zero1 zero2 zero3 fsdp tp2_pp2 zero1_pp2
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from plait.plugins.models.gpt import GPT
from plait.testing import (
    TEST_OVERRIDES,
    ImportFirst,
    MemoryProbe,
    memory_cgroup,
    read_metrics,
    run_training,
)

MIB = 2**20

# A GPT whose activations outweigh its model states, and one the other way round.
ACTIVATION_HEAVY = {"n_layer": 8, "n_embd": 256, "n_head": 8, "seq_len": 256, "batch_size": 8}
STATE_HEAVY = {"n_layer": 8, "n_embd": 512, "n_head": 8, "seq_len": 64, "batch_size": 8}
TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, "batch_size": 4}  # --tiny

DP2 = ["launcher.nproc_per_node=2"]
PP2_DP2 = ["parallel.pp=2", "pipeline.microbatches=2", "launcher.nproc_per_node=4"]
COMPARISONS = {
    "recompute": (
        ACTIVATION_HEAVY,
        {
            "ddp, recompute none": [*DP2],
            "ddp, recompute full": [*DP2, "train.activation_checkpointing=full"],
            "ddp, recompute selective": [*DP2, "train.activation_checkpointing=selective"],
        },
    ),
    "zero1_pp": (
        STATE_HEAVY,
        {
            "pp2 x dp2, ddp (plain pipeline)": [*PP2_DP2],
            "pp2 x dp2, zero1": [*PP2_DP2, "strategy=zero1"],
            "pp2 x dp2, zero1 + recompute full": [
                *PP2_DP2,
                "strategy=zero1",
                "train.activation_checkpointing=full",
            ],
        },
    ),
}


def layouts(n: int) -> dict[str, list[str]]:
    """The ``--budget-mib`` / ``--job-mib`` cases on ``n`` processes (``--dp``)."""
    procs = [f"launcher.nproc_per_node={n}"]
    pp2 = ["parallel.pp=2", "pipeline.microbatches=2"]
    return {
        "ddp": procs,
        "zero1": [*procs, "strategy=zero1"],
        "zero2": [*procs, "strategy=zero2"],
        "zero3": [*procs, "strategy=zero3"],
        "fsdp": [*procs, "strategy=fsdp"],
        "tp2": ["parallel.tp=2", *procs],
        "pp2": [*pp2, *procs],
        "tp2_pp2": ["parallel.tp=2", *pp2, *procs],
        "zero1_pp2": [*pp2, *procs, "strategy=zero1"],
        "zero1_pp2_tp2": [
            *pp2,
            "parallel.tp=2",
            f"launcher.nproc_per_node={2 * n}",
            "strategy=zero1",
        ],
    }


# Libraries a run imports while it builds and steps, imported before the pre-model baseline
# (``ImportFirst``) so that "above start" is the model's and the engine's memory, what ``plait
# estimate`` predicts: every layout's torch optimizer imports torch._dynamo, its DTensor code
# torch.distributed.fsdp; DeepSpeed's ZeRO optimizer checks for Muon, whose module compiles
# with torch.compile (inductor's imports); pipeline stages import torch's pipelining.
LIBRARIES = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor")
ZERO_LIBRARIES = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer")
PIPELINE_LIBRARIES = ("torch.distributed.pipelining",)


def libraries(overrides: list[str]) -> tuple[str, ...]:
    """What a run with ``overrides`` imports anyway (see ``LIBRARIES``)."""
    zero = any(o.startswith("strategy=zero") for o in overrides)
    pipeline = any(o.startswith("parallel.pp=") and o != "parallel.pp=1" for o in overrides)
    return (
        *LIBRARIES,
        *(ZERO_LIBRARIES if zero else ()),
        *(PIPELINE_LIBRARIES if pipeline else ()),
    )


def model_overrides(model: dict, n_layer: int | None = None) -> list[str]:
    return [
        "model=gpt_tiny",
        f"model.n_layer={n_layer or model['n_layer']}",
        f"model.n_embd={model['n_embd']}",
        f"model.n_head={model['n_head']}",
        f"model.block_size={model['seq_len']}",
        f"train.seq_len={model['seq_len']}",
        f"train.batch_size={model['batch_size']}",
        "checkpoint.save_final=false",
    ]


def n_params(model: dict, n_layer: int | None = None) -> int:
    gpt = GPT(
        vocab_size=256,
        block_size=model["seq_len"],
        n_layer=n_layer or model["n_layer"],
        n_head=model["n_head"],
        n_embd=model["n_embd"],
    )
    return sum(p.numel() for p in gpt.parameters())


def measure(
    root: Path,
    name: str,
    overrides: list[str],
    steps: int,
    warmup: int,
    job_mib: float | None = None,
) -> dict | None:
    """One run's figures; with ``job_mib`` the run is a ``plait train`` process in a memory
    cgroup of that size, and None when the kernel killed it."""
    run = root / re.sub(r"\W+", "_", name)
    overrides = [*overrides, f"train.steps={steps}"]
    job_peak = None
    if job_mib is None:
        run_training(run, overrides, plugins=[ImportFirst(*libraries(overrides)), MemoryProbe()])
    else:
        job_peak = run_in_cgroup(run, overrides, job_mib)
        if job_peak is None:
            return None
    metrics = read_metrics(run)
    last = metrics[-1]
    return {
        "peak": last["peak_memory_bytes/max"],
        "above_start": last["peak_memory_bytes/max"] - last["memory/rss_before_model_bytes"],
        "optimizer": last.get("model_state_bytes/optimizer"),
        "step_s": statistics.median(m["step_time_s/max"] for m in metrics[warmup:]),
        "recomputes": last.get("activation_checkpointing/recomputes", 0.0),
        "job_peak": job_peak,
    }


def run_in_cgroup(run: Path, overrides: list[str], job_mib: float) -> float | None:
    """Run ``plait train`` (launcher and workers) inside a fresh memory cgroup capped at
    ``job_mib`` with no swap; the kernel's peak for the whole job, or None if the kernel killed
    one of its processes for memory (any other failure raises)."""
    # ImportFirst's modules reach the command line as a plugin module of their own
    probe = run.parent / "bench_memory_imports.py"
    probe.write_text(
        "from plait.testing import ImportFirst\n"
        f"import_first = ImportFirst(*{libraries(overrides)!r})\n"
    )
    command = [
        sys.executable,
        "-m",
        "plait",
        "train",
        *TEST_OVERRIDES,
        f"run.root={run.parent}",
        f"run.name={run.name}",
        "+plugins=[plait.testing:memory_probe,bench_memory_imports:import_first]",
        *overrides,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(run.parent), os.environ.get("PYTHONPATH")])
        ),
    }
    with memory_cgroup(job_mib) as group:
        done = subprocess.run(group.command(command), capture_output=True, text=True, env=env)
        if done.returncode == 0:
            return float(group.peak_bytes())
        if not group.oom_kills():  # a crash or a hang is a bug, not "does not fit"
            raise RuntimeError(
                f"{run.name} failed without an OOM kill (exit "
                f"{done.returncode}):\n{done.stderr[-3000:]}"
            )
        return None


def ratio(value, base) -> str:
    return f"{value / base:.3f}" if value is not None and base else "-"


def mib(value) -> str:
    return f"{value / MIB:.1f}" if value is not None else "-"


def compare(root: Path, name: str, args) -> None:
    model, cases = COMPARISONS[name]
    print(
        f"\n## {name}: GPT {model}, {n_params(model):,} parameters, fp32, "
        f"{args.steps} steps ({args.warmup} warm-up)\n"
    )
    print(
        "| case | peak MiB | x | above start MiB | x | optimizer MiB | x | step s | x "
        "| recomputes |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for case, overrides in list(cases.items())[: args.cases]:
        got = measure(
            root, f"{name}-{case}", [*model_overrides(model), *overrides], args.steps, args.warmup
        )
        base = base or got
        print(
            f"| {case} | {mib(got['peak'])} | {ratio(got['peak'], base['peak'])} "
            f"| {mib(got['above_start'])} | {ratio(got['above_start'], base['above_start'])} "
            f"| {mib(got['optimizer'])} | {ratio(got['optimizer'], base['optimizer'])} "
            f"| {got['step_s']:.3f} | {ratio(got['step_s'], base['step_s'])} "
            f"| {got['recomputes']:.0f} |",
            flush=True,
        )


def estimated_bytes(overrides: list[str]) -> float | None:
    """What ``plait estimate`` predicts per rank for these overrides (the strategy's model states
    and buffers plus the model's activations); None for a strategy that gives no estimate."""
    from plait.meta import meta_model
    from plait.plan import make_plan
    from plait.plugins.planner.estimate import activation_bytes, strategy_cost

    plan = make_plan([*TEST_OVERRIDES, *overrides]).check()
    model = meta_model(plan.pm.hook, plan.cfg)
    try:
        cost = strategy_cost(plan, model)
    except ValueError:
        return None
    cfg = plan.cfg
    micro = cfg.train.batch_size // (cfg.train.grad_accum_steps * plan.dims.dp)
    return cost.device_bytes + (activation_bytes(plan, model, micro) or 0)


def largest_fitting(root: Path, layout: str, args) -> tuple[int, dict | None]:
    """Bisection on n_layer in ``--min-layers .. --max-layers``: the largest that fits (0 if
    none) and its figures. Fits: the peak above start is within ``--budget-mib``, or the job
    finished in ``--job-mib``."""
    name, _, recompute = layout.partition("+")
    overrides = [
        *layouts(args.dp)[name],
        f"precision={args.precision}",
        f"launcher.allocator={args.allocator}",
        f"launcher.decommit_above={args.decommit_above}",
        *([f"train.activation_checkpointing={recompute}"] if recompute else []),
    ]
    low, high, fitted = args.min_layers - 1, args.max_layers + 1, None
    while high - low > 1:
        n_layer = (low + high) // 2
        got = measure(
            root,
            f"fit-{layout}-{n_layer}",
            [*model_overrides(STATE_HEAVY, n_layer), *overrides],
            2,
            1,
            args.job_mib,
        )
        fits = got is not None and (
            args.job_mib is not None or got["above_start"] <= args.budget_mib * MIB
        )
        if fits:
            low, fitted = n_layer, got
            fitted["estimate"] = estimated_bytes(
                [*model_overrides(STATE_HEAVY, n_layer), *overrides]
            )
        else:
            high = n_layer
        print(
            f"  {layout} n_layer={n_layer}: {'fits' if fits else 'does not fit'}",
            file=sys.stderr,
            flush=True,
        )
    return (low, fitted) if fitted is not None else (0, None)


def fit(root: Path, args) -> None:
    budget = (
        f"a {args.job_mib} MiB memory cgroup for the whole job"
        if args.job_mib
        else f"{args.budget_mib} MiB above start per rank"
    )
    print(
        f"\n## largest GPT (width {STATE_HEAVY['n_embd']}, seq {STATE_HEAVY['seq_len']}, "
        f"{args.precision}, {args.dp} processes, allocator {args.allocator}, decommit above "
        f"{args.decommit_above}) fitting {budget}\n"
    )
    print(
        "| layout | n_layer | parameters | x ddp | peak above start MiB (max rank) "
        "| plait estimate MiB | estimate / peak above start | job peak MiB (kernel) "
        "| optimizer MiB |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for layout in args.layouts:
        n_layer, got = largest_fitting(root, layout, args)
        params = n_params(STATE_HEAVY, n_layer) if n_layer else 0
        base = base or params
        got = got or {}
        print(
            f"| {layout} | {n_layer} | {params:,} | {ratio(params, base)} "
            f"| {mib(got.get('above_start'))} | {mib(got.get('estimate'))} "
            f"| {ratio(got.get('estimate'), got.get('above_start'))} "
            f"| {mib(got.get('job_peak'))} | {mib(got.get('optimizer'))} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(COMPARISONS), nargs="+", default=list(COMPARISONS))
    parser.add_argument(
        "--cases",
        type=int,
        default=None,
        help="only the first N cases of each comparison (the baseline first)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="1-layer models of width 32 (a smoke run: the figures mean nothing)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, help="bisect n_layer for this budget")
    parser.add_argument(
        "--job-mib", type=float, help="bisect n_layer for a memory cgroup of this size (root)"
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["ddp", "zero1_pp2"],
        help=f"for --budget-mib/--job-mib: {', '.join(layouts(2))}, each optionally +full",
    )
    parser.add_argument("--dp", type=int, default=2, help="processes of each --layouts case")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--allocator", default="auto", help="plait's launcher.allocator")
    parser.add_argument(
        "--decommit-above", type=float, default=0.8, help="plait's launcher.decommit_above"
    )
    parser.add_argument(
        "--min-layers",
        type=int,
        default=1,
        help="the bisection's lower end (a smaller model is not tried)",
    )
    parser.add_argument("--max-layers", type=int, default=32)
    args = parser.parse_args()
    if args.tiny:
        for model in (ACTIVATION_HEAVY, STATE_HEAVY):
            model.update(TINY)
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as root:
        if args.budget_mib or args.job_mib:
            fit(Path(root), args)
        else:
            for name in args.only:
                compare(Path(root), name, args)


if __name__ == "__main__":
    main()
