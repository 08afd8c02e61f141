"""``plait prepare`` against the library it wraps: HF ``tokenizers``' own ``encode_batch`` on the
same documents and cores, for each format, many small files against one large file; peak
memory for a corpus and four times it; 1 against 2 SLURM array tasks.

    DS_ACCELERATOR=cpu python scripts/bench_prepare.py                  # ~22 MB, vocab 8192
    DS_ACCELERATOR=cpu python scripts/bench_prepare.py --slurm          # + 1 and 2 array tasks
    DS_ACCELERATOR=cpu python scripts/bench_prepare.py --mb 0.3 --vocab 300 --repeats 1 \\
        --rss-mb 0.2                                                    # a smoke run
    DS_ACCELERATOR=cpu python scripts/bench_prepare.py --mb 8 --repeats 1 \\
        --formats .jsonl parquet                                        # some rows only

The corpus is the running Python's standard library source (one document per file), the
tokenizer a byte-level BPE of ``--vocab`` ids trained on its first 2 MB and given as a file.
Prints, from one command:

1. tokens/s of ``plait prepare`` (``data.num_workers`` = the cores) and of
   ``Tokenizer.encode_batch`` over the same documents already in memory (its own thread pool on
   every core; a fresh process each time, see ``time_library``), the median of ``--repeats``
   interleaved runs each, and their ratio (target >= 0.9x), for: many small text files, one
   large text file (the library's baseline: the file as one document, ``encode_batch([text])``),
   ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, parquet (row groups of ~1 MB) and a
   ``save_to_disk`` directory (``--formats``: only those rows);
2. the peak resident memory of ``plait prepare`` in a fresh process (the command's own,
   ``VmHWM``, and its largest worker's, ``getrusage``) for ``--rss-mb`` of JSON lines and for four times that
   (target: within 10%), with the same task size for both;
3. with ``--slurm`` (root, slurm-wlm and munge installed): tokens/s of ``launcher=slurm`` with
   1 and 2 array tasks of one core each, on a controller and node daemon started on localhost as
   ``tests/slurm_cluster.py`` starts them for the tests (the same code).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from plait.plugins.data import stdlib_sources  # noqa: E402
from plait.plugins.data.index import read_index  # noqa: E402
from plait.plugins.data.prepare import PrepareDataConfig, prepare  # noqa: E402
from plait.plugins.data.tokenizer import train_bpe  # noqa: E402


def read_corpus(mb: float) -> list[str]:
    docs, total = [], 0
    for p in stdlib_sources():
        text = p.read_text(errors="replace")
        if total + len(text) > mb * 1e6:
            break
        docs.append(text)
        total += len(text)
    return docs


def write_formats(root: Path, docs: list[str]) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True)
    (root / "files").mkdir()
    for i, text in enumerate(docs):
        (root / "files" / f"{i:05d}.txt").write_text(text)
    (root / "one.txt").write_text("\n".join(docs))
    lines = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in docs)
    (root / "corpus.jsonl").write_bytes(lines)
    (root / "corpus.jsonl.gz").write_bytes(gzip.compress(lines, 6))
    (root / "corpus.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    rows_per_group = max(1, int(len(docs) * 1e6 / sum(map(len, docs))))
    pq.write_table(pa.table({"text": docs}), root / "corpus.parquet", row_group_size=rows_per_group)
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(root / "saved")
    names = ("files", "one.txt", "corpus.jsonl", "corpus.jsonl.gz", "corpus.jsonl.zst")
    names += ("corpus.parquet", "saved")
    return {label: root / name for label, name in zip(FORMATS, names)}


FORMATS = (
    "many small text files",
    "one large text file",
    ".jsonl",
    ".jsonl.gz",
    ".jsonl.zst",
    "parquet",
    "save_to_disk",
)


def time_prepare(
    path: Path, tokenizer: Path, out: Path, workers: int, launcher=None
) -> tuple[float, int]:
    data = OmegaConf.structured(
        PrepareDataConfig(path=str(path), tokenizer=str(tokenizer), num_workers=workers)
    )
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    prepare(data, out, launcher, log=lambda message: None)
    elapsed = time.perf_counter() - started
    tokens = read_index(str(out)).total_tokens
    shutil.rmtree(out)
    return elapsed, tokens


LIBRARY_SCRIPT = """
import json, sys, time
from tokenizers import Tokenizer
docs = json.loads(open(sys.argv[2]).read())
library = Tokenizer.from_file(sys.argv[1])
started = time.perf_counter()
library.encode_batch(docs)
print(time.perf_counter() - started)
"""


def time_library(tokenizer: Path, docs_file: Path) -> float:
    """``encode_batch`` of the documents in ``docs_file`` (a JSON list), timed in a fresh
    process. Not in this one: the library's output for the one large file of 22 MB (offsets and
    token strings of every token) left this process 1.6 GB larger once freed, and the prepare
    workers it forked afterwards spent 50% more CPU on the same .jsonl (7.3 -> 11.2 s)."""
    done = subprocess.run(
        [sys.executable, "-c", LIBRARY_SCRIPT, str(tokenizer), str(docs_file)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def section_speed(args, root: Path, docs: list[str], tokenizer: Path, workers: int) -> None:
    formats = write_formats(root / "formats", docs)
    print(
        f"\n1. tokens/s, plait prepare ({workers} workers) against encode_batch (all "
        f"{os.cpu_count()} cores), median of {args.repeats}"
    )
    print("| input | plait prepare tokens/s | encode_batch tokens/s | ratio |")
    print("| --- | ---: | ---: | ---: |")
    documents, whole = root / "documents.json", root / "whole.json"
    documents.write_text(json.dumps(docs))
    whole.write_text(json.dumps(["\n".join(docs)]))
    for label, path in formats.items():
        if args.formats and label not in args.formats:
            continue
        ours, theirs, tokens = [], [], 0
        for _ in range(args.repeats):  # interleaved: a slow spell hits both
            elapsed, tokens = time_prepare(path, tokenizer, root / "out", workers)
            ours.append(elapsed)
            theirs.append(
                time_library(tokenizer, whole if label == "one large text file" else documents)
            )
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"| {label} | {tokens / a:,.0f} | {tokens / b:,.0f} | {b / a:.2f}x |", flush=True)


RSS_SCRIPT = """
import json, resource, sys
from omegaconf import OmegaConf
from plait.plugins.data.prepare import PrepareDataConfig, prepare
data = OmegaConf.structured(PrepareDataConfig(path=sys.argv[1], tokenizer=sys.argv[2],
                                              num_workers=int(sys.argv[4]),
                                              task_mb=float(sys.argv[5])))
