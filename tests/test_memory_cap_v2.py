"""``plait.memory_cap`` reads a cgroup v2 machine's files: ``memory.max`` on the way from this
process's cgroup to the root, ``memory.stat``'s ``anon``.

**A stand-in, said so:** this machine binds the memory controller to cgroup v1 (its own sandbox
lives in a v1 memory cgroup), so no v2 memory controller can be had here, and the real cgroups of
tests/test_memory_cap.py and tests/test_out_of_memory.py exercise only the v1 files. These tests
write the files a v2 kernel shows (``cgroup.controllers`` at the root, ``memory.max``,
``memory.stat``, and ``/proc/self/cgroup``'s ``0::`` line) into a temporary directory that takes
``/sys/fs/cgroup``'s place.
"""

from pathlib import Path

import pytest

from plait import memory_cap

GIB = 1 << 30


@pytest.fixture
def fake_cgroups(tmp_path, monkeypatch):
    """A stand-in ``/sys/fs/cgroup`` and ``/proc/self/cgroup``; returns the tree's root."""
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(memory_cap, "CGROUPS", root)
    monkeypatch.setattr(memory_cap, "PROC_SELF_CGROUP", tmp_path / "proc_self_cgroup")
    return root


def place(lines: str) -> None:
    """This process's ``/proc/self/cgroup`` (the stand-in the fixture put in its place)."""
    memory_cap.PROC_SELF_CGROUP.write_text(lines)


def group(root: Path, path: str, limit: str | None, stat: str = "") -> None:
    """A cgroup at ``path`` with ``limit`` in ``memory.max`` (None: no memory controller there)."""
    (root / path).mkdir(parents=True, exist_ok=True)
    if limit is not None:
        (root / path / "memory.max").write_text(f"{limit}\n")
        (root / path / "memory.stat").write_text(stat)


def test_on_cgroup_v2_the_cap_is_the_tightest_memory_max_above_the_process(fake_cgroups):
    (fake_cgroups / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    place("0::/system.slice/job.service/run\n")
    group(fake_cgroups, "system.slice", "max", "anon 1\nfile 2\n")
    group(fake_cgroups, "system.slice/job.service", str(2 * GIB), "anon_thp 2\nanon 9\nfile 3\n")
    group(fake_cgroups, "system.slice/job.service/run", str(3 * GIB), "anon 7\n")

    cap = memory_cap.memory_cap()

    assert (cap.limit, cap.source) == (2 * GIB, "its memory cgroup")
    assert cap.used() == 9  # the capping group's anonymous bytes, not its page cache
    group(fake_cgroups, "system.slice/job.service/run", str(GIB), "file 5\nanon 4\n")
    tighter = memory_cap.memory_cap()
    assert (tighter.limit, tighter.used()) == (GIB, 4)


def test_on_cgroup_v2_without_a_cap_the_job_has_the_machines_memory(fake_cgroups):
    (fake_cgroups / "cgroup.controllers").write_text("memory\n")
    place("0::/user.slice/session\n")
    group(fake_cgroups, "user.slice", "max", "anon 1\n")
    group(fake_cgroups, "user.slice/session", None)  # the controller not enabled for it

    cap = memory_cap.memory_cap()

    assert cap.source == "this machine"
    assert cap.limit == memory_cap.figure(memory_cap.MEMINFO, "MemTotal:") * 1024


def test_beside_cgroup_v1_the_unified_tree_without_memory_leaves_the_cap_to_v1(fake_cgroups):
    """The hybrid layout (this machine's): v1's memory hierarchy, v2 mounted at ``unified``."""
    place("4:memory:/job\n1:cpu:/\n0::/job\n")
    (fake_cgroups / "memory" / "job").mkdir(parents=True)
    (fake_cgroups / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    (fake_cgroups / "memory" / "job" / "memory.stat").write_text("cache 5\nrss 6\ntotal_rss 8\n")
    (fake_cgroups / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    group(fake_cgroups, "unified/job", None)

    cap = memory_cap.memory_cap()

    assert (cap.limit, cap.used()) == (GIB, 8)
