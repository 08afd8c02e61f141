"""The plain loops ``bench_parity.py`` runs plait against: for each strategy, the shortest loop a
user would write directly on the library plait wraps, on plait's GPT and plait's data.

    python -m torch.distributed.run --standalone --nproc_per_node 2 scripts/parity_loops.py \
        SPEC.json                                    # what bench_parity.py runs for each row

``SPEC.json`` (written by ``bench_parity.py`` from plait's composed config, so both sides train
the same thing) names the row and holds the model, the optimizer's and schedule's settings, the
batch, the steps and, for ZeRO, the DeepSpeed JSON plait generates. Rank 0 writes its wall clock
and CPU time at the end of each step to ``SPEC["clock"]`` and, with ``SPEC["losses"]``, writes its
own per-step losses (``None`` on a pipeline stage without the loss) for the loss check.

Each loop is written as its library's documentation teaches it:

- ``ddp``: torch ``DistributedDataParallel``, AdamW, ``clip_grad_norm_``;
- ``zero1..3``: ``deepspeed.initialize`` with the JSON, ``engine.backward``, ``engine.step``;
- ``fsdp``: ``fully_shard`` per block, then the root (on gloo with the sum-then-divide reduction
  every FSDP2 user on CPU needs: gloo's AVG is wrong under FSDP2, pytorch#162338);
- ``tp2``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on each block's
  attention and MLP (the fused QKV weight's rows reordered once so a contiguous split holds
  whole heads); embeddings, norms and head replicated;
- ``pp2``: ``torch.distributed.pipelining``: each rank's stage cut from the model by hand,
  ``PipelineStage`` and ``Schedule1F1B``, the norm for clipping summed over the stages;
- ``ep2``: plait's mixture-of-experts GPT, each rank keeping half the experts, tokens sent to
  them by a dispatcher written here on ``all_to_all_single``; DDP over the dense parameters;
- ``cp2``: DDP over the context-parallel ranks, each rank's zigzag chunks of the sequence, the
  attention cores replaced by plait's own ring attention (only the layer is measured).

Also here: :data:`clock`, the plugin that records plait's side the same way (rank 0's wall clock
at each step's end), loaded by ``+plugins=[parity_loops:clock]``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait import hookimpl


class StepProfile:
    """With ``$PARITY_PROFILE`` set (``bench_parity.py --profile DIR``): torch.profiler on rank
    0 over ``PARITY_PROFILE_STEPS`` steps after the first 10, its operator table (by self CPU
    time) written to that path; both sides of a row profiled the same way. On CUDA the GPU's
    kernels too, and the timeline beside the table (``<path>.trace.json``, Chrome's format):
    where the GPU waits for the host between kernels."""

    def __init__(self) -> None:
        self.path = os.environ.get("PARITY_PROFILE")
        self.first = 10
        self.last = self.first + int(os.environ.get("PARITY_PROFILE_STEPS", "10"))
        self.profiler = None

    def step(self, finished: int) -> None:
        if not self.path:
            return
        if finished == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        elif finished == self.last and self.profiler is not None:
            self.profiler.stop()
            table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=80)
            Path(self.path).write_text(f"steps {self.first}..{self.last} on rank 0\n{table}\n")
            if torch.cuda.is_available():
                self.profiler.export_chrome_trace(f"{self.path}.trace.json")
            self.profiler = None


def thread_cpu() -> dict[str, float]:
    """This process's CPU seconds so far, per thread, by name: ``main``, a Python thread's name
    (``plait-loader``), else the kernel's (``gloo_tcp_loop``); threads of one name summed. From
    the scheduler's nanosecond count (``/proc/self/task/*/schedstat``), else the clock ticks of
    ``stat``."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "main"
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = names.get(int(task.name)) or (task / "comm").read_text().strip()
            if (task / "schedstat").exists():
                used = int((task / "schedstat").read_text().split()[0]) / 1e9
            else:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                used = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        seconds[name] = seconds.get(name, 0.0) + used
    return seconds


class ThreadTimes:
    """With ``$PARITY_THREADS`` set to the warm-up steps (``bench_parity.py --threads``): rank
    0's CPU time per thread from the end of that step to the end of the last, and the main
    thread's inside the step function (plait's ``engine.train_step`` within the phase clock's
    wrapper, the plain loop's ``step``), written per step as ``<clock>.threads``. Main minus
    in-step is the loop around the step: data, hooks, metrics, the phase clock. Both sides are
    measured the same way, at two points only."""

    def __init__(self) -> None:
        warmup = os.environ.get("PARITY_THREADS")
        self.warmup = int(warmup) if warmup else None
        self.finished, self.in_step = 0, 0.0
        self.start: dict[str, float] = {}
        self.steps_timed = False  # a loop with no step function of its own (tp2, pp2, cp2)

    def timed(self, step):
        """``step``, its main-thread CPU time after the warm-up added up."""
        if self.warmup is None:
            return step
        self.steps_timed = True

        def timed_step(*args, **kwargs):
            counted, began = self.finished >= self.warmup, time.thread_time()
            try:
                return step(*args, **kwargs)
            finally:
                if counted:
                    self.in_step += time.thread_time() - began

        return timed_step

    def step_end(self, finished: int) -> None:
        self.finished = finished
        if finished == self.warmup:
            self.start = thread_cpu()

    def write(self, clock: str) -> None:
        if self.warmup is None or self.finished <= self.warmup:
            return
        steps = self.finished - self.warmup
        used = {n: (s - self.start.get(n, 0.0)) / steps for n, s in thread_cpu().items()}
        if self.steps_timed:
            used["main: in the step"] = self.in_step / steps
        Path(f"{clock}.threads").write_text(json.dumps(used))


class ParityClock:
    """plait's side of the record: rank 0's wall clock and its process's CPU time at the end of
    each step, written at the end of the run to ``$PARITY_CLOCK`` (nothing during the steps);
    with ``$PARITY_THREADS``, its CPU time by thread (:class:`ThreadTimes`)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.profile = StepProfile()
        self.threads = ThreadTimes()

    # outside every other engine wrapper but the phase clock's (also tryfirst, registered
    # later, so outermost): the phase clock's bookkeeping counts with the loop around the step
    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_engine(self):
        engine = yield
        if self.threads.warmup is not None:
            engine.train_step = self.threads.timed(engine.train_step)
        return engine

    @hookimpl
    def plait_on_step_end(self, step) -> None:
        self.ends.append((time.time(), time.process_time()))
        self.profile.step(len(self.ends))
        self.threads.step_end(len(self.ends))

    @hookimpl
    def plait_on_run_end(self) -> None:
        Path(os.environ["PARITY_CLOCK"]).write_text(json.dumps(self.ends))
        self.threads.write(os.environ["PARITY_CLOCK"])


clock = ParityClock()


# -- what every plain loop shares ----------------------------------------------------------------


def setup(spec: dict) -> torch.device:
    cuda = spec["device"] == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    if not cuda:
        return torch.device("cpu")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def build_gpt(spec: dict):
    from plait.plugins.models.gpt import GPT

    torch.manual_seed(spec["seed"])  # plait's GPT initialises each parameter from this seed
    return GPT(**spec["model"])


def token_windows(spec: dict):
    """plait's default data (the standard library's source, byte tokens), its train split."""
    import numpy as np

    from plait.plugins.data import TokenWindows, load_split, stdlib_tokens

    path = stdlib_tokens(Path(spec["cache_dir"]).expanduser(), 0)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    return TokenWindows(load_split(tokens, spec["val_fraction"], "train"), spec["seq_len"])


def batches(spec: dict, dp_rank: int, dp_size: int, device):
    """This rank's share of each global batch, in plait's sample order (seeded permutation)."""
    import numpy as np

    data = token_windows(spec)
    order = np.random.default_rng(spec["seed"]).permutation(len(data))
    local = spec["batch_size"] // dp_size
    for step in range(spec["steps"]):
        start = step * spec["batch_size"] + dp_rank * local
        x, y = data.batch(order[start : start + local].tolist())
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def adamw(spec: dict, params_by_decay):
    opt = spec["optimizer"]
    return torch.optim.AdamW(
        params_by_decay,
        lr=opt["lr"],
        betas=tuple(opt["betas"]),
        eps=opt["eps"],
        fused=True if spec["device"] == "cuda" else None,
    )


def decay_groups(params, weight_decay: float) -> list[dict]:
    params = list(params)
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def lr_at(spec: dict):
    from plait.plugins.optim import cosine_with_warmup

    s = spec["schedule"]
    return cosine_with_warmup(s["lr"], s["min_lr"], s["warmup"], s["decay"])


def autocast(spec: dict, device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"])
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


class Record:
    """Rank 0's clock at each step's end (with ``$PARITY_THREADS``, its CPU time by thread:
    :class:`ThreadTimes`); each rank's losses where asked (``spec["losses"]``)."""

    def __init__(self, spec: dict):
        self.spec, self.ends, self.losses = spec, [], []
        self.rank = dist.get_rank()
        self.profile = StepProfile() if self.rank == 0 else None
        self.threads = ThreadTimes()

    def step(self, loss: float | None) -> None:
        self.ends.append((time.time(), time.process_time()))
        self.losses.append(loss)
        if self.profile is not None:
            self.profile.step(len(self.ends))
        self.threads.step_end(len(self.ends))

    def close(self) -> None:
        if self.rank == 0:
            Path(self.spec["clock"]).write_text(json.dumps(self.ends))
            self.threads.write(self.spec["clock"])
        if self.spec.get("losses"):
            Path(f"{self.spec['losses']}.rank{self.rank}").write_text(json.dumps(self.losses))
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        Path(f"{self.spec['clock']}.device_peak.rank{self.rank}").write_text(str(peak))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# -- the loops -------------------------------------------------------------------------------------


