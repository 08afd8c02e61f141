"""Gradient communication between real "nodes": 2 Linux network namespaces x 2 processes, each
node its own address on a bridge, started by scripts/netns_cluster.py exactly as a user runs it
(``plait train`` per node, c10d rendezvous across the addresses). Bytes between nodes are read
from the veth counters of node 0's link, never computed.

The jobs, each shared by every claim it can prove: 1 process (the reference); 2 x 2 runs of
ddp under flat, ring and hierarchical (parity over 20 steps and cross-node bytes); pp=2 x dp=2
under ring and hierarchical (parity over 8 steps; hierarchical falls back to flat there);
fp16 / bf16 / PowerSGD (tolerance and learning; fp16 also halves the bytes); one cluster of
bench_comm's collectives (steps on the link); a failing and an interrupted job (clean-up, which
every other job checks on success).

Tolerances: fp32 losses and grad norms equal 1 process to rel 1e-5 (the runs differ only in the
order gradients are summed); fp16 / bf16 / PowerSGD within 2% / 3% / 5% of fp32 over 50 steps.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.testing import TEST_OVERRIDES, link_bytes_per_step, read_metrics, run_training

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_comm  # noqa: E402
import netns_cluster  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        netns_cluster.can_make_namespaces() is not None,
        reason=f"{netns_cluster.can_make_namespaces()}",
    ),
]

STEPS = 50  # the compressed runs; the fp32 runs stop at PARITY_STEPS of the same schedule
PARITY_STEPS = 20
# Pipeline steps cost ~3x a DDP step here; a wrong dp reduction or stage boundary shows in the
# first step's grad norm, the optimizer state from the second step on, and 8 steps span the
# warm-up (5) and the start of the decay.
PIPELINE_PARITY_STEPS = 8
# The global batch of 8 is 4 micro-batches of 2 sequences: 1 process accumulates them, 4 ranks
# take one each (pipeline: 2 dp ranks x 2 pipeline micro-batches), so each micro-batch runs the
# same kernels everywhere and only the summation order of gradients differs.
COMMON = [
    *TEST_OVERRIDES,
    "train.batch_size=8",
    "optimizer.decay_steps=50",
    "optimizer.warmup_steps=5",
    "train.grad_clip=1.0",
]
NODES = [*COMMON, "+plugins=[plait.testing:link_counter]"]
REL = 1e-5
SKIP = 2  # steps before the per-step link bytes are counted (DDP rebuilds its buckets)


def theory(nodes: int, local: int) -> float:
    return (nodes - 1) * local / (nodes * local - 1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("one") / "r"
    run_training(
        run,
        [*COMMON, f"train.steps={STEPS}", "launcher.nproc_per_node=1", "train.grad_accum_steps=4"],
    )
    return read_metrics(run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Memoised 2 x 2 runs through the script: ``runs(name, *overrides)`` -> (metrics, output,
    run dir)."""
    root, done = tmp_path_factory.mktemp("nodes"), {}

    def run(name: str, *overrides: str):
        if name not in done:
            out = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts/netns_cluster.py"),
                    "--nodes",
                    "2",
                    "--nproc-per-node",
                    "2",
                    "--",
                    *NODES,
                    *overrides,
                    f"run.root={root}",
                    f"run.name={name}",
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
            assert left_behind(out.stderr) == set()  # cleaned up on success
            done[name] = (read_metrics(root / name), out.stdout + out.stderr, root / name)
        return done[name]

    return run


def assert_matches(metrics, reference, rel):
    assert [m["loss"] for m in metrics] == pytest.approx(
        [m["loss"] for m in reference[: len(metrics)]], rel=rel
    )
    assert [m["grad_norm"] for m in metrics] == pytest.approx(
        [m["grad_norm"] for m in reference[: len(metrics)]], rel=rel
    )


@pytest.mark.parametrize(
    "layout, algorithm",
    [
        ("ddp", "flat"),
        ("ddp", "ring"),
        ("ddp", "hierarchical"),
        ("pp2xdp2", "ring"),
        # Stages are split across the nodes, so each dp group lies on one node and hierarchical falls
        # back to flat (the same reducer `comm=flat` selects): this one run is flat under pp too.
        ("pp2xdp2", "hierarchical"),
    ],
)
def test_two_nodes_match_one_process(runs, reference, layout, algorithm):
    pipeline = ["parallel.pp=2", "pipeline.microbatches=2"] if layout == "pp2xdp2" else []
    steps = PIPELINE_PARITY_STEPS if pipeline else PARITY_STEPS
    metrics, output, _ = runs(
        f"{layout}-{algorithm}", f"comm={algorithm}", f"train.steps={steps}", *pipeline
    )
    assert len(metrics) == steps
    assert_matches(metrics, reference, REL)
    if layout == "pp2xdp2" and algorithm == "hierarchical":
        assert (
            "comm=hierarchical: data-parallel group [0, 1] lies on one node; falling back "
            "to flat all-reduce" in output
        )


