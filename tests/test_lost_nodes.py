"""Ranks and nodes that hold a job up: a rank that stops entering collectives, a link cut between
two nodes, a straggling node excluded from an elastic job.

- One node, 2 ranks, ``fault.collective_timeout_s=T``: rank 1 stops before its third forward
  (alive, never arriving, ``stragglers.StopEntering``). The job fails within T + MARGIN of that
  moment, and rank 0 names rank 1 as the rank that did not arrive.
- Two "machines" (network namespaces on a bridge, as tests/test_elastic.py), one process each,
  the README's multi-node command plus ``fault.collective_timeout_s=T``: after step 4's
  checkpoint both nodes pause (``stragglers.PauseAfter``), node 1's port on the bridge is set
  down, and both go on into step 5. With ``launcher.nnodes=2`` both ``plait train`` processes end
  within T + MARGIN of the cut, each naming the other node as lost; with
  ``launcher.nnodes=1:2 launcher.max_restarts=1`` node 1 ends the same way and node 0's attempt
  ends within T + MARGIN, then it goes on alone from the step-4 checkpoint to the last step, the
  global batch kept (accumulation 2 at dp 1).
- ``fault.straggler_action=exclude`` in the same elastic job, node 1 computing twice as long as
  node 0 (``stragglers.SlowNode``): node 1 is named, leaves after the next checkpoint, and node 0
  finishes alone; every step's global batch (its input rows) and loss equal one process that
  accumulates the same 2 micro-batches per step, never interrupted. Its report shows the
  straggler, the restart and the membership change as markers.

MARGIN covers what follows the verdict: the verdict itself (three heartbeats), the worker's and
its agent's shutdown (about 10 s on a loaded 2-core host for a plain crash) and the test's
polling.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import inhouse
import pytest

from plait.plugins.report import report
from plait.testing import TEST_OVERRIDES, read_metrics, run_training

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import netns_cluster  # noqa: E402

T = 8.0  # fault.collective_timeout_s
MARGIN = 30.0
STEPS = 8
RUN = [
    *TEST_OVERRIDES,
    f"train.steps={STEPS}",
    f"optimizer.decay_steps={STEPS}",
    "precision=fp32",
    "checkpoint.every=2",
    "checkpoint.keep_last=0",
]
RDZV = "launcher.rdzv_conf={last_call_timeout:5,keep_alive_interval:2,keep_alive_max_attempt:3}"
TESTS = str(Path(__file__).parent)
needs_namespaces = pytest.mark.skipif(
    netns_cluster.can_make_namespaces() is not None, reason=f"{netns_cluster.can_make_namespaces()}"
)


@pytest.mark.slow
def test_a_rank_that_stops_entering_collectives_fails_the_job_naming_it(tmp_path):
    run_dir = tmp_path / "stuck"
    command = [
        sys.executable,
        "-m",
        "plait",
        "train",
        *RUN,
        f"run.root={tmp_path}",
        "run.name=stuck",
        f"fault.collective_timeout_s={T}",
        "+plugins=[stragglers:stop_rank1_at_step3]",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment())
    ended = time.time()
    stopped = float((run_dir / "stopped_at").read_text())
    assert done.returncode != 0
    assert ended - stopped < T + MARGIN, (ended - stopped, done.stderr[-3000:])
    assert re.search(
        r"plait: rank 0 \(node 0\): a collective failed at step 3, .*"
        rf"\(fault.collective_timeout_s={T:g}\): rank 1 \(node 0\) did not arrive: "
        r"it is alive at step 3",
        done.stderr,
    ), done.stderr[-3000:]
    assert "Timed out waiting 8000ms" in done.stderr  # gloo's own timeout, set to T


def environment() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": TESTS + ":" + os.environ.get("PYTHONPATH", "")}


class Job:
    """One plait job on a 2-node cluster, one process per node; each node's output in a log."""

    def __init__(self, cluster, tmp_path: Path, overrides: list[str], nnodes: str):
        self.cluster, self.logs, self.procs, self.ended = cluster, {}, {}, {}
        for node in cluster.nodes:
            self.logs[node.rank] = tmp_path / f"node{node.rank}.log"
            command = netns_cluster.train_command(cluster, node, 1, overrides, nnodes=nnodes)
            with open(self.logs[node.rank], "w") as log:
                self.procs[node.rank] = cluster.popen(
                    node,
                    command,
                    # the two "nodes" share this host's cores: one intra-op thread each, as a
                    # node's launcher gives a worker its own cores (2 each here would put 4
                    # threads on 2 cores, whose spinning blurs the CPU time the detector reads)
                    env={"PYTHONPATH": TESTS, "OMP_NUM_THREADS": "1"},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

    def wait_until(self, done, seconds: float) -> None:
        """Poll until ``done()``, noting when each node's process ends."""
        deadline = time.monotonic() + seconds
        while not done():
            for rank, proc in self.procs.items():
                if proc.poll() is not None and rank not in self.ended:
                    self.ended[rank] = time.time()
            assert time.monotonic() < deadline, self.tail()
            time.sleep(0.1)

    def first_line(self, rank: int, pattern: str) -> float | None:
        """When the node's log first showed a line matching ``pattern`` (the test's clock: the
        log is polled), or None."""
        text = self.logs[rank].read_text()
        return time.time() if re.search(pattern, text) else None

    def tail(self) -> str:
        return "\n".join(f"--- node {r}\n{p.read_text()[-3000:]}" for r, p in self.logs.items())


def cut_after_step_4(tmp_path: Path, nnodes: str, restarts: int) -> tuple[Job, float, dict]:
    """Run the job, cut node 1's link once both paused after step 4, and wait for both nodes'
    verdicts; returns the job, the time of the cut and when each verdict line appeared."""
    run_dir = tmp_path / "cut"
    overrides = [
        *RUN,
        RDZV,
        f"fault.collective_timeout_s={T}",
        f"launcher.max_restarts={restarts}",
        f"run.root={tmp_path}",
        "run.name=cut",
        "+plugins=[stragglers:pause_after_step_4]",
    ]
    verdicts = {
        0: r"plait: rank 0 \(node 0\): a collective failed at step 5.*node 1 was lost",
        1: r"plait: rank 1 \(node 1\): a collective failed at step 5.*node 0 was lost, or "
        r"the link to it: the rendezvous store at 10\.99\.0\.1",
    }
    seen = {}
    with netns_cluster.Cluster(2) as cluster:
        job = Job(cluster, tmp_path, overrides, nnodes)
        job.wait_until(lambda: all((run_dir / f"paused_node{n}").exists() for n in (0, 1)), 400)
        cluster.cut(cluster.nodes[1])
        cut = time.time()
        (run_dir / "go").write_text("")

        def verdicts_seen() -> bool:
            for rank, pattern in verdicts.items():
                if rank not in seen and (when := job.first_line(rank, pattern)):
                    seen[rank] = when
            return len(seen) == 2 and 1 in job.ended

        job.wait_until(verdicts_seen, T + MARGIN + 10)
        if nnodes == "2":
            job.wait_until(lambda: 0 in job.ended, T + MARGIN)
        else:
            job.wait_until(lambda: 0 in job.ended, 300)
    return job, cut, seen


@pytest.mark.slow
@needs_namespaces
def test_a_cut_link_ends_both_nodes_naming_the_lost_one(tmp_path):
    job, cut, seen = cut_after_step_4(tmp_path, nnodes="2", restarts=0)
    assert {rank: seen[rank] - cut < T + MARGIN for rank in (0, 1)} == {0: True, 1: True}, (
        {r: s - cut for r, s in seen.items()},
        job.tail(),
    )
    assert {rank: job.ended[rank] - cut < T + MARGIN for rank in (0, 1)} == {0: True, 1: True}
    assert job.procs[0].returncode == 1  # the worker's collective error ends node 0's job
    assert_left(job)


def assert_left(job: Job) -> None:
    """Node 1, cut off from the store on node 0, left the job: its agent stopped by SIGTERM, or,
    when that agent sat in a rendezvous store call over the dead link, killed."""
    node1 = job.logs[1].read_text()
    assert "plait: this node leaves the job: stopping its agent (SIGTERM)" in node1
    stopped = "plait: this node's agent was stopped by SIGTERM" in node1
    killed = "plait: the agent did not stop: killing it (SIGKILL)" in node1
    assert (job.procs[1].returncode, stopped or killed) in [(143, True), (-9, True)], job.tail()


@pytest.mark.slow
@needs_namespaces
def test_after_a_cut_link_the_surviving_node_goes_on_alone_from_the_checkpoint(tmp_path):
    job, cut, seen = cut_after_step_4(tmp_path, nnodes="1:2", restarts=1)
    assert {rank: seen[rank] - cut < T + MARGIN for rank in (0, 1)} == {0: True, 1: True}, (
        {r: s - cut for r, s in seen.items()},
        job.tail(),
    )
    assert job.ended[1] - cut < T + MARGIN
    assert_left(job)
    assert job.procs[0].returncode == 0, job.tail()
    metrics = read_metrics(tmp_path / "cut")
    assert [
        (m["step"], m["world_size"], m["grad_accum_steps"], m["restarts"]) for m in metrics
    ] == [(s, 2, 1, 0) for s in range(1, 5)] + [(s, 1, 2, 1) for s in range(5, STEPS + 1)]
    assert "plait: resumed from " in job.logs[0].read_text()
    assert "checkpoints/step_00000004 at step 4" in job.logs[0].read_text()


def global_batches(rows: Path, ranks: range, attempt: int) -> list[list[str]]:
    per_rank = [inhouse.recorded_steps(rows, r)[attempt] for r in ranks]
    return [sorted(sum(step, [])) for step in zip(*per_rank)]


@pytest.mark.alone
@pytest.mark.slow
@needs_namespaces
def test_exclude_takes_the_straggling_node_out_and_keeps_the_global_batch(tmp_path):
    steps = 12
    # micro-batches of 8 x 64 tokens through a GPT 256 wide (tests/test_report.py's slow run):
    # a step's compute long enough (~0.2 s) that the hooks' fixed costs are a small part of it;
    # on gpt_tiny a node computing every forward twice read 1.5-1.8 and, on a slow host, fell
    # below fault.straggler_factor=1.5 one logged step after it was named
    run = [
        *RUN,
        f"train.steps={steps}",
        f"optimizer.decay_steps={steps}",
        "train.batch_size=16",
        "train.seq_len=64",
        "model.n_embd=256",
        "model.n_layer=4",
    ]
    reference = tmp_path / "one_process"
    run_training(
        reference,
        [*run, "launcher.nproc_per_node=1", "train.grad_accum_steps=2"],
        [inhouse.RecordBatches(tmp_path / "rows_reference")],
    )
    want_rows = global_batches(tmp_path / "rows_reference", range(1), 0)
    want_losses = [m["loss"] for m in read_metrics(reference)]

    run_dir = tmp_path / "exclude"
    overrides = [
        *run,
        RDZV,
        "launcher.max_restarts=1",
        "fault.straggler_action=exclude",
        "fault.straggler_window=3",
        "tracker=none",
        f"run.root={tmp_path}",
        "run.name=exclude",
        "+plugins=[stragglers:slow_node1,inhouse:record_rows]",
    ]
    with netns_cluster.Cluster(2) as cluster:
        job = Job(cluster, tmp_path, overrides, "1:2")
        job.wait_until(lambda: len(job.ended) == 2, 400)
    assert job.procs[0].returncode == 0, job.tail()
    assert job.procs[1].returncode == 143, job.tail()
    node0, node1 = (job.logs[n].read_text() for n in (0, 1))
    excluded = re.search(
        r"plait: excluding node 1 \(fault.straggler_action=exclude\): rank 1 "
        r"computes ([0-9.]+)x the median of the others \(fault.straggler_factor"
        r"=1.5\); the group re-forms without it from checkpoint step_0*(\d+)",
        node0,
    )
    assert excluded, job.tail()
    assert float(excluded.group(1)) == pytest.approx(2.0, rel=0.25)
    at = int(excluded.group(2))
    assert "plait: this node leaves the job" in node1
    metrics = read_metrics(run_dir)
    assert [(m["step"], m["world_size"], m["grad_accum_steps"]) for m in metrics] == (
        [(s, 2, 1) for s in range(1, at + 1)] + [(s, 1, 2) for s in range(at + 1, steps + 1)]
    )
    assert [m.get("straggler/rank") for m in metrics[:at]][-1] == 1
    rows = run_dir / "rows"
    assert global_batches(rows, range(2), 0)[:at] == want_rows[:at]
    assert global_batches(rows, range(1), -1) == want_rows[at:]
    assert [m["loss"] for m in metrics] == pytest.approx(want_losses, rel=1e-5)
    # the report shows where the straggler was named, the restart and the membership change
    target, _ = report([str(run_dir)], str(tmp_path / "report.html"))
    events = re.findall(r"<tr><td>exclude</td><td>(\d+)</td><td>([\w ]+)</td>", target.read_text())
    kinds = {kind: int(step) for step, kind in events}
    assert kinds["restart"] == kinds["membership"] == at + 1
    assert kinds["straggler"] <= at
    assert json.loads(
        re.search(r'id="data-loss_by_step">(.*?)</script>', target.read_text()).group(1)
    )["markers"]["exclude"]
