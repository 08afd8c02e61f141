"""A real SLURM on this machine for the tests that submit to one (tests/test_slurm.py,
tests/test_prepare_slurm.py): Debian's slurm-wlm and munge, one controller and one node daemon on
localhost, started once per test session by the ``slurm`` fixture in conftest.py (installed by
scripts/test.sh where root and apt-get are available, never by a test; skipped, with the reason,
where they are absent or cannot run)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from plait.testing import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


def slurm_missing() -> str | None:
    """Why SLURM cannot run here, or None. The tests install nothing: ``scripts/test.sh``
    installs slurm-wlm and munge where root and apt-get are available."""
    missing = [d for d in DAEMONS if not (shutil.which(d) or Path(f"/usr/sbin/{d}").exists())]
    if missing:
        return (
            f"{', '.join(missing)} not installed (scripts/test.sh installs slurm-wlm and "
            "munge where it runs as root with apt-get)"
        )
    return None


def slurm_conf(root: Path, host: str, cpus: int) -> str:
    return f"""\
ClusterName=plaittest
SlurmctldHost={host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
NodeName={host} CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@contextlib.contextmanager
def running_slurm(tmp_path_factory):
    """A running single-host SLURM; yields the environment that points its commands at it."""
    reason = slurm_missing()
    if reason:
        pytest.skip(f"no SLURM: {reason}")
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o755)  # munged wants its socket's directories searchable by everyone
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, host, os.cpu_count() or 2))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started = []
    try:
        for cmd in (
            [
                _sbin("munged"),
                "--force",
                f"--key-file={key}",
                f"--socket={root}/munge.socket",
                f"--pid-file={root}/munged.pid",
                f"--log-file={root}/munged.log",
                f"--seed-file={root}/munge.seed",
            ],
            [_sbin("slurmctld"), "-f", str(conf)],
            [_sbin("slurmd"), "-f", str(conf)],
        ):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
            if done.returncode:
                pytest.skip(f"no SLURM: {Path(cmd[0]).name} did not start: {done.stderr[-500:]}")
            started.append(Path(cmd[0]).name)
        if not _node_idle(env):
            logs = "".join(p.read_text()[-400:] for p in root.glob("slurm*.log"))
            pytest.skip(f"no SLURM: the node did not come up within 60 s: {logs}")
        yield env
    finally:
        if "slurmd" in started:  # let jobs end before their daemons go
            subprocess.run(["scancel", "--full", "--user=root"], env=env, timeout=30)
            deadline = time.time() + 60
            while (
                time.time() < deadline
                and subprocess.run(
                    ["squeue", "-h"], env=env, capture_output=True, text=True
                ).stdout.strip()
            ):
                time.sleep(1)
        for name in reversed(started):
            pid_file = root / f"{name}.pid"
            if pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGTERM)


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _node_idle(env) -> bool:
    deadline = time.time() + 60
    while time.time() < deadline:
        state = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True
        ).stdout.strip()
        if state.startswith("idle") or state.startswith("mixed"):
            return True
        time.sleep(1)
    return False


def final_state(env, job_id: str, timeout: float = 120) -> str:
    """The job's state once it has left the queue's running states (submitit returns as soon as
    the tasks wrote their results, while SLURM is still ending the job). Polled every second:
    ``sbatch --wait`` polls at growing intervals up to 10 s, which cost a test ~20 s idle."""
    deadline = time.time() + timeout
    while True:
        shown = subprocess.run(
            ["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True
        ).stdout
        state = re.search(r"JobState=(\w+)", shown)[1]
        if state not in ("PENDING", "RUNNING", "COMPLETING") or time.time() > deadline:
            return state
        time.sleep(1)
