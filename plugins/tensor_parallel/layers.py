"""Megatron-style tensor-parallel layers on plain tensors (Megatron-core's
``tensor_parallel/layers.py`` and ``cross_entropy.py``).

Each layer is built *from the full layer* of the unsplit model by slicing its weights, so a split
model starts from exactly the weights of the single-device model. On the meta device (a model
that initialises by name, :mod:`plait.meta`) the slice is only a shape, and the shard carries
``slice_of_full``: how to cut its value from the full initial value when it is materialized. Parameters stay ordinary
``torch.nn.Parameter`` (DeepSpeed ZeRO and DDP need plain tensors) and carry Megatron's attributes
``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``, which DeepSpeed and
:func:`plait.engine.norm.grad_norm` read to count each shard once in the global
gradient norm.

A weight with ``parts`` fused blocks along ``dim`` (the GPT's ``[3E, E]`` QKV weight) is split
block by block: ``W = [Q; K; V]`` gives rank ``r`` the rows ``[Q_r; K_r; V_r]``, so every rank
holds whole heads of each of q, k and v (Megatron's ``partition_stride``).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.engine.tensor_shards import split_tensor
from plait.meta import FullSlice
from plait.plugins.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)


def shard_box(shape: torch.Size, dim: int, rank: int, size: int) -> tuple[slice, ...]:
    """Where a plain split's shard (``parts=1``) sits in the full tensor: rows (or columns)
    ``[rank·n/size, (rank+1)·n/size)`` of ``dim``, all of every other dimension."""
    n = shape[dim] // size
    return tuple(
        slice(rank * n, (rank + 1) * n) if d == dim else slice(0, length)
        for d, length in enumerate(shape)
    )


def shard_parameter(
    full: nn.Parameter, dim: int, parts: int, rank: int, size: int, memo: dict[int, nn.Parameter]
) -> nn.Parameter:
    """A new Parameter holding this rank's shard, tagged the Megatron way; a parameter shared
    by two modules (tied embeddings) is split once and stays shared."""
    if id(full) in memo:
        return memo[id(full)]
    p = nn.Parameter(
        split_tensor(full.detach(), dim, parts, rank, size), requires_grad=full.requires_grad
    )
    if full.is_meta:  # the values come later, cut the same way from the full initial value
        p.slice_of_full = FullSlice(
            full.shape,
            functools.partial(split_tensor, dim=dim, parts=parts, rank=rank, size=size),
            box=shard_box(full.shape, dim, rank, size) if parts == 1 else None,
        )
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.partition_stride = parts
    memo[id(full)] = p
    return p


def _check_divisible(what: str, size: int, tp: int) -> None:
    if size % tp:
        raise ValueError(
            f"{what}={size} is not divisible by parallel.tp={tp}: choose a tp "
            "that divides it or change the model"
        )


class RegionEntry:
    """Enters the tensor-parallel region: ``copy_to_tensor_model_parallel_region`` (backward
    all-reduces ``dL/dX``), or under sequence parallelism ``gather_from_sequence_parallel_region``.

    Column-parallel siblings fed the same input tensor (Llama's separate q/k/v or gate/up
    projections) share one entry and enter once, so backward communicates once, as Megatron's
    fused QKV / gate-up linears do. The entered tensor is kept only until every member has used
    it; a different input enters anew.
    """

    def __init__(self, group, sequence_parallel: bool):
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.members = 0
        self._input: weakref.ref | None = None
        self._entered: torch.Tensor | None = None
        self._uses = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._entered is not None and self._input() is x:
            entered = self._entered
            self._uses += 1
        else:
            if self.sequence_parallel:
                entered = gather_from_sequence_parallel_region(x, self.group)
            else:
                entered = copy_to_tensor_model_parallel_region(x, self.group)
            self._input, self._entered, self._uses = weakref.ref(x), entered, 1
        if self._uses >= self.members:
            self._input = self._entered = None
        return entered


class ColumnParallelLinear(nn.Module):
    """``Y = XA + b`` with ``A`` split along its second (output) dimension as
    ``[A_1, ..., A_p]``: rank ``i`` computes ``Y_i = X A_i + b_i`` and keeps its slice of ``Y``,
    or with ``gather_output`` all-gathers ``Y = [Y_1, ..., Y_p]`` (Megatron's ``gather_output``;
    transformers' ``colwise_gather_output``: for a fused weight its module slices by the full
    widths, e.g. Phi-3's ``qkv_proj``).

    Forward first enters the region (:class:`RegionEntry`: identity forward / all-reduce
    backward, or under sequence parallelism all-gather / reduce-scatter).
    """

    def __init__(
        self,
        linear: nn.Linear,
        group,
        rank: int,
        size: int,
        parts: int = 1,
        sequence_parallel: bool = False,
        memo: dict | None = None,
        region: RegionEntry | None = None,
        gather_output: bool = False,
    ):
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        memo = {} if memo is None else memo
        _check_divisible("output features per fused part", linear.out_features // parts, size)
        self.region = region if region is not None else RegionEntry(group, sequence_parallel)
        self.region.members += 1
        self.weight = shard_parameter(linear.weight, 0, parts, rank, size, memo)
        self.bias = (
            shard_parameter(linear.bias, 0, parts, rank, size, memo)
            if linear.bias is not None
            else None
        )
        self.is_vocab_parallel_output = False  # True for the output layer: logits stay split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.region(x), self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = XA + b`` with ``A`` split along its first (input) dimension as ``[A_1; ...; A_p]``
    and ``X`` already split as ``[X_1, ..., X_p]`` (the output of a column-parallel layer):
    ``Y = sum_i X_i A_i + b``. The sum is one all-reduce in forward, or a reduce-scatter along
    the sequence under sequence parallelism. ``b`` is replicated and added after the sum.
    With ``input_is_parallel=False`` (Megatron's flag; transformers' ``rowwise_split_input``)
    ``X`` arrives whole and each rank first keeps its slice ``X_i`` (backward: all-gather).
    """

    def __init__(
        self,
        linear: nn.Linear,
        group,
        rank: int,
        size: int,
        sequence_parallel: bool = False,
        memo: dict | None = None,
        input_is_parallel: bool = True,
    ):
        super().__init__()
        memo = {} if memo is None else memo
        _check_divisible("input features", linear.in_features, size)
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.input_is_parallel = input_is_parallel
        self.weight = shard_parameter(linear.weight, 1, 1, rank, size, memo)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.group)
        if self.bias is None:
            return y
        return y + sequence_parallel_param(self.bias, self.group, self.sequence_parallel)


