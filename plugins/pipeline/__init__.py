"""``parallel.pp>1`` (``parallel.pipeline=torch``): pipeline parallelism through
``torch.distributed.pipelining``.

The model's blocks are cut into ``pp`` stages (``pp × virtual_stages`` for the interleaved and
zero-bubble schedules), one rank of the pipeline group per stage (see
:mod:`plait.plugins.pipeline.split` for the balance), and every optimizer step runs the chosen
schedule over ``parallel.microbatches`` micro-batches::

    parallel.schedule   torch schedule                  stages per rank  placement of stage s
    gpipe               ScheduleGPipe                   1                rank s
    1f1b                Schedule1F1B                    1                rank s
    interleaved_1f1b    ScheduleInterleaved1F1B         v >= 2           rank s mod pp
    zero_bubble         ScheduleInterleavedZeroBubble   v >= 1           rank s mod pp
    zbv                 ScheduleZBVZeroBubble           v = 2            rank s, or 2pp-1-s ("V")

Batching: the global batch is ``train.batch_size`` whatever ``pp`` is. Each data-parallel rank
takes ``batch_size / dp`` sequences and the schedule cuts them into ``microbatches`` pipeline
micro-batches; these *are* the step's gradient-accumulation micro-batches, so
``train.grad_accum_steps`` is set to ``parallel.microbatches`` (a different explicit value is
refused). Gradients are the mean over the micro-batches (the schedule scales by ``1/m``), then
averaged over data-parallel ranks: the same gradient as one process on the whole batch.

The engine wraps the strategy's engine (``plait_build_engine`` wrapper): it keeps that engine's
optimizer and checkpoint files (``model_pp{p}_tp{t}.pt``, original parameter names) and replaces
only the forward/backward with the schedule; the data-parallel gradient average is
one bucketed all-reduce over the dp group after the schedule (see ``docs/architecture.md``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from plait import hookimpl
from plait.plugins.optim.clip_grads import clip_grad_norm_
from plait.plugins.optim.mixed_precision import autocast
from plait.plugins.pipeline.split import (
    BALANCES,
    PipelineStageModules,
    build_stage_modules,
    measure_part_times,
    split_stages,
)
from plait.types import Batch, PluginInfo, StepOutput

# schedule name -> (torch class name, allowed virtual_stages, placement style)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "1", "loop"),
    "1f1b": ("Schedule1F1B", "1", "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", ">=2", "loop"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", ">=1", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "2", "v"),
}


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
MAX_DIMS = 6


def stages_per_rank(cfg) -> int:
    return cfg.parallel.virtual_stages if SCHEDULES[cfg.parallel.schedule][1] != "1" else 1


def stage_to_rank(pp: int, n_stages: int, style: str) -> list[int]:
    """Pipeline rank of each stage: ``loop`` puts stage s on s mod pp, ``v`` goes down the ranks
    and back up (rank r holds stages r and 2pp-1-r), as torch's ZBV schedule expects."""
    if style == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
    return [s % pp for s in range(n_stages)]


# ---------------------------------------------------------------------------------------------
# before launch
# ---------------------------------------------------------------------------------------------


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="pipeline", selected_by={"parallel.pipeline": "torch"},
                      description="pipeline stages + schedules via torch.distributed.pipelining")


@hookimpl
def plait_configure(cfg) -> None:
    """The pipeline micro-batches are the step's gradient-accumulation micro-batches."""
    if cfg.parallel.pp > 1 and cfg.train.grad_accum_steps == 1:
        cfg.train.grad_accum_steps = cfg.parallel.microbatches


