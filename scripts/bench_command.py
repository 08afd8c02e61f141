"""What one ``plait train`` command costs from start to exit: the command as installed, whose worker
server is a fork of itself (``plait.command``), against the same command without that step
(``plait.cli.run``, what the console script ran before: its server a new interpreter).

    python scripts/bench_command.py                      # 5 pairs, 2 processes, 2 steps
    python scripts/bench_command.py --repeats 1 --steps 1

Each pair runs the two alternately, a tiny GPT on the CPU (``tracker=none``), and reads each
command's output to its end (as a caller does: the server holds it until it exits). Prints per
side the median wall seconds and CPU seconds (the whole machine's busy time over the command,
from ``/proc/stat``: the command, its server and workers; so measure alone), and their ratios,
with the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIDES = {
    "plait": [sys.executable, "-m", "plait", "train"],
    "before": [sys.executable, "-c", "from plait.cli import run; run()", "train"],
}


def busy_seconds() -> float:
    """CPU seconds the machine has spent busy since boot (every process's)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run(side: str, args, root: str, name: str) -> tuple[float, float]:
    command = [
        *SIDES[side],
        "model=gpt_tiny",
        "tracker=none",
        "device=cpu",
        f"train.steps={args.steps}",
        f"launcher.nproc_per_node={args.nproc}",
        f"run.root={root}",
        f"run.name={name}",
    ]
    busy, start = busy_seconds(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, busy_seconds() - busy
    if done.returncode != 0:
        sys.exit(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, cpu


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="pairs of commands")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    before_load = load()
    seen: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))
            for side in order:
                seen[side].append(run(side, args, root, f"{side}{repeat}"))
    wall = {side: statistics.median(w for w, _ in runs) for side, runs in seen.items()}
    cpu = {side: statistics.median(c for _, c in runs) for side, runs in seen.items()}
    print(
        f"`plait train` of a tiny GPT, {args.nproc} process(es), {args.steps} step(s), on the CPU; "
        f"medians of {args.repeats} alternate pair(s); load {before_load} before, {load()} after"
    )
    print()
    print("| side | wall s | CPU s (machine) |")
    print("| --- | ---: | ---: |")
    for side in SIDES:
        print(f"| {side} | {wall[side]:.2f} | {cpu[side]:.2f} |")
    print()
    print(
        f"before / plait: wall {wall['before'] / wall['plait']:.2f}, "
        f"CPU {cpu['before'] / cpu['plait']:.2f}"
    )


if __name__ == "__main__":
    main()