def train_stepwise(spec: dict, device) -> None:
    """The loop around the row's step (:data:`STEPS`): this rank's batches in plait's order,
    the schedule's learning rate, the loss read every step (as plait logs it)."""
    schedule, record = lr_at(spec), Record(spec)
    step = record.threads.timed(STEPS[spec["loop"]](spec, device))
    data = batches(spec, dist.get_rank(), dist.get_world_size(), device)
    for i, (x, y) in enumerate(data):
        record.step(step(x, y, schedule(i)).item())
    record.close()


def ddp_step(spec: dict, device):
    """torch DDP: build the model and optimizer; return ``step(x, y, lr) -> loss``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_gpt(spec).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = adamw(spec, decay_groups(model.parameters(), spec["optimizer"]["weight_decay"]))

    def step(x, y, lr: float) -> torch.Tensor:
        set_lr(opt, lr)
        with autocast(spec, device):
            loss = cross_entropy(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def zero_step(spec: dict, device):
    """``deepspeed.initialize`` with plait's JSON; return ``step(x, y, lr) -> loss``."""
    import deepspeed

    model = build_gpt(spec)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=decay_groups(model.parameters(), spec["optimizer"]["weight_decay"]),
        config=spec["deepspeed"],
    )

    def step(x, y, lr: float) -> torch.Tensor:
        set_lr(engine.optimizer, lr)
        loss = cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def fsdp_step(spec: dict, device):
    """``fully_shard`` per block, then the root; return ``step(x, y, lr) -> loss``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_gpt(spec).to(device)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"])
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    for module in [*model.blocks.values(), model]:
        fully_shard(module, mp_policy=policy)
        if device.type == "cpu":  # gloo's AVG is wrong under FSDP2 (pytorch#162338)
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(float(dist.get_world_size()))
    opt = adamw(spec, decay_groups(model.parameters(), spec["optimizer"]["weight_decay"]))

    def step(x, y, lr: float) -> torch.Tensor:
        set_lr(opt, lr)
        loss = cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def heads_per_rank_qkv(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """The fused QKV rows ``[q; k; v]`` reordered to ``[q_0; k_0; v_0; q_1; ...]``, so that a
    contiguous split over ``tp`` ranks gives each its own heads' q, k and v."""
    return weight.view(3, tp, -1, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def global_norm_clip(params, max_norm: float, group=None, sharded=lambda p: False) -> None:
    """Clip by the norm over every rank's parameters: squares of ``sharded`` ones summed over
    ``group``, the others (the same on every rank of it) counted once."""
    params = [p for p in params if p.grad is not None]
    local = lambda g: g.to_local() if hasattr(g, "to_local") else g  # noqa: E731
    split = [local(p.grad).float().square().sum() for p in params if sharded(p)]
    whole = [local(p.grad).float().square().sum() for p in params if not sharded(p)]
    total = torch.stack(split).sum() if split else torch.zeros((), device=params[0].grad.device)
    dist.all_reduce(total, group=group)
    if whole:
        total = total + torch.stack(whole).sum()
    coef = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
    for p in params:
        local(p.grad).mul_(coef)


def train_tp(spec: dict, device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = dist.get_world_size()
    mesh = init_device_mesh(device.type, (tp,))
    model = build_gpt(spec).to(device)
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    with torch.no_grad():
        for block in model.blocks.values():
            for p in block.attn.qkv.parameters():
                p.copy_(heads_per_rank_qkv(p, tp))
            parallelize_module(block, mesh, plan)
    opt = adamw(spec, decay_groups(model.parameters(), spec["optimizer"]["weight_decay"]))
    schedule, record = lr_at(spec), Record(spec)
    sharded = lambda p: hasattr(p, "placements") and p.placements[0].is_shard()  # noqa: E731
    for step, (x, y) in enumerate(batches(spec, 0, 1, device)):
        set_lr(opt, schedule(step))
        loss = cross_entropy(model(x), y)
        loss.backward()
        global_norm_clip(model.parameters(), spec["grad_clip"], sharded=sharded)
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.step(loss.item())
    record.close()


def train_pp(spec: dict, device) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, stages = dist.get_rank(), dist.get_world_size()
    model = build_gpt(spec)
    names = list(model.blocks.keys())
    per_stage = len(names) // stages
    mine = names[rank * per_stage : (rank + 1) * per_stage if rank < stages - 1 else None]
    for name in names:
        if name not in mine:
            del model.blocks[name]
    if rank > 0:
        model.embed = None
    if rank < stages - 1:
        model.norm = model.head = None
    model.to(device)
    stage = PipelineStage(model, rank, stages, device)
    schedule = Schedule1F1B(stage, spec["microbatches"], loss_fn=cross_entropy)
    opt = adamw(spec, decay_groups(model.parameters(), spec["optimizer"]["weight_decay"]))
    lrs, record = lr_at(spec), Record(spec)
    last = rank == stages - 1
    for step, (x, y) in enumerate(batches(spec, 0, 1, device)):
        set_lr(opt, lrs(step))
        losses: list = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        global_norm_clip(model.parameters(), spec["grad_clip"], sharded=lambda p: True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.step(torch.stack(losses).mean().item() if last else None)
    record.close()


class AllToAllExperts:
    """A mixture-of-experts layer's dispatcher over ``all_to_all_single``: tokens arrive sorted
    by expert (``counts[e]`` for expert ``e``); this rank holds experts ``[r·L, (r+1)·L)``."""

    def __init__(self, local: int):
        self.rank, self.size, self.local = dist.get_rank(), dist.get_world_size(), local

    def __call__(self, tokens, counts, experts):
        size, local = self.size, self.local
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous())
        by_source = received.view(size, local).tolist()
        send = counts.view(size, local).sum(dim=1).tolist()
        receive = [sum(row) for row in by_source]
        arrived = Exchange.apply(tokens, send, receive)
        chunks = arrived.split([n for row in by_source for n in row])
        outs = []
        for j in range(local):
            x = torch.cat([chunks[s * local + j] for s in range(size)])
            expert = experts[str(self.rank * local + j)]
            outs.append(expert(x).split([by_source[s][j] for s in range(size)]))
        back = torch.cat([outs[j][s] for s in range(size) for j in range(local)])
        return Exchange.apply(back, receive, send)


class Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows; the backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, x, send, receive):
        ctx.send, ctx.receive = send, receive
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive)
        return out, None, None


