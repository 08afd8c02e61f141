"""``train.activation_checkpointing=full|selective``: recompute activations in the backward
instead of keeping them from the forward (``torch.utils.checkpoint``, non-reentrant).

    plait train train.activation_checkpointing=full        # every transformer block
    plait train train.activation_checkpointing=selective   # the attention core only

What each mode recomputes is the model's to say: ``activation_checkpointing_plan`` maps a mode to
a module-name pattern, as its tensor-parallel plan does (plait's GPT: ``full`` → ``blocks.*``,
``selective`` → ``blocks.*.attn.core_attention``). Per layer, with ``s`` positions, ``b``
sequences, hidden size ``h`` and ``a`` heads, a block keeps ``s·b·h·(34 + 5·a·s/h)`` bytes of
activations at 16 bits (Korthikanti et al. 2022, eq. 1): ``full`` keeps only its input,
``2·s·b·h``, and recomputes the whole block; ``selective`` drops the ``5·a·s/h`` term of the attention scores
(largest at long sequences) and recomputes only ``softmax(QKᵀ)·V``, which has no weights.

Applied in place after tensor parallelism and before the pipeline split and the engine
(torchtitan's order), so it holds under every strategy and pipeline stage: each planned module's
``forward`` becomes a checkpointed call of itself. Unlike torch's ``checkpoint_wrapper``, which
adds a ``_checkpoint_wrapped_module`` level to every parameter name, this keeps the names that
checkpoints, plans and ZeRO's export key on. The forward recomputed in the backward runs the same
operations on the same inputs (and, for dropout, the same RNG state), so losses and gradients do
not change. Each logged step reports ``activation_checkpointing/recomputes``: how many module
forwards the logging rank ran again in backwards since the previous logged step.

A plugin that cannot run with recompute (e.g. one that counts forward calls) says so with
``PluginInfo.excludes={"activation_checkpointing"}``; the plan is then refused before launch.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch.utils.checkpoint import checkpoint

from plait import hookimpl
from plait.meta import meta_model
from plait.types import ALWAYS, PluginInfo


class RecomputeCounter:
    """Forward calls of checkpointed modules: ``checkpointed`` by the model, ``calls`` of the
    module's own forward (once more for every recompute in a backward)."""

    def __init__(self):
        self.checkpointed = self.calls = 0

    def take(self) -> int:
        """Recomputes since the last call."""
        recomputes = self.calls - self.checkpointed
        self.checkpointed = self.calls = 0
        return recomputes


counter = RecomputeCounter()


def recompute_in_backward(module: torch.nn.Module, counts: RecomputeCounter) -> None:
    """Replace ``module.forward`` by a checkpointed call of it (outside autograd: the plain one)."""
    forward = module.forward

    def counted_forward(*args, **kwargs):
        counts.calls += 1
        return forward(*args, **kwargs)

    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        counts.checkpointed += 1
        return checkpoint(counted_forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward


def name_matches(name: str, pattern: str) -> bool:
    """``blocks.*`` matches ``blocks.3`` but not ``blocks.3.attn``: a ``*`` stands for one part
    of the dotted name, so the plan names the modules to recompute, not their children."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(map(fnmatchcase, parts, wanted))


def planned_modules(model: torch.nn.Module, mode: str) -> list[str]:
    """Names of the modules ``mode`` recomputes, by the model's plan."""
    pattern = getattr(model, "activation_checkpointing_plan", {}).get(mode)
    if pattern is None:
        return []
    return [name for name, _ in model.named_modules() if name_matches(name, pattern)]


def apply_activation_checkpointing(
    model: torch.nn.Module, mode: str, counts: RecomputeCounter = counter
) -> list[str]:
    names = planned_modules(model, mode)
    for name in names:
        recompute_in_backward(model.get_submodule(name), counts)
    return names


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="activation_checkpointing",
        selected_by={"train.activation_checkpointing": ("full", "selective")},
        requires={ALWAYS: frozenset({"model:activation_checkpointing_plan"})},
        description="recompute blocks (full) or the attention core (selective) in the backward",
    )


@hookimpl
def plait_validate(cfg, hook) -> list[str]:
    mode = cfg.train.activation_checkpointing
    model = meta_model(hook, cfg)
    if model is None:  # the models plugin says why
        return []
    plan = getattr(model, "activation_checkpointing_plan", None)
    if plan is None:
        return []  # the capability check names the missing plan
    if mode not in plan:
        return [
            f"train.activation_checkpointing={mode}: the model ({cfg.model._target_}) has no "
            f"{mode!r} entry in its activation_checkpointing_plan (it has: "
            f"{', '.join(sorted(plan))}); choose one of those"
        ]
    if not planned_modules(model, mode):
        return [
            f"train.activation_checkpointing={mode}: the model's pattern {plan[mode]!r} "
            "matches no module; fix the model's activation_checkpointing_plan"
        ]
    return []


@hookimpl
def plait_apply_activation_checkpointing(cfg, model, topology) -> None:
    names = apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if topology.is_logging_rank:
        print(
            f"activation checkpointing ({cfg.train.activation_checkpointing}): "
            f"{len(names)} modules recomputed in the backward",
            flush=True,
        )


@hookimpl(tryfirst=True)
def plait_log_metrics(metrics) -> None:
    """Before the trackers see the step: the recomputes run since the last logged step."""
    metrics["activation_checkpointing/recomputes"] = float(counter.take())
