"""What one failure costs under ``fault=torchft`` against a restart from the last checkpoint, and
what ``fault=torchft`` costs per step while nobody fails.

    python scripts/bench_torchft.py                     # 2 processes on CPU/gloo: 2 replica groups
    python scripts/bench_torchft.py --steps 60 --kill-at 28 --checkpoint-every 5 20 --repeats 3
    python scripts/bench_torchft.py --parts overhead --repeats 5   # the steady state alone

Every run is the same job: ``strategy=ddp`` on ``--nproc`` processes, a GPT of ``--n-layer`` x
``--n-embd``, ``--steps`` steps; under ``fault=torchft`` each dp rank is a replica group (a torch
job of its own, restarted by its own agent). Per repetition, alternating:

- overhead: plain DDP (``fault=checkpoint``, no checkpoint) and ``fault=torchft``, nobody failing
  (its groups start together: ``plait.testing.GroupsStartTogether``): steps/s of rank 0 between
  the end of step ``--warmup`` and the last step;
- one failure: the last rank (of the last replica group under torchft) SIGKILLed as its step
  ``--kill-at`` starts (``plait.testing.KillRank``), with ``launcher.max_restarts=1``:
  ``fault=torchft`` (the others go on, the group rejoins from a peer), and plain DDP with
  ``checkpoint.every=N`` for each N of ``--checkpoint-every`` (every process restarts from the
  last checkpoint); each against the same run without the kill.

Lost per failure, from rank 0's log of every step it attempted (``plait.testing.StepLog``; under
torchft rank 0 of replica group 0, a survivor): ``steps_lost`` = steps attempted - steps of the
run (steps done again after a restart from a checkpoint, or not taken: torchft's step whose
collective failed), ``wall_s_lost`` = (end of the last step - end of the first step) of the run
with the kill - the same of the run without it. torchft's own timings are ``fault.*``'s
(``--heartbeat-ms``: how long the lighthouse waits for a silent group).

Prints one JSON object (every run's figures and the medians) and a markdown table:
``overhead = median(plain) / median(torchft) - 1`` (target <= 0.03 on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from plait.api import train
from plait.testing import GroupsStartTogether, KillRank, StepLog


@contextmanager
def output_into(path: Path) -> Iterator[None]:
    """This process's and its workers' standard output and error into ``path`` (a killed run's
    tracebacks are torch elastic's report of the kill); its tail is shown if the run fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    except BaseException:
        restore(saved)
        print(path.read_text()[-4000:], file=sys.stderr)
        raise
    restore(saved)


def restore(saved: list[int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in zip(saved, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)


def run(args, root: Path, name: str, extra: list[str], kill: bool, torchft: bool) -> dict:
    """One run; its steps attempted by rank 0 and the seconds from its first step's end to its
    last's, and its steps/s after the warm-up."""
    log = root / f"{name}.steps"
    plugins: list = [StepLog(str(log))]
    if torchft:
        plugins.append(GroupsStartTogether(args.nproc))
    if kill:  # the last process: under torchft the one of the last replica group
        where = (0, args.nproc - 1) if torchft else (args.nproc - 1, 0)
        plugins.append(KillRank(args.kill_at, *where))
    with output_into(root / f"{name}.log"):
        train(
            [
                f"launcher.nproc_per_node={args.nproc}",
                "tracker=none",
                "model=gpt_tiny",
                f"train.steps={args.steps}",
                f"optimizer.decay_steps={args.steps}",
                f"train.batch_size={args.batch_size}",
                f"train.seq_len={args.seq_len}",
                f"model.n_layer={args.n_layer}",
                f"model.n_embd={args.n_embd}",
                f"model.n_head={args.n_head}",
                f"model.block_size={args.seq_len}",
                f"train.log_every={args.log_every}",
                "checkpoint.save_final=false",
                "launcher.max_restarts=1",
                f"run.root={root}",
                f"run.name={name}",
                *extra,
            ],
            plugins=plugins,
        )
    stamps = [json.loads(line) for line in log.read_text().splitlines()]
    ends = [s["t"] for s in stamps]
    timed = ends[args.warmup :]
    return {
        "attempted": len(stamps),
        "taken": sum(s["taken"] for s in stamps),
        "wall_s": ends[-1] - ends[0],
        "steps_per_s": (len(timed) - 1) / (timed[-1] - timed[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=28)
    parser.add_argument("--checkpoint-every", type=int, nargs="+", default=[5, 20])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--heartbeat-ms", type=int, default=5000)
    parser.add_argument(
        "--parts", nargs="+", choices=("overhead", "failure"), default=["overhead", "failure"]
    )
    args = parser.parse_args()
    ft = ["fault=torchft", f"fault.heartbeat_timeout_ms={args.heartbeat_ms}"]
    kinds = {
        "torchft": ft,
        **{f"checkpoint_every_{n}": [f"checkpoint.every={n}"] for n in args.checkpoint_every},
    }
    figures: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(args.repeats):
            if "overhead" in args.parts:
                figures.setdefault("plain", []).append(
                    run(args, root, f"plain{i}", [], False, False)
                )
                figures.setdefault("torchft", []).append(run(args, root, f"ft{i}", ft, False, True))
            for kind, extra in kinds.items() if "failure" in args.parts else ():
                torchft = kind == "torchft"
                whole = run(args, root, f"{kind}_whole{i}", extra, False, torchft)
                killed = run(args, root, f"{kind}_killed{i}", extra, True, torchft)
                figures.setdefault(f"failure_{kind}", []).append(
                    {
                        "steps_lost": killed["attempted"] - whole["attempted"],
                        "wall_s_lost": killed["wall_s"] - whole["wall_s"],
                        "whole": whole,
                        "killed": killed,
                    }
                )
    summary: dict = {"runs": figures}
    if "failure" in args.parts:
        summary["lost_per_failure"] = {
            kind: {
                key: statistics.median(f[key] for f in figures[f"failure_{kind}"])
                for key in ("steps_lost", "wall_s_lost")
            }
            for kind in kinds
        }
    if "overhead" in args.parts:
        plain = statistics.median(f["steps_per_s"] for f in figures["plain"])
        torchft = statistics.median(f["steps_per_s"] for f in figures["torchft"])
        summary.update(
            steps_per_s={"plain": plain, "torchft": torchft}, overhead=plain / torchft - 1
        )
    print(json.dumps(summary, indent=1))
    if "failure" in args.parts:
        print(
            f"\n| run | steps lost per failure | wall s lost per failure | (medians of {args.repeats})"
        )
        print("|---|---|---|")
        for kind, lost in summary["lost_per_failure"].items():
            print(f"| {kind} | {lost['steps_lost']:g} | {lost['wall_s_lost']:.1f} |")
    if "overhead" in args.parts:
        print(
            f"\nsteady state, nobody failing: plain ddp {plain:.2f} steps/s, fault=torchft "
            f"{torchft:.2f} steps/s: overhead {100 * summary['overhead']:+.1f}%"
        )


if __name__ == "__main__":
    main()
