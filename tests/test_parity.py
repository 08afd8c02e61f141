"""Each plain loop of ``scripts/bench_parity.py`` trains what plait trains: its first 5 losses
equal plait's for the same overrides, within fp32 round-off (tiny GPT, 2 processes).

So the benchmark's ratios compare the same work. plait runs as ``plait train`` would
(``plait.testing``); the plain loop (``scripts/parity_loops.py``) runs on 2 processes started
by ``torch.multiprocessing`` from the launcher's forkserver, as torchrun would start them but
without a fresh interpreter each."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from plait import api
from plait.testing import free_port, read_metrics

SCRIPTS = Path(__file__).parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_parity  # noqa: E402

ROWS = ["ddp", "zero1", "zero2", "zero3", "fsdp", "tp2", "pp2", "ep2", "cp2"]
TOLERANCE = 1e-5  # relative; the rows differ from plait's by 0 to 2e-7 (summation order)


def tiny_args() -> argparse.Namespace:
    return argparse.Namespace(
        model="gpt",
        n_layer=2,
        n_embd=32,
        n_head=2,
        batch_size=4,
        seq_len=16,
        microbatches=2,
        steps=5,
        device="cpu",
        precision="fp32",
        nproc=2,
        allocator="auto",
        plait_overrides=[],
    )


def plain_losses(spec: dict, tmp_path: Path) -> list[float]:
    spec = {**spec, "clock": str(tmp_path / "clock"), "losses": str(tmp_path / "losses")}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    from parity_loops import run_rank

    mp.start_processes(
        run_rank, args=(2, free_port(), str(path)), nprocs=2, start_method="forkserver"
    )
    ranks = [json.loads(Path(f"{spec['losses']}.rank{r}").read_text()) for r in range(2)]
    return [
        sum(v for v in step if v is not None) / sum(v is not None for v in step)
        for step in zip(*ranks)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
def test_the_plain_loop_trains_what_plait_trains(row, tmp_path):
    args = tiny_args()
    run = tmp_path / "plait"
    overrides = [*bench_parity.plait_overrides(args, row, run), "train.log_every=1"]
    spec = bench_parity.plain_spec(args, row, overrides)
    api.train(overrides)
    ours = [m["loss"] for m in read_metrics(run)]
    theirs = plain_losses(spec, tmp_path)
    assert len(ours) == len(theirs) == 5
    assert theirs == pytest.approx(ours, rel=TOLERANCE)
