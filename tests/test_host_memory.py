"""What a run's workers start with: the allocator ``launcher.allocator`` chose, none of the
heavy libraries the run does not use, and what the libraries it uses would build in every
worker (issue 32). Each case is a real ``plait train`` command in a fresh process (a test
session's forkserver would carry an earlier launch's modules)."""

import json
import os
import subprocess
import sys

import pytest

from plait import host_memory
from plait.testing import TEST_OVERRIDES

PROBE = """
import json, os, sys
from plait import hookimpl
from plait.host_memory import running_allocator

WATCHED = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "wandb", "transformers",
           "transformers.modeling_utils")

class Probe:
    @hookimpl(tryfirst=True)
    def plait_build_topology(self, cfg):  # the first hook of every worker: what it started with
        seen = {"allocator": running_allocator(),
                "modules": [m for m in WATCHED if m in sys.modules]}
        renames = sys.modules.get("transformers.conversion_mapping")
        if renames is not None:  # its table of checkpoint renames, built at the first lookup
            seen["renames"] = renames._checkpoint_conversion_mapping_cache is not None
        ops = sys.modules.get("deepspeed.ops")
        if ops is not None:  # which ops DeepSpeed can build, probed at the first access
            seen["ops_probed"] = "__compatible_ops__" in vars(ops)
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(seen, f)

probe = Probe()
"""


MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def worker_sees(tmp_path, *overrides: str) -> dict:
    (tmp_path / "allocator_probe.py").write_text(PROBE)
    out = tmp_path / "seen.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
        "PROBE_OUT": str(out),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "train",
            *TEST_OVERRIDES,
            "train.steps=1",
            "launcher.nproc_per_node=1",
            "checkpoint.save_final=false",
            f"run.root={tmp_path}",
            "+plugins=[allocator_probe:probe]",
            *overrides,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_ddp_run_without_wandb_imports_neither_deepspeed_nor_wandb_and_gets_glibc(tmp_path):
    seen = worker_sees(tmp_path, "launcher.allocator=glibc")
    assert seen == {"allocator": "glibc", "modules": []}


@pytest.mark.slow
def test_a_run_tracked_by_wandb_starts_its_workers_without_wandb(tmp_path):
    """W&B is imported on rank 0's init thread, beside the first steps, not by the worker server
    before every worker starts (1.3 s of CPU on the path to the first step)."""
    seen = worker_sees(tmp_path, "tracker=wandb", "tracker.mode=offline")
    assert seen["modules"] == []


@pytest.mark.slow
@pytest.mark.parametrize("allocator", ["jemalloc", "tcmalloc"])
def test_the_chosen_allocator_serves_the_workers(tmp_path, allocator):
    if host_memory.library_of(allocator) is None:
        pytest.skip(f"lib{host_memory.LIBRARIES[allocator]} is not installed here")
    seen = worker_sees(tmp_path, f"launcher.allocator={allocator}", "strategy=zero1")
    assert seen == {"allocator": allocator, "modules": ["deepspeed", MUON], "ops_probed": True}


@pytest.mark.slow
def test_a_zero_run_of_a_hf_model_starts_its_workers_with_what_each_would_build(tmp_path):
    """The worker server does once, before it forks, what every worker would do before its
    first step: DeepSpeed's engine imports its Muon optimizer (whose ``torch.compile``
    decorators import torch's inductor: 1.8 s of CPU per worker here), ``deepspeed.comm``
    probes which ops this machine can build (a compiled and linked test program), and a
    ``model=hf``
    worker imports ``transformers``' model classes (3.3 s) and builds its table of checkpoint
    renames (0.8 s)."""
    from hf_models import family_config

    model = tmp_path / "llama"
    family_config("llama").save_pretrained(model)
    seen = worker_sees(
        tmp_path, "strategy=zero1", "model=hf", f"model.path={model}", "model.pretrained=false"
    )
    assert seen["modules"] == ["deepspeed", MUON, "transformers", "transformers.modeling_utils"]
    assert seen["renames"] is True
    assert seen["ops_probed"] is True


def test_auto_takes_tcmalloc_else_jemalloc_else_glibc(monkeypatch):
    """tcmalloc first: on a GPT 8 x 768 jemalloc's steps took 1.11-1.46x glibc's, tcmalloc's
    0.90-0.99x, each rank's peak within 5% of jemalloc's (docs/benchmarks.md, "Host memory
    allocator")."""
    found = {"tcmalloc": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}
    monkeypatch.setattr(host_memory, "library_of", found.get)
    assert host_memory.resolve("auto") == "tcmalloc"
    assert host_memory.preload("auto") == "libtcmalloc_minimal.so.4"
    found["tcmalloc"] = None
    assert host_memory.resolve("auto") == "jemalloc"
    assert host_memory.preload("auto") == "libjemalloc.so.2"
    found["jemalloc"] = None
    assert host_memory.resolve("auto") == "glibc" and host_memory.preload("auto") is None
    assert host_memory.preload("glibc_mmap") is None


def test_an_allocator_that_is_not_installed_is_refused_with_its_package(monkeypatch):
    monkeypatch.setattr(host_memory, "library_of", lambda name: None)
    assert host_memory.allocator_problems("jemalloc") == [
        "launcher.allocator=jemalloc: libjemalloc is not installed on this machine: install it "
        "(Debian: apt-get install libjemalloc2), or set launcher.allocator=auto (the best one "
        "found) or glibc"
    ]
    assert host_memory.allocator_problems("auto") == []


def test_the_preload_goes_first_and_keeps_what_was_there():
    env = {"LD_PRELOAD": "libfoo.so", "X": "1"}
    assert host_memory.with_preload(env, "libjemalloc.so.2") == {
        "LD_PRELOAD": "libjemalloc.so.2 libfoo.so",
        "X": "1",
    }
    assert host_memory.with_preload(env, None) is env
