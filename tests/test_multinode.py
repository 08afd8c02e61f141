"""Two "nodes" on one machine: network namespaces with their own addresses, joined by a veth
pair, each running `plait train launcher.nnodes=2` — the real multi-node path (c10d rendezvous
across addresses, one worker per node)."""

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from plait.testing import TEST_OVERRIDES, free_port, read_metrics, run_losses

pytestmark = pytest.mark.slow


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_nodes():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = uuid.uuid4().hex[:6]
    nodes = [(f"plait{tag}n{i}", f"pl{tag}v{i}", f"10.77.{int(tag[:2], 16)}.{i + 1}")
             for i in range(2)]
    try:
        for ns, _, _ in nodes:
            ip("netns", "add", ns)
        ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for ns, dev, addr in nodes:
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for ns, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_nodes_train_like_one_node_with_two_processes(two_nodes, tmp_path):
    steps = ["train.steps=3", "optimizer.decay_steps=3"]
    reference = run_losses(tmp_path / "ref", [*steps, "launcher.nproc_per_node=2"])
    master = two_nodes[0][2]
    common = [*TEST_OVERRIDES, *steps, "launcher.nnodes=2", "launcher.nproc_per_node=1",
              f"launcher.master_addr={master}", f"launcher.master_port={free_port()}",
              f"run.root={tmp_path}", "run.name=two_nodes"]
    procs = [
        subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "plait", "train",
                          *common, f"launcher.node_rank={rank}", f"launcher.local_addr={addr}"],
                         env={**os.environ, "GLOO_SOCKET_IFNAME": dev},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for rank, (ns, dev, addr) in enumerate(two_nodes)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path / "two_nodes")]
    assert losses == pytest.approx(reference, rel=1e-6)
