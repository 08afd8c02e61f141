"""An in-training evaluation at dp=2 against the same evaluation by ``plait eval`` in one
process: lm-evaluation-harness's ``plait_tiny_mc`` (128 documents, 512 log-likelihood requests),
in one command.

    DS_ACCELERATOR=cpu python scripts/bench_eval.py                       # 512 requests, 3 repeats
    DS_ACCELERATOR=cpu python scripts/bench_eval.py --limit 4 --repeats 1 --steps 2   # a smoke run

For each of ``--repeats`` repetitions (alternating):

- ``in training, dp=N``: a real ``plait train`` run of ``--steps`` steps on ``--nproc``
  processes (``launcher.nproc_per_node``, data parallel) with ``eval.tasks=[plait_tiny_mc]``
  and ``eval.every=1``: the harness on the logging rank, every replica scoring its share of the
  requests through the engine, gathered on the logging rank. Timed: the logging rank's
  ``eval/time_s`` at the last step (from the start of the evaluation to its metrics: the
  harness's request building, the broadcast, the forwards, the gather, the metrics and the
  JSON), an evaluation after the first, so the one-off costs (imports, the dataset's cache) are
  left out.
- ``plait eval, one process``: the checkpoint that run saved at its last step, read once
  (``plait.export.consolidate``, not timed), then the same harness evaluation with the unsplit
  model in this process (``lm_eval.simple_evaluate`` with plait's ``LocalScorer``, and the JSON),
  twice. Timed: the second.

Both score the same weights with ``--micro-batch`` sequences of ``train.seq_len`` tokens per
forward; the one process uses torch's default thread count, each worker its share of the cores
(the launcher's ``OMP_NUM_THREADS``). Printed: the median seconds of each, requests per second, the ratio one-process /
in-training (above 1: the in-training evaluation is faster), whether both gave the same
accuracy, the repeat count and the load average. Timings on a shared machine are noise: run it
on an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def in_training(root: Path, name: str, args) -> tuple[float, float, Path]:
    """The logging rank's evaluation seconds, the accuracy and the run's last checkpoint."""
    from plait.testing import read_metrics, run_training

    run = run_training(
        root / name,
        [
            f"model={args.model}",
            f"train.steps={args.steps}",
            f"train.seq_len={args.seq_len}",
            f"train.batch_size={args.batch_size}",
            f"launcher.nproc_per_node={args.nproc}",
            "eval.tasks=[plait_tiny_mc]",
            "eval.every=1",
            f"eval.micro_batch_size={args.micro_batch}",
            *([f"eval.limit={args.limit}"] if args.limit else []),
        ],
    )
    last = read_metrics(run)[-1]
    return last["eval/time_s"], last["eval/plait_tiny_mc/acc"], run


def one_process(run: Path, args) -> tuple[float, float]:
    """The same evaluation of the run's last checkpoint, in this process."""
    import torch

    from plait.export import consolidate
    from plait.plugin_manager import keep_selected, make_plugin_manager
    from plait.plugins.eval.harness import HarnessSettings, evaluate, write_json
    from plait.plugins.eval.lm import PlaitLM
    from plait.plugins.eval.scoring import LocalScorer

    found = consolidate(str(run))
    model = found.model
    model.load_state_dict(found.state, assign=True)
    model.eval()
    tokenizer = keep_selected(make_plugin_manager(found.cfg), found.cfg).hook.plait_tokenizer(
        cfg=found.cfg
    )
    length = found.cfg.train.seq_len
    settings = HarnessSettings(
        tasks=["plait_tiny_mc"], limit=args.limit, batch_size=args.micro_batch
    )
    for _ in range(2):  # the first pays the one-off costs (imports, the dataset's cache)
        started = time.perf_counter()
        lm = PlaitLM(
            LocalScorer(model, args.micro_batch, length, torch.device("cpu")), tokenizer, length
        )
        results = evaluate(lm, settings)
        write_json(results, run / "one_process_eval.json")
        seconds = time.perf_counter() - started
    return seconds, results["results"]["plait_tiny_mc"]["acc,none"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="data-parallel processes")
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--steps", type=int, default=2, help="at least 2 (one warm evaluation)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=16,
        help="sequences per forward (eval.micro_batch_size / batch_size=)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="documents of plait_tiny_mc (4 requests each); default all 128",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_eval_"))
    sharded, single, same = [], [], True
    for repeat in range(args.repeats):
        seconds, acc, run = in_training(root, f"r{repeat}", args)
        sharded.append(seconds)
        one_seconds, one_acc = one_process(run, args)
        single.append(one_seconds)
        same &= acc == one_acc
        print(
            f"repeat {repeat + 1}: in training {seconds:.2f} s, one process "
            f"{one_seconds:.2f} s (acc {acc:.4f} / {one_acc:.4f})",
            flush=True,
        )
    requests = 4 * (args.limit or 128)
    a, b = statistics.median(sharded), statistics.median(single)
    import torch

    print(
        f"\nplait_tiny_mc: {requests} log-likelihood requests, model={args.model}, "
        f"seq_len {args.seq_len}, {args.micro_batch} sequences per forward; one process with "
        f"{torch.get_num_threads()} threads, each of the {args.nproc} workers with "
        f"{max(1, (os.cpu_count() or 1) // args.nproc)} (the launcher's OMP_NUM_THREADS)"
    )
    print("| evaluation | median s | requests/s |\n| --- | --- | --- |")
    print(f"| in training, dp={args.nproc} | {a:.2f} | {requests / a:.0f} |")
    print(f"| plait eval, one process | {b:.2f} | {requests / b:.0f} |")
    print(f"ratio one process / in training: {b / a:.2f}x")
    print(f"same accuracy in every repeat: {same}")
    print(f"repeats: {args.repeats}; load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps({"in_training_s": a, "one_process_s": b, "ratio": b / a}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
