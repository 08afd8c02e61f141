"""The workers' host allocator side by side (``launcher.allocator``): step time and memory per
rank of the same plait runs under glibc with issue 20's fixed mmap threshold, glibc as it is,
jemalloc and tcmalloc (those installed).

    DS_ACCELERATOR=cpu python scripts/bench_allocator.py                     # ddp, zero3, fsdp
    DS_ACCELERATOR=cpu python scripts/bench_allocator.py --layouts ddp --repeats 5 --steps 30

Every case is a real ``plait train`` run on ``--nproc`` CPU processes (a GPT of ``--n-layer``
layers of width ``--n-embd``, sequence ``--seq-len``, global batch ``--batch-size``), the
allocators interleaved within each repeat. Per case it prints the median over repeats of: the
step time (the slowest rank's ``step_time_s`` median after ``--warmup`` steps), the peak per
rank above its resident size before the model was built (``plait.testing.MemoryProbe``: what
the model, its states and the activations held, imports excluded) and the peak resident size,
each also as a ratio to glibc_mmap's (issue 20's setting, the memory to keep), then the load
average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from bench_memory import libraries  # noqa: E402

from plait.host_memory import LIBRARIES, library_of  # noqa: E402
from plait.testing import ImportFirst, MemoryProbe, read_metrics, run_training  # noqa: E402

LAYOUTS = {
    "ddp": [],
    "zero3": ["strategy=zero3"],
    "fsdp": ["strategy=fsdp"],
    "zero1": ["strategy=zero1"],
}
MIB = 2**20


def measure(root: Path, name: str, overrides: list[str], warmup: int) -> dict:
    run = run_training(root / name, overrides, [ImportFirst(*libraries(overrides)), MemoryProbe()])
    metrics = read_metrics(run)
    last = metrics[-1]
    peak = last["peak_memory_bytes/max"]
    return {
        "step": statistics.median(m["step_time_s/max"] for m in metrics[warmup:]),
        "above": peak - last["memory/rss_before_model_bytes"],
        "peak": peak,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layouts", nargs="+", default=["ddp", "zero3", "fsdp"], choices=list(LAYOUTS)
    )
    parser.add_argument(
        "--allocators", nargs="+", default=["glibc_mmap", "glibc", "jemalloc", "tcmalloc"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    allocators = []
    for name in args.allocators:
        if name in LIBRARIES and library_of(name) is None:
            print(f"{name}: skipped (lib{LIBRARIES[name]} is not installed)", flush=True)
        else:
            allocators.append(name)
    model = [
        "model=gpt_tiny",
        f"model.n_layer={args.n_layer}",
        f"model.n_embd={args.n_embd}",
        f"model.n_head={args.n_head}",
        f"model.block_size={args.seq_len}",
        f"train.seq_len={args.seq_len}",
        f"train.batch_size={args.batch_size}",
        f"train.steps={args.steps}",
        f"launcher.nproc_per_node={args.nproc}",
        "checkpoint.save_final=false",
    ]
    got: dict[tuple[str, str], list[dict]] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_allocator-") as tmp:
        for repeat in range(args.repeats):
            for layout in args.layouts:
                for allocator in allocators:
                    overrides = [*model, *LAYOUTS[layout], f"launcher.allocator={allocator}"]
                    name = f"{layout}-{allocator}-{repeat}"
                    got.setdefault((layout, allocator), []).append(
                        measure(Path(tmp), name, overrides, args.warmup)
                    )
    print(
        f"\n{args.nproc} processes, GPT {args.n_layer} x {args.n_embd}, batch {args.batch_size} x "
        f"{args.seq_len}, fp32; medians of {args.repeats} interleaved repeats; load average "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n"
    )
    print("| layout | allocator | step s | x glibc_mmap | above start MiB | x | peak MiB | x |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layout in args.layouts:
        base = None
        for allocator in allocators:
            runs = got[(layout, allocator)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("step", "above", "peak")}
            base = base or med
            print(
                f"| {layout} | {allocator} | {med['step']:.3f} | {med['step'] / base['step']:.3f} "
                f"| {med['above'] / MIB:.1f} | {med['above'] / base['above']:.3f} "
                f"| {med['peak'] / MIB:.1f} | {med['peak'] / base['peak']:.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
