"""Gradient communication without a network: the node layout, plan checks, the ZeRO mapping (no
processes), and the algorithms on 4 gloo processes posing as 2 nodes x 2 (the launcher's node
variables, as torch elastic sets them): their sums, and what each rank sends to which peer and
hands to all-reduce (``inhouse.WireRecorder``), which tells ring from hierarchical from gloo's own
all-reduce and a compressed payload from an uncompressed one. The same algorithms across real
network namespaces: tests/test_comm_multinode.py."""

from __future__ import annotations

import pytest
import torch

from plait.plan import format_plan, make_plan
from plait.testing import spawn
from plait.topology import ParallelDims, launcher_node_env, mesh_groups, node_enumeration

ALGORITHMS = ("flat", "ring", "hierarchical")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


def problems(*overrides: str) -> str:
    return "\n".join(make_plan(["tracker=none", "launcher.nproc_per_node=2", *overrides]).problems)


# ---------------------------------------------------------------------------------------------
# the node layout
# ---------------------------------------------------------------------------------------------


def test_intra_and_inter_node_groups_are_strided_by_tensor_parallelism():
    dims = ParallelDims(dp=4, tp=2, pp=1, world_size=8, nnodes=2)
    node_of = [0, 0, 0, 0, 1, 1, 1, 1]
    assert mesh_groups(dims, "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    intra, inter = node_enumeration(mesh_groups(dims, "dp"), node_of)
    assert intra == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert inter == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_node_groups_follow_the_launcher_not_rank_numbers():
    dims = ParallelDims(dp=4, tp=1, pp=1, world_size=4, nnodes=2)
    # a launcher that placed ranks round-robin (srun --distribution=cyclic)
    assert node_enumeration(mesh_groups(dims, "dp"), [0, 1, 0, 1]) == (
        [[0, 2], [1, 3]],
        [[0, 1], [2, 3]],
    )
    # pipeline stages across nodes, each dp group on one node: nothing to split
    pp = ParallelDims(dp=2, tp=1, pp=2, world_size=4, nnodes=2)
    assert node_enumeration(mesh_groups(pp, "dp"), [0, 0, 1, 1]) == ([], [])


def test_engines_without_buckets_fuse_gradients_by_dtype_up_to_the_bucket_size():
    from plait.engine.buckets import fuse

    grads = [
        torch.zeros(256),
        torch.zeros(256),
        torch.zeros(600),
        torch.zeros(8, dtype=torch.bfloat16),
    ]
    sizes = [[g.numel() for g in bucket] for bucket in fuse(grads, bucket_bytes=2048)]
    assert sizes == [[256, 256], [600], [8]]


def test_node_variables_come_from_the_launcher():
    assert launcher_node_env({"GROUP_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}) == (
        1,
        0,
        2,
    )
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE, GROUP_RANK not set: plait learns"):
        launcher_node_env({"LOCAL_RANK": "0"})


def test_plan_prints_the_node_layout_and_the_comm_choice():
    text = format_plan(
        make_plan(
            [
                "tracker=none",
                "launcher.nnodes=2",
                "launcher.nproc_per_node=4",
                "parallel.tp=2",
                "run.name=x",
                "comm=hierarchical",
                "comm.compression=fp16",
                "comm.bucket_mb=4",
            ]
        )
    )
    assert "nodes: 2, ranks by node [0 1 2 3 | 4 5 6 7]" in text
    assert "dp groups by node: [0 2 | 4 6], [1 3 | 5 7]" in text
    assert "inter-node groups: [0, 4] [2, 6] [1, 5] [3, 7]" in text
    assert "comm: hierarchical, compression fp16, bucket 4 MiB" in text


# ---------------------------------------------------------------------------------------------
# settings checked before launch
# ---------------------------------------------------------------------------------------------


def test_bad_comm_settings_are_refused_before_launch():
    assert "comm.compression=zip: choose one of none, fp16, bf16, powersgd" in problems(
        "comm=ring", "comm.compression=zip"
    )
    assert "comm.bucket_mb=0.0 must be positive" in problems("comm.bucket_mb=0")
    assert "comm.powersgd_start_iter=1 must be at least 2" in problems(
        "comm.compression=powersgd", "comm.powersgd_start_iter=1"
    )
    assert (
        "comm.name=rign selects no plugin that decides plait_grad_reducer; installed "
        "plugins offer: allreduce, flat, hierarchical, ring" in problems("comm.name=rign")
    )


def test_zero_maps_each_comm_choice_onto_deepspeed():
    plan = make_plan(
        [
            "tracker=none",
            "launcher.nproc_per_node=2",
            "launcher.nnodes=2",
            "launcher.master_port=29500",
            "run.name=x",
            "strategy=zero3",
            "comm=hierarchical",
            "comm.compression=bf16",
            "comm.bucket_mb=2",
        ]
    )
    assert plan.problems == []
    ds = plan.backend_configs["deepspeed"]
    assert ds["communication_data_type"] == "bf16"
    assert ds["zero_optimization"]["reduce_bucket_size"] == 2 * 2**20 // 2  # bf16 elements
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 2  # processes per node
    assert (
        "comm=hierarchical (processes per node):\n    "
        "zero_optimization.zero_hpz_partition_size: 2" in format_plan(plan)
    )
    fp32 = make_plan(
        [
            "tracker=none",
            "launcher.nproc_per_node=2",
            "strategy=zero1",
            "comm.bucket_mb=1",
            "comm.compression=fp16",
        ]
    ).backend_configs["deepspeed"]
    assert fp32["communication_data_type"] == "fp16"
    assert fp32["zero_optimization"]["reduce_bucket_size"] == 2**20 // 2
    default = make_plan(["tracker=none", "strategy=zero2"]).backend_configs["deepspeed"]
    assert "communication_data_type" not in default
    # without comm.bucket_mb the bucket is sized from the model (plugins/zero/sizing.py: the
    # default GPT's largest parameter, 256 x 64), not set by the comm plugin
    assert default["zero_optimization"]["reduce_bucket_size"] == 256 * 64


def test_zero_refuses_what_deepspeed_cannot_do():
    assert (
        "comm=ring under strategy=zero2: DeepSpeed reduces gradients with its own "
        "collectives and cannot call a plait reducer" in problems("strategy=zero2", "comm=ring")
    )
    assert "comm=flat under strategy=zero1" in problems("strategy=zero1", "comm=flat")
    assert (
        "comm=hierarchical under strategy=zero2: DeepSpeed's hierarchical scheme is ZeRO++'s "
        "hpZ (zero_hpz_partition_size), for ZeRO-3 only"
        in problems("strategy=zero2", "comm=hierarchical")
    )
    assert (
        "comm.compression=powersgd under strategy=zero1: DeepSpeed has no such gradient "
        "compression" in problems("strategy=zero1", "comm.compression=powersgd")
    )
    assert (
        'strategy.deepspeed.communication_data_type="fp32" conflicts with '
        "comm.compression=fp16"
        in problems(
            "strategy=zero1",
            "comm.compression=fp16",
            "strategy.deepspeed.communication_data_type=fp32",
        )
    )
    # a key the comm choice leaves alone stays the user's
    assert problems("strategy=zero1", "strategy.deepspeed.communication_data_type=fp32") == ""


# ---------------------------------------------------------------------------------------------
# the algorithms, on 4 processes posing as 2 nodes x 2
# ---------------------------------------------------------------------------------------------


def _cfg(
    name: str, compression: str = "none", bucket_mb: float | None = None, powersgd_rank: int = 1
):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "device": "cpu",
            "seed": 0,
            "launcher": {"timeout_s": 120, "nnodes": 2, "nproc_per_node": 2},
            "parallel": {"dp": -1, "tp": 1, "pp": 1},
            "train": {"grad_accum_steps": 1},
            "comm": {
                "name": name,
                "compression": compression,
                "bucket_mb": bucket_mb,
                "powersgd_rank": powersgd_rank,
                "powersgd_start_iter": 2,
            },
        }
    )


