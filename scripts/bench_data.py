"""The data path: prepare throughput, loader throughput cold vs warm against the model's
consumption, and the share of step time spent waiting for data.

    DS_ACCELERATOR=cpu python scripts/bench_data.py                       # about 8 MB of text
    DS_ACCELERATOR=cpu python scripts/bench_data.py --mb 4 --remote-mb-s 20 --gpt2-steps 3
    DS_ACCELERATOR=cpu python scripts/bench_data.py --mb 0.05 --vocab 300 --shard-tokens 4096 \
        --seq-len 16 --batch-size 2 --tiny-steps 3 --gpt2-steps 0      # a smoke run (no GPT-2)

Prints, from one command:
1. ``plait prepare`` MB/s of text with 1 and 2 worker processes, for bytes and for a BPE of
   ``--vocab`` ids (trained once beforehand and given as a file, so only tokenizing is timed);
2. loader tokens/s (this rank's micro-batches, dp=1) from a throttled ``slow://`` remote at
   ``--remote-mb-s``: cold (empty node-local cache) and warm (all shards cached), and from the
   local directory in place, each against the tokens/s the tiny GPT and GPT-2 small consume;
3. data wait / step time for real ``plait train`` runs of the tiny GPT and GPT-2 small on the
   warm cache (``data_wait_s/max`` and ``step_time_s/max`` from ``metrics.jsonl``, steps after
   the first two). ``--gpt2-steps 0`` leaves GPT-2 small out (its columns show ``-``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the throttled slow:// remote
import slowfs  # noqa: E402,F401

from plait.plugins.data import stdlib_sources  # noqa: E402
from plait.plugins.data.cache import NodeCache  # noqa: E402
from plait.plugins.data.index import read_index  # noqa: E402
from plait.plugins.data.loader import StepLoader  # noqa: E402
from plait.plugins.data.prepare import PrepareDataConfig, prepare  # noqa: E402
from plait.plugins.data.shard_dataset import CachedShards, LocalShards, ShardDataset  # noqa: E402
from plait.plugins.data.sharding import GlobalOrderSampler  # noqa: E402
from plait.plugins.data.tokenizer import train_bpe  # noqa: E402
from plait.testing import read_metrics, run_training  # noqa: E402


def copy_corpus(directory: Path, max_bytes: int) -> int:
    directory.mkdir(parents=True)
    total = 0
    for k, p in enumerate(stdlib_sources()):
        if total + p.stat().st_size > max_bytes:
            break
        shutil.copy(p, directory / f"{k:05d}_{p.name}")
        total += p.stat().st_size
    return total


def time_prepare(corpus: Path, out: Path, workers: int, tokenizer: str, shard_tokens: int):
    data = OmegaConf.structured(
        PrepareDataConfig(
            path=str(corpus), tokenizer=tokenizer, shard_tokens=shard_tokens, num_workers=workers
        )
    )
    started = time.perf_counter()
    prepare(data, out, log=lambda message: None)
    return time.perf_counter() - started


def loader_tokens_per_s(dataset, args, steps: int) -> float:
    sampler = GlobalOrderSampler(
        len(dataset), lambda e: dataset.epoch_order(0, e), args.batch_size, 1, 0, 1
    )
    batches = iter(StepLoader(dataset, sampler, prefetch=2, prefetch_shards=2))
    started = time.perf_counter()
    for _ in range(steps):
        next(batches)
    return steps * args.batch_size * args.seq_len / (time.perf_counter() - started)


def train_figures(root: Path, name: str, overrides: list[str]) -> tuple[float, float, float]:
    """tokens/s, summed data wait / summed step time (steps after the first two), max wait."""
    run_training(
        root / name,
        [
            "data=shards",
            "launcher.nproc_per_node=1",
            "checkpoint.save_final=false",
            "+plugins=[slowfs]",
            *overrides,
        ],
    )
    steps = read_metrics(root / name)[2:]
    wait = sum(m["data_wait_s/max"] for m in steps)
    total = sum(m["step_time_s/max"] for m in steps)
    return (
        sum(m["tokens_per_s"] for m in steps) / len(steps),
        wait / total,
        max(m["data_wait_s/max"] for m in steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=8.0, help="MB of stdlib source to prepare")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--remote-mb-s", type=float, default=5.0)
    parser.add_argument("--shard-tokens", type=int, default=1 << 16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tiny-steps", type=int, default=40)
    parser.add_argument("--gpt2-steps", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="plait-bench-data-"))
    os.environ["PLAIT_SLOWFS_BYTES_PER_S"] = str(args.remote_mb_s * 1e6)
    text = copy_corpus(root / "corpus", int(args.mb * 1e6))
    print(
        f"corpus: {text / 1e6:.2f} MB of the standard library's source; machine: "
        f"{os.cpu_count()} cores"
    )

    print("\n1. plait prepare (MB of text per second)")
    bpe = train_bpe((p.read_bytes() for p in sorted((root / "corpus").iterdir())), args.vocab)
    (root / "bpe.json").write_text(bpe.json)
    shard_tokens = args.shard_tokens
    for tokenizer, label in (("bytes", "bytes"), (str(root / "bpe.json"), f"BPE {args.vocab}")):
        rates = []
        for workers in (1, 2):
            out = root / f"prep-{label.split()[0]}-{workers}"
            rates.append(
                text / 1e6 / time_prepare(root / "corpus", out, workers, tokenizer, shard_tokens)
            )
        print(
            f"   {label:10s} 1 worker {rates[0]:7.2f} MB/s   2 workers {rates[1]:7.2f} MB/s"
            f"   ({rates[1] / rates[0]:.2f}x)"
        )
    shards = root / "prep-BPE-2"

    print(
        f"\n2. consumption: plait train on data=shards slow://, warm cache "
        f"(batch {args.batch_size}, seq {args.seq_len}, dp 1)"
    )
    common = [
        f"data.path=slow://{shards}",
        f"data.cache_dir={root / 'train-cache'}",
        f"train.batch_size={args.batch_size}",
        f"train.seq_len={args.seq_len}",
        "tracker=none",
    ]
    tiny_model = [
        "model=gpt_tiny",
        f"model.block_size={args.seq_len}",
        f"model.vocab_size={args.vocab}",
    ]
    train_figures(root, "warm-up", [*tiny_model, "train.steps=3", *common])  # fills the cache
    tiny = train_figures(root, "tiny", [*tiny_model, f"train.steps={args.tiny_steps}", *common])
    gpt2 = (
        train_figures(root, "gpt2", ["model=gpt2_small", f"train.steps={args.gpt2_steps}", *common])
        if args.gpt2_steps
        else None
    )
    for label, figures in (("tiny GPT", tiny), ("GPT-2 small", gpt2)):
        if figures is None:
            print(f"   {label:12s} not run (--gpt2-steps 0)")
            continue
        rate, fraction, worst = figures
        print(
            f"   {label:12s} consumes {rate:10,.0f} tokens/s   data wait {100 * fraction:.3f}% "
            f"of step time (worst step {1e3 * worst:.2f} ms)"
        )

    print(
        f"\n3. loader tokens/s (remote throttled to {args.remote_mb_s:g} MB/s), "
        "against the models' consumption"
    )
    index = read_index(f"slow://{shards}")
    settings = dict(
        seq_len=args.seq_len,
        split="train",
        pack=False,
        val_fraction=0.01,
        shuffle=True,
        shuffle_block=4096,
    )
    cache = NodeCache(index.root, root / "bench-cache", None)
    steps = max(4, index.total_tokens // (args.batch_size * args.seq_len) // 2)
    cold = loader_tokens_per_s(
        ShardDataset(index, CachedShards(index, cache), **settings), args, steps
    )
    warm = loader_tokens_per_s(
        ShardDataset(index, CachedShards(index, cache), **settings), args, steps
    )
    local_index = read_index(str(shards))
    local = loader_tokens_per_s(
        ShardDataset(local_index, LocalShards(local_index), **settings), args, steps
    )
    for label, rate in (("cold cache", cold), ("warm cache", warm), ("local, in place", local)):
        versus_gpt2 = f"{rate / gpt2[0]:10.1f}x" if gpt2 else f"{'-':>11s}"
        print(
            f"   {label:16s} {rate:12,.0f} tokens/s   {rate / tiny[0]:8.1f}x tiny GPT   "
            f"{versus_gpt2} GPT-2 small"
        )
    print(
        f"\n({steps} loader steps over {len(index.shard_sizes)} shards of {shard_tokens} "
        f"tokens; outputs in {root})"
    )


if __name__ == "__main__":
    main()
