"""The cost of a launch from a long-lived process (a test session, a sweep, a notebook): warm
launches of a tiny run, as plait makes them, against the same launches without what it does for
every launch since the sixteenth session.

    python scripts/bench_launch.py                          # ddp, zero3, hf; 3 repeats
    python scripts/bench_launch.py --rows zero3 --repeats 1 --launches 2

``plait``: the worker server imports and builds, once before it forks, what every worker would
(each active plugin's ``PluginInfo.preload``), and the launcher names torch elastic's rendezvous
events from the frames. ``before``: the server preloads only DeepSpeed (what it did before), and
torch names the events with ``inspect.stack()``. Each variant runs in a process of its own (a
worker server keeps the modules it started with), the two alternately, ``--repeats`` times:
one launch starts the server, then ``--launches`` launches are timed, each of 2 ranks and
``--steps`` steps, called ``--depth`` frames deep (a test session's stack under pytest is about
60) with ``--modules`` imported (DeepSpeed and ``transformers``), as in a test session. Prints per row the
median launch time of each variant and their ratio (before / plait).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = {
    "ddp": [],
    "zero3": ["strategy=zero3"],
    "hf": ["model=hf", "model.path={model}", "model.pretrained=false"],
}


def write_model(directory: Path) -> Path:
    """A 2-layer Llama config (no weights: ``model.pretrained=false``)."""
    import transformers

    transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(directory)
    return directory


def as_before() -> None:
    """The launcher as it was: DeepSpeed the only declared preload, torch's event names."""
    from plait import forkserver
    from plait.plugins.launch import rendezvous_events

    use_forkserver = forkserver.use_forkserver
    forkserver.use_forkserver = lambda declared, on_cpu, ld_preload: use_forkserver(
        set(declared) & {"deepspeed"}, on_cpu, ld_preload
    )
    rendezvous_events.name_events_from_frames = lambda: None


def deep(depth: int, call):
    return call() if depth == 0 else deep(depth - 1, call)


def child(args) -> None:
    """One variant's launches of one row, in this process; prints their wall times (JSON)."""
    import importlib

    from plait.testing import run_training

    for module in args.modules:
        importlib.import_module(module)

    if args.child == "before":
        as_before()
    root = Path(tempfile.mkdtemp())
    overrides = [
        "launcher.nproc_per_node=2",
        f"train.steps={args.steps}",
        "checkpoint.save_final=false",
        *(o.format(model=args.model) for o in ROWS[args.row]),
    ]
    times = []
    for k in range(args.launches + 1):
        start = time.perf_counter()
        deep(args.depth, lambda: run_training(root / f"run{k}", overrides))
        times.append(time.perf_counter() - start)
    print(json.dumps(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--depth", type=int, default=60)
    parser.add_argument(
        "--modules",
        nargs="*",
        default=["deepspeed", "transformers.modeling_utils"],
        help="imported by the launching process first, as a test session holds them",
    )
    parser.add_argument("--child", choices=["plait", "before"], help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    model = write_model(Path(tempfile.mkdtemp()) / "llama")
    launches: dict[tuple[str, str], list[float]] = {}
    for row in args.rows:
        for _ in range(args.repeats):
            for variant in ("plait", "before"):
                done = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        f"--child={variant}",
                        f"--row={row}",
                        f"--model={model}",
                        f"--launches={args.launches}",
                        f"--steps={args.steps}",
                        f"--depth={args.depth}",
                        "--modules",
                        *args.modules,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                times = json.loads(done.stdout.strip().splitlines()[-1])
                launches.setdefault((row, variant), []).extend(times)
    print(f"## A warm launch: 2 ranks, {args.steps} steps, {args.depth} frames deep")
    print(f"{args.repeats} repeat(s) x {args.launches} launch(es) per variant; median seconds\n")
    print("| row | plait s | before s | before / plait |")
    print("| --- | ---: | ---: | ---: |")
    for row in args.rows:
        plait = statistics.median(launches[row, "plait"])
        before = statistics.median(launches[row, "before"])
        print(f"| {row} | {plait:.2f} | {before:.2f} | {before / plait:.2f} |")


if __name__ == "__main__":
    main()