class VocabParallelEmbedding(nn.Module):
    """An embedding table split along the vocabulary: rank ``i`` holds rows
    ``[i V/p, (i+1) V/p)``, looks up the ids it owns, writes zeros for the others, and one
    all-reduce sums the partial results into the full embedding. A ``padding_idx`` row (whose
    gradient stays zero) is the owning rank's local row; the others have none."""

    def __init__(
        self, embedding: nn.Embedding, group, rank: int, size: int, memo: dict | None = None
    ):
        super().__init__()
        self.shard_vocabulary(embedding, group, rank, size, memo)

    def shard_vocabulary(
        self, embedding: nn.Embedding, group, rank: int, size: int, memo: dict | None
    ) -> None:
        memo = {} if memo is None else memo
        _check_divisible("vocab size", embedding.num_embeddings, size)
        self.group = group
        self.vocab_start = rank * embedding.num_embeddings // size
        self.vocab_end = (rank + 1) * embedding.num_embeddings // size
        pad = embedding.padding_idx
        self.padding_idx = (
            pad - self.vocab_start
            if pad is not None and self.vocab_start <= pad < self.vocab_end
            else None
        )
        self.weight = shard_parameter(embedding.weight, 0, 1, rank, size, memo)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # and no gradient from those rows
        return reduce_from_tensor_model_parallel_region(out, self.group)


class _VocabParallelLookup(nn.Embedding):
    """Sits between an ``nn.Embedding`` subclass and ``nn.Embedding`` in a vocab-parallel copy of
    the subclass, so that the subclass's ``super().forward(ids)`` is the vocab-parallel lookup."""

    forward = VocabParallelEmbedding.forward


_KEEPING_FORWARD: dict[type, type] = {}


