"""Builds the model named by ``model._target_`` with Hydra's ``instantiate``.

Any ``nn.Module`` whose forward maps token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]``
trains through plait: ``plait train model=custom model._target_=my_pkg.MyLM +model.width=512``.
A model that can be split declares it through a plugin selected by its ``_target_`` (see
:mod:`plait.plugins.models.gpt`): ``model:tensor_parallel_plan`` (it carries a
``tensor_parallel_plan``); pipeline stages follow the model's ``pipeline_plan`` attribute, or
for any module ``pipeline.layers=<its layer list>``. A model may also define
``flops_per_token(seq_len)`` for the MFU figure; without it plait counts 6·N. A model plugin
that refuses, itself, the settings its model cannot be built with declares
``model:build_checks``, and this plugin's generic refusal stays silent.
"""

from __future__ import annotations

import torch
from hydra.utils import instantiate

from plait import hookimpl
from plait.meta import meta_device
from plait.types import PluginInfo


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="models", description="instantiate model._target_")


BUILD_CHECKS = "model:build_checks"


@hookimpl
def plait_validate(cfg, hook) -> list[str]:
    """Build the model on the meta device, so that a ``_target_`` or arguments it cannot be built
    with are refused here rather than in every worker (unless the model's plugin says why)."""
    if any(BUILD_CHECKS in info.provides for info in hook.plait_declare()):
        return []
    try:
        with meta_device():
            hook.plait_build_model(cfg=cfg)
    except Exception as e:
        cause = e.__cause__ or e  # the model's own error, not Hydra's wrapper
        return [
            f"model._target_={cfg.model._target_} cannot be built with these settings "
            f"({type(cause).__name__}: {cause}): fix model._target_ or the model.* settings"
        ]
    return []


@hookimpl
def plait_build_model(cfg) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)  # every rank builds identical full weights
    return instantiate(cfg.model)
