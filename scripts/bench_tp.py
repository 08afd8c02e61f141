"""Per-rank memory and step time of plait's GPT with tensor (and sequence) parallelism.

    DS_ACCELERATOR=cpu python scripts/bench_tp.py                 # the default size below
    python scripts/bench_tp.py --layers 4 --embd 512 --heads 8 --vocab 8192 --seq 256 --batch 4 \
        --steps 8 --repeats 5
    python scripts/bench_tp.py --layers 1 --embd 32 --heads 2 --vocab 64 --seq 8 --batch 2 \
        --steps 1 --repeats 1                                      # a smoke run, seconds

Runs the same GPT (same seed, same batch) three ways in one command: tp=1 (one process, the
plain model: the raw-torch baseline), tp=2, and tp=2 with sequence parallelism (2 processes each,
on CPU with gloo, started by ``plait.testing.spawn``), ``--repeats`` times interleaved (tp=1,
tp=2, tp=2+sp, then again), so a change in the machine's load hits every layout alike. It prints
the load average at the start and the end and, for rank 0:

- ``param MiB``: bytes of the parameters this rank holds;
- ``act MiB``: bytes of the activations autograd saves for backward in one forward + loss
  (counted through ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters
  excluded): the activation memory Megatron's papers count;
- ``step ms``: per run the median wall time of forward + backward + clip + AdamW step over
  ``--steps`` steps after 2 warm-up steps; printed: the median over the runs, and the fastest
  and slowest run;

and each figure as a ratio to tp=1 (step time: of the medians). On a CPU-only machine the
processes share the cores (each rank gets ``cpu_count / tp`` threads), so step time shows the
cost of the split and of the collectives, not the speed-up of tp devices.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from plait.engine.norm import ShardGroups, clip_grad_norm_
from plait.plugins.models.gpt import GPT
from plait.plugins.tensor_parallel.layers import VocabParallelCrossEntropy
from plait.plugins.tensor_parallel.plan import TensorParallelPlan, apply_plan
from plait.testing import spawn
from plait.train import cross_entropy


def saved_activation_bytes(model, loss_fn, idx, targets) -> int:
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(idx), targets)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def measure(rank: int, world: int, sp: bool, args: dict, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
    torch.manual_seed(0)
    model = GPT(
        vocab_size=args["vocab"],
        block_size=args["seq"],
        n_layer=args["layers"],
        n_head=args["heads"],
        n_embd=args["embd"],
        bias=True,
    )
    group, loss_fn = None, cross_entropy
    if world > 1:
        group = dist.group.WORLD
        apply_plan(
            model, TensorParallelPlan(styles=dict(GPT.tensor_parallel_plan)), group, rank, world, sp
        )
        loss_fn = VocabParallelCrossEntropy(group, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, args["vocab"], (args["batch"], args["seq"]))
    targets = torch.randint(0, args["vocab"], (args["batch"], args["seq"]))

    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    act_bytes = saved_activation_bytes(model, loss_fn, idx, targets)
    times = []
    for step in range(args["steps"] + 2):
        if group is not None:
            dist.barrier()
        start = time.perf_counter()
        loss_fn(model(idx), targets).backward()
        clip_grad_norm_(model.parameters(), 1.0, ShardGroups(tp=group, tp_rank=rank))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(
            json.dumps({"param": param_bytes, "act": act_bytes, "step": statistics.median(times)})
        )


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved runs of each layout; medians are printed",
    )
    args = vars(parser.parse_args())
    print(
        f"GPT layers={args['layers']} embd={args['embd']} heads={args['heads']} "
        f"vocab={args['vocab']} seq={args['seq']} batch={args['batch']}, fp32, cpu (gloo); "
        f"figures of rank 0; {args['repeats']} interleaved run(s) of each layout, "
        f"{args['steps']} timed steps each after 2 warm-up steps; {os.cpu_count()} CPU cores; "
        f"load average {load_average()} (1, 5, 15 min) at the start"
    )
    layouts = (
        ("tp=1 (plain torch)", 1, False),
        ("tp=2", 2, False),
        ("tp=2 + sequence parallel", 2, True),
    )
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args["repeats"]):  # tp=1, tp=2, tp=2+sp, tp=1, ...
            for label, world, sp in layouts:
                out = f"{tmp}/{rep}-{world}{sp}.json"
                spawn(measure, world, sp, args, out)
                runs[label].append(json.loads(Path(out).read_text()))
    # memory is the same in every run; step time: the median run, and the spread
    rows = [
        (
            label,
            {
                "param": r[0]["param"],
                "act": r[0]["act"],
                "step": statistics.median(x["step"] for x in r),
                "spread": (min(x["step"] for x in r), max(x["step"] for x in r)),
            },
        )
        for label, r in runs.items()
    ]
    base = rows[0][1]
    mib = 2**20
    print(
        f"{'run':26s} {'param MiB':>10s} {'x':>6s} {'act MiB':>9s} {'x':>6s} "
        f"{'step ms':>9s} {'x':>6s}  step ms of each run (min-max)"
    )
    for label, r in rows:
        low, high = r["spread"]
        print(
            f"{label:26s} {r['param'] / mib:10.2f} {r['param'] / base['param']:6.2f} "
            f"{r['act'] / mib:9.2f} {r['act'] / base['act']:6.2f} "
            f"{r['step'] * 1e3:9.1f} {r['step'] / base['step']:6.2f}  "
            f"{low * 1e3:.1f}-{high * 1e3:.1f}"
        )
    print(
        f"step ms: median of {args['repeats']} run(s), x: against tp=1's median; load average "
        f"{load_average()} (1, 5, 15 min) at the end"
    )


if __name__ == "__main__":
    main()