def vocab_parallel_embedding(
    embedding: nn.Embedding, group, rank: int, size: int, memo: dict | None = None
) -> nn.Module:
    """The vocab-parallel form of ``embedding``. A subclass whose forward does more than the
    lookup (Gemma's and MiniCPM3's embeddings multiply it by a non-persistent ``embed_scale``
    buffer) keeps its class, forward and buffers, with the lookup made vocab-parallel under it:
    the multiplier applies once, to the all-reduced embedding (``(sum_i E_i[x]) * s``), as in the
    unsplit module."""
    cls = type(embedding)
    if cls.forward is nn.Embedding.forward:
        return VocabParallelEmbedding(embedding, group, rank, size, memo)
    if cls not in _KEEPING_FORWARD:  # a name of this module, like transformers' classes
        name = f"VocabParallel{cls.__name__}"
        _KEEPING_FORWARD[cls] = type(name, (cls, _VocabParallelLookup), {"__module__": __name__})
        globals()[name] = _KEEPING_FORWARD[cls]
    new = _KEEPING_FORWARD[cls].__new__(_KEEPING_FORWARD[cls])
    new.__dict__.update(embedding.__dict__)  # settings and buffers (embed_scale)
    new._parameters, new._buffers = {}, dict(embedding._buffers)
    VocabParallelEmbedding.shard_vocabulary(new, embedding, group, rank, size, memo)
    return new


class SharedRotaryKey:
    """Forward hook of multi-head latent attention's down-projection ``c = x W``, kept whole on
    every rank: ``c = [c_kv, k_rot]``. ``c_kv`` reaches the heads through the column-parallel
    ``kv_b_proj``, whose backward already sums ``dL/dc_kv`` over the group; ``k_rot`` (the last
    ``rope_features``) is the rotary key shared by every head, used by each rank's heads directly,
    so each rank's ``dL/dk_rot`` is its heads' part and is summed here
    (``copy_to_tensor_model_parallel_region``: identity forward, all-reduce backward), as
    ``transformers``' ``MlaKvAProjParallel`` does."""

    def __init__(self, group, rope_features: int):
        self.group = group
        self.rope_features = rope_features

    def __call__(self, module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        kv, rope = output.split([output.shape[-1] - self.rope_features, self.rope_features], -1)
        return torch.cat([kv, copy_to_tensor_model_parallel_region(rope, self.group)], dim=-1)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm on sequence-split activations. Its weights are replicated but each rank sees
    only ``seq / tp`` positions, so their gradients are summed over the tensor-parallel group in
    backward (Megatron all-reduces the ``sequence_parallel`` parameters' gradients)."""

    @classmethod
    def from_layer_norm(cls, norm: nn.LayerNorm, group) -> SequenceParallelLayerNorm:
        new = cls.__new__(cls)
        new.__dict__.update(norm.__dict__)  # same parameters, same state-dict names
        new.group = group
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sequence_parallel_param(self.weight, self.group, True)
        bias = sequence_parallel_param(self.bias, self.group, True)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def sequence_parallel_param(p: torch.Tensor | None, group, sequence_parallel: bool):
    """A replicated parameter used on sequence-split activations: its gradient is summed over
    the group (identity / all-reduce)."""
    if p is None or not sequence_parallel:
        return p
    return copy_to_tensor_model_parallel_region(p, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split along the vocabulary, never gathering them.

    With ``z`` the logits and ``t`` the target: ``loss = log sum_v exp(z_v - m) - (z_t - m)``,
    ``m = max_v z_v``. Three all-reduces over the group: the max, ``z_t`` (owned by one rank) and
    the sum of exponentials. ``dloss/dz = softmax(z) - onehot(t)``, computed locally.
    """

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        import torch.distributed as dist

        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)

        vocab_local = logits.size(-1)
        outside = (target < vocab_start) | (target >= vocab_start + vocab_local)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        logits_2d = logits.reshape(-1, vocab_local)
        rows = torch.arange(logits_2d.size(0), device=logits.device)
        predicted = logits_2d[rows, local_target.reshape(-1)].masked_fill(outside.reshape(-1), 0.0)
        dist.all_reduce(predicted, group=group)

        exp_logits = logits.exp()
        sum_exp = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted.view_as(sum_exp)

        softmax = exp_logits / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        grad_2d = grad.view(-1, grad.size(-1))
        rows = torch.arange(grad_2d.size(0), device=grad.device)
        grad_2d[rows, local_target.reshape(-1)] -= (~outside).reshape(-1).float()
        return grad * grad_loss.unsqueeze(-1), None, None, None


class VocabParallelCrossEntropy:
    """``loss_fn(logits_shard, targets) -> mean loss``, the loss for a vocab-parallel head."""

    def __init__(self, group, rank: int):
        self.group = group
        self.rank = rank

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab_start = self.rank * logits.size(-1)
        return _VocabParallelCrossEntropy.apply(logits, targets, self.group, vocab_start).mean()
