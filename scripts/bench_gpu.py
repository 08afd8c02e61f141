"""GPT-2 small (124M) on one CUDA GPU: plait against a plain loop, tokens/s and MFU.

    python scripts/bench_gpu.py                      # bf16, fused AdamW, SDPA, eager
    python scripts/bench_gpu.py --compile            # the same with torch.compile
    python scripts/bench_gpu.py --peak-tflops 989    # dense bf16 peak of the GPU (H100 SXM: 989)

Runs only where CUDA is present (exits with a message elsewhere). Both paths train the same
model (``model=gpt2_small``: 12 layers, 12 heads, width 768, vocab 50304, tied embeddings) on the
embedded default data with the same batch; plait runs through ``plait train`` (one worker, the
DDP strategy with dp=1), the plain loop is written by hand in this process. Prints tokens/s of
each, MFU = (6·N + 12·L·H·Q·T) · tokens/s / peak, and the ratio plait / plain (target >= 0.97,
MFU target >= 40% on an H100).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from plait import api
from plait.plugins.optim import cosine_with_warmup
from plait.testing import StepClock, steps_per_s

N_LAYER, N_HEAD, N_EMBD, VOCAB = 12, 12, 768, 50304


def flops_per_token(n_params: int, seq_len: int) -> float:
    return 6 * n_params + 12 * N_LAYER * N_HEAD * (N_EMBD // N_HEAD) * seq_len


def run_plait(args, root: Path) -> float:
    clock = root / "plait.clock"
    api.train(
        [
            "model=gpt2_small",
            f"model.block_size={args.seq_len}",
            "precision=bf16",
            "device=cuda",
            "launcher.nproc_per_node=1",
            "tracker=none",
            "checkpoint.save_final=false",
            f"train.steps={args.steps}",
            f"train.batch_size={args.batch_size}",
            f"train.seq_len={args.seq_len}",
            f"strategy.compile={str(args.compile).lower()}",
            f"train.peak_flops={args.peak_tflops * 1e12}",
            "train.log_every=10",
            f"run.root={root}",
            "run.name=plait",
        ],
        plugins=[StepClock(clock)],
    )
    return steps_per_s([float(t) for t in clock.read_text().split()], args.warmup)


def run_plain(args) -> float:
    """The hand-written loop: same model, data order, bf16 autocast, fused AdamW, clipping."""
    import time

    from plait.plugins.data import TokenWindows, load_split, stdlib_tokens
    from plait.plugins.models.gpt import GPT

    device = torch.device("cuda", 0)
    torch.manual_seed(1337)
    model = GPT(
        vocab_size=VOCAB,
        block_size=args.seq_len,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        n_embd=N_EMBD,
        bias=False,
        tie_embeddings=True,
    ).to(device)
    step_fn = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        fused=True,
    )
    path = stdlib_tokens(Path("~/.cache/plait").expanduser(), 0)
    data = TokenWindows(
        load_split(np.memmap(path, dtype=np.uint16, mode="r"), 0.01, "train"), args.seq_len
    )
    order = np.random.default_rng(1337).permutation(len(data))
    stamps = []
    lr_at = cosine_with_warmup(lr=1e-3, min_lr=1e-4, warmup=10, decay=args.steps)  # plait's
    for step in range(args.steps):
        lr = lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr
        idx = order[step * args.batch_size : (step + 1) * args.batch_size].tolist()
        x, y = (t.to(device, non_blocking=True) for t in data.batch(idx))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step_fn(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # plait reads the loss every step too
        stamps.append(time.perf_counter())
    return steps_per_s(stamps, args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU; none is present here")
    from plait.plugins.models.gpt import GPT

    with torch.device("meta"):
        n_params = sum(
            p.numel()
            for p in GPT(
                vocab_size=VOCAB,
                block_size=args.seq_len,
                n_layer=N_LAYER,
                n_head=N_HEAD,
                n_embd=N_EMBD,
                bias=False,
                tie_embeddings=True,
            ).parameters()
        )
    tokens_per_step = args.batch_size * args.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        plait_sps = run_plait(args, Path(tmp))
    plain_sps = run_plain(args)
    result = {"gpu": torch.cuda.get_device_name(0), "params": n_params, "args": vars(args)}
    for name, sps in (("plait", plait_sps), ("plain", plain_sps)):
        tokens_per_s = sps * tokens_per_step
        result[name] = {
            "tokens_per_s": tokens_per_s,
            "mfu": flops_per_token(n_params, args.seq_len)
            * tokens_per_s
            / (args.peak_tflops * 1e12),
        }
    result["ratio_plait_over_plain"] = plait_sps / plain_sps
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
