"""A checkpoint's memory against training's: each rank's peak resident memory while training,
while saving the final checkpoint and (``--resume``) while a second run loads it, for one
layout, as a ratio to the training peak (issue 32's target: <= 1.05x).

    DS_ACCELERATOR=cpu python scripts/bench_save_peak.py                  # the issue's 1B fsdp run
    DS_ACCELERATOR=cpu python scripts/bench_save_peak.py --n-layer 2 --n-embd 64 --steps 2

The default is the issue's run: a 1,008M-parameter GPT (20 layers x 2048, fp32 AdamW) under
``strategy=fsdp`` on 4 processes, 3 steps, batch 4 x 128; it needs ~19 GiB. Peaks are the
kernel's (``VmHWM``, reset where each phase starts) as tests/test_checkpoint_memory.py's
``PhasePeaks`` reads them; that test checks the same ratio at test size for fsdp, zero3, zero2
and ddp x tp2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from test_checkpoint_memory import PhasePeaks, peaks  # noqa: E402

from plait.testing import run_training  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-layer", type=int, default=20)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the run goes (default: a temp dir)")
    args = parser.parse_args()
    # the test plugin must unpickle in the workers: they import it from tests/
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[1] / "tests"), os.environ.get("PYTHONPATH", "")]
    )
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_save_peak_"))
    started = time.time()
    run = run_training(
        root / "run",
        [
            f"model.n_layer={args.n_layer}",
            f"model.n_embd={args.n_embd}",
            f"model.n_head={args.n_head}",
            f"strategy={args.strategy}",
            f"launcher.nproc_per_node={args.nproc}",
            f"train.steps={args.steps}",
            "train.batch_size=4",
            "train.seq_len=128",
            "model.block_size=128",
            "precision=fp32",
        ],
        [PhasePeaks()],
    )
    print(
        f"{args.strategy}, {args.nproc} processes, GPT {args.n_layer} x {args.n_embd}: "
        f"{args.steps} steps and the final save in {time.time() - started:.1f} s; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print("| rank | training peak GiB | save peak GiB | save / training |")
    print("| ---: | ---: | ---: | ---: |")
    for rank, seen in enumerate(peaks(run)):
        print(
            f"| {rank} | {seen['train'] / 2**30:.2f} | {seen['save'] / 2**30:.2f} | "
            f"{seen['save'] / seen['train']:.3f}x |"
        )
    print("checkpoints:", ", ".join(sorted(p.name for p in (run / "checkpoints").iterdir())))


if __name__ == "__main__":
    main()