prepare(data, sys.argv[3], log=lambda message: None)
# VmHWM: this process's own peak since it started; getrusage's ru_maxrss (RUSAGE_SELF) also
# holds the peak of the process that started it (Linux keeps it across fork and exec)
own = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps([own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))
"""


def section_memory(args, root: Path, tokenizer: Path, workers: int) -> None:
    docs = read_corpus(args.rss_mb)
    lines = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in docs)
    task_mb = args.rss_mb / 8  # the same tasks in both: 8 for 1x, 32 for 4x
    print(
        f"\n2. peak resident memory of plait prepare ({workers} workers, tasks of "
        f"{task_mb:.3g} MiB), JSON lines"
    )
    print("| corpus | MB of text | command's peak MiB | largest worker's peak MiB |")
    print("| --- | ---: | ---: | ---: |")
    peaks = []
    for times in (1, 4):
        corpus = root / f"rss{times}.jsonl"
        corpus.write_bytes(lines * times)
        out = root / f"rss-out{times}"
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                RSS_SCRIPT,
                str(corpus),
                str(tokenizer),
                str(out),
                str(workers),
                str(task_mb),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        own, child = json.loads(done.stdout.strip().splitlines()[-1])
        peaks.append((own, child))
        print(
            f"| {times}x | {len(lines) * times / 1e6:.1f} | {own / 1024:.0f} | {child / 1024:.0f} |"
        )
        shutil.rmtree(out)
    print(
        f"4x / 1x: command {peaks[1][0] / peaks[0][0]:.2f}x, largest worker "
        f"{peaks[1][1] / max(peaks[0][1], 1):.2f}x"
    )


class TempDirs:
    """What tests/slurm_cluster.py asks of pytest's tmp_path_factory."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=name, dir=self.root))


def section_slurm(args, root: Path, docs: list[str], tokenizer: Path) -> None:
    from slurm_cluster import running_slurm

    from plait.plugins.data.launchers import PrepareLauncherConfig

    print("\n3. launcher=slurm on localhost, array tasks of 1 core (1 worker) each")
    cluster = running_slurm(TempDirs(root))  # the tests' cluster (tests/slurm_cluster.py)
    try:
        env = cluster.__enter__()
    except BaseException as e:  # pytest.skip's exception: SLURM cannot run here
        print(f"   not run: {e}")
        return
    try:
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
        path = root / "formats" / "corpus.jsonl"
        rates = {}
        for tasks in (1, 2):
            launcher = OmegaConf.structured(
                PrepareLauncherConfig(name="slurm", tasks=tasks, cpus_per_task=1, time=30)
            )
            runs = [
                time_prepare(path, tokenizer, root / "out", 1, launcher)
                for _ in range(args.repeats)
            ]
            rates[tasks] = runs[0][1] / statistics.median(t for t, _ in runs)
            print(
                f"   {tasks} array task(s): {rates[tasks]:,.0f} tokens/s (median of "
                f"{args.repeats}, submission and start included)",
                flush=True,
            )
        print(f"   2 / 1: {rates[2] / rates[1]:.2f}x")
    finally:
        cluster.__exit__(None, None, None)  # daemons stopped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=22.0, help="MB of stdlib source")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rss-mb", type=float, default=10.0, help="the 1x corpus of section 2")
    parser.add_argument("--slurm", action="store_true", help="section 3 (needs root, SLURM)")
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=FORMATS,
        help="section 1's rows to run (default: all)",
    )
    args = parser.parse_args()
    workers = os.cpu_count() or 1
    root = Path(tempfile.mkdtemp(prefix="plait-bench-prepare-"))
    try:
        docs = read_corpus(args.mb)
        tokenizer = root / "tokenizer.json"
        tokenizer.write_text(train_bpe(read_corpus(min(args.mb, 2.0)), args.vocab).json)
        print(
            f"corpus: {sum(map(len, docs)) / 1e6:.1f} MB in {len(docs)} documents (stdlib "
            f"source); BPE of {args.vocab} ids; {workers} cores; load average "
            f"{os.getloadavg()[0]:.2f}"
        )
        section_speed(args, root, docs, tokenizer, workers)
        section_memory(args, root, tokenizer, workers)
        if args.slurm:
            section_slurm(args, root, docs, tokenizer)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
