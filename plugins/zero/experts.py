"""Expert parameters under DeepSpeed ZeRO-1/2: DeepSpeed-MoE's own handling, reused.

DeepSpeed partitions a param group marked ``moe: True`` over that group's expert-data-parallel
group (``DeepSpeedZeroOptimizer._configure_moe_settings``), divides its reduced gradients by the
whole dp size, adds the experts' squares over every rank to the gradient norm, and broadcasts
experts within their expert-data-parallel group. It does so when its engine finds a
``deepspeed.moe.layer.MoE`` module in the model (``has_moe_layers``) and the optimizer's param
groups are split by ``split_params_into_different_moe_groups_for_optimizer`` (named groups;
experts marked ``allreduce = False``, ``group_name``, as :mod:`plait.engine.experts`
marks them).

plait's experts are its own modules, so :func:`moe_marker` stands a ``MoE`` subclass (with no
parameters and no forward) in the model while ``deepspeed.initialize`` runs: DeepSpeed calls its
``set_deepspeed_parallelism``, which creates the expert groups with DeepSpeed's own
``_create_expert_data_and_model_parallel`` over plait's ``mpu`` (exactly as a ``MoE`` layer does)
and checks that they are plait's. DeepSpeed's MoE checkpoint files name experts by its
``deepspeed_moe`` modules, so under expert parallelism the engine writes only plait's layout-free
copy (every expert under its global name), from which any layout resumes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def moe_marker(topology, n_experts: int) -> torch.nn.Module:
    """A module DeepSpeed's engine takes for an MoE layer of ``n_experts`` experts over
    ``topology``'s expert-parallel groups."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    ep = topology.dims.ep

    class PlaitExperts(MoE):
        def __init__(self):
            torch.nn.Module.__init__(self)  # not MoE's: its experts and gate are plait's own
            self.num_experts, self.ep_size = n_experts, ep
            self.num_local_experts = n_experts // ep
            self.expert_group_name = f"ep_size_{ep}"

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False):
            groups._create_expert_data_and_model_parallel(ep, mpu=groups.mpu)
            name = self.expert_group_name
            ours = (
                dist.get_process_group_ranks(topology.group("ep")),
                dist.get_process_group_ranks(topology.group("edp")),
            )
            theirs = (
                list(groups._get_expert_parallel_group_ranks(name)),
                list(groups._get_expert_data_parallel_group_ranks(name)),
            )
            if ours != theirs:
                raise RuntimeError(
                    f"DeepSpeed's expert groups (ep, edp) {theirs} are not plait's {ours}"
                )

        def forward(self, *args, **kwargs):
            raise RuntimeError("stands in for plait's experts while DeepSpeed initializes")

    return PlaitExperts()


def named_param_groups(param_groups: list[dict]) -> list[dict]:
    """Names for the param groups, which DeepSpeed's MoE split keys its groups by."""
    return [{**group, "name": f"group_{i}"} for i, group in enumerate(param_groups)]