def schedule_problems(par, pp: int) -> list[str]:
    name, v, m = par.schedule, par.virtual_stages, par.microbatches
    if name not in SCHEDULES:
        return [f"parallel.schedule={name}: choose one of {', '.join(SCHEDULES)}"]
    allowed = SCHEDULES[name][1]
    if allowed == "1" and v != 1:
        return [f"parallel.virtual_stages={v} needs an interleaved schedule: set "
                "parallel.schedule=interleaved_1f1b, zero_bubble or zbv, or virtual_stages=1"]
    if allowed == ">=2" and v < 2:
        return [f"parallel.schedule={name} needs parallel.virtual_stages>=2 (stages per rank); "
                "with one stage per rank use parallel.schedule=1f1b"]
    if allowed == "2" and v != 2:
        return [f"parallel.schedule=zbv places exactly 2 stages per rank in a V: set "
                f"parallel.virtual_stages=2 (got {v})"]
    if name == "1f1b" and m < pp:
        return [f"parallel.schedule=1f1b needs parallel.microbatches >= pp ({m} < {pp}): raise "
                "parallel.microbatches or use parallel.schedule=gpipe"]
    rounds = max(1, m // pp)
    if allowed != "1" and m % rounds:
        return [f"parallel.schedule={name} runs micro-batches in rounds of pp: "
                f"parallel.microbatches={m} must be a multiple of {rounds} (e.g. a multiple of "
                f"pp={pp})"]
    return []


def balance_problems(par, n_layer: int | None, n_stages: int) -> list[str]:
    balance = par.balance
    if isinstance(balance, str):
        if balance not in BALANCES:
            return [f"parallel.balance={balance}: choose one of {', '.join(BALANCES)} or a list "
                    "of block counts per stage, e.g. parallel.balance=[3,5]"]
        return []
    counts = list(balance)
    if len(counts) != n_stages or min(counts) < 1 or (n_layer and sum(counts) != n_layer):
        return [f"parallel.balance={counts} must list {n_stages} block counts (one per pipeline "
                f"stage), each at least 1, adding up to model.n_layer={n_layer}"]
    return []


@hookimpl
def plait_validate(cfg, dims) -> list[str]:
    par, pp = cfg.parallel, dims.pp
    if pp == 1:
        return []
    problems = schedule_problems(par, pp)
    if problems:
        return problems
    n_stages = pp * stages_per_rank(cfg)
    n_layer = OmegaConf.select(cfg, "model.n_layer", default=None)
    if n_layer is not None and n_stages > n_layer:
        problems.append(f"parallel.pp={pp} x {n_stages // pp} stage(s) per rank = {n_stages} "
                        f"pipeline stages, but model.n_layer={n_layer}: each stage needs a block; "
                        "lower parallel.pp / parallel.virtual_stages or raise model.n_layer")
    problems += balance_problems(par, n_layer, n_stages)
    per_dp = cfg.train.batch_size // dims.dp
    if par.microbatches < 1 or per_dp % par.microbatches:
        problems.append(f"parallel.microbatches={par.microbatches} does not divide the batch of "
                        f"each data-parallel rank (train.batch_size={cfg.train.batch_size} / "
                        f"dp={dims.dp} = {per_dp}): choose a divisor of {per_dp}")
    if cfg.train.grad_accum_steps != par.microbatches:
        problems.append(f"train.grad_accum_steps={cfg.train.grad_accum_steps} with parallel.pp="
                        f"{pp}: the pipeline micro-batches are the step's accumulation micro-"
                        f"batches; leave train.grad_accum_steps unset (1) or equal to "
                        f"parallel.microbatches={par.microbatches}")
    if cfg.strategy.name != "ddp":
        problems.append(
            f"parallel.pp={pp} with strategy={cfg.strategy.name}: plait runs pipelines through "
            "torch.distributed.pipelining with strategy=ddp for the data-parallel part; "
            "DeepSpeed's PipelineModule engine is not wired in (and ZeRO-2/3 cannot shard "
            "gradients across micro-batches of a pipeline): use strategy=ddp")
    if cfg.precision == "fp16":
        problems.append(f"precision=fp16 with parallel.pp={pp}: the schedules run the backward "
                        "themselves, without a loss scaler; use precision=bf16 or fp32")
    if OmegaConf.select(cfg, "model.tie_embeddings", default=False):
        problems.append(f"model.tie_embeddings=true with parallel.pp={pp}: the embedding and the "
                        "head live on different stages; set model.tie_embeddings=false")
    if dims.dp > 1 and cfg.comm.name != "allreduce":
        problems.append(f"comm={cfg.comm.name} with parallel.pp={pp}: pipeline stages average "
                        "gradients over dp with a plain bucketed all-reduce after the schedule, "
                        "not a DDP comm hook; use comm=allreduce")
    return problems


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------


def profile_sample(cfg, dp: int) -> torch.Tensor:
    """One micro-batch of random token ids, for the ``time`` balance's profiling pass."""
    micro = max(1, cfg.train.batch_size // (dp * cfg.parallel.microbatches))
    vocab = OmegaConf.select(cfg, "model.vocab_size", default=256)
    generator = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(0, vocab, (micro, cfg.train.seq_len), generator=generator)


@hookimpl
def plait_split_pipeline(cfg, model, topology) -> PipelineStageModules | None:
    pp = topology.dims.pp
    if pp == 1:
        return None
    style = SCHEDULES[cfg.parallel.schedule][2]
    n_stages = pp * stages_per_rank(cfg)
    balance = cfg.parallel.balance
    balance = balance if isinstance(balance, str) else list(balance)
    part_times = None
    if balance == "time":
        times = torch.tensor(measure_part_times(model, profile_sample(cfg, topology.dims.dp)),
                             dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # every rank must cut the same way
        part_times = times.tolist()
    split = split_stages(model, n_stages, balance, part_times)
    placement = stage_to_rank(pp, n_stages, style)
    if topology.is_logging_rank:
        print(split.describe(placement), flush=True)
    mine = [s for s in range(n_stages) if placement[s] == topology.pp_rank]
    return build_stage_modules(model, split, mine)


def make_schedule(name: str, stages: list, n_microbatches: int, loss_fn):
    """The torch schedule ``name`` over this rank's stages; gradients are the micro-batch mean."""
    from torch.distributed import pipelining

    torch_class, per_rank, _ = SCHEDULES[name]
    return getattr(pipelining, torch_class)(stages if per_rank != "1" else stages[0],
                                            n_microbatches=n_microbatches, loss_fn=loss_fn,
                                            scale_grads=True)


def send_tensor(tensor: torch.Tensor, dst: int) -> None:
    """Send a tensor of any shape and dtype: a fixed-size header, then the data."""
    dtype_code = DTYPES.index(tensor.dtype)
    header = torch.tensor([tensor.dim(), dtype_code, *tensor.shape]
                          + [0] * (MAX_DIMS - tensor.dim()), dtype=torch.int64)
    dist.send(header.to(tensor.device), dst)
    dist.send(tensor.contiguous(), dst)


def recv_tensor(src: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src)
    ndim, dtype_code, *shape = header.tolist()
    tensor = torch.empty(shape[:ndim], dtype=DTYPES[dtype_code], device=device)
    dist.recv(tensor, src)
    return tensor


class PipelineEngine:
    """Runs one optimizer step as a pipeline schedule over the step's micro-batches.

    Reuses the strategy engine's optimizer and checkpoint files; the loss is computed on the
    last stage and summed over the pipeline group (zero elsewhere), so every rank, rank 0
    included, returns the global mean. The gradient norm is the global one,
    ``sqrt(sum over stages (and tp shards) of |g|^2)``, and clipping scales every stage by the
    same factor.
    """

    def __init__(self, cfg, inner, loss_fn, topology):
        from torch.distributed import pipelining

        self.inner = inner
        self.model: PipelineStageModules = inner.model
        self.optimizer = inner.optimizer
        self.device = topology.device
        self.precision = cfg.precision
        self.grad_clip = cfg.train.grad_clip
        self.pp_group = topology.get_pipeline_model_parallel_group()
        self.dp_group = topology.get_data_parallel_group()
        self.dp_size = topology.dims.dp
        self.tp_group = topology.get_tensor_model_parallel_group()
        self.tp_size, self.tp_rank = topology.dims.tp, topology.tp_rank
        n_stages = self.model.n_stages
        self.stages = [
            pipelining.PipelineStage(chunk, index, n_stages, self.device, group=self.pp_group)
            for index, chunk in self.model.chunks
        ]
        self.chunks = dict(self.model.chunks)
        self.n_stages, self.loss_fn = n_stages, loss_fn
        self.placement = stage_to_rank(topology.dims.pp, n_stages,
                                       SCHEDULES[cfg.parallel.schedule][2])
        self.pp_rank = topology.pp_rank
        self.has_first, self.has_last = 0 in self.chunks, n_stages - 1 in self.chunks
        self.schedule = make_schedule(cfg.parallel.schedule, self.stages,
                                      cfg.parallel.microbatches, loss_fn)

    def _reduce_loss(self, loss: torch.Tensor) -> float:
        """The last stage's loss (zero on the others) to every rank, averaged over dp."""
        loss = loss.detach().to(self.device, torch.float32)
        dist.all_reduce(loss, group=self.pp_group)
        if self.dp_size > 1:
            dist.all_reduce(loss, group=self.dp_group)
            loss = loss / self.dp_size
        return loss.item()

    def _average_grads_over_dp(self) -> None:
        """The data-parallel part: one flat all-reduce per dtype of this stage's gradients."""
        if self.dp_size == 1:
            return
        grads: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.setdefault(p.grad.dtype, []).append(p.grad)
        for tensors in grads.values():
            flat = torch._utils._flatten_dense_tensors(tensors)
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.dp_size
            for g, reduced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
                g.copy_(reduced)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepOutput:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x = torch.cat([b[0] for b in micro_batches]).to(self.device)
        y = torch.cat([b[1] for b in micro_batches]).to(self.device)
        losses: list[torch.Tensor] = []
        with autocast(self.precision, self.device):
            self.schedule.step(*((x,) if self.has_first else ()), target=y, losses=losses,
                               return_outputs=False)
        loss = self._reduce_loss(torch.stack(losses).mean() if self.has_last
                                 else torch.zeros(()))
        self._average_grads_over_dp()
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm,
                                    self.tp_group if self.tp_size > 1 else None, self.tp_rank,
                                    self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(loss=loss, grad_norm=grad_norm.item())

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> float:
        """Forward only, the whole batch at once, stage after stage over point-to-point sends
        (the same for every schedule; torch's ``schedule.eval`` fails for ZBV in torch 2.13)."""
        self.model.eval()
        x, y = (t.to(self.device) for t in batch)
        hidden, loss = x, torch.zeros((), device=self.device)
        with autocast(self.precision, self.device):
            for index in range(self.n_stages):
                if self.placement[index] != self.pp_rank:
                    continue
                if index > 0 and self.placement[index - 1] != self.pp_rank:
                    hidden = recv_tensor(self._peer(self.placement[index - 1]), self.device)
                hidden = self.chunks[index](hidden)
                if index == self.n_stages - 1:
                    loss = self.loss_fn(hidden, y).detach().float()
                elif self.placement[index + 1] != self.pp_rank:
                    send_tensor(hidden, self._peer(self.placement[index + 1]))
        self.model.train()
        return self._reduce_loss(loss)

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.pp_group, pp_rank)

    def save_state(self, directory: Path) -> None:
        self.inner.save_state(directory)

    def load_state(self, directory: Path) -> None:
        self.inner.load_state(directory)


@hookimpl(wrapper=True)
def plait_build_engine(cfg, loss_fn, topology):
    """Wrap the strategy's engine when the model was cut into pipeline stages."""
    engine = yield
    if topology.dims.pp == 1 or engine is None:
        return engine
    if not isinstance(engine.model, PipelineStageModules):
        raise ValueError("parallel.pp>1 but the model was not split by the pipeline plugin: "
                         "another plugin answered plait_split_pipeline; set parallel.pipeline")
    return PipelineEngine(cfg, engine, loss_fn, topology)
