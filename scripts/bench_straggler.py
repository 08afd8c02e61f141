"""The straggler detector's overhead per step: plait with its defaults (per-rank phase timing,
the detector at ``fault.straggler_factor=1.5``) against the detector off
(``fault.straggler_factor=0``: no phase hooks, no verdict), same model, data and settings.

    python scripts/bench_straggler.py                  # 4 processes, CPU/gloo (or CUDA/NCCL)
    python scripts/bench_straggler.py --nproc 4 --steps 80 --repeats 3 --n-layer 4 --n-embd 256
    python scripts/bench_straggler.py --log-every 1    # also the per-rank gather every step

Runs the two alternately (``--repeats`` times each), times steps after ``--warmup`` from rank 0's
clock at the end of each step (``plait.testing.StepClock``), and prints one JSON object: steps/s
of each run, their medians, and ``overhead = median(off) / median(on) - 1`` (target <= 0.01).
Both runs log every ``--log-every`` steps, so the one all-gather of logged steps is in both; what
differs is the hooks (a forward pre/post hook, one post-accumulate-grad hook per parameter, the
optimizer's step hooks) and the verdict on logged steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from plait import api
from plait.testing import StepClock, steps_per_s


def run(args, root: Path, name: str, factor: float) -> float:
    clock = root / f"{name}.clock"
    api.train(
        [
            f"launcher.nproc_per_node={args.nproc}",
            "tracker=none",
            "model=gpt_tiny",
            f"train.steps={args.steps}",
            f"train.batch_size={args.batch_size}",
            f"train.seq_len={args.seq_len}",
            f"model.n_layer={args.n_layer}",
            f"model.n_embd={args.n_embd}",
            f"model.n_head={args.n_head}",
            f"model.block_size={args.seq_len}",
            f"train.log_every={args.log_every}",
            f"fault.straggler_factor={factor}",
            "checkpoint.save_final=false",
            f"run.root={root}",
            f"run.name={name}",
        ],
        plugins=[StepClock(str(clock))],
    )
    return steps_per_s([float(t) for t in clock.read_text().split()], args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"detector_on": [], "detector_off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            results["detector_on"].append(run(args, Path(tmp), f"on{i}", 1.5))
            results["detector_off"].append(run(args, Path(tmp), f"off{i}", 0.0))
    on, off = (statistics.median(results[k]) for k in ("detector_on", "detector_off"))
    print(
        json.dumps(
            {
                "steps_per_s": results,
                "median_on": on,
                "median_off": off,
                "overhead": off / on - 1,
                "load_average": os.getloadavg(),
                "args": vars(args),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
