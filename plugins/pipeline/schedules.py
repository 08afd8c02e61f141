"""The pipeline schedules plait offers: torch's classes, how many stages each rank holds, where
each stage sits, and which settings each schedule accepts."""

from __future__ import annotations

# schedule name -> (torch class name, allowed virtual_stages, placement style)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "1", "loop"),
    "1f1b": ("Schedule1F1B", "1", "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", ">=2", "loop"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", ">=1", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "2", "v"),
}


def stages_per_rank(cfg) -> int:
    return cfg.pipeline.virtual_stages if SCHEDULES[cfg.pipeline.schedule][1] != "1" else 1


def stage_to_rank(pp: int, n_stages: int, style: str) -> list[int]:
    """Pipeline rank of each stage: ``loop`` puts stage s on s mod pp, ``v`` goes down the ranks
    and back up (rank r holds stages r and 2pp-1-r), as torch's ZBV schedule expects."""
    if style == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
    return [s % pp for s in range(n_stages)]


def schedule_problems(par, pp: int) -> list[str]:
    name, v, m = par.schedule, par.virtual_stages, par.microbatches
    if name not in SCHEDULES:
        return [f"pipeline.schedule={name}: choose one of {', '.join(SCHEDULES)}"]
    allowed = SCHEDULES[name][1]
    if allowed == "1" and v != 1:
        return [
            f"pipeline.virtual_stages={v} needs an interleaved schedule: set "
            "pipeline.schedule=interleaved_1f1b, zero_bubble or zbv, or virtual_stages=1"
        ]
    if allowed == ">=2" and v < 2:
        return [
            f"pipeline.schedule={name} needs pipeline.virtual_stages>=2 (stages per rank); "
            "with one stage per rank use pipeline.schedule=1f1b"
        ]
    if allowed == "2" and v != 2:
        return [
            f"pipeline.schedule=zbv places exactly 2 stages per rank in a V: set "
            f"pipeline.virtual_stages=2 (got {v})"
        ]
    if name == "1f1b" and m < pp:
        return [
            f"pipeline.schedule=1f1b needs pipeline.microbatches >= pp ({m} < {pp}): raise "
            "pipeline.microbatches or use pipeline.schedule=gpipe"
        ]
    rounds = max(1, m // pp)
    if allowed != "1" and m % rounds:
        return [
            f"pipeline.schedule={name} runs micro-batches in rounds of pp: "
            f"pipeline.microbatches={m} must be a multiple of {rounds} (e.g. a multiple of "
            f"pp={pp})"
        ]
    return []


def make_schedule(name: str, stages: list, n_microbatches: int, loss_fn):
    """The torch schedule ``name`` over this rank's stages; gradients are the micro-batch mean."""
    from torch.distributed import pipelining

    torch_class, per_rank, _ = SCHEDULES[name]
    return getattr(pipelining, torch_class)(
        stages if per_rank != "1" else stages[0],
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        scale_grads=True,
    )
