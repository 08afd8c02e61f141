"""``plait new-plugin``: the generated packages install, load, train, and pass their own tests.

Installed with ``pip install --target`` on a temporary path (the venv stays untouched) and used
through ``PYTHONPATH``, as a user's ``pip install`` would be through site-packages."""

import json
import os
import subprocess
import sys

import pytest


def run(cwd, env, *args, timeout=300):
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaffold")
    env = {
        **os.environ,
        "PYTHONPATH": f"{root / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    for name, kind in (("demo", "observer"), ("demo_comm", "comm")):
        done = run(root, env, "-m", "plait", "new-plugin", name, "--kind", kind)
        assert done.returncode == 0, done.stderr
    installed = run(
        root,
        env,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(root / "site"),
        "./plait-demo",
        "./plait-demo-comm",
    )
    assert installed.returncode == 0, installed.stderr
    return root, env


def test_generated_plugins_appear_in_plait_plugins(generated):
    root, env = generated
    done = run(root, env, "-m", "plait", "plugins", "--check")
    assert done.returncode == 0, done.stderr
    assert "demo  [entry point (plait-demo 0.1.0)]  selected by: always" in done.stdout
    assert (
        "demo_comm  [entry point (plait-demo-comm 0.1.0)]  selected by: comm.name=demo_comm"
        in done.stdout
    )


@pytest.mark.slow
def test_generated_plugins_run_in_plait_train(generated):
    root, env = generated
    done = run(
        root,
        {**env, "PLAIT_DEMO_OUT": str(root / "seen.jsonl")},
        "-m",
        "plait",
        "train",
        "model=gpt_tiny",
        "tracker=none",
        "train.steps=2",
        "train.batch_size=8",
        "train.seq_len=32",
        "device=cpu",
        "comm.name=demo_comm",
        f"run.root={root / 'runs'}",
        "run.name=cli",
    )
    assert done.returncode == 0, done.stderr
    plan = run(root, env, "-m", "plait", "plan", "comm.name=demo_comm").stdout
    assert "plait_grad_reducer           demo_comm" in plan
    seen = [json.loads(line) for line in (root / "seen.jsonl").open()]
    assert [s["step"] for s in seen] == [1, 2]


@pytest.mark.slow
def test_generated_tests_pass_as_generated(generated):
    root, env = generated
    done = run(
        root,
        env,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "plait-demo/tests",
        "plait-demo-comm/tests",
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "4 passed" in done.stdout


@pytest.mark.slow
def test_model_data_and_strategy_kinds_install_and_pass_their_generated_tests(tmp_path):
    """The other three kinds: ``model=demo_model`` (a TinyLM trains on 2 processes), ``data=
    demo_data`` (a counting stream is learnt), ``strategy=demo_strategy`` (a per-parameter
    all-reduce engine equals one process, rel 1e-5)."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    kinds = ("model", "data", "strategy")
    for kind in kinds:
        done = run(tmp_path, env, "-m", "plait", "new-plugin", f"demo_{kind}", "--kind", kind)
        assert done.returncode == 0, done.stderr
    installed = run(
        tmp_path,
        env,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(tmp_path / "site"),
        *(f"./plait-demo-{kind}" for kind in kinds),
    )
    assert installed.returncode == 0, installed.stderr
    listed = run(tmp_path, env, "-m", "plait", "plugins", "--check")
    assert listed.returncode == 0, listed.stderr
    for selector in (
        "model._target_=plait_demo_model.TinyLM",
        "data.name=demo_data",
        "strategy.name=demo_strategy",
    ):
        assert f"selected by: {selector}" in listed.stdout
    done = run(
        tmp_path,
        env,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *(f"plait-demo-{kind}/tests" for kind in kinds),
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "4 passed" in done.stdout
