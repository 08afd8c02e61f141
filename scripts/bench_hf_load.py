"""Loading a pretrained Hugging Face checkpoint: time and peak memory per rank, plait (``model=hf``
under ddp, zero3 and tp=2 x pp=2) against ``from_pretrained`` plus a plain DDP wrap, in one
command.

    DS_ACCELERATOR=cpu python scripts/bench_hf_load.py                 # a ~300 MB checkpoint
    DS_ACCELERATOR=cpu python scripts/bench_hf_load.py --repeats 3 --dir /tmp/hfload
    DS_ACCELERATOR=cpu python scripts/bench_hf_load.py --hidden 64 --layers 2 --vocab 512 \\
        --repeats 1                                                       # a smoke run
    DS_ACCELERATOR=cpu python scripts/bench_hf_load.py --cases tp2_pp2    # the baseline and one

It writes a random ``LlamaForCausalLM`` with ``save_pretrained`` (fp32; default hidden 768,
MLP 2048, 8 layers, 12 heads / 4 KV heads, vocabulary 16384: 75M parameters, 300 MB), then on
``--nproc`` processes (default 4), ``--repeats`` times each, alternating:

- ``from_pretrained + DDP`` (the baseline): every rank ``AutoModelForCausalLM.from_pretrained``
  and ``DistributedDataParallel`` around it (gloo), in a spawned process group;
- ``plait ddp`` / ``plait zero3`` / ``plait tp2_pp2``: a real ``plait train model=hf`` run of one
  step (``train.steps=1``), every rank reading its slices (``plait.testing.LoadClock``).

and, with ``--saves``, how long saving stops a tp=2 x pp=2 run of 4 steps (``plait.testing.
SaveClock``, the logging rank's time in ``plait_save_checkpoint`` at steps 2 and 4): a plait
checkpoint (``checkpoint.every=2``: model, optimizer states and the layout-free copy)
against ``checkpoint.hf_every=2`` alone (Hugging Face safetensors of the weights).

Per rank it measures, from the moment the model is asked for (``plait_build_model``; the
baseline: the call of ``from_pretrained``) until the engine is built (the DDP wrap):

- ``load s``: wall seconds (the slowest rank; median over repeats);
- ``peak MiB``: the rise of the process's peak resident memory (``VmHWM``, reset at the start;
  the libraries are imported before), the largest rank; memory does not depend on the load.

Printed: one line per case with both figures and their ratios against the baseline, then the
checkpoint's size, the repeat count and the load average. Timings on a shared machine are
noise: run it on an idle one.
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

LAYOUTS = {
    "plait ddp": [],
    "plait zero3": ["strategy=zero3"],
    "plait tp2_pp2": ["parallel.tp=2", "parallel.pp=2", "pipeline.microbatches=2"],
}
LIBRARIES = (
    "transformers",
    "transformers.models.llama.modeling_llama",
    "safetensors.torch",
    "torch.distributed.pipelining",
    "deepspeed",
)
VOCAB_OF_DATA = 512  # the BPE the data is tokenized with; --vocab must hold it


def corpus_files(count: int) -> list[Path]:
    import sysconfig

    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]


def write_checkpoint(directory: Path, args) -> int:
    """A random Llama (fp32) and a 512-id BPE tokenizer, as save_pretrained writes them."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from plait.plugins.data.tokenizer import train_bpe

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=128,
        eos_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer = train_bpe((p.read_bytes() for p in corpus_files(8)), VOCAB_OF_DATA)
    (directory / "tokenizer.json").write_text(tokenizer.json)
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def _baseline_rank(rank: int, world_size: int, directory: str, out: str) -> None:
    import importlib

    for name in LIBRARIES:
        importlib.import_module(name)
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    from plait.testing import peak_resident_bytes, reset_peak_resident_bytes, resident_bytes

    base = resident_bytes()
    reset_peak_resident_bytes()
    started = time.perf_counter()
    model = DistributedDataParallel(AutoModelForCausalLM.from_pretrained(directory))
    seconds = time.perf_counter() - started
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"seconds": seconds, "peak": peak_resident_bytes() - base})
    )
    del model


def baseline(directory: Path, nproc: int, out: Path) -> list[dict]:
    from plait.testing import spawn

    out.mkdir(parents=True)
    spawn(_baseline_rank, nproc, str(directory), str(out))
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def plait_case(
    directory: Path, shards: Path, nproc: int, layout: list[str], run_dir: Path
) -> list[dict]:
    from plait.testing import LoadClock, run_training

    run_training(
        run_dir,
        [
            "model=hf",
            f"model.path={directory}",
            "data=shards",
            f"data.path={shards}",
            "train.steps=1",
            "train.batch_size=4",
            "train.seq_len=16",
            "checkpoint.save_final=false",
            f"launcher.nproc_per_node={nproc}",
            *layout,
        ],
        plugins=[LoadClock(LIBRARIES)],
    )
    return [json.loads(p.read_text()) for p in sorted((run_dir / "load").glob("rank*.json"))]


