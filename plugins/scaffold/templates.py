"""The files ``plait new-plugin`` writes, as ``str.format`` templates (``{{``/``}}`` are braces).

Fields: name, package, dist, kind, plait_version, hookspec.
"""

COMMON = {
    "pyproject.toml": '''
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A plait {kind} plugin"
# written against plait {plait_version}, hook spec {hookspec}: any 1.x hook spec keeps it working
dependencies = ["plait>={plait_version}"]

[project.entry-points.plait]
{name} = "{package}"

[tool.setuptools]
packages = ["{package}"]
''',
    "README.md": '''
# {dist}

A plait {kind} plugin, registered through the `plait` entry-point group as `{name}`.

    pip install -e .
    plait plugins --check          # loads every installed plugin; exit 2 if one is broken
    python -m pytest tests         # trains the tiny GPT on 2 processes with this plugin
''',
}

OBSERVER = {
    "{package}/__init__.py": '''
"""{name}: a plait observer. It sees every optimizer step's metrics on the logging rank.

Active in every run once installed; ``PLAIT_BLOCK_PLUGINS={name}`` keeps it out.
"""

import json
import os

from plait import hookimpl

OUT_ENV = "PLAIT_{upper}_OUT"


@hookimpl
def plait_on_step_end(step, metrics):
    """Called on the logging rank after every optimizer step.

    :param step: the optimizer step just finished (1 for the first).
    :param metrics: loss, lr, grad_norm and the engine's figures (every logged step: what the
        loggers get, step times and memory too).
    """
    line = json.dumps({{"step": step, "loss": metrics["loss"]}})
    path = os.environ.get(OUT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(line + "\\n")
    else:
        print(f"{name}: {{line}}", flush=True)
''',
    "tests/test_{package}.py": '''
"""{name} in a real 2-process training run, through plait.testing."""

import json

from plait.plugin_manager import make_plugin_manager
from plait.testing import read_metrics, run_training

from {package} import OUT_ENV


def test_installed_and_loads():
    pm = make_plugin_manager()
    assert "{name}" in pm.records and not pm.broken


def test_sees_every_step_loss(tmp_path, monkeypatch):
    monkeypatch.setenv(OUT_ENV, str(tmp_path / "seen.jsonl"))
    run_dir = run_training(tmp_path / "run", ["train.steps=3", "launcher.nproc_per_node=2"])
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").open()]
    assert [s["step"] for s in seen] == [1, 2, 3]
    assert [s["loss"] for s in seen] == [m["loss"] for m in read_metrics(run_dir)]
''',
}

COMM = {
    "{package}/__init__.py": '''
"""{name}: a plait comm plugin, a gradient reducer selected by ``comm.name={name}``.

It averages each gradient bucket with one all-reduce (the contract of
``plait.types.GradReducer``); change ``reduce`` to compress, or to reduce in stages.
"""

import torch.distributed as dist

from plait import hookimpl
from plait.types import CommSpec, PluginInfo


class MeanAllReduce:
    """``reduce(bucket, group)``: start averaging ``bucket.buffer()`` over ``group``; return a
    future of the averaged flat buffer (written in place)."""

    def __init__(self, bucket_bytes):
        self.spec = CommSpec(algorithm="{name}", bucket_bytes=bucket_bytes)
        self.calls = 0

    def reduce(self, bucket, group):
        self.calls += 1
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(group))
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])


@hookimpl
def plait_declare():
    return PluginInfo(name="{name}", selected_by={{"comm.name": "{name}"}},
                      requires={{"dp": frozenset({{"engine:grad_reducer"}})}},
                      description="mean all-reduce of gradient buckets")


@hookimpl
def plait_grad_reducer(cfg, topology):
    """Build the reducer; called on every rank in the same order. Stops at the first non-None
    result, so only the selected comm plugin answers."""
    bucket_mb = cfg.comm.get("bucket_mb")
    return MeanAllReduce(bucket_bytes=None if bucket_mb is None else int(bucket_mb * 2**20))
''',
    "tests/test_{package}.py": '''
"""{name} in a real 2-process training run, through plait.testing."""

import pytest

from plait.plugin_manager import make_plugin_manager
from plait.testing import compose, run_losses


def test_installed_and_selected():
    assert "{name}" in make_plugin_manager().records
    assert compose(["comm.name={name}"]).comm.name == "{name}"


def test_trains_like_the_built_in_all_reduce(tmp_path):
    steps = ["train.steps=3", "launcher.nproc_per_node=2"]
    built_in = run_losses(tmp_path / "built_in", steps)
    mine = run_losses(tmp_path / "mine", [*steps, "comm.name={name}"])
    assert mine == pytest.approx(built_in, rel=1e-4)
''',
}

KINDS = {"observer": OBSERVER, "comm": COMM}
