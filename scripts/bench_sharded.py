"""Step time and memory of the two fully sharded strategies side by side: torch's FSDP2
(``strategy=fsdp``) against DeepSpeed ZeRO-3 (``strategy=zero3``), same GPT, same batch, same dp.

    DS_ACCELERATOR=cpu python scripts/bench_sharded.py                       # defaults below
    DS_ACCELERATOR=cpu python scripts/bench_sharded.py --dp 4 --layers 8 --embd 512 --reps 3

Every case is a real ``plait train`` run (CPU, gloo); the repetitions are interleaved
(zero3, fsdp, zero3, fsdp, ...) so that a change in the machine's load hits both alike. Per
strategy it prints the median over the repetitions of:

- ``step s``: the median over the steps after ``--warmup`` of the slowest rank's step time
  (plait's ``step_time_s/max``);
- ``peak above start MiB``: the largest rank's peak resident memory less its memory just before
  the model was built (``plait.testing.MemoryProbe``);

and fsdp's figures as a ratio to zero3's (the baseline: DeepSpeed's, in the same command).
Memory does not depend on the load; step time does: run it alone and give the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from plait.testing import MemoryProbe, read_metrics, run_training

MIB = 2**20
STRATEGIES = ("zero3", "fsdp")


def run_once(root: Path, name: str, strategy: str, args) -> dict:
    run = run_training(
        root / name,
        [
            f"strategy={strategy}",
            f"launcher.nproc_per_node={args.dp}",
            f"model.n_layer={args.layers}",
            f"model.n_embd={args.embd}",
            f"model.n_head={args.heads}",
            f"model.block_size={args.seq}",
            f"train.seq_len={args.seq}",
            f"train.batch_size={args.batch}",
            f"train.steps={args.steps}",
            f"precision={args.precision}",
            "train.log_every=1",
            "checkpoint.save_final=false",
        ],
        plugins=[MemoryProbe()],
    )
    metrics = read_metrics(run)
    last = metrics[-1]
    return {
        "step_s": statistics.median(m["step_time_s/max"] for m in metrics[args.warmup :]),
        "above_start": last["peak_memory_bytes/max"] - last["memory/rss_before_model_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    with tempfile.TemporaryDirectory(prefix="bench_sharded-") as root:
        for rep in range(args.reps):
            for strategy in STRATEGIES:
                runs[strategy].append(run_once(Path(root), f"{strategy}-{rep}", strategy, args))
    print(
        f"\nGPT {args.layers} layers x {args.embd}, seq {args.seq}, batch {args.batch}, "
        f"{args.precision}, dp={args.dp}; medians of {args.reps} interleaved runs, "
        f"{args.steps} steps ({args.warmup} warm-up); load average at the end "
        f"{os.getloadavg()[0]:.2f}\n"
    )
    print("| strategy | step s | x zero3 | peak above start MiB | x zero3 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = None
    for strategy in STRATEGIES:
        step = statistics.median(r["step_s"] for r in runs[strategy])
        memory = statistics.median(r["above_start"] for r in runs[strategy])
        base = base or (step, memory)
        print(
            f"| {strategy} | {step:.3f} | {step / base[0]:.3f} | {memory / MIB:.1f} "
            f"| {memory / base[1]:.3f} |"
        )


if __name__ == "__main__":
    main()
