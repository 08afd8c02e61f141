"""Expert parallelism of plait's GPT-MoE: throughput, memory and all-to-all bytes at ep=1/2/4,
and the most experts a per-rank budget holds at each ep. One command:

    DS_ACCELERATOR=cpu python scripts/bench_moe.py                       # the defaults below
    python scripts/bench_moe.py --world-size 4 --experts 8 --top-k 1 --steps 30 --budget-mb 256
    python scripts/bench_moe.py --estimate-only                           # no training

For each ``ep`` in ``--eps`` (each must divide ``--world-size``; dp = world size, so ep=1 is the
baseline: every rank holds every expert and no token leaves its rank) it trains the same GPT-MoE
(same seed, same global batch) with ``plait train`` on ``--world-size`` processes and prints:

- ``tokens/s``: global tokens per second between the end of step ``--warmup`` and the last
  step (rank 0's step ends), and its ratio to ep=1;
- ``peak MiB/rank``: the largest rank's peak memory (plait's ``peak_memory_bytes/max``: CUDA's
  allocator peak, or the process's peak resident set on the CPU), and its ratio to ep=1;
- ``params MiB/rank``: parameters one rank holds (``plait.meta.parameters_per_rank``, fp32);
- ``a2a KiB/step``: bytes a rank sends to other ranks per step in all-to-all calls (plait's
  ``moe/all_to_all_bytes``, mean over ranks and steps), against the theory for uniform routing,
  per MoE layer and micro-batch: ``2 · T · k · h · b · (ep−1)/ep`` in forward (dispatch and
  combine of the rank's ``T`` tokens' ``k`` choices, ``h`` values of ``b`` bytes each; the
  issue's ``2 · tokens · hidden · (E−1)/E`` for top-1) and as much again in backward, plus the
  token counts (``E · 8 · (ep−1)/ep`` bytes); ``meas/theory`` near 1 means the all-to-all sends
  what routing needs and nothing more (routing is not exactly uniform, so not exactly 1).

Then, without training, for each ep the largest ``model.n_experts`` (a multiple of ep) whose
per-rank estimate (``plait estimate``'s: model states under ``--strategy`` plus one
micro-batch's activations) fits ``--budget-mb``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # several processes share the cores

from plait.meta import meta_model, parameters_per_rank  # noqa: E402
from plait.plan import make_plan  # noqa: E402
from plait.plugins.planner.estimate import activation_bytes, strategy_cost  # noqa: E402
from plait.testing import StepClock, read_metrics, run_training, steps_per_s  # noqa: E402


def model_overrides(args, experts: int) -> list[str]:
    return [
        f"model.n_layer={args.layers}",
        f"model.n_embd={args.embd}",
        f"model.n_head={args.heads}",
        f"model.n_experts={experts}",
        f"model.top_k={args.top_k}",
        f"model.block_size={args.seq}",
        f"train.seq_len={args.seq}",
        f"train.batch_size={args.batch}",
        f"strategy={args.strategy}",
        "model.aux_loss_coeff=0.01",
    ]


def train(root: Path, ep: int, args) -> dict:
    clock = root / f"clock_ep{ep}.txt"
    run = run_training(
        root / f"ep{ep}",
        [
            *model_overrides(args, args.experts),
            f"launcher.nproc_per_node={args.world_size}",
            f"parallel.ep={ep}",
            f"train.steps={args.steps}",
            "train.log_every=1",
        ],
        plugins=[StepClock(clock)],
    )
    stamps = [float(line) for line in clock.read_text().split()]
    metrics = read_metrics(run)[args.warmup :]
    tokens_per_step = args.batch * args.seq
    return {
        "tokens_per_s": steps_per_s(stamps, args.warmup) * tokens_per_step,
        "peak": max(m["peak_memory_bytes/max"] for m in metrics),
        "a2a": sum(m.get("moe/all_to_all_bytes", 0.0) for m in metrics) / len(metrics),
    }


def a2a_theory(ep: int, args) -> float:
    """Bytes a rank sends per step to other ranks, uniform routing (see the docstring)."""
    if ep == 1:
        return 0.0
    share = (ep - 1) / ep
    micro = args.batch // args.world_size  # one micro-batch per rank
    tokens = micro * args.seq
    rows = 2 * 2 * tokens * args.top_k * args.embd * 4 * share  # fp32, forward and backward
    counts = args.experts * 8 * share
    return args.layers * (rows + counts)


def per_rank_bytes(args, ep: int, experts: int) -> float:
    """``plait estimate``'s per-rank total for ``experts`` experts at ``ep``."""
    plan = make_plan(
        [
            *model_overrides(args, experts),
            "tracker=none",
            f"launcher.nproc_per_node={args.world_size}",
            f"parallel.ep={ep}",
        ]
    ).check()
    model = meta_model(plan.pm.hook, plan.cfg)
    micro = args.batch // args.world_size
    return strategy_cost(plan, model).device_bytes + (activation_bytes(plan, model, micro) or 0)


