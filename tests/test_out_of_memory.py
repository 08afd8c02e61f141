"""A worker the kernel kills for memory is told as such (plugins/launch/out_of_memory.py).

The real trigger: ``plait train`` on 2 processes in a memory cgroup capped at 1 GiB (root, Linux;
the job alone peaks near 0.5 GiB), whose rank 1 allocates until the kernel's OOM killer ends it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from plait.host_memory import DECOMMIT_ABOVE, memory_cap_advice, resolve
from plait.plugins.launch.out_of_memory import WorkerOutOfMemory, oom_kill_count, out_of_memory
from plait.testing import TEST_OVERRIDES, memory_cgroup

HOG = '''
import torch

from plait import hookimpl


class Hog:
    """Rank 1 writes 64 MiB at a time once its engine is built, until the kernel kills it (or it
    holds 8 GiB: then the test's cap did not hold, and the run fails with this error)."""

    @hookimpl(wrapper=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield
        if topology.rank == 1:
            held = [torch.ones(16 << 20) for _ in range(128)]
            raise RuntimeError(f"held {len(held) * 64} MiB without being killed")
        return engine


hog = Hog()
'''


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="makes a memory cgroup: needs root")
def test_a_worker_killed_for_memory_is_told_with_what_uses_less(tmp_path):
    (tmp_path / "hog_plugin.py").write_text(HOG)
    command = [
        sys.executable,
        "-m",
        "plait",
        "train",
        *TEST_OVERRIDES,
        "launcher.nproc_per_node=2",
        f"run.root={tmp_path}",
        "run.name=hog",
        "+plugins=[hog_plugin:hog]",
    ]
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    with memory_cgroup(1024) as group:
        done = subprocess.run(
            group.command(command), capture_output=True, text=True, env=env, timeout=300
        )
        assert group.oom_kills() >= 1, done.stderr[-3000:]
    assert done.returncode == 1, done.stderr[-3000:]
    told = done.stderr[done.stderr.index("plait: the kernel's out-of-memory killer ended") :]
    # torch records rank 1's SIGKILL, or first rank 0's lost connection to it
    assert "while the job ran: rank 1, ended by SIGKILL." in told or "one of the workers" in told
    assert (
        "The job outgrew the 1.0 GiB of its memory cgroup (0.50 GiB for each of the 2 workers "
        "on this node)"
    ) in told
    assert "`plait plan --search world_size=2 --memory-gb 0.50 <this run's overrides>`" in told
    assert memory_cap_advice(resolve("auto"), DECOMMIT_ABOVE) in told  # tcmalloc's line ...


def failure(exitcode: int) -> ChildFailedError:
    return ChildFailedError(
        "worker_entry", {1: ProcessFailure(local_rank=1, pid=1, exitcode=exitcode, error_file="")}
    )


def test_a_failure_is_told_as_a_kill_for_memory_only_when_the_kernel_counted_one():
    now = oom_kill_count()
    assert now is not None  # Linux 4.13 and later
    assert out_of_memory(failure(-9), now, "auto", 0.8, 2, 2) is None  # a SIGKILL, no OOM kill
    told = out_of_memory(failure(-9), now - 1, "glibc_mmap", 0.8, 2, 2)
    assert isinstance(told, WorkerOutOfMemory) and isinstance(told, ChildFailedError)
    assert "exitcode  : -9" in str(told)  # torch's own table first
    assert "while the job ran: rank 1, ended by SIGKILL." in str(told)
    assert "launcher.allocator" not in str(told)  # glibc_mmap already hands memory back
    lost_peer = out_of_memory(failure(1), now - 1, "auto", 0.8, 2, 2)
    assert "one of the workers, most likely" in str(lost_peer)
