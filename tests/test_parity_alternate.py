"""``bench_parity.py --alternate``: the sides of a row take turns on the cores, each frozen as a
whole while another runs, and each side's step time is read per turn (scripts/parity_alternate.py).
A frozen job must make no progress at all, a step that spans a freeze or begins a turn must not be
timed, and a ratio must be taken against the other side's neighbouring turns."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from parity_alternate import (  # noqa: E402
    Freezer,
    freezer_problem,
    neighbour_ratios,
    turn_steps,
)


def test_a_turn_times_only_the_steps_it_holds_whole():
    # steps of 0.1 s from t=0, then frozen from 1.05 to 3.05, then steps of 0.2 s
    ends = [0.1 * i for i in range(1, 11)] + [3.05 + 0.2 * i for i in range(1, 6)]
    turns = [(0.0, 1.05), (3.05, 4.1)]
    steps = turn_steps(ends, turns, warmup=2, values=ends)
    assert steps[0] == (0.0, pytest.approx(0.1))
    # the gap across the freeze (3.25 - 1.0) and the turn's first step are not timed
    assert steps[1] == (3.05, pytest.approx(0.2))
    # a turn with fewer than 3 timed steps has no figure
    assert turn_steps(ends, [(3.05, 3.7)], warmup=0, values=ends) == [(3.05, None)]
    # the warm-up steps are left out, and another clock's values are read at the same steps:
    # CPU seconds of 0.65, 0.75, 0.85 and 0.95 for the steps ending at indices 6..9
    cpu = [0.05 * (i + 1) ** 2 for i in range(15)]
    assert turn_steps(ends, turns[:1], warmup=5, values=cpu)[0][1] == pytest.approx(0.8)


def test_a_ratio_is_taken_against_the_other_sides_neighbouring_turns():
    # the host slows down steadily: the plain side's turns before and after each of plait's
    plain = [(0.0, 1.0), (10.0, 1.2), (20.0, 1.4), (30.0, None)]
    plait = [(5.0, 1.1), (15.0, 1.3), (25.0, 1.4)]
    assert neighbour_ratios(plain, plait) == pytest.approx([1.0, 1.0, 1.0])
    assert neighbour_ratios(plain, [(40.0, 0.7), (50.0, None)]) == pytest.approx([2.0])


@pytest.mark.skipif(freezer_problem() is not None, reason=str(freezer_problem()))
def test_a_frozen_job_makes_no_progress_until_it_is_thawed(tmp_path):
    counter = tmp_path / "count"
    # the count is replaced whole (written beside it, then renamed): a file rewritten in place
    # reads empty between its truncation and its write (seen once in the suite)
    script = (
        "import os, sys, time\n"
        "n = 0\n"
        "while True:\n"
        "    n += 1\n"
        "    open(sys.argv[1] + '.new', 'w').write(str(n))\n"
        "    os.replace(sys.argv[1] + '.new', sys.argv[1])\n"
        "    time.sleep(0.01)\n"
    )
    freezer = Freezer(None, f"test-{os.getpid()}")
    process = subprocess.Popen(
        ["sh", "-c", f'echo $$ > {freezer.procs} && exec "$@"', "sh"]
        + [sys.executable, "-c", script, str(counter)]
    )
    try:
        while not counter.exists() or not counter.read_text():
            time.sleep(0.01)
        freezer.set(True)
        frozen_at = counter.read_text()
        time.sleep(0.5)
        assert counter.read_text() == frozen_at
        freezer.set(False)
        time.sleep(0.3)
        assert int(counter.read_text()) > int(frozen_at)
    finally:
        process.kill()  # a frozen process takes SIGKILL when thawed, which close() does
        freezer.close()
        process.wait()
    assert not freezer.group.exists()


@pytest.mark.skipif(freezer_problem() is not None, reason=str(freezer_problem()))
def test_bench_parity_alternate_prints_its_table():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_parity.py"),
            "--tiny",
            "--rows",
            "ddp",
            "--repeats",
            "1",
            "--steps",
            "120",
            "--alternate",
            "1.5",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| row | turns timed plait / plain |" in result.stdout
    assert "| ddp |" in result.stdout