def most_experts(args, ep: int, budget: float) -> int:
    """The largest multiple of ep (up to 2^16) whose estimate fits ``budget`` (0: none)."""
    if per_rank_bytes(args, ep, ep) > budget:
        return 0
    low, high = 1, 2
    while high * ep <= 2**16 and per_rank_bytes(args, ep, high * ep) <= budget:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if per_rank_bytes(args, ep, mid * ep) <= budget else (low, mid)
    return low * ep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--eps", default="1,2,4")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--budget-mb", type=float, default=256)
    parser.add_argument("--estimate-only", action="store_true")
    args = parser.parse_args()
    eps = [int(e) for e in args.eps.split(",")]

    print(
        f"GPT-MoE: {args.layers} layers, n_embd {args.embd}, {args.experts} experts, top "
        f"{args.top_k}; batch {args.batch} x seq {args.seq}; {args.world_size} processes, "
        f"strategy={args.strategy}",
        flush=True,
    )
    if not args.estimate_only:
        with tempfile.TemporaryDirectory() as tmp:
            results = {ep: train(Path(tmp), ep, args) for ep in eps}
        base = results[eps[0]]
        print(
            f"{'ep':>3} {'tokens/s':>10} {'x ep1':>6} {'peak MiB/rank':>14} {'x ep1':>6} "
            f"{'params MiB/rank':>16} {'a2a KiB/step':>13} {'theory KiB':>11} "
            f"{'meas/theory':>11}"
        )
        for ep, r in results.items():
            dims = make_plan(
                [
                    *model_overrides(args, args.experts),
                    "tracker=none",
                    f"launcher.nproc_per_node={args.world_size}",
                    f"parallel.ep={ep}",
                ]
            ).check()
            model = meta_model(dims.pm.hook, dims.cfg)
            params = sum(parameters_per_rank(model, dims.dims)) * 4
            theory = a2a_theory(ep, args)
            ratio = f"{r['a2a'] / theory:.3f}" if theory else "-"
            speed = r["tokens_per_s"] / base["tokens_per_s"]
            print(
                f"{ep:>3} {r['tokens_per_s']:>10.0f} {speed:>6.2f} {r['peak'] / 2**20:>14.1f}"
                f" {r['peak'] / base['peak']:>6.2f}"
                f" {params / 2**20:>16.2f} {r['a2a'] / 1024:>13.1f} {theory / 1024:>11.1f}"
                f" {ratio:>11}",
                flush=True,
            )
    budget = args.budget_mb * 2**20
    print(
        f"most experts per layer within {args.budget_mb:g} MiB per rank (plait estimate: "
        f"model states under strategy={args.strategy} + one micro-batch's activations):"
    )
    for ep in eps:
        print(f"  ep={ep}: {most_experts(args, ep, budget)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
