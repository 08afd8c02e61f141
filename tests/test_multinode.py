"""Two "nodes" on one machine, each running the README's multi-node command as written.

Each node is a network namespace with its own address (joined to the other by a veth pair) and
its own UTS namespace with its own host name; both resolve the two host names through their own
``/etc/hosts`` (``ip netns exec`` mounts ``/etc/netns/<ns>/hosts``), as a cluster's DNS would. So
the command needs nothing a real cluster would not: the c10d rendezvous meets at the README's
``launcher.master_addr``, and the workers find each other by host name.
"""

import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from plait.cli import main
from plait.plan import make_plan
from plait.testing import TEST_OVERRIDES, read_metrics, run_losses

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import netns_cluster  # noqa: E402

README = Path(__file__).parents[1] / "README.md"
STEPS = ["train.steps=3", "optimizer.decay_steps=3"]


def readme_multinode_overrides() -> list[str]:
    """The overrides of the README's multi-node example (node 0's), exactly as written."""
    [span] = re.findall(r"`([^`\n]*launcher\.nnodes=[^`\n]*)`", README.read_text())
    return span.split()


def settings(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_nodes():
    """Node i: (namespace, host name, address); node 0 has the README's master_addr."""
    # tried, not assumed: root in a container may still be refused namespaces
    reason = netns_cluster.can_make_namespaces()
    if reason is None and shutil.which("unshare") is None:
        reason = "needs unshare (util-linux) to give each node its own host name"
    if reason is not None:
        pytest.skip(reason)
    master = settings(readme_multinode_overrides())["launcher.master_addr"]
    prefix, last = master.rsplit(".", 1)
    tag = uuid.uuid4().hex[:6]
    nodes = [(f"plait{tag}n{i}", f"node{i}", f"{prefix}.{int(last) + i}") for i in range(2)]
    devs = [f"pl{tag}v{i}" for i in range(2)]
    hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for _, name, addr in nodes)
    try:
        for ns, _, _ in nodes:
            ip("netns", "add", ns)
            Path(f"/etc/netns/{ns}").mkdir(parents=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(hosts)
        ip("link", "add", devs[0], "type", "veth", "peer", "name", devs[1])
        for (ns, _, addr), dev in zip(nodes, devs):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for ns, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


@pytest.mark.slow
def test_readme_multinode_command_trains_like_one_node_with_two_processes(two_nodes, tmp_path):
    reference = run_losses(tmp_path / "ref", [*STEPS, "launcher.nproc_per_node=2"])
    readme = readme_multinode_overrides()
    procs = []
    for rank, (ns, hostname, _) in enumerate(two_nodes):
        command = [
            o if not o.startswith("launcher.node_rank=") else f"launcher.node_rank={rank}"
            for o in readme
        ]  # "with its own node_rank", as the README says
        procs.append(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    'hostname "$0" && exec "$@"',
                    hostname,
                    sys.executable,
                    "-m",
                    "plait",
                    "train",
                    *TEST_OVERRIDES,
                    *STEPS,
                    "launcher.nproc_per_node=1",
                    f"run.root={tmp_path}",
                    *command,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path / settings(readme)["run.name"])]
    assert losses == pytest.approx(reference, rel=1e-6)


def test_multinode_without_run_name_is_refused(tmp_path, capsys, monkeypatch):
    without_name = [o for o in readme_multinode_overrides() if not o.startswith("run.name=")]
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    assert main(["train", *TEST_OVERRIDES, f"run.root={tmp_path}", *without_name]) == 2
    assert (
        "launcher.nnodes=2 needs run.name=<name>, the same on every node" in capsys.readouterr().err
    )
    assert not any(tmp_path.iterdir())
    # an external launcher's job id is the same on every node: the run name follows from it
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    plan = make_plan([*TEST_OVERRIDES, f"run.root={tmp_path}", *without_name])
    assert plan.problems == [] and plan.cfg.run.name == "job-4242"
