"""Checkpoint costs of plait's layout-free (DCP) checkpoints: sync vs async save, load, reshard.

    DS_ACCELERATOR=cpu python scripts/bench_checkpoint.py             # GPT-2 small, 124M params
    python scripts/bench_checkpoint.py --layers 4 --embd 512 --heads 8 --vocab 8192 --repeats 3

One command, interleaved runs, CPU and gloo (started by ``plait.testing.spawn``):

1. one process holds the GPT and its AdamW states (fp32: 12 bytes per parameter), and saves
   them ``--repeats`` times each way, alternately: ``dcp.save`` (what training blocks for with
   ``checkpoint.async_save=false``) and ``dcp.async_save`` with plait's CPU stager (training blocks
   only for the copy to CPU memory; ``write s`` is until the background write has finished);
   then loads the checkpoint back (same layout);
2. two processes with tensor parallelism (tp=2) load that tp=1 checkpoint: the conversion
   (each rank reads the full tensors and cuts its shard).

The save and load paths are plait's own (``plait.engine.layout_free`` and
``background.cpu_stager``) over the state DDP gives at fp32 (``plait.plugins.optim.
state_by_name``, what ``DDPEngine.layout_free_state`` returns without a loss scaler). Prints
seconds and the ratios ``async block / sync save`` (target <= 0.25) and ``reshard / load``.
``--dir D`` writes under ``D`` (made if missing) instead of the system's temp directory, e.g. to
measure another disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from plait.engine import layout_free
from plait.engine.state_by_name import load_state_by_name, state_by_name
from plait.plugins.checkpoint.background import cpu_stager
from plait.plugins.models.gpt import GPT
from plait.plugins.tensor_parallel.plan import TensorParallelPlan, apply_plan
from plait.testing import spawn


class Engine:
    """The model and optimizer with the layout-free state surface
    (``plait.types.LayoutFreeStateEngine``), as DDP gives and takes it at fp32."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def layout_free_state(self) -> dict:
        return state_by_name(self.model, self.optimizer)

    def load_layout_free_state(self, state: dict) -> None:
        load_state_by_name(self.model, self.optimizer, state)


def build(rank: int, world: int, args: dict) -> tuple[Engine, SimpleNamespace]:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    model = GPT(
        vocab_size=args["vocab"],
        block_size=64,
        n_layer=args["layers"],
        n_head=args["heads"],
        n_embd=args["embd"],
        bias=False,
    )
    if world > 1:
        apply_plan(
            model,
            TensorParallelPlan(styles=dict(model.tensor_parallel_plan)),
            dist.group.WORLD,
            rank,
            world,
            sequence_parallel=False,
        )
    topology = SimpleNamespace(
        dims=SimpleNamespace(tp=world), tp_rank=rank, group=lambda name: dist.group.WORLD
    )
    return Engine(model), topology


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def save_and_load(rank: int, world: int, args: dict, tmp: str, out: str) -> None:
    engine, topology = build(rank, world, args)
    for p in engine.model.parameters():  # one step: AdamW has its states, as in training
        p.grad = torch.ones_like(p)
    engine.optimizer.step()
    group = dist.group.WORLD
    sync, block, write = [], [], []
    for i in range(args["repeats"]):
        sync.append(timed(lambda: layout_free.save(engine, topology, Path(tmp, f"s{i}"), group)))
        stager = cpu_stager()
        start = time.perf_counter()
        future = layout_free.save(engine, topology, Path(tmp, f"a{i}"), group, stager)
        block.append(time.perf_counter() - start)
        future.result()
        write.append(time.perf_counter() - start)
        stager.close()
    load = timed(lambda: layout_free.load(engine, topology, Path(tmp, "s0"), group))
    n_params = sum(p.numel() for p in engine.model.parameters())
    Path(out).write_text(
        json.dumps({"sync": sync, "block": block, "write": write, "load": load, "params": n_params})
    )


def reshard(rank: int, world: int, args: dict, tmp: str, out: str) -> None:
    engine, topology = build(rank, world, args)
    seconds = timed(lambda: layout_free.load(engine, topology, Path(tmp, "s0"), dist.group.WORLD))
    if rank == 0:
        Path(out).write_text(json.dumps({"reshard": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = vars(parser.parse_args())
    if args["dir"] is not None:
        Path(args["dir"]).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args["dir"]) as tmp:
        spawn(save_and_load, 1, args, tmp, f"{tmp}/save.json")
        spawn(reshard, 2, args, tmp, f"{tmp}/reshard.json")
        r = json.loads(Path(tmp, "save.json").read_text())
        r |= json.loads(Path(tmp, "reshard.json").read_text())
        size = sum(f.stat().st_size for f in Path(tmp, "s0").rglob("*") if f.is_file())
    med = {k: statistics.median(r[k]) for k in ("sync", "block", "write")}
    print(
        f"GPT layers={args['layers']} embd={args['embd']} vocab={args['vocab']}: "
        f"{r['params'] / 1e6:.1f}M parameters, checkpoint {size / 2**30:.2f} GiB "
        f"(fp32 model + AdamW), median of {args['repeats']} interleaved saves each way"
    )
    print(f"{'sync save (blocks)':28s} {med['sync']:8.2f} s")
    print(
        f"{'async save: blocks for':28s} {med['block']:8.2f} s   "
        f"x{med['block'] / med['sync']:.3f} of sync (target <= 0.25)"
    )
    print(f"{'async save: written after':28s} {med['write']:8.2f} s")
    print(f"{'load (same layout, tp=1)':28s} {r['load']:8.2f} s")
    print(
        f"{'reshard load (tp=1 -> tp=2)':28s} {r['reshard']:8.2f} s   "
        f"x{r['reshard'] / r['load']:.2f} of load"
    )


if __name__ == "__main__":
    main()
