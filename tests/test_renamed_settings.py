"""Settings moved in hook spec 1.5 keep working under their old names for one minor version, with a
``FutureWarning`` naming the new one: on a command line, in a sweep, from Python. The checkpoint
plugin's settings moved from ``fault.*`` into its own group (``checkpoint.every`` beside
``checkpoint.hf_every``); the fault plugins declare what ``fault.*`` holds now."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from plait.renames import rename_overrides
from plait.testing import TEST_OVERRIDES, compose

RENAMED = {"fault.checkpoint_every": "checkpoint.every", "checkpoint=hf": "checkpoint=default"}


def test_an_old_name_warns_naming_the_new_one_and_still_sets_it():
    with pytest.warns(
        FutureWarning,
        match="fault.checkpoint_every is deprecated since hook spec 1.5.0 .*: use checkpoint.every",
    ) as warned:
        cfg = compose(["tracker=none", "fault.checkpoint_every=3", "fault.keep_last=5"])
    assert cfg.checkpoint.every == 3 and cfg.checkpoint.keep_last == 5
    assert "checkpoint_every" not in cfg.fault and "keep_last" not in cfg.fault
    assert any("use checkpoint.keep_last" in str(w.message) for w in warned)


def test_the_fault_and_checkpoint_groups_hold_their_own_plugins_settings():
    cfg = compose(
        ["tracker=none", "checkpoint.every=2", "checkpoint.hf_every=0", "fault.max_bad_steps=4"]
    )
    assert set(cfg.fault) == {
        "name",
        "max_bad_steps",
        "spike_factor",
        "straggler_factor",
        "straggler_window",
        "straggler_action",
        "collective_timeout_s",
    }
    assert {
        "every",
        "hf_every",
        "keep_last",
        "save_final",
        "async_save",
        "local_dir",
        "replicas",
    } <= set(cfg.checkpoint)


def test_sweep_and_hydra_override_forms_keep_their_values():
    with pytest.warns(FutureWarning):
        renamed = rename_overrides(
            [
                "fault.checkpoint_every=1,2",
                "+fault.checkpoint_every=3",
                "~fault.checkpoint_every",
                "checkpoint=hf",
                "fault.max_bad_steps=2",
            ],
            RENAMED,
        )
    assert renamed == [
        "checkpoint.every=1,2",
        "+checkpoint.every=3",
        "~checkpoint.every",
        "checkpoint=default",
        "fault.max_bad_steps=2",
    ]


def plait(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plait", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )


def test_a_command_line_with_the_old_name_prints_the_warning_and_runs_with_the_new():
    done = plait(
        "train", "--cfg", "job", "tracker=none", "fault.checkpoint_every=7", "checkpoint=hf"
    )
    assert done.returncode == 0, done.stderr
    assert "FutureWarning: fault.checkpoint_every is deprecated" in done.stderr
    assert "use checkpoint.every" in done.stderr
    assert "FutureWarning: checkpoint=hf is deprecated" in done.stderr
    checkpoint = done.stdout.split("\ncheckpoint:\n", 1)[1]
    assert "  name: default\n" in checkpoint and "  every: 7\n" in checkpoint


@pytest.mark.slow
def test_a_sweep_over_the_old_name_runs_each_job_with_its_value(tmp_path):
    """``plait train -m fault.checkpoint_every=1,2``: two real one-process jobs, each writing the
    checkpoints its value asks for."""
    done = plait(
        "train",
        "-m",
        *TEST_OVERRIDES,
        "train.steps=2",
        "launcher.nproc_per_node=1",
        f"run.root={tmp_path}",
        "run.name=sweep",
        "checkpoint.keep_last=0",
        "checkpoint.save_final=false",
        "fault.checkpoint_every=1,2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("FutureWarning: fault.checkpoint_every is deprecated") == 1
    written = {
        job: sorted(p.name for p in (tmp_path / "sweep" / job / "checkpoints").glob("step_*"))
        for job in ("0", "1")
    }
    assert written == {"0": ["step_00000001", "step_00000002"], "1": ["step_00000002"]}