def ep_step(spec: dict, device):
    """Expert parallelism written in the loop: each rank keeps its share of every MoE layer's
    experts and dispatches tokens to them with ``all_to_all_single``; DDP averages the rest.
    Returns ``step(x, y, lr) -> loss``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, size = dist.get_rank(), dist.get_world_size()
    model = build_gpt(spec)
    experts = set()
    for layer in (m for m in model.modules() if getattr(m, "is_moe_layer", False)):
        local = layer.n_experts // size
        for key in list(layer.experts.keys()):
            if not rank * local <= int(key) < (rank + 1) * local:
                del layer.experts[key]
        layer.dispatcher = AllToAllExperts(local)
        layer.record_stats = False  # plait's routing figures: not what a plain loop keeps
        experts |= {id(p) for p in layer.experts.parameters()}
    model.to(device)
    ignored = [n for n, p in model.named_parameters() if id(p) in experts]
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)  # each rank's own experts
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = adamw(spec, decay_groups(model.parameters(), spec["optimizer"]["weight_decay"]))

    def step(x, y, lr: float) -> torch.Tensor:
        set_lr(opt, lr)
        loss = cross_entropy(ddp(x), y)
        loss.backward()
        for p in model.parameters():  # an expert's gradient: every rank's tokens, summed
            if id(p) in experts and p.grad is not None:
                p.grad.div_(size)
        global_norm_clip(model.parameters(), spec["grad_clip"], sharded=lambda p: id(p) in experts)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def train_cp(spec: dict, device) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from plait.plugins.context_parallel.apply import apply_context_parallel
    from plait.plugins.context_parallel.layout import SequenceLayout
    from plait.plugins.context_parallel.ring import ExchangeStats

    rank, size = dist.get_rank(), dist.get_world_size()
    layout = SequenceLayout.zigzag(spec["seq_len"], size, rank)
    model = build_gpt(spec).to(device)
    apply_context_parallel(model, "ring", layout, dist.group.WORLD, ExchangeStats())
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = adamw(spec, decay_groups(model.parameters(), spec["optimizer"]["weight_decay"]))
    schedule, record = lr_at(spec), Record(spec)
    index = layout.index(device=device)
    for step, (x, y) in enumerate(batches(spec, 0, 1, device)):
        set_lr(opt, schedule(step))
        loss = cross_entropy(ddp(x), y[:, index])  # the embedding's hook cuts x the same way
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.step(loss.item())
    record.close()


# the loops whose step stands alone (bench_engine_ab.py runs these steps beside plait's engine)
STEPS = {
    "ddp": ddp_step,
    "zero1": zero_step,
    "zero2": zero_step,
    "zero3": zero_step,
    "fsdp": fsdp_step,
    "ep2": ep_step,
}


LOOPS = {
    **dict.fromkeys(STEPS, train_stepwise),
    "tp2": train_tp,
    "pp2": train_pp,
    "cp2": train_cp,
}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    device = setup(spec)
    LOOPS[spec["loop"]](spec, device)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as plait's workers end (plait.testing.exit_without_teardown)


def run_rank(rank: int, world_size: int, port: int, spec_path: str) -> None:
    """One rank started by ``torch.multiprocessing`` instead of torchrun (tests/test_parity.py):
    the variables torchrun would set, then the loop."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    main(spec_path)


if __name__ == "__main__":
    main(sys.argv[1])
