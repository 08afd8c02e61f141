"""DiLoCo's outer step (Douillard et al. 2023): H inner steps of the run's optimizer on each
replica, then, from the outer parameters θ and the replicas' average θ̄ over the data-parallel
group, the pseudo-gradient Δ = θ − θ̄ and one Nesterov-momentum SGD step of θ with it; every
replica restarts from the new θ::

    θ̄ = mean_r θ_r          (torch's model_averaging.utils.average_parameters)
    θ ← OuterSGD(θ, Δ = θ − θ̄; lr, momentum, nesterov)

torch has no DiLoCo; the outer optimizer is ``torch.optim.SGD`` on a copy of the parameters.
With outer lr 1 and no momentum θ ← θ̄: local SGD.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from plait.plugins.local_sgd.engine import LocalSGDEngine


class DiLoCoEngine(LocalSGDEngine):
    def wrap(self, optimizer: torch.optim.Optimizer, cfg) -> torch.optim.Optimizer:
        settings = cfg.strategy
        self.outer_params = [p.detach().clone() for p in self.model.parameters()]
        self.outer_optimizer = torch.optim.SGD(
            self.outer_params,
            lr=settings.outer_lr,
            momentum=settings.outer_momentum,
            nesterov=settings.outer_momentum > 0,
        )
        return optimizer  # the inner optimizer, stepped alone between outer steps

    def optimizer_step(self) -> None:
        self.optimizer.step()
        if not self.averaged:
            return
        params = list(self.model.parameters())
        average_parameters(iter(params), self.dp_group)
        with torch.no_grad():
            for outer, p in zip(self.outer_params, params):
                outer.grad = outer - p
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
            for outer, p in zip(self.outer_params, params):
                p.copy_(outer)

    def state(self) -> dict:
        return {
            **super().state(),
            "outer_params": self.outer_params,
            "outer_optimizer": self.outer_optimizer.state_dict(),
        }

    def load(self, state: dict) -> None:
        super().load(state)
        with torch.no_grad():
            for outer, saved in zip(self.outer_params, state["outer_params"]):
                outer.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
