"""Hook spec 1.0-1.4's Megatron-style names for the topology's groups, deprecated since hook spec
1.5 and removed in 2.0: each warns once (``FutureWarning``) naming ``topology.group(name)``, the
one naming scheme, and returns the same group.

plait keeps Megatron's names in one place only, where DeepSpeed needs them: ``TopologyMPU`` in
the ZeRO plugin, the ``mpu`` object DeepSpeed calls (``get_data_parallel_group``,
``get_model_parallel_group``, ...). These aliases remain only so that in-house plugins written
against hook spec 1.x keep working until 2.0.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

ALIASES = {
    "get_data_parallel_group": 'group("dp"), or group("dp_cp") with context parallelism',
    "get_context_parallel_group": 'group("cp")',
    "get_tensor_model_parallel_group": 'group("tp")',
    "get_pipeline_model_parallel_group": 'group("pp")',
    "get_expert_parallel_group": 'group("ep")',
    "get_expert_data_parallel_group": 'group("edp")',
    "replica_group": 'group("replica")',
}
_WARNED: set[str] = set()


def warn_renamed(old: str) -> None:
    """Warn once per process that ``topology.<old>()`` is deprecated, naming its replacement."""
    if old not in _WARNED:
        _WARNED.add(old)
        warnings.warn(
            f"topology.{old}() is deprecated since hook spec 1.5 and goes in 2.0: use "
            f"topology.{ALIASES[old]}",
            FutureWarning,
            stacklevel=3,
        )


class DeprecatedGroupNames:
    """The deprecated names, on :class:`plait.topology.Topology`, whose ``group`` they call."""

    group: Callable[[str], Any]

    def get_data_parallel_group(self, with_context_parallel: bool = False):
        warn_renamed("get_data_parallel_group")
        return self.group("dp_cp" if with_context_parallel else "dp")

    def get_context_parallel_group(self):
        warn_renamed("get_context_parallel_group")
        return self.group("cp")

    def get_tensor_model_parallel_group(self):
        warn_renamed("get_tensor_model_parallel_group")
        return self.group("tp")

    def get_pipeline_model_parallel_group(self):
        warn_renamed("get_pipeline_model_parallel_group")
        return self.group("pp")

    def get_expert_parallel_group(self):
        warn_renamed("get_expert_parallel_group")
        return self.group("ep")

    def get_expert_data_parallel_group(self):
        warn_renamed("get_expert_data_parallel_group")
        return self.group("edp")

    def replica_group(self):
        warn_renamed("replica_group")
        return self.group("replica")
