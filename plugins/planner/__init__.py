"""``plait plan --search world_size=N``: the layout planner.

    plait plan --search world_size=8 model=gpt2_small precision=bf16 train.seq_len=1024
    plait plan --search world_size=8 model=gpt2_small --memory-gb 40 --bandwidth-gbs 25
    plait plan --search world_size=4 --memory-gb 2 train.peak_flops=1e11 --confirm 2

Enumerates the layouts of ``N`` ranks (dp × tp × pp, ZeRO stage or ddp, micro-batch, activation
checkpointing: :mod:`.search`), estimates memory per rank and step time for each (:mod:`.cost`,
the formulas are there), keeps those within the memory budget, checks them fastest first
through the plan every run gets (a layout any plugin refuses is dropped; how many and the most
common reason are printed) and prints the ranking. ``--confirm K`` trains the top K for a few
steps as one Hydra multirun and prints measured against estimated (:mod:`.confirm`).

Budgets: ``--memory-gb`` per rank, else the CUDA device's memory. On a CPU there is no per-rank
figure to take: the ranks of a node share its RAM with each other and the OS, so the planner asks
for ``--memory-gb`` rather than guess. The peak is ``train.peak_flops``, else the known peak of
the CUDA device (:data:`plait.metrics.PEAK_BF16_FLOPS`); a CPU has none, so set it.
"""

from __future__ import annotations

import argparse

import torch

from plait import hookimpl
from plait.config import node_range
from plait.meta import meta_model
from plait.metrics import device_peak_flops
from plait.plan import compose_config
from plait.plugin_manager import make_plugin_manager
from plait.plugins.planner.estimate import estimated_strategies
from plait.topology import ParallelDims
from plait.types import PluginInfo

DEFAULT_BANDWIDTH_GBS = 50.0  # GB/s per rank: one 400 Gb/s InfiniBand link per GPU


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="planner", description="plait plan --search: rank parallel layouts")


@hookimpl
def plait_register_commands(register) -> None:
    from plait.plugins.planner.estimate import cmd_estimate

    register(
        "estimate",
        cmd_estimate,
        "per-rank bytes of model states and activations for a strategy, without training",
    )
    register(
        "plan --search",
        cmd_plan_search,
        "rank the layouts of N ranks by estimated step time (world_size=N [--memory-gb G] "
        "[--confirm K])",
    )


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="plait plan --search", description=__doc__.split("\n")[0])
    parser.add_argument("--search", required=True, metavar="world_size=N")
    parser.add_argument("--memory-gb", type=float, help="memory budget per rank, GiB")
    parser.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=DEFAULT_BANDWIDTH_GBS,
        help="bytes/s per rank for dp/tp/pp traffic, GB/s (default %(default)s)",
    )
    parser.add_argument("--top", type=int, default=10, help="layouts to print (0: all)")
    parser.add_argument(
        "--confirm",
        type=int,
        default=0,
        metavar="K",
        help="train the top K for a few steps and print measured vs estimated",
    )
    args, overrides = parser.parse_known_args(argv)
    key, _, value = args.search.partition("=")
    if key != "world_size" or not value.isdigit() or int(value) < 1:
        raise ValueError(f"--search {args.search}: give --search world_size=N with N >= 1")
    return args, overrides


def memory_budget(memory_gb: float | None) -> float:
    if memory_gb is not None:
        return memory_gb * 2**30
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    raise ValueError(
        "plait plan --search needs --memory-gb G (per rank) on a machine without "
        "CUDA: the ranks of a node share its RAM, so there is no per-rank figure to "
        "take"
    )


def peak_flops(cfg) -> float:
    peak = cfg.train.peak_flops or (
        device_peak_flops(torch.device("cuda", 0)) if torch.cuda.is_available() else None
    )
    if not peak:
        raise ValueError(
            "plait plan --search needs train.peak_flops=<dense FLOP/s of one "
            "device>: this device has no known peak"
        )
    return float(peak)


def search_layouts(argv: list[str]):
    """Run the search ``argv`` asks for: ``(result, printed table, overrides, args, cfg)``."""
    from plait.plugins.planner.cost import Workload, plugin_axis_cost
    from plait.plugins.planner.search import search, split_overrides
    from plait.plugins.planner.table import format_search

    args, overrides = parse_args(argv)
    world_size = int(args.search.partition("=")[2])
    fixed, overrides = split_overrides(overrides)
    pm = make_plugin_manager()
    cfg = compose_config(overrides, pm)
    nodes = node_range(cfg.launcher.nnodes)  # parsed once: each layout's dims carry it
    nnodes = nodes.max  # an elastic job is planned at MAX nodes
    if world_size % nnodes:
        raise ValueError(
            f"world_size={world_size} is not a multiple of launcher.nnodes={cfg.launcher.nnodes}"
        )
    overrides = overrides + [f"launcher.nproc_per_node={world_size // nnodes}"]
    budget = memory_budget(args.memory_gb)
    model = meta_model(pm.hook, cfg)
    if model is None:
        raise ValueError(
            f"model._target_={cfg.model._target_} cannot be built with these "
            "settings: `plait plan` with the same overrides says why"
        )

    def strategy_cost(strategy: str, dp: int, tp: int, pp: int, cp: int, ep: int = 1):
        dims = ParallelDims(
            dp=dp,
            tp=tp,
            pp=pp,
            cp=cp,
            world_size=dp * cp * tp * pp,
            nnodes=nnodes,
            nodes=nodes,
            ep=ep,
        )
        return pm.hook.plait_strategy_cost(cfg=cfg, strategy=strategy, model=model, dims=dims)

    axis_cost = plugin_axis_cost(pm.hook, cfg, model, cfg.train.seq_len, cfg.precision, nodes)
    work = Workload(
        model,
        cfg.train.batch_size,
        cfg.train.seq_len,
        cfg.precision,
        peak_flops(cfg),
        args.bandwidth_gbs * 1e9,
        strategy_cost,
        axis_cost,
    )
    top = args.top and max(args.top, args.confirm)
    strategies = estimated_strategies(pm, cfg, model, ParallelDims(1, 1, 1, 1))
    result = search(pm, overrides, world_size, budget, work, fixed, top, strategies)
    if result.estimates and result.over_budget == result.enumerated:
        layout, smallest = min(result.estimates, key=lambda lc: lc[1].memory_bytes)
        raise ValueError(
            f"--memory-gb={budget / 2**30:g}: none of the {result.enumerated} "
            f"layouts of world_size={world_size} fits; the smallest needs "
            f"{smallest.memory_bytes / 2**30:.3f} GiB per rank ({layout.describe()}):"
            f" give --memory-gb {smallest.memory_bytes / 2**30:.3f} or more, or a "
            "larger world_size, a smaller train.batch_size / train.seq_len or model"
        )
    return result, format_search(result, world_size, budget, work, overrides), overrides, args, cfg


def cmd_plan_search(argv: list[str]) -> int:
    result, table, overrides, args, cfg = search_layouts(argv)
    print(table, flush=True)
    if not result.accepted:
        return 1
    if args.confirm:
        from plait.plugins.planner.confirm import confirm

        print(confirm(result.accepted[: args.confirm], overrides, cfg))
    return 0
