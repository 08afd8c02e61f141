import contextlib
import multiprocessing.forkserver
import os
import signal
import sys
import time
from pathlib import Path

import pytest

# inhouse.py holds assertion helpers shared by several test files: show their values on failure.
pytest.register_assert_rewrite("inhouse")

# Every test run shares one token cache (the stdlib is tokenized once per session) and keeps
# W&B offline and quiet; tests never reach the network.
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_MODE", "offline")
# DeepSpeed's CPU ops (CPU Adam) are built beside this virtual environment, where
# scripts/test.sh's set-up built them: in the shared ~/.cache/torch_extensions a second checkout
# on the machine (a CI clone) rebuilds them against its own include paths, and the next test run
# here rebuilt them again inside tests/test_zero.py's offload test (2.5 minutes). Outside a
# virtual environment (a system interpreter) torch's default stays.
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("plait-cache")
    previous = os.environ.get("PLAIT_CACHE_DIR")
    os.environ["PLAIT_CACHE_DIR"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("PLAIT_CACHE_DIR", None)
    else:
        os.environ["PLAIT_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def no_gpu_unless_marked_cuda(request, monkeypatch):
    """Tests run on the CPU unless marked ``cuda``: plans composed in this process see no GPU, so
    ``device=auto`` means the CPU here as ``plait.testing.TEST_OVERRIDES``' ``device=cpu`` does in
    the workers (on a 1-GPU host a plan with 2 processes on ``auto`` is refused otherwise)."""
    if request.node.get_closest_marker("cuda") is None:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(autouse=True)
def no_worker_outlives_its_test():
    """Every process this test's launches forked from the worker server (``plait.forkserver``)
    has ended when the test ends. One left running (a rank hung in a collective behind a test's
    timeout) would hold the server's pipe and take the cores from the tests after it: it is
    killed here, and the test errors at teardown, naming it, instead of a later test."""
    yield
    deadline = time.monotonic() + 30  # a worker still ending: torch elastic has joined it
    while (left := forkserver_children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):  # it ended after all, since listed
            os.kill(pid, signal.SIGKILL)
    if left:
        pytest.fail(f"worker processes {left} outlived the test (killed)", pytrace=False)


def forkserver_children() -> list[int]:
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    try:
        tasks = Path(f"/proc/{server}/task").iterdir() if server else ()
        return [int(pid) for task in tasks for pid in (task / "children").read_text().split()]
    except OSError:  # the server has just ended
        return []


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(items):
    """``@pytest.mark.cuda(gpus=n)``: skip, saying why, where fewer than n GPUs (or no NCCL).
    Under pytest-xdist (``-n 2 --dist loadgroup``, scripts/test.sh) every test that uses the
    ``slurm`` fixture runs on one worker, so that one SLURM serves them all, and the tests of a
    module that share a module-scoped fixture (its training runs) run on one worker, so that the
    runs are made once and not once per worker."""
    for item in items:
        if "slurm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    marked = [(item, item.get_closest_marker("cuda")) for item in items]
    marked = [(item, marker) for item, marker in marked if marker is not None]
    if not marked:
        return
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if dist.is_nccl_available() else 0
    for item, marker in marked:
        needed = marker.kwargs.get("gpus", 1)
        if gpus < needed:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs {needed} CUDA GPU(s) with NCCL; this machine has {gpus}"
                )
            )


def uses_a_module_fixture(item) -> bool:
    fixtures = getattr(item, "_fixtureinfo", None)
    return fixtures is not None and any(
        definitions[-1].scope == "module" for definitions in fixtures.name2fixturedefs.values()
    )


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running single-host SLURM (tests/slurm_cluster.py), started once per session for every
    test that submits to it; yields the environment that points SLURM's commands at it."""
    from slurm_cluster import running_slurm

    with running_slurm(tmp_path_factory) as env:
        yield env
