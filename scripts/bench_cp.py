"""Context parallelism: for each cp and backend, the longest sequence one rank's memory budget
holds, tokens/s, and the bytes the attention exchanges per step against the theory.

    python scripts/bench_cp.py                                   # 4 ranks, CPU/gloo, 1 GiB
    python scripts/bench_cp.py --world 4 --budget-mb 1024 --seq 4096 --repeats 3
    python scripts/bench_cp.py --world 4 --device cuda --budget-mb 8192 --n-embd 1024

Spawns ``--world`` processes (gloo on the CPU, NCCL with ``--device cuda``). For cp = 1, 2, 4 (up
to ``--world``) and each backend (ring, ulysses) the ranks form groups of cp consecutive ranks,
each group training plait's GPT (``--n-layer``, ``--n-embd``, ``--n-head``, ``--batch``
sequences, fp32, AdamW) with its sequences split over the group. Prints one line per setting:

- ``longest``: the longest sequence (doubling from ``--start-seq``) whose training step keeps
  every rank's peak memory within ``--budget-mb`` (CPU: the process's peak resident set above
  its size before the step, ``VmHWM``; CUDA: ``max_memory_allocated``), and its ratio to cp=1;
- ``tok/s/rank``: tokens per second per rank at ``--seq`` tokens (median of ``--repeats``
  timed steps after one warm-up), each group's tokens over its time and its ranks, and the ratio
  to cp=1 (below 1: splitting a sequence costs exchanges; what it buys is ``longest``);
- ``bytes/step``: what rank 0's attention sent in one step (forward and backward), measured
  (``ExchangeStats``), and the theory, ``n_layer · exchange_bytes`` (ring: ``(3C-2)·2·(T/C)·b·h·v``;
  Ulysses: ``8·(C-1)/C·(T/C)·b·h·v``).

Timings need an idle machine; memory and bytes do not depend on load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.host_memory import configure_worker
from plait.plugins.context_parallel.apply import (
    SequenceShardLoss,
    apply_context_parallel,
    exchange_bytes,
    layout_for,
)
from plait.plugins.context_parallel.ring import ExchangeStats
from plait.plugins.models.gpt import GPT
from plait.testing import peak_resident_bytes, reset_peak_resident_bytes, resident_bytes, spawn

VOCAB = 256


def settings(world: int) -> list[tuple[int, str]]:
    cps = [c for c in (2, 4, 8) if c <= world and world % c == 0]
    return [(1, "-")] + [(c, backend) for c in cps for backend in ("ring", "ulysses")]


def build(args, seq: int, cp: int, backend: str, group, rank: int, device, stats):
    torch.manual_seed(0)
    model = GPT(
        vocab_size=VOCAB,
        block_size=seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    ).to(device)
    loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    if cp > 1:
        layout = layout_for(backend, seq, cp, rank)
        apply_context_parallel(model, backend, layout, group, stats)
        loss_fn = SequenceShardLoss(loss_fn, layout)
    return model, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, loss_fn, optimizer, seq: int, batch: int, group, cp: int, device) -> None:
    tokens = torch.randint(
        0,
        VOCAB,
        (batch, seq + 1),
        device=device,
        generator=torch.Generator(device).manual_seed(seq),
    )
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    if cp > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_peak(args, seq, cp, backend, group, rank, device) -> int:
    """Peak memory of one training step above the memory before it, the largest over ranks."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resident_bytes()
        reset_peak_resident_bytes()
    try:
        step(
            *build(args, seq, cp, backend, group, rank, device, ExchangeStats()),
            seq,
            args.batch,
            group,
            cp,
            device,
        )
        peak = (
            torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_resident_bytes()
        ) - base
    except (RuntimeError, MemoryError):  # out of memory
        peak = 1 << 62
    figure = torch.tensor([float(peak)], device=device)
    dist.all_reduce(figure, op=dist.ReduceOp.MAX)
    return int(figure.item())


def longest(args, cp, backend, group, rank, device) -> int:
    seq, fits = args.start_seq, 0
    while seq <= args.max_seq:
        if step_peak(args, seq, cp, backend, group, rank, device) > args.budget_mb * 2**20:
            break
        fits, seq = seq, seq * 2
    return fits


def throughput(args, cp, backend, group, rank, device) -> tuple[float, int]:
    """Tokens/s per rank at ``--seq`` and rank 0's bytes sent in one step."""
    stats = ExchangeStats()
    model, loss_fn, optimizer = build(args, args.seq, cp, backend, group, rank, device, stats)
    step(model, loss_fn, optimizer, args.seq, args.batch, group, cp, device)  # warm-up
    stats.take()
    seconds = []
    for _ in range(args.repeats):
        dist.barrier()
        started = time.perf_counter()
        step(model, loss_fn, optimizer, args.seq, args.batch, group, cp, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    sent = stats.take()["bytes_sent"] // args.repeats
    return args.batch * args.seq / statistics.median(seconds) / cp, sent


def _bench(rank: int, world: int, args, out: str) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        configure_worker("glibc_mmap")  # freed tensors go back to the kernel: the RSS is live
        torch.set_num_threads(args.threads)
    else:
        torch.cuda.set_device(device)
    groups = {
        c: [dist.new_group(list(range(g, g + c))) for g in range(0, world, c)]
        for c, _ in settings(world)
        if c > 1
    }
    # one unmeasured step first: what a process allocates once (kernels' and the allocator's
    # first use) would otherwise count against the first setting measured
    step(
        *build(args, args.start_seq, 1, "-", None, 0, device, ExchangeStats()),
        args.start_seq,
        args.batch,
        None,
        1,
        device,
    )
    rows = []
    for cp, backend in settings(world):
        group = groups[cp][rank // cp] if cp > 1 else None
        fits = longest(args, cp, backend, group, rank % cp, device)
        tokens, sent = throughput(args, cp, backend, group, rank % cp, device)
        theory = args.n_layer * exchange_bytes(backend, args.seq, args.batch, args.n_embd, cp, 4)
        rows.append(
            {
                "cp": cp,
                "backend": backend,
                "longest": fits,
                "tokens_per_s": tokens,
                "bytes": sent,
                "theory": theory,
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--budget-mb", type=float, default=1024)
    parser.add_argument("--start-seq", type=int, default=512)
    parser.add_argument("--max-seq", type=int, default=1 << 17)
    parser.add_argument("--seq", type=int, default=2048, help="tokens/s and bytes at this length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        spawn(_bench, args.world, args, out)
        rows = json.loads(Path(out).read_text())
    base = rows[0]
    print(
        f"context parallelism, {args.world} ranks on {args.device}: GPT {args.n_layer} layers x "
        f"{args.n_embd} wide, {args.n_head} heads, batch {args.batch}, fp32; budget "
        f"{args.budget_mb:g} MiB per rank; tok/s and bytes at seq {args.seq}"
    )
    print(
        f"{'cp':>3} {'backend':8} {'longest':>8} {'x cp1':>6} {'tok/s/rank':>11} {'x cp1':>6} "
        f"{'bytes/step':>12} {'theory':>12}"
    )
    for row in rows:
        print(
            f"{row['cp']:>3} {row['backend']:8} {row['longest']:>8} "
            f"{row['longest'] / max(base['longest'], 1):>6.2f} {row['tokens_per_s']:>11.0f} "
            f"{row['tokens_per_s'] / base['tokens_per_s']:>6.2f} {row['bytes']:>12,} "
            f"{row['theory']:>12,.0f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
