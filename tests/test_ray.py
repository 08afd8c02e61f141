"""``launcher=ray`` on real Ray clusters: a local Ray that plait starts itself; a head node
started by the fixture with ``ray start --head`` on 127.0.0.1; and two Ray "nodes" in two
network namespaces (scripts/netns_cluster.py), a head in one and a worker node in the other, with
``plait train`` run on the head's node as a user runs it. Every Ray started here is limited (2
CPUs per node, a 100 MB object store, no dashboard) and stopped in teardown. Skipped, with the
reason, where Ray is not installed (``pip install -e ".[ray]"``; scripts/setup.sh installs it).

Proof: 2 Ray workers give the local launcher's 2-process losses step for step (rel 1e-5), on a
new local Ray even with ``RAY_ADDRESS`` naming the head; a SIGKILLed Ray worker under
``launcher.max_restarts=1`` is restarted by Ray Train and the run ends bit-identical to the
uninterrupted one, in one W&B run; 2 nodes x 2 workers with ``comm=hierarchical`` give the local
launcher's 4-process losses (rel 1e-5).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import inhouse
import pytest

from plait.testing import TEST_OVERRIDES, free_port, read_metrics, run_losses, run_training

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import netns_cluster  # noqa: E402

ray = pytest.importorskip("ray", reason="launcher=ray needs Ray: pip install -e '.[ray]'")
# One pytest-xdist worker runs them all, one Ray at a time (Ray's token authentication, on by
# default for local clusters, once refused a head's driver beside another worker's Ray: see
# ray_token)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_ray")]

STEPS = ["train.steps=3", "optimizer.decay_steps=3"]
# As tests/test_fault.py: dropout on, so a resume that does not restore each rank's generators
# draws other masks; a checkpoint every 3 steps, the kill after step 5.
FAULT_RUN = [
    "train.steps=8",
    "optimizer.decay_steps=8",
    "checkpoint.every=3",
    "launcher.nproc_per_node=2",
    "checkpoint.keep_last=0",
    "model.dropout=0.1",
]
KILL_STEP = 5


def ray_env(**extra: str) -> dict[str, str]:
    """What a Ray node started here runs with: workers inherit it (the tests' in-house plugins
    importable, DeepSpeed on the CPU)."""
    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


def ray_start(address_args: list[str], temp_dir: str) -> list[str]:
    return [
        shutil.which("ray") or "ray",
        "start",
        *address_args,
        "--num-cpus=2",
        "--object-store-memory=100000000",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        "--block",
    ]


def wait_for_port(
    host: str, port: int, proc: subprocess.Popen, netns: str | None = None, timeout: float = 90
) -> None:
    deadline = time.monotonic() + timeout
    probe = ["ip", "netns", "exec", netns] if netns else []
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        done = subprocess.run(
            [
                *probe,
                sys.executable,
                "-c",
                f"import socket; socket.create_connection(('{host}', {port}), 1)",
            ],
            capture_output=True,
        )
        if done.returncode == 0:
            return
        time.sleep(1)
    raise RuntimeError(f"no Ray head at {host}:{port} after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    """End a ``ray start --block`` and every Ray process it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module", autouse=True)
def ray_token(monkeypatch_module):
    """Every Ray here (heads, nodes, plait's drivers) reads this module's token from
    ``RAY_AUTH_TOKEN``, Ray's first source, and not the user's ``~/.ray/auth_token``: a local
    ``ray.init()`` writes that file when it is missing, and two Rays started at once on a fresh
    machine can each write their own, leaving a head and its driver with different tokens."""
    monkeypatch_module.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))


