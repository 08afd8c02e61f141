"""Whether a layout computes a model's own forward: a stand-in of the model (``model.
stand_in(seed)``: a small seeded model of the same family and settings) run whole and run as the
layout cuts it, on the same tokens, with the same seeded weights on its logits; the logits and
every parameter's gradient compared. The pipeline plugin checks its stages this way before
launch, the tensor-parallel plugin its shards at load (once the model is built), both before the
first step.

Rounding alone moves an fp32 result by about 1e-7 to 1e-6 of its size (a tensor-parallel
all-reduce sums in another order); arithmetic a cut loses or repeats (a multiplier, a soft cap, a
gradient summed on one rank only) moves it by far more, so :data:`TOLERANCE` separates the two.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn

TOLERANCE = 1e-4  # of the largest reference value: logits, and each parameter's gradient
BATCH, MAX_TOKENS = 2, 32


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one CPU thread while a stand-in runs: its tensors are tiny, and on a busy host
    torch's thread pool made the check 20-40 times slower (measured, load average 15)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def probe_tokens(vocab_size: int, seq_len: int, seed: int, device="cpu") -> torch.Tensor:
    """``[2, min(seq_len, 32)]`` token ids drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, min(seq_len, MAX_TOKENS))
    return torch.randint(0, vocab_size, shape, generator=generator).to(device)


def probe_cotangent(shape: torch.Size, seed: int, device="cpu") -> torch.Tensor:
    """The seeded weights ``w`` of ``sum(logits * w)``, whose gradients are compared."""
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(tuple(shape), generator=generator).to(device)


def run(
    forward: Callable[[torch.Tensor], torch.Tensor],
    model: nn.Module,
    tokens: torch.Tensor,
    seed: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``forward(tokens)`` (the logits over the whole vocabulary) and the gradient of
    ``sum(logits * w)`` for every parameter of ``model``, by name."""
    logits = forward(tokens)
    (logits.float() * probe_cotangent(logits.shape, seed, logits.device)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def relative(value: torch.Tensor, reference: torch.Tensor, floor: float = 0.0) -> float:
    """``max|value - reference| / max|reference|`` (the denominator at least ``floor``)."""
    scale = max(reference.abs().max().item(), floor, torch.finfo(torch.float32).tiny)
    return (value.float() - reference.float()).abs().max().item() / scale


@dataclass(frozen=True)
class Difference:
    """How far a layout's result is from the whole forward's, relative to the reference's
    largest value: the logits, and the gradient of the worst parameter (named)."""

    logits: float
    gradients: float
    worst: str
    missing: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        reference: tuple[torch.Tensor, dict[str, torch.Tensor]],
        result: tuple[torch.Tensor, dict[str, torch.Tensor]],
        expected_grad: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, g: g,
    ) -> Difference:
        """``expected_grad(name, full_grad)``: what the layout's parameter ``name`` should hold
        of the whole model's gradient (a tensor-parallel shard: its slice)."""
        (ref_logits, ref_grads), (logits, grads) = reference, result
        floor = 1e-3 * max((g.abs().max().item() for g in ref_grads.values()), default=0.0)
        per_parameter = {
            name: relative(g, expected_grad(name, ref_grads[name]), floor)
            for name, g in grads.items()
        }
        worst = max(per_parameter, key=per_parameter.__getitem__, default="")
        return cls(
            relative(logits, ref_logits),
            per_parameter.get(worst, 0.0),
            worst,
            tuple(sorted(set(ref_grads) - set(grads))),
        )

    @property
    def faithful(self) -> bool:
        return max(self.logits, self.gradients) <= TOLERANCE and not self.missing

    def describe(self) -> str:
        text = (
            f"{self.logits:.1e} in the logits and {self.gradients:.1e} in the gradients "
            f"(relative to the largest value; worst {self.worst or 'none'}; the check allows "
            f"{TOLERANCE:.0e})"
        )
        if self.missing:
            text += f", and no gradient at all for {list(self.missing[:3])}"
        return text
