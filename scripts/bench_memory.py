"""Per-rank peak memory and step time of plait's GPT under activation checkpointing, and under
ZeRO-1 with pipeline stages, each against its baseline in the same command.

    DS_ACCELERATOR=cpu python scripts/bench_memory.py                      # both comparisons
    DS_ACCELERATOR=cpu python scripts/bench_memory.py --only recompute --steps 6
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
(ddp, zero1, zero2, zero3, tp2, pp2, zero1_pp2, zero1_pp2_tp2, each also ``+full``) on the
``zero1_pp`` model, keeping the largest whose peak above start fits in B MiB per rank, and
prints its parameter count and the ratio against ddp.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from pathlib import Path

from plait.plugins.models.gpt import GPT
from plait.testing import MemoryProbe, read_metrics, run_training

MIB = 2**20

# A GPT whose activations outweigh its model states, and one the other way round.
ACTIVATION_HEAVY = {"n_layer": 8, "n_embd": 256, "n_head": 8, "seq_len": 256, "batch_size": 8}
STATE_HEAVY = {"n_layer": 8, "n_embd": 512, "n_head": 8, "seq_len": 64, "batch_size": 8}

DP2 = ["launcher.nproc_per_node=2"]
PP2_DP2 = ["parallel.pp=2", "pipeline.microbatches=2", "launcher.nproc_per_node=4"]
COMPARISONS = {
    "recompute": (ACTIVATION_HEAVY, {
        "ddp, recompute none": [*DP2],
        "ddp, recompute full": [*DP2, "train.activation_checkpointing=full"],
        "ddp, recompute selective": [*DP2, "train.activation_checkpointing=selective"],
    }),
    "zero1_pp": (STATE_HEAVY, {
        "pp2 x dp2, ddp (plain pipeline)": [*PP2_DP2],
        "pp2 x dp2, zero1": [*PP2_DP2, "strategy=zero1"],
        "pp2 x dp2, zero1 + recompute full": [*PP2_DP2, "strategy=zero1",
                                              "train.activation_checkpointing=full"],
    }),
}
LAYOUTS = {  # for --budget-mib
    "ddp": DP2, "zero1": [*DP2, "strategy=zero1"], "zero2": [*DP2, "strategy=zero2"],
    "zero3": [*DP2, "strategy=zero3"], "tp2": ["parallel.tp=2", *DP2],
    "pp2": ["parallel.pp=2", "pipeline.microbatches=2", *DP2],
    "zero1_pp2": [*PP2_DP2, "strategy=zero1"],
    "zero1_pp2_tp2": [*PP2_DP2, "parallel.tp=2", "launcher.nproc_per_node=8", "strategy=zero1"],
}


def model_overrides(model: dict, n_layer: int | None = None) -> list[str]:
    return ["model=gpt_tiny", f"model.n_layer={n_layer or model['n_layer']}",
            f"model.n_embd={model['n_embd']}", f"model.n_head={model['n_head']}",
            f"model.block_size={model['seq_len']}", f"train.seq_len={model['seq_len']}",
            f"train.batch_size={model['batch_size']}", "fault.save_final=false"]


def n_params(model: dict, n_layer: int | None = None) -> int:
    gpt = GPT(vocab_size=256, block_size=model["seq_len"], n_layer=n_layer or model["n_layer"],
              n_head=model["n_head"], n_embd=model["n_embd"])
    return sum(p.numel() for p in gpt.parameters())


def measure(root: Path, name: str, overrides: list[str], steps: int, warmup: int) -> dict:
    run = run_training(root / re.sub(r"\W+", "_", name),
                       [*overrides, f"train.steps={steps}"], plugins=[MemoryProbe()])
    metrics = read_metrics(run)
    last = metrics[-1]
    return {
        "peak": last["peak_memory_bytes/max"],
        "above_start": last["peak_memory_bytes/max"] - last["memory/rss_before_model_bytes"],
        "optimizer": last.get("model_state_bytes/optimizer"),
        "step_s": statistics.median(m["step_time_s/max"] for m in metrics[warmup:]),
        "recomputes": last.get("activation_checkpointing/recomputes", 0.0),
    }


def ratio(value, base) -> str:
    return f"{value / base:.3f}" if value is not None and base else "-"


def mib(value) -> str:
    return f"{value / MIB:.1f}" if value is not None else "-"


def compare(root: Path, name: str, args) -> None:
    model, cases = COMPARISONS[name]
    print(f"\n## {name}: GPT {model}, {n_params(model):,} parameters, fp32, "
          f"{args.steps} steps ({args.warmup} warm-up)\n")
    print("| case | peak MiB | x | above start MiB | x | optimizer MiB | x | step s | x "
          "| recomputes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for case, overrides in cases.items():
        got = measure(root, f"{name}-{case}", [*model_overrides(model), *overrides], args.steps,
                      args.warmup)
        base = base or got
        print(f"| {case} | {mib(got['peak'])} | {ratio(got['peak'], base['peak'])} "
              f"| {mib(got['above_start'])} | {ratio(got['above_start'], base['above_start'])} "
              f"| {mib(got['optimizer'])} | {ratio(got['optimizer'], base['optimizer'])} "
              f"| {got['step_s']:.3f} | {ratio(got['step_s'], base['step_s'])} "
              f"| {got['recomputes']:.0f} |", flush=True)


def largest_fitting(root: Path, layout: str, args) -> tuple[int, float]:
    """Bisection on n_layer: the largest whose peak above start fits the budget (0 if none)."""
    name, _, recompute = layout.partition("+")
    overrides = [*LAYOUTS[name], *([f"train.activation_checkpointing={recompute}"]
                                   if recompute else [])]
    low, high, peak_of_low = 0, args.max_layers + 1, float("nan")
    while high - low > 1:
        n_layer = (low + high) // 2
        got = measure(root, f"fit-{layout}-{n_layer}",
                      [*model_overrides(STATE_HEAVY, n_layer), *overrides], 2, 1)
        if got["above_start"] <= args.budget_mib * MIB:
            low, peak_of_low = n_layer, got["above_start"]
        else:
            high = n_layer
    return low, peak_of_low


def fit(root: Path, args) -> None:
    print(f"\n## largest GPT (width {STATE_HEAVY['n_embd']}, seq {STATE_HEAVY['seq_len']}) "
          f"fitting {args.budget_mib} MiB above start per rank\n")
    print("| layout | n_layer | parameters | x ddp | peak above start MiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = None
    for layout in args.layouts:
        n_layer, peak = largest_fitting(root, layout, args)
        params = n_params(STATE_HEAVY, n_layer) if n_layer else 0
        base = base or params
        print(f"| {layout} | {n_layer} | {params:,} | {ratio(params, base)} | {mib(peak)} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(COMPARISONS), nargs="+", default=list(COMPARISONS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, help="bisect n_layer for this budget")
    parser.add_argument("--layouts", nargs="+", default=["ddp", "zero1_pp2"],
                        help=f"for --budget-mib: {', '.join(LAYOUTS)}, each optionally +full")
    parser.add_argument("--max-layers", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as root:
        if args.budget_mib:
            fit(Path(root), args)
        else:
            for name in args.only:
                compare(Path(root), name, args)


if __name__ == "__main__":
    main()