def test_hierarchical_moves_less_across_nodes_than_ring(runs):
    measured = {
        a: link_bytes_per_step(
            runs(f"ddp-{a}", f"comm={a}", f"train.steps={PARITY_STEPS}")[2], SKIP
        )
        for a in ("flat", "ring", "hierarchical")
    }
    ratio = measured["hierarchical"] / measured["ring"]
    print(
        f"\ncross-node bytes per step: {measured}; hierarchical / ring = {ratio:.3f} "
        f"(theory (n-1)L/(nL-1) = {theory(2, 2):.3f}); flat (gloo) / ring = "
        f"{measured['flat'] / measured['ring']:.3f}"
    )
    assert ratio == pytest.approx(theory(2, 2), rel=0.05)  # headers, loss and metric reductions
    assert ratio < 0.75


@pytest.mark.parametrize(
    "compression,algorithm,rel",
    [("fp16", "hierarchical", 0.02), ("bf16", "flat", 0.03), ("powersgd", "ring", 0.05)],
)
def test_compression_stays_close_and_learns(runs, reference, compression, algorithm, rel):
    metrics, _, run_dir = runs(
        f"{compression}-{algorithm}",
        f"comm={algorithm}",
        f"comm.compression={compression}",
        f"train.steps={STEPS}",
    )
    losses = [m["loss"] for m in metrics]
    assert losses == pytest.approx([m["loss"] for m in reference], rel=rel)
    assert losses != [m["loss"] for m in reference]  # the compression really ran
    assert sum(losses[-5:]) < sum(losses[:5]) - 5 * 0.5  # and the loss still falls
    if compression == "fp16":
        fp32 = link_bytes_per_step(
            runs("ddp-hierarchical", "comm=hierarchical", f"train.steps={PARITY_STEPS}")[2], SKIP
        )
        half = link_bytes_per_step(run_dir, SKIP) / fp32
        print(f"\nfp16 / fp32 cross-node bytes per step (hierarchical): {half:.3f}")
        assert half == pytest.approx(0.5, abs=0.03)


def test_hierarchical_takes_fewer_steps_on_the_slow_link():
    """Per all-reduce, each inter-node connection carries 2(nL-1) = 6 chunks under ring and
    2(n-1) = 2 under hierarchical (bytes each connection sent, from the kernel, over one chunk
    S/(nL) of a small buffer)."""
    args = bench_comm.parse_args(
        ["--sizes", "0.25", "--repeats", "1", "--chunks-kb", "64", "--chunk-repeats", "10"]
    )
    results = bench_comm.collectives(args, rate=None)
    chunks = {
        r["algorithm"]: sorted(r["chunks"].values()) for r in results if r["table"] == "chunks"
    }
    print(f"\nchunks per inter-node connection and direction: {chunks}")
    assert chunks["ring"] == pytest.approx([6, 6], rel=0.03)
    assert chunks["hierarchical"] == pytest.approx([2, 2, 2, 2], rel=0.03)
    sizes = {r["algorithm"]: r["cross_bytes"] for r in results if r["table"] == "sizes"}
    assert sizes["hierarchical"] / sizes["ring"] == pytest.approx(theory(2, 2), rel=0.02)
    assert sizes["hierarchical+fp16"] / sizes["hierarchical"] == pytest.approx(0.5, rel=0.02)


def left_behind(output: str) -> set[str]:
    """The namespaces of the cluster the script reported in ``output`` that still exist (only
    this cluster's: other clusters may come and go on a shared machine meanwhile)."""
    tag = re.search(r"netns_cluster: namespaces (plait-[0-9a-f]+)-n0 ", output)[1]
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(tag + "-")}


def test_the_script_cleans_up_after_a_failure_and_after_ctrl_c(tmp_path):
    failed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/netns_cluster.py"),
            "--",
            *COMMON,
            "train.steps=2",
            f"run.root={tmp_path}",
            "run.name=f",
            "+plugins=[plait.testing:no_such_plugin]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode != 0 and "no_such_plugin" in failed.stderr + failed.stdout
    assert json.loads(failed.stdout.strip().splitlines()[-1])["exit_codes"][0] not in (0, None)
    assert left_behind(failed.stderr) == set()
    job = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "scripts/netns_cluster.py"),
            "--",
            *COMMON,
            "train.steps=100000",
            f"run.root={tmp_path}",
            "run.name=c",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    made = next(line for line in job.stdout if line.startswith("netns_cluster: namespaces"))
    deadline = time.monotonic() + 120
    while not (tmp_path / "c" / "config.yaml").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(left_behind(made)) == 3, "the cluster should be up while training"
    job.send_signal(signal.SIGINT)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 130, output[-3000:]
    assert "interrupted; namespaces and processes removed" in output
    assert left_behind(made) == set()
    leftover = subprocess.run(["pgrep", "-f", f"run.root={tmp_path}"], capture_output=True)
    assert leftover.returncode == 1, "a worker outlived the script"
