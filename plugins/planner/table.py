"""The planner's printed ranking."""

from __future__ import annotations

from plait.plugins.planner.cost import Workload
from plait.plugins.planner.search import SearchResult

HEADER = (
    f"{'#':>3} {'strategy':8} {'dp':>3} {'cp':>3} {'tp':>3} {'pp':>3} {'ep':>3} "
    f"{'micro':>5} {'accum':>5} "
    f"{'recompute':9} {'mem/rank GiB':>12} {'compute ms':>10} {'bubble ms':>9} "
    f"{'comm ms':>9} {'step ms':>9}"
)


def format_search(
    result: SearchResult, world_size: int, budget: float, work: Workload, overrides: list[str]
) -> str:
    lines = [
        f"plait plan --search world_size={world_size}: global batch {work.batch_size} x "
        f"seq {work.seq_len}, {work.precision}, peak {work.peak_flops:.3g} FLOP/s, "
        f"{work.bandwidth / 1e9:g} GB/s per rank, budget {budget / 2**30:g} GiB per rank",
        HEADER,
    ]
    for i, (layout, cost) in enumerate(result.accepted, 1):
        lines.append(
            f"{i:>3} {layout.strategy:8} {layout.dp:>3} {layout.cp:>3} {layout.tp:>3} "
            f"{layout.pp:>3} {layout.ep:>3} "
            f"{layout.micro_batch_size:>5} {layout.microbatches:>5} "
            f"{layout.activation_checkpointing:9} {cost.memory_bytes / 2**30:>12.3f} "
            f"{cost.compute_s * 1e3:>10.2f} {cost.bubble_s * 1e3:>9.2f} "
            f"{cost.comm_s * 1e3:>9.2f} {cost.step_s * 1e3:>9.2f}"
        )
    lines.append(
        f"{result.enumerated} layouts enumerated, {result.over_budget} over the memory "
        f"budget; of the rest {result.checked} checked fastest first, "
        f"{result.refused} refused by the plan's checks"
    )
    common = result.most_common_refusal()
    if common:
        lines.append(f"most common refusal ({common[1]}x): {common[0]}")
    if result.accepted:
        lines.append(
            "the best: plait train " + " ".join(overrides + result.accepted[0][0].overrides())
        )
    else:
        lines.append(
            "no layout fits and passes the checks: raise --memory-gb, lower "
            "train.batch_size or train.seq_len, or use a smaller model"
        )
    return "\n".join(lines)