# What one step of the reducer hands to all-reduce for the gradients [16x12, 12, 12x20] (444
# fp32 values, 1776 bytes): the whole bucket; half the bytes in fp16 / bf16; PowerSGD at rank
# r=1 sends the vector whole and each matrix M (m x n) as its factors P (m x r) and Q (n x r),
# (m+n)·r values instead of m·n, in three all-reduces: the uncompressed tensors, every P, every Q.
PAYLOAD = {
    "none": [4 * 444],
    "fp16": [2 * 444],
    "bf16": [2 * 444],
    "powersgd": [4 * 12, 4 * (16 + 12) * 1, 4 * (12 + 20) * 1],
}


def _same_on_every_rank(tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    every = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(every, tensor)
    assert all(torch.equal(t, every[0]) for t in every)


def _algorithms_on_two_nodes(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from inhouse import WireRecorder
    from torch.nn.parallel import DistributedDataParallel

    from plait.engine.buckets import FlatBucket
    from plait.plugins import comm as plugins
    from plait.plugins.comm.hierarchical import hierarchical_all_reduce_
    from plait.plugins.comm.ring import ring_all_reduce_
    from plait.plugins.ddp import ddp_options, register_reducer
    from plait.topology import Topology

    topology = Topology.initialize(_cfg("ring"))
    assert topology.node_of == [0, 0, 1, 1] and topology.dims.nnodes == 2
    nodes = topology.node_groups("dp")
    assert (nodes.nnodes, nodes.local_size) == (2, 2)
    assert dist.get_process_group_ranks(nodes.intra) == [[0, 1], [2, 3]][rank // 2]
    assert dist.get_process_group_ranks(nodes.inter) == [[0, 2], [1, 3]][rank % 2]
    group = topology.group("dp")

    # integers: the same sums as torch's all-reduce, bit for bit (short buffers included)
    for numel in (0, 1, 3, 4, 7, 1001):
        data = torch.randint(
            -(2**20), 2**20, (numel,), generator=torch.Generator().manual_seed(rank * 7919 + numel)
        )
        expected = data.clone()
        dist.all_reduce(expected)
        ring, hierarchical, pipelined = data.clone(), data.clone(), data.clone()
        ring_all_reduce_(ring, group)
        hierarchical_all_reduce_(hierarchical, nodes.intra, nodes.inter)
        # segments of 5 elements: up to 201 segments in flight through the three stages
        hierarchical_all_reduce_(pipelined, nodes.intra, nodes.inter, segment_bytes=5 * 8)
        assert torch.equal(ring, expected) and torch.equal(hierarchical, expected), numel
        assert torch.equal(pipelined, expected), numel

    # floats, through each plugin's reducer and every compression: the average, up to the
    # summation order (fp32) or the rounding of the wire format, the same on every rank; and
    # what went on the wire (inhouse.WireRecorder), by peer, in the step that counts
    torch.manual_seed(rank)
    grads = [torch.randn(16, 12), torch.randn(12), torch.randn(12, 20)]
    exact = [g.clone() for g in grads]
    for g in exact:
        dist.all_reduce(g)
        g /= world_size
    tolerance = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}
    right, partner, across = (rank + 1) % 4, rank ^ 1, (rank + 2) % 4  # nodes [0 1 | 2 3]
    for name in ALGORITHMS:
        for compression in COMPRESSIONS:
            reducer = plugins.comm.plait_grad_reducer(_cfg(name, compression), topology)
            assert (reducer.spec.algorithm, reducer.spec.compression) == (name, compression)
            with WireRecorder() as wire:
                for _ in range(3):  # PowerSGD: 2 uncompressed steps, then compressed
                    bucket = FlatBucket(0, [g.clone() for g in grads], last=True)
                    wire.take()
                    averaged = reducer.reduce(bucket, group).wait()
                sends, all_reduces = wire.take()
            # the compression decides the payload; the algorithm the group it goes through
            group_name = "backend" if name == "flat" else name
            assert all_reduces == [(group_name, b) for b in PAYLOAD[compression]], (
                name,
                compression,
                all_reduces,
            )
            # flat is gloo's own all-reduce: no send of plait's. Ring and hierarchical send
            # 2(p-1)/p = 1.5 of each payload (p = 4 ranks; 2 per node: 1/2 + 2·1/4 + 1/2)
            assert sum(b for _, b in sends) == (
                0 if name == "flat" else 1.5 * sum(PAYLOAD[compression])
            ), (name, compression, sends)
            _same_on_every_rank(averaged)
            bucket.copy_back(averaged)
            error = max((a - e).abs().max().item() for a, e in zip(bucket._grads, exact))
            if compression == "powersgd":  # rank-1 approximation of random matrices: lossy
                assert 1e-3 < error < 10, (name, error)
            else:
                assert error < tolerance[compression] * 4, (name, compression, error)
            if compression != "none":
                continue
            S = 4 * 444
            if name == "ring":  # 2(N-1) = 6 chunks of S/N, all to the right neighbour
                assert sends == [(right, S // 4)] * 6, sends
            if name == "hierarchical":  # reduce-scatter in the node, all-reduce across the
                assert sends == [
                    (partner, S // 2),  # nodes of the half this rank holds,
                    (across, S // 4),
                    (across, S // 4),
                    (partner, S // 2),
                ], sends  # all-gather in the node
    # Between nodes: the ring's ranks 1 and 3 send all 6 chunks across (3·S in all), the
    # hierarchical ranks 2 chunks each (2·S): the (n-1)L/(nL-1) = 2/3 of hierarchical.py.

    # PowerSGD's ratio for one matrix at rank r = 2: (m+n)·r / (m·n) of the bytes
    with WireRecorder() as wire:
        reducer = plugins.comm.plait_grad_reducer(
            _cfg("ring", "powersgd", powersgd_rank=2), topology
        )
        for _ in range(3):
            wire.take()
            reducer.reduce(FlatBucket(0, [torch.randn(32, 24)], last=True), group).wait()
        sends, all_reduces = wire.take()
    assert [b for _, b in all_reduces] == [0, 4 * 32 * 2, 4 * 24 * 2], all_reduces  # -; P; Q
    assert sum(b for _, b in sends) / (1.5 * 4 * 32 * 24) == (32 + 24) * 2 / (32 * 24), sends

    # DDP keeps its C++ paths for comm=allreduce, takes every other reducer as a hook, and
    # its bucket size from comm.bucket_mb
    def ddp_with(name, compression, bucket_mb=None):
        plugin = plugins.allreduce if name == "allreduce" else plugins.comm
        reducer = plugin.plait_grad_reducer(_cfg(name, compression, bucket_mb), topology)
        ddp = DistributedDataParallel(
            torch.nn.Linear(4, 4), process_group=group, **ddp_options(reducer)
        )
        register_reducer(ddp, reducer, group)
        return ddp

    def hook_and_bucket(ddp):
        return str(ddp._get_ddp_logging_data().get("comm_hook")), ddp.bucket_bytes_cap

    assert hook_and_bucket(ddp_with("allreduce", "none")) == ("None", 25 * 2**20)  # DDP's C++
    assert hook_and_bucket(ddp_with("allreduce", "fp16"))[0] == "BuiltinCommHookType.FP16_COMPRESS"
    assert hook_and_bucket(ddp_with("allreduce", "bf16"))[0] == "reduce_bucket"
    ring = ddp_with("ring", "none", bucket_mb=0.5)
    assert hook_and_bucket(ring) == ("reduce_bucket", 2**19)
    # and DDP's backward really runs the ring: its one bucket (the Linear's 20 gradients, 80
    # bytes) goes round in 6 chunks of 20 bytes to the right neighbour
    with WireRecorder() as wire:
        ring(torch.randn(2, 4)).sum().backward()
    sends, all_reduces = wire.take()
    assert (sends, all_reduces) == ([(right, 20)] * 6, [("ring", 80)]), (sends, all_reduces)


@pytest.mark.slow
def test_algorithms_on_four_processes_posing_as_two_nodes():
    spawn(_algorithms_on_two_nodes, 4, nproc_per_node=2)
