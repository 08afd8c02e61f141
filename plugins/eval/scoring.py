"""Scoring token sequences for the harness: the log-probability of each scored token and the
model's most likely token at its place.

An *item* is ``(tokens, n)``: the model reads ``tokens[:-1]`` and the last ``n`` of
``tokens[1:]`` are scored. Every batch is ``batch_size`` rows of ``length`` tokens, right-padded
(a causal model's earlier positions never see the padding) with targets ``-100`` where nothing is
scored, so every forward has the same shape (pipeline sends, sequence parallelism).

- :class:`LocalScorer` runs the unsplit model in this process (``plait eval``).
- :class:`ScoringLoss` wraps a run's loss function (``plait_build_loss``): while armed it keeps
  :func:`token_scores` of the logits it is given instead of a loss. The engine's own
  ``eval_loss`` then drives the forward through whatever split the run uses (data-parallel
  replicas, tensor-parallel shards with a vocab-parallel head, pipeline stages, ZeRO-3 or FSDP
  gathers), and :class:`EngineScorer` splits the items over the data-parallel ranks and gathers
  the scores on the logging rank (:mod:`.distributed`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

Item = tuple[Sequence[int], int]
Scores = tuple[torch.Tensor, torch.Tensor]  # float32 log-probs and int64 best tokens, n each
IGNORE = -100


def token_scores(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    tp_rank: int = 0,
) -> Scores:
    """``(log p(target), argmax)`` at every position of ``[batch, length, vocab]`` logits
    (log-prob 0 where the target is ``-100``).

    With ``tp_group`` the logits are this rank's vocab shard ``[rank·V/t, (rank+1)·V/t)``
    (a vocab-parallel head): ``log p(y) = z_y - log Σ_t Σ_v exp(z_v)`` with the maximum, the sum
    and the target's logit reduced over the group (Megatron's vocab-parallel cross-entropy), and
    the argmax is the lowest id holding the global maximum (``torch.argmax``'s tie rule).
    """
    logits = logits.float()
    valid = targets != IGNORE
    safe = targets.masked_fill(~valid, 0)
    if tp_group is None:
        logprobs = logits.log_softmax(-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        return logprobs.masked_fill(~valid, 0.0), logits.argmax(-1)
    shard = logits.size(-1)
    start = tp_rank * shard
    local_max, local_best = logits.max(-1)
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    sum_exp = (logits - global_max.unsqueeze(-1)).exp().sum(-1)
    dist.all_reduce(sum_exp, group=tp_group)
    mine = (safe >= start) & (safe < start + shard)
    target_logit = logits.gather(-1, (safe - start).clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = target_logit.masked_fill(~mine, 0.0)
    dist.all_reduce(target_logit, group=tp_group)
    logprobs = target_logit - global_max - sum_exp.log()
    candidate = torch.where(
        local_max == global_max,
        local_best + start,
        torch.full_like(local_best, torch.iinfo(torch.int64).max),
    )
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=tp_group)
    return logprobs.masked_fill(~valid, 0.0), candidate


def make_batch(
    items: Sequence[Item], batch_size: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, ``[batch_size, length]`` int64: one row per item, then rows of
    padding alone."""
    inputs = torch.zeros(batch_size, length, dtype=torch.long)
    targets = torch.full((batch_size, length), IGNORE, dtype=torch.long)
    for row, (tokens, n) in enumerate(items):
        m = len(tokens) - 1
        if not 1 <= n <= m <= length:
            raise ValueError(
                f"a request of {len(tokens)} tokens scoring {n} does not fit "
                f"the model's {length}-token window"
            )
        inputs[row, :m] = torch.as_tensor(tokens[:-1])
        targets[row, m - n : m] = torch.as_tensor(tokens[-n:])
    return inputs, targets


def split_rows(items: Sequence[Item], logprobs: torch.Tensor, best: torch.Tensor) -> list[Scores]:
    """Each item's scored positions out of its batch's ``[batch, length]`` scores."""
    out = []
    for row, (tokens, n) in enumerate(items):
        m = len(tokens) - 1
        out.append((logprobs[row, m - n : m].cpu(), best[row, m - n : m].cpu()))
    return out


class LocalScorer:
    """The unsplit model in this process: ``model(inputs) -> logits``."""

    def __init__(self, model: torch.nn.Module, batch_size: int, length: int, device: torch.device):
        self.model, self.batch_size, self.length, self.device = model, batch_size, length, device

    @torch.no_grad()
    def score(self, items: Sequence[Item]) -> list[Scores]:
        out = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            inputs, targets = make_batch(chunk, self.batch_size, self.length)
            logits = self.model(inputs.to(self.device))
            out += split_rows(chunk, *token_scores(logits, targets.to(self.device)))
        return out


class ScoringLoss:
    """A run's loss function, unchanged, until :meth:`capture` arms it: then each call keeps
    :func:`token_scores` of its logits in ``captured`` and returns a zero loss (the engine's
    ``eval_loss`` reduces that over data-parallel ranks as it would a loss)."""

    def __init__(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        tp_group: dist.ProcessGroup | None,
        tp_rank: int,
    ):
        self.loss_fn, self.tp_group, self.tp_rank = loss_fn, tp_group, tp_rank
        self.captured: list[Scores] | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.captured is None:
            return self.loss_fn(logits, targets)
        self.captured.append(token_scores(logits, targets, self.tp_group, self.tp_rank))
        return torch.zeros((), device=logits.device)

    def capture(self, forward: Callable[[], object]) -> list[Scores]:
        """Run ``forward`` (the engine's ``eval_loss`` of a batch) armed; what it captured
        (empty on a rank that does not hold the logits: an earlier pipeline stage)."""
        self.captured = []
        try:
            forward()
            return self.captured
        finally:
            self.captured = None
