"""Every benchmark in ``scripts/`` still runs: each is started as a user starts it, at tiny sizes
and one repetition, and must exit 0 and print its table. The figures of such a run mean nothing
(seconds of tiny models); what goes red is a benchmark that rots (an import that moved, an engine
attribute a script borrowed, a crash at exit). Benchmarks that need root (network namespaces) or
a GPU are skipped with the reason where those are absent.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from netns_cluster import can_make_namespaces  # noqa: E402

# script -> (arguments of a smoke run, lines its output must hold)
SMOKE = {
    "bench_allocator": (
        [
            "--layouts",
            "ddp",
            "--allocators",
            "glibc_mmap",
            "glibc",
            "--repeats",
            "1",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--n-layer",
            "1",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "4",
        ],
        ["| ddp | glibc_mmap |", "| ddp | glibc |"],
    ),
    "bench_checkpoint": (
        [
            "--layers",
            "1",
            "--embd",
            "32",
            "--heads",
            "2",
            "--vocab",
            "64",
            "--repeats",
            "1",
            "--dir",
            "{tmp}/not/made/yet",
        ],
        ["async save: blocks for", "reshard load (tp=1 -> tp=2)"],
    ),
    "bench_checkpoint_cgroup": (
        [
            "--layouts",
            "fsdp",
            "--nproc",
            "2",
            "--n-layer",
            "1",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--steps",
            "1",
            "--cap",
            "1.5",  # a smoke run: the tiny job's start-up varies more than 5%
        ],
        ["| fsdp |"],
    ),
    "bench_command": (
        ["--repeats", "1", "--steps", "1"],
        ["| plait |", "| before |", "before / plait: wall"],
    ),
    "bench_compose": (
        ["--rounds", "1", "--strategies", "ddp"],
        ["| 1 |", "hydra / plait over 2 configs"],
    ),
    "bench_comm": (
        [
            "--nproc-per-node",
            "1",
            "--sizes",
            "0.01",
            "--repeats",
            "1",
            "--chunks-kb",
            "4",
            "--chunk-repeats",
            "1",
            "--rates",
            "--no-steps",
        ],
        ["## all-reduce on 2 nodes x 1 processes", "| free | 0.01 | ring |"],
    ),
    "bench_data": (
        [
            "--mb",
            "0.05",
            "--vocab",
            "300",
            "--shard-tokens",
            "4096",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--tiny-steps",
            "3",
            "--gpt2-steps",
            "0",
        ],
        ["1. plait prepare", "tiny GPT     consumes", "GPT-2 small  not run", "warm cache"],
    ),
    "bench_prepare": (
        ["--mb", "0.3", "--vocab", "300", "--repeats", "1", "--rss-mb", "0.2"],
        ["| one large text file |", "| save_to_disk |", "4x / 1x: command"],
    ),
    "bench_cp": (
        [
            "--world",
            "2",
            "--budget-mb",
            "64",
            "--start-seq",
            "32",
            "--max-seq",
            "64",
            "--seq",
            "32",
            "--n-layer",
            "1",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--repeats",
            "1",
        ],
        ["  2 ring ", "  2 ulysses "],
    ),
    "bench_engine_ab": (
        [
            "--rows",
            "fsdp",
            "ep2",
            "--blocks",
            "2",
            "--block-steps",
            "2",
            "--warmup",
            "1",
            "--n-layer",
            "1",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "4",
        ],
        ["| fsdp |", "| ep2 |", "plain/plait: turns median"],
    ),
    "bench_eval": (
        [
            "--limit",
            "2",
            "--repeats",
            "1",
            "--steps",
            "2",
            "--seq-len",
            "32",
            "--micro-batch",
            "4",
            "--dir",
            "{tmp}/runs",
        ],
        [
            "| in training, dp=2 |",
            "| plait eval, one process |",
            "ratio one process / in training",
            "same accuracy in every repeat: True",
        ],
    ),
    "bench_gpu": (
        ["--steps", "3", "--warmup", "1", "--batch-size", "2", "--seq-len", "64"],
        ['"ratio_plait_over_plain"'],
    ),
    "bench_hf_load": (
        [
            "--hidden",
            "64",
            "--layers",
            "2",
            "--vocab",
            "512",
            "--mlp",
            "128",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--repeats",
            "1",
            "--nproc",
            "2",
            "--cases",
            "ddp",
        ],
        ["from_pretrained + DDP", "plait ddp"],
    ),
    "bench_layout_check": (
        ["--cases", "gemma2_tiny", "--repeats", "1"],
        ["gemma2_tiny", "medians of 1 repeat(s); load average"],
    ),
    "bench_launch": (
        ["--rows", "ddp", "--repeats", "1", "--launches", "1", "--steps", "1", "--modules"],
        ["| ddp |"],
    ),
    "bench_memory": (
        ["--only", "recompute", "--cases", "2", "--tiny", "--steps", "2", "--warmup", "1"],
        ["| ddp, recompute none |", "| ddp, recompute full |"],
    ),
    "bench_moe": (
        [
            "--world-size",
            "2",
            "--eps",
            "1,2",
            "--layers",
            "1",
            "--embd",
            "32",
            "--heads",
            "2",
            "--experts",
            "2",
            "--seq",
            "16",
            "--batch",
            "4",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--budget-mb",
            "1",
        ],
        [" ep   tokens/s", "most experts per layer"],
    ),
    "bench_overhead": (
        [
            "--nproc",
            "1",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--n-layer",
            "1",
            "--n-head",
            "2",
            "--n-embd",
            "32",
        ],
        ["plait ", "ratio "],
    ),
    "bench_parity": (
        [
            "--tiny",
            "--rows",
            "fsdp",
            "--repeats",
            "1",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--control",
            "--threads",
        ],
        [
            "| fsdp |",
            "speed plain/plait",
            "control plain/plain",
            "| fsdp | plait |",
            "| fsdp | plain |",
        ],
    ),
    "bench_pipeline": (
        [
            "--micro",
            "2",
            "--steps",
            "1",
            "--repeats",
            "1",
            "--width",
            "32",
            "--layers",
            "4",
            "--seq",
            "8",
            "--micro-batch",
            "1",
        ],
        ["### pp = 2 (median of 1 interleaved repetition(s))", "| 1f1b | 2 |", "| zbv | 2 |"],
    ),
    "bench_ps": (
        [
            "--strategies",
            "async_ps",
            "--no-stragglers",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--batch",
            "4",
            "--device-ms",
            "0",
        ],
        ["| async PS |"],
    ),
    "bench_save_peak": (
        ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--nproc", "2", "--steps", "2"],
        ["| rank | training peak GiB", "save / training", "step_00000002"],
    ),
    "bench_sharded": (
        [
            "--layers",
            "1",
            "--embd",
            "32",
            "--heads",
            "2",
            "--seq",
            "16",
            "--batch",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--reps",
            "1",
        ],
        ["| zero3 |", "| fsdp |"],
    ),
    "bench_straggler": (
        [
            "--nproc",
            "2",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--n-layer",
            "1",
            "--n-head",
            "2",
            "--n-embd",
            "32",
            "--log-every",
            "2",
        ],
        ['"overhead"'],
    ),
    "bench_torchft": (
        [
            "--nproc",
            "2",
            "--steps",
            "6",
            "--warmup",
            "1",
            "--kill-at",
            "4",
            "--checkpoint-every",
            "2",
            "--repeats",
            "1",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--n-layer",
            "1",
            "--n-head",
            "2",
            "--n-embd",
            "32",
            "--log-every",
            "2",
            "--heartbeat-ms",
            "1000",
        ],
        ["| torchft |", "| checkpoint_every_2 |", "steady state, nobody failing"],
    ),
    "bench_tp": (
        [
            "--layers",
            "1",
            "--embd",
            "32",
            "--heads",
            "2",
            "--vocab",
            "64",
            "--seq",
            "8",
            "--batch",
            "2",
            "--steps",
            "1",
            "--repeats",
            "1",
        ],
        ["tp=2 + sequence parallel", "step ms: median of 1 run(s)"],
    ),
    "bench_zero": (
        [
            "--stages",
            "3",
            "--reps",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--n-layer",
            "1",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "4",
            "--grad-accum",
            "1",
        ],
        [" zero3 "],
    ),
}


def skip_reason(script: str) -> str | None:
    if script == "bench_checkpoint_cgroup" and os.geteuid() != 0:
        return "bench_checkpoint_cgroup makes memory cgroups: needs root"
    if script == "bench_comm":
        reason = can_make_namespaces()
        return f"bench_comm runs its nodes in network namespaces: {reason}" if reason else None
    return None


def test_every_benchmark_has_a_smoke_run():
    assert sorted(SMOKE) == sorted(p.stem for p in (ROOT / "scripts").glob("bench_*.py"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [pytest.param(s, marks=pytest.mark.cuda) if s == "bench_gpu" else s for s in sorted(SMOKE)],
)
def test_the_benchmark_runs_at_tiny_sizes(script, tmp_path):
    reason = skip_reason(script)
    if reason:
        pytest.skip(reason)
    args, expected = SMOKE[script]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / f"{script}.py"),
            *(a.format(tmp=tmp_path) for a in args),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for line in expected:
        assert line in done.stdout, f"{line!r} not in:\n{done.stdout[-4000:]}"
    assert "Traceback" not in output and "terminate called" not in output, output[-4000:]
    if script == "bench_checkpoint":  # --dir D is made when missing
        assert (tmp_path / "not" / "made" / "yet").is_dir()