@pytest.fixture(scope="module")
def ray_head(monkeypatch_module):
    """A Ray head node on 127.0.0.1 (2 CPUs), started once for the module; yields its address."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="rayt", dir="/tmp")  # Ray's socket paths must be short
    head = subprocess.Popen(
        ray_start(
            [
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--include-dashboard=false",
            ],
            temp_dir,
        ),
        env=ray_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port("127.0.0.1", port, head)
        # the driver (this process) hands the workers its PYTHONPATH (launcher=ray forwards it)
        monkeypatch_module.setenv("PYTHONPATH", ray_env()["PYTHONPATH"])
        yield f"127.0.0.1:{port}"
    finally:
        stop(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_two_ray_workers_match_the_local_launchers_two_processes(
    ray_head, tmp_path, monkeypatch, capfd
):
    """No launcher.address: plait starts a local Ray for the run and ends it afterwards, also
    where ``RAY_ADDRESS`` names a cluster (Ray's ``ray.init()`` would join it, and refuse the
    local Ray's ``num_cpus`` there; ``launcher.address=auto`` joins it)."""
    reference = run_losses(tmp_path / "local", [*STEPS, "launcher.nproc_per_node=2"])
    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    # a new local Ray keeps its session under Ray's default temp directory, named after the
    # process that started it; a driver that joins a cluster uses that cluster's session
    sessions = Path(os.environ.get("RAY_TMPDIR", tempfile.gettempdir()), "ray")
    before = set(sessions.glob(f"session_*_{os.getpid()}"))
    losses = run_losses(tmp_path / "ray", [*STEPS, "launcher=ray", "launcher.nproc_per_node=2"])
    assert losses == pytest.approx(reference, rel=1e-5)
    assert len(losses) == 3
    assert len(set(sessions.glob(f"session_*_{os.getpid()}")) - before) == 1
    assert f"RAY_ADDRESS={ray_head} is not joined (launcher.address=auto" in capfd.readouterr().err
    assert not ray.is_initialized()  # the local Ray was shut down with the run


def test_sigkilled_ray_worker_is_restarted_by_ray_and_the_run_is_bit_identical(ray_head, tmp_path):
    settings = [*FAULT_RUN, "tracker=wandb", "tracker.project=plait-test"]
    straight_dir = run_training(tmp_path / "straight", settings)
    straight = read_metrics(straight_dir)
    run_dir = run_training(
        tmp_path / "killed",
        [*settings, "launcher=ray", f"launcher.address={ray_head}", "launcher.max_restarts=1"],
        plugins=[inhouse.KillAt(KILL_STEP)],
    )
    assert (run_dir / "killed").exists(), "the Ray worker was never killed"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert [m["loss"] for m in metrics] == [m["loss"] for m in straight]  # bit-identical
    resumed_at = KILL_STEP // 3 * 3  # the last checkpoint before the kill
    assert [m["restarts"] for m in metrics] == [0.0] * resumed_at + [1.0] * (8 - resumed_at)
    ids = {p.name.rsplit("-", 1)[1] for p in run_dir.glob("wandb/offline-run-*")}
    assert len(ids) == 1, f"one W&B run per job, across the restart: {ids}"


@pytest.mark.skipif(
    netns_cluster.can_make_namespaces() is not None, reason=f"{netns_cluster.can_make_namespaces()}"
)
def test_two_ray_nodes_in_namespaces_with_hierarchical_comm_match_the_local_launcher(tmp_path):
    reference = run_losses(tmp_path / "local", [*STEPS, "launcher.nproc_per_node=4"])
    env = ray_env()
    with netns_cluster.Cluster(2) as cluster:
        head_node, worker_node = cluster.nodes
        temp_dirs = [tempfile.mkdtemp(prefix="rayn", dir="/tmp") for _ in cluster.nodes]
        try:
            head = cluster.popen(
                head_node,
                ray_start(
                    [
                        "--head",
                        f"--node-ip-address={head_node.addr}",
                        "--port=6379",
                        "--include-dashboard=false",
                    ],
                    temp_dirs[0],
                ),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_for_port(head_node.addr, 6379, head, head_node.netns)
            cluster.popen(
                worker_node,
                ray_start(
                    [f"--address={head_node.addr}:6379", f"--node-ip-address={worker_node.addr}"],
                    temp_dirs[1],
                ),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            train = cluster.popen(
                head_node,
                [
                    sys.executable,
                    "-m",
                    "plait",
                    "train",
                    *TEST_OVERRIDES,
                    *STEPS,
                    "launcher=ray",
                    f"launcher.address={head_node.addr}:6379",
                    "launcher.nnodes=2",
                    "launcher.nproc_per_node=2",
                    "comm=hierarchical",
                    f"run.root={tmp_path}",
                    "run.name=nodes",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            out, _ = train.communicate(timeout=500)
            assert train.returncode == 0, out[-4000:]
        finally:
            for proc in cluster.procs:
                stop(proc)
            for temp_dir in temp_dirs:
                shutil.rmtree(temp_dir, ignore_errors=True)
    # plait's topology learned the nodes from Ray's (two workers each), so hierarchical ran
    assert "nodes: 2, ranks by node [0 1 | 2 3]" in out
    assert "falling back to flat all-reduce" not in out
    losses = [m["loss"] for m in read_metrics(tmp_path / "nodes")]
    assert losses == pytest.approx(reference, rel=1e-5)
