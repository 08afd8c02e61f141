"""plait's DDP path against a plain hand-written torch DDP loop: same model, data and settings.

    python scripts/bench_overhead.py                       # 2 processes, CPU/gloo (or CUDA/NCCL)
    python scripts/bench_overhead.py --nproc 2 --steps 60 --repeats 3 --n-layer 4 --n-embd 256

Runs plait and the plain loop alternately (``--repeats`` times each), times steps after
``--warmup`` steps from rank 0's clock at the end of each step (everything in the loop counts:
data, forward/backward, all-reduce, optimizer, logging), and prints steps/s of each, their medians
and the ratio plait / plain (target >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plait import api
from plait.plugins.optim import cosine_with_warmup
from plait.testing import StepClock, exit_without_teardown, free_port, steps_per_s


def overrides(args, root: Path, name: str) -> list[str]:
    return [
        f"launcher.nproc_per_node={args.nproc}",
        "tracker=none",
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        f"train.seq_len={args.seq_len}",
        f"model.n_layer={args.n_layer}",
        f"model.n_embd={args.n_embd}",
        f"model.n_head={args.n_head}",
        f"model.block_size={args.seq_len}",
        "checkpoint.save_final=false",
        f"run.root={root}",
        f"run.name={name}",
    ]


def run_plait(args, root: Path, name: str) -> float:
    clock = root / f"{name}.clock"
    api.train(overrides(args, root, name), plugins=[StepClock(str(clock))])
    return steps_per_s([float(t) for t in clock.read_text().split()], args.warmup)


def plain_worker(rank: int, args, port: int, clock: str, cfg: dict) -> None:
    """The loop a user would write by hand: DDP, AdamW, cosine LR, clipping, loss print."""
    import numpy as np

    from plait.plugins.data import TokenWindows, load_split, stdlib_tokens
    from plait.plugins.models.gpt import GPT

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.nproc)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(cfg["seed"])
    model = GPT(
        vocab_size=256,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    ).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        fused=cuda or None,
    )
    path = stdlib_tokens(Path(cfg["cache_dir"]).expanduser(), rank)
    data = TokenWindows(
        load_split(np.memmap(path, dtype=np.uint16, mode="r"), 0.01, "train"), args.seq_len
    )
    order = np.random.default_rng(cfg["seed"]).permutation(len(data))
    local = args.batch_size // args.nproc
    lr_at = cosine_with_warmup(lr=1e-3, min_lr=1e-4, warmup=10, decay=args.steps)  # plait's
    for step in range(args.steps):
        lr = lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr
        start = step * args.batch_size + rank * local
        x, y = (t.to(device) for t in data.batch(order[start : start + local].tolist()))
        loss = torch.nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        if rank == 0:
            print(f"step {step} loss {value:.4f}", file=sys.stderr if step % 20 else sys.stdout)
            with open(clock, "a") as f:
                f.write(f"{time.perf_counter()}\n")
    dist.destroy_process_group()
    exit_without_teardown()  # as plait's workers end (no abort at interpreter teardown)


def run_plain(args, root: Path, name: str) -> float:
    clock = root / f"{name}.clock"
    cfg = {"seed": 1337, "cache_dir": os.environ.get("PLAIT_CACHE_DIR", "~/.cache/plait")}
    mp.spawn(plain_worker, args=(args, free_port(), str(clock), cfg), nprocs=args.nproc)
    return steps_per_s([float(t) for t in clock.read_text().split()], args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    args = parser.parse_args()
    # The same intra-op threads for both loops (plait's launcher would pick this value too).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    results: dict[str, list[float]] = {"plait": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            results["plait"].append(run_plait(args, Path(tmp), f"plait{i}"))
            results["plain"].append(run_plain(args, Path(tmp), f"plain{i}"))
    plait_sps, plain_sps = (statistics.median(results[k]) for k in ("plait", "plain"))
    summary = {
        "plait_steps_per_s": results["plait"],
        "plain_steps_per_s": results["plain"],
        "plait_median": plait_sps,
        "plain_median": plain_sps,
        "ratio_plait_over_plain": plait_sps / plain_sps,
        "args": vars(args),
    }
    print(json.dumps(summary, indent=1))
    print(
        f"plait {plait_sps:.2f} steps/s, plain torch DDP {plain_sps:.2f} steps/s, "
        f"ratio {plait_sps / plain_sps:.3f}"
    )


if __name__ == "__main__":
    main()
