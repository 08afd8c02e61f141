"""The groups of a size-1 mesh axis (pp, cp and tp in a data-parallel run) start no gloo
communicator: each gloo group is a transport device whose loop thread wakes every 10 ms beside
the training threads (plait.topology.one_rank; issue 32's zero1 row). Their collectives still
do over one rank what gloo's do. 2 gloo processes; the loop threads are read from /proc."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.testing import spawn


def _gloo_loop_threads() -> int:
    """How many gloo transport devices this process holds: one ``gloo_tcp_loop`` thread each."""
    tasks = Path("/proc/self/task").iterdir()
    return sum((task / "comm").read_text().strip() == "gloo_tcp_loop" for task in tasks)


def _data_parallel_topology(rank: int, world_size: int, ep: int, out: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from plait.topology import Topology

    cfg = OmegaConf.create(
        {
            "device": "cpu",
            "launcher": {"timeout_s": 120, "nnodes": 1, "nproc_per_node": world_size},
            "parallel": {"dp": -1, "tp": 1, "pp": 1, "cp": 1, "ep": ep},
            "train": {"grad_accum_steps": 1},
        }
    )
    topology = Topology.initialize(cfg)
    found = {"loop_threads": _gloo_loop_threads()}
    x = torch.arange(6.0) + 10 * rank
    one_rank_axes = ("pp", "cp", "tp", "replica") + (("edp",) if ep > 1 else ())
    for axis in one_rank_axes:
        group = topology.group(axis)
        summed, gathered, scattered = x.clone(), [torch.zeros(6)], torch.zeros(6)
        dist.all_reduce(summed, group=group)
        dist.all_gather(gathered, x, group=group)
        dist.reduce_scatter_tensor(scattered, x, group=group)
        exchanged = torch.zeros(6)
        dist.all_to_all_single(exchanged, x, group=group)
        dist.broadcast(summed, src=rank, group=group)
        dist.barrier(group=group)
        found[axis] = {
            "size": dist.get_world_size(group),
            "exact": all(torch.equal(t, x) for t in (summed, gathered[0], scattered, exchanged)),
        }
    found["dp"] = dist.get_process_group_ranks(topology.group("dp"))
    if ep > 1:
        found["ep"] = dist.get_process_group_ranks(topology.group("ep"))
    found["loop_threads_after"] = _gloo_loop_threads()
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))


@pytest.mark.parametrize("ep", [1, 2])
def test_size_one_axes_start_no_gloo_device_and_stay_exact(tmp_path, ep):
    """ep=2 over dp=2: the expert-data-parallel groups hold one rank, and the expert-parallel
    group is every rank, the job's own group (no second gloo group over the same ranks)."""
    spawn(_data_parallel_topology, 2, ep, str(tmp_path))
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the default group's device alone (four: one more per size-1 axis, before the change)
        assert found["loop_threads"] == found["loop_threads_after"] == 1, found
        for axis in ("pp", "cp", "tp", "replica") + (("edp",) if ep > 1 else ()):
            assert found[axis] == {"size": 1, "exact": True}, (axis, found)
        assert found["dp"] == [0, 1]
        assert found.get("ep", [0, 1]) == [0, 1]
