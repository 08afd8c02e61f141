"""A checkpoint costs no more memory than training (issue 32): each rank's peak while the final
checkpoint is saved, and while a resumed run loads it, is at most 1.05x its peak while training.

A 1B-parameter GPT under ``strategy=fsdp`` on 4 processes trained and was OOM-killed at its
save: the layout-free copy gathered every parameter and Adam state whole on every rank. Here a
GPT of ~7M parameters (model states ~112 MB in fp32 with AdamW, a fair part of a small worker's
resident memory) shows the same at test size: gathered, a save's peak read ~1.2-1.4x training's.

Peaks are the kernel's (``VmHWM``), reset where each phase starts (``/proc/self/clear_refs``):
training's runs from the start (or from the end of the load: a resumed run trains 2 steps, so
that its figure is a steady step's, not the first one's after a load) to the final save; the save's from
there to its end; the load's over ``plait_load_checkpoint``.
"""

import json
from pathlib import Path

import pytest

from plait import hookimpl
from plait.testing import run_training

MODEL = [
    "model.n_layer=4",
    "model.n_embd=384",
    "model.n_head=4",
    "train.batch_size=4",
    "train.seq_len=32",
    "model.block_size=32",
]
CASES = {
    "fsdp": ["strategy=fsdp", "launcher.nproc_per_node=2"],
    "zero3": ["strategy=zero3", "launcher.nproc_per_node=2"],
    "zero2": ["strategy=zero2", "launcher.nproc_per_node=2"],
    "ddp_tp2": ["parallel.tp=2", "launcher.nproc_per_node=2"],
    "ddp": ["launcher.nproc_per_node=2"],
    "zero1": ["strategy=zero1", "launcher.nproc_per_node=2"],
    "pp2": [
        "parallel.pp=2",
        "pipeline.schedule=1f1b",
        "pipeline.microbatches=2",
        "launcher.nproc_per_node=2",
    ],
    "ep2": ["parallel.ep=2", "model.n_experts=4", "model.top_k=2", "launcher.nproc_per_node=2"],
    "cp2": ["parallel.cp=2", "launcher.nproc_per_node=2"],
    # in the background (a copy in CPU memory, written by a thread): the copy is of this rank's
    # shards, not of the whole tensors (1.31x with those)
    "fsdp_async_save": ["strategy=fsdp", "launcher.nproc_per_node=2", "checkpoint.async_save=true"],
}


def vmhwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class PhasePeaks:
    """Every rank's peak resident memory while training, saving the final checkpoint and
    loading one, into ``run.dir/peaks/rank<r>.json``."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}

    @hookimpl(wrapper=True)
    def plait_load_checkpoint(self, cfg, topology):
        reset_peak()
        state = yield
        if state is not None:
            self.peaks["load"] = vmhwm()
            reset_peak()
        return state

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self, cfg, topology, final):
        if not final:
            return (yield)
        self.peaks["train"] = vmhwm()
        reset_peak()
        written = yield
        self.peaks["save"] = vmhwm()
        out = Path(cfg.run.dir) / "peaks"
        out.mkdir(exist_ok=True)
        (out / f"rank{topology.rank}.json").write_text(json.dumps(self.peaks))
        return written


def peaks(run: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run / "peaks").glob("rank*.json"))]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_saving_and_loading_cost_no_more_than_training(case, tmp_path):
    overrides = [*MODEL, *CASES[case]]
    first = run_training(tmp_path / "first", [*overrides, "train.steps=2"], [PhasePeaks()])
    resumed = run_training(
        tmp_path / "resumed",
        [*overrides, "train.steps=4", f"resume={first / 'checkpoints' / 'step_00000002'}"],
        [PhasePeaks()],
    )
    for run, phases in ((first, ["save"]), (resumed, ["load", "save"])):
        for rank, seen in enumerate(peaks(run)):
            for phase in phases:
                ratio = seen[phase] / seen["train"]
                assert ratio <= 1.05, f"{case} {run.name} rank {rank}: {phase} {ratio:.3f}x"