def prepare_shards(directory: Path, root: Path) -> Path:
    """``plait prepare data.tokenizer=<the checkpoint>``: the model's own tokenizer."""
    from plait.cli import main

    corpus = root / "corpus"
    corpus.mkdir()
    for file in corpus_files(4):
        (corpus / file.name).write_bytes(file.read_bytes())
    main(
        [
            "prepare",
            f"data.path={corpus}",
            f"out={root / 'shards'}",
            f"data.tokenizer={directory}",
            "data.num_workers=1",
        ]
    )
    return root / "shards"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--mlp", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--saves", action="store_true", help="also time the saves (see above)")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=[name.removeprefix("plait ") for name in LAYOUTS],
        default=[name.removeprefix("plait ") for name in LAYOUTS],
        help="plait's cases beside the baseline (default: all)",
    )
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_hf_load_"))
    root.mkdir(parents=True, exist_ok=True)
    checkpoint = root / "checkpoint"
    size = write_checkpoint(checkpoint, args)
    shards = prepare_shards(checkpoint, root)
    results: dict[str, list[tuple[float, float]]] = {
        "from_pretrained + DDP": [],
        **{name: [] for name in LAYOUTS if name.removeprefix("plait ") in args.cases},
    }
    for repeat in range(args.repeats):
        for name in results:  # alternating, so a change of load hits every case alike
            out = root / f"{name.replace(' ', '_').replace('+', 'and')}_{repeat}"
            ranks = (
                baseline(checkpoint, args.nproc, out)
                if name.startswith("from")
                else plait_case(checkpoint, shards, args.nproc, LAYOUTS[name], out)
            )
            results[name].append((max(r["seconds"] for r in ranks), max(r["peak"] for r in ranks)))
    base_s = statistics.median(s for s, _ in results["from_pretrained + DDP"])
    base_peak = max(p for _, p in results["from_pretrained + DDP"])
    print(f"{'case':24s} {'load s':>8s} {'x base':>7s} {'peak MiB':>9s} {'x base':>7s}")
    for name, runs in results.items():
        seconds = statistics.median(s for s, _ in runs)
        peak = max(p for _, p in runs)
        print(
            f"{name:24s} {seconds:8.2f} {seconds / base_s:7.2f} {peak / 2**20:9.1f} "
            f"{peak / base_peak:7.2f}"
        )
    print(
        f"checkpoint {size / 2**20:.1f} MiB (fp32) on {args.nproc} processes; load s: median "
        f"of {args.repeats}, the slowest rank; peak: the largest rank over repeats; load "
        f"average {os.getloadavg()[0]:.2f}"
    )
    if args.saves:
        print_saves(checkpoint, shards, root, args.repeats)
    return 0


SAVES = {
    "plait checkpoint": ["checkpoint.every=2", "checkpoint.save_final=false"],
    "checkpoint.hf_every=2": ["checkpoint.hf_every=2", "checkpoint.save_final=false"],
}


def print_saves(checkpoint: Path, shards: Path, root: Path, repeats: int) -> None:
    from plait.testing import SaveClock, run_training

    seconds: dict[str, list[float]] = {name: [] for name in SAVES}
    for repeat in range(repeats):
        for name, settings in SAVES.items():
            run_dir = root / f"save_{name.split('.')[-1].split('=')[0].replace(' ', '_')}_{repeat}"
            run_training(
                run_dir,
                [
                    "model=hf",
                    f"model.path={checkpoint}",
                    "data=shards",
                    f"data.path={shards}",
                    "train.steps=4",
                    "train.batch_size=4",
                    "train.seq_len=16",
                    "launcher.nproc_per_node=4",
                    *LAYOUTS["plait tp2_pp2"],
                    *settings,
                ],
                plugins=[SaveClock()],
            )
            lines = [
                json.loads(line)
                for line in (run_dir / "save_seconds.jsonl").read_text().splitlines()
            ]
            seconds[name] += [line["seconds"] for line in lines if line["step"] % 2 == 0]
    base = statistics.median(seconds["plait checkpoint"])
    for name, values in seconds.items():
        median = statistics.median(values)
        print(
            f"save, tp2_pp2: {name:24s} {median:8.2f} s  x{median / base:.2f}  (median of "
            f"{len(values)} saves)"
        )


if __name__ == "__main__":
    sys.exit(main())
