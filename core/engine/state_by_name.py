"""Model and torch-optimizer state keyed by parameter name, through DCP's ``get_state_dict`` /
``set_state_dict``: the layout-free form (see :mod:`plait.engine.layout_free`) of
every engine that steps a plain torch optimizer (DDP, ZeRO stage 0).

DCP is imported where it is used (it pulls in DTensor and sympy, ~0.8 s, which a process that
never saves or converts a checkpoint, such as the launcher, does not need)."""

from __future__ import annotations

import torch


def state_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state["state"]}


def load_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """The optimizer keeps its own param groups (learning rate, schedule position)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _, current = get_state_dict(model, optimizer)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict={"state": state["optim"], "param_groups": current["param_groups"]},
    )
