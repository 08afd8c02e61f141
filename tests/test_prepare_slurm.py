"""``plait prepare launcher=slurm``: job arrays through submitit on the real SLURM controller and
node daemon that the ``slurm`` fixture (tests/slurm_cluster.py) starts on localhost (skipped, saying why,
where slurm-wlm and munge are absent). Each array task runs one worker process here (2 cores);
the corpus is ~3 MB of the standard library, a BPE of 512 ids given as a file."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import final_state
from test_shards import copy_corpus, files_of, prepare_into

from plait.plugins.data.tokenizer import train_bpe

pytestmark = pytest.mark.slow

SETTINGS = ["data.shard_tokens=16384", "data.task_mb=0.25", "data.num_workers=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("slurm-corpus")
    text = copy_corpus(root / "text", 3_000_000)
    tokenizer = root / "tokenizer.json"
    tokenizer.write_text(train_bpe((p.read_bytes() for p in sorted(text.iterdir())), 512).json)
    return text, tokenizer


@pytest.fixture(scope="module")
def one_worker(corpus, tmp_path_factory) -> Path:
    """The reference: 1 worker in this process, tasks of 1 MiB."""
    text, tokenizer = corpus
    return prepare_into(
        tmp_path_factory.mktemp("one") / "out",
        text,
        tokenizer=str(tokenizer),
        shard_tokens=16384,
        num_workers=1,
    )


def command(corpus, out: Path, *overrides: str) -> list[str]:
    text, tokenizer = corpus
    return [
        sys.executable,
        "-m",
        "plait",
        "prepare",
        f"data.path={text}",
        f"out={out}",
        f"data.tokenizer={tokenizer}",
        *SETTINGS,
        "launcher=slurm",
        "launcher.time=10",
        *overrides,
    ]


def test_a_job_array_of_2_tasks_writes_the_shards_of_one_worker(
    slurm, corpus, one_worker, tmp_path
):
    out = tmp_path / "out"
    done = subprocess.run(
        command(corpus, out, "launcher.tasks=2"),
        env=slurm,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    arrays = re.findall(
        r"(tokenize|shards): job array \d+, (\d+) task\(s\), (\d+) unit", done.stdout
    )
    assert [(phase, tasks) for phase, tasks, _ in arrays] == [("tokenize", "2"), ("shards", "2")]
    assert int(arrays[0][2]) >= 10
    assert files_of(out) == files_of(one_worker)


def task_processes(job: str, task: str) -> list[int]:
    """The Python processes SLURM runs for array task ``job_task`` (submitit's entry point),
    found by the array variables in their environment."""
    found = []
    for proc in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if (
            b"submitit" in cmdline
            and f"SLURM_ARRAY_JOB_ID={job}".encode() in environ
            and f"SLURM_ARRAY_TASK_ID={task}".encode() in environ
        ):
            found.append(int(proc.name))
    return found


def array_tasks(env, name: str) -> list[str]:
    shown = subprocess.run(
        ["squeue", "-h", "-o", "%i %j %T"], env=env, capture_output=True, text=True
    ).stdout.split("\n")
    return [line.split()[0] for line in shown if name in line and "RUNNING" in line]


def test_an_array_task_killed_midway_is_run_again_and_the_shards_are_the_same(
    slurm, corpus, one_worker, tmp_path
):
    """Array task 1's worker is SIGKILLed once it has tokenized its first task
    (task 1; array task i takes tasks i, i+2, ...) and before its last. The prepare submits
    the unfinished tasks again, only those, and ends with the 1-worker run's files."""
    out = tmp_path / "out"
    driver = subprocess.Popen(
        command(corpus, out, "launcher.tasks=2"),
        env=slurm,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        marker = out / "work" / "task_000001.done"
        deadline = time.time() + 300
        while not marker.exists():
            assert driver.poll() is None and time.time() < deadline, "no task finished"
            time.sleep(0.02)
        killed = [t for t in array_tasks(slurm, "plait-prepare-tokenize") if t.endswith("_1")]
        assert killed, "array task 1 ended before it could be killed"
        pids = task_processes(*killed[0].split("_"))
        assert pids, f"no process of array task {killed[0]} found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        finished = {int(p.name[5:11]) for p in (out / "work").glob("task_*.done")}
        n_tasks = len(json.loads((out / "work" / "plan.json").read_text())["tasks"])
        assert not set(range(1, n_tasks, 2)) <= finished, "array task 1 was done"
        stdout, stderr = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert final_state(slurm, killed[0]) in ("CANCELLED", "FAILED"), stdout
    said = f"tokenize: 1 array task\\(s\\) did not finish \\(array task {killed[0]} .*\\); "
    assert re.search(said + r"\d+ unit\(s\) left, submitting them again", stdout), stdout
    retried = re.findall(r"tokenize: job array \d+, \d+ task\(s\), (\d+) unit", stdout)
    assert len(retried) == 2 and 0 < int(retried[1]) <= n_tasks - len(finished)
    assert files_of(out) == files_of(one_worker)
