"""Checkpoints within training's memory, checked as issue 32 asks: the whole job in a memory
cgroup capped just above its training peak must still save, and load, its checkpoint.

For each layout, three ``plait train`` jobs, each (launcher and every worker) in a fresh memory
cgroup with swap off (root, cgroup v1 or v2; ``bench_memory.run_in_cgroup``):

1. train without saving, uncapped: the whole job's training peak ``P`` (the kernel's peak);
2. the same run saving its final checkpoint, capped at ``--cap`` x ``P`` (default 1.05);
3. a run that loads that checkpoint (``resume=<dir>``) and takes one step, capped the same.

A save or load that gathered what training keeps sharded would need more and be killed by the
kernel (reported as "killed"). The kernel's peak counts the checkpoint files' page cache too,
which it reclaims under the cap instead of killing.

    DS_ACCELERATOR=cpu python scripts/bench_checkpoint_cgroup.py
    DS_ACCELERATOR=cpu python scripts/bench_checkpoint_cgroup.py --layouts fsdp --n-layer 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

from bench_memory import MIB, run_in_cgroup  # noqa: E402

LAYOUTS = {
    "fsdp": ["strategy=fsdp"],
    "zero3": ["strategy=zero3"],
    "zero2": ["strategy=zero2"],
    "ddp_tp2": ["strategy=ddp", "parallel.tp=2"],
    "ddp": ["strategy=ddp"],
    "zero1": ["strategy=zero1"],
    "pp2": ["parallel.pp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"],
    "ep2": ["parallel.ep=2", "model.n_experts=4", "model.top_k=2"],
    "cp2": ["parallel.cp=2"],
}
UNCAPPED_MIB = 1 << 30  # training's own run: no cap short of the machine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cap", type=float, default=1.05, help="the cap, x the training peak")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_checkpoint_cgroup.py: needs root (memory cgroups)", file=sys.stderr)
        return 2
    model = [
        f"model.n_layer={args.n_layer}",
        f"model.n_embd={args.n_embd}",
        f"model.n_head={args.n_head}",
        "model.block_size=128",
        "train.batch_size=8",
        "train.seq_len=128",
        "precision=fp32",
        f"launcher.nproc_per_node={args.nproc}",
        "resume=null",
    ]
    print(
        f"{args.nproc} processes, GPT {args.n_layer} x {args.n_embd}, fp32 AdamW; cap "
        f"{args.cap} x the training peak; load average {os.getloadavg()[0]:.2f}\n"
    )
    print("| layout | training peak MiB | cap MiB | save: peak MiB | x | load: peak MiB | x |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    good = True
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_cgroup_") as tmp:
        root = Path(tmp)
        for layout in args.layouts:
            runs = root / layout
            runs.mkdir()
            common = [*model, *LAYOUTS[layout], f"train.steps={args.steps}"]
            trained = run_in_cgroup(
                runs / "train", [*common, "checkpoint.save_final=false"], UNCAPPED_MIB
            )
            assert trained is not None
            cap = args.cap * trained / MIB
            saved = run_in_cgroup(runs / "save", [*common, "checkpoint.save_final=true"], cap)
            loaded = None
            if saved is not None:
                checkpoint = max((runs / "save" / "checkpoints").glob("step_*"))
                loaded = run_in_cgroup(
                    runs / "load",
                    [
                        *[o for o in common if not o.startswith(("train.steps", "resume"))],
                        f"train.steps={args.steps + 1}",
                        f"resume={checkpoint}",
                        "checkpoint.save_final=false",
                    ],
                    cap,
                )
            good &= saved is not None and loaded is not None
            print(
                f"| {layout} | {trained / MIB:.0f} | {cap:.0f} | {figure(saved, trained)} | "
                f"{figure(loaded, trained)} |",
                flush=True,
            )
    return 0 if good else 1


def figure(peak: float | None, trained: float) -> str:
    if peak is None:
        return "killed | -"
    return f"{peak / MIB:.0f} | {peak / trained:.3f}"


if __name__ == "__main__":
    sys.exit(main())
