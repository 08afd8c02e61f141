"""Data at scale: ``plait prepare``, ``data=shards``, blends, the node-local cache, refusals.

Corpora are the running Python's standard library: ~2 MB for prepare and BPE, a few kB where a
run goes through whole epochs. The slow "remote" is ``tests/slowfs.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import inhouse
import numpy as np
import pytest
import slowfs
from omegaconf import OmegaConf

from plait.cli import main
from plait.plan import make_plan
from plait.plugins.data import stdlib_sources
from plait.plugins.data.blend import BlendedDataset
from plait.plugins.data.cache import NodeCache, ShardPrefetcher
from plait.plugins.data.index import read_index, shard_name
from plait.plugins.data.prepare import PrepareDataConfig, prepare
from plait.plugins.data.shard_dataset import LocalShards, ShardDataset
from plait.plugins.data.sharding import GlobalOrderSampler
from plait.plugins.data.tokenizer import load_tokenizer_file
from plait.testing import StepClock, read_metrics, run_losses, run_training

SEQ = ["train.seq_len=32", "train.batch_size=8"]


def copy_corpus(directory: Path, max_bytes: int, min_file: int = 0) -> Path:
    """Standard-library files of at least ``min_file`` bytes, in path order, copied into
    ``directory`` up to ``max_bytes`` in all."""
    directory.mkdir(parents=True)
    total = 0
    for k, p in enumerate(p for p in stdlib_sources() if p.stat().st_size >= min_file):
        if total + p.stat().st_size > max_bytes:
            break
        shutil.copy(p, directory / f"{k:04d}_{p.name}")
        total += p.stat().st_size
    return directory


def prepare_into(out: Path, path, **settings) -> Path:
    data = OmegaConf.structured(PrepareDataConfig(path=str(path), **settings))
    return prepare(data, out, log=lambda message: None)


def dataset_of(
    directory,
    split="train",
    pack=False,
    shuffle=True,
    shuffle_block=1 << 18,
    seq_len=32,
    val_fraction=0.0,
) -> ShardDataset:
    index = read_index(str(directory))
    return ShardDataset(
        index, LocalShards(index), seq_len, split, pack, val_fraction, shuffle, shuffle_block
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 2 MB of the standard library's source."""
    return copy_corpus(tmp_path_factory.mktemp("corpus") / "text", 2_000_000)


@pytest.fixture(scope="module")
def bpe_shards(corpus, tmp_path_factory):
    """The corpus, BPE of 512 ids trained on it, shards of 32k tokens, 2 workers."""
    return prepare_into(
        tmp_path_factory.mktemp("bpe") / "out",
        corpus,
        tokenizer="bpe",
        vocab_size=512,
        shard_tokens=1 << 15,
        num_workers=2,
    )


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    """Bytes, ~9 kB in shards of 2048 tokens: ~270 samples of 32 tokens, 5 shards."""
    root = tmp_path_factory.mktemp("small")
    return prepare_into(
        root / "out",
        copy_corpus(root / "text", 9_000, min_file=1_500),
        shard_tokens=2048,
        num_workers=1,
    )


@pytest.fixture(scope="module")
def other_small_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("other")
    return prepare_into(
        root / "out",
        copy_corpus(root / "text", 20_000, min_file=5_000),
        shard_tokens=4096,
        num_workers=1,
    )


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ---------------------------------------------------------------------------------------------
# tokenizer and prepare
# ---------------------------------------------------------------------------------------------


def test_bpe_round_trips_text_exactly(bpe_shards, corpus):
    tokenizer = load_tokenizer_file(bpe_shards / "tokenizer.json")
    index = read_index(str(bpe_shards))
    assert index.tokenizer == {
        "name": "bpe",
        "identity": tokenizer.identity,
        "vocab_size": 512,
        "eot": 0,
    }
    odd = "tabs\tand  spaces \r\n ünïcödé ☃ 😀 \x00 ends with a space "
    assert tokenizer.decode(tokenizer.encode_batch([odd.encode()])[0]) == odd
    # the shards hold every file's text, each followed by <|endoftext|>, at the indexed offsets
    stream = dataset_of(bpe_shards).tokens(0, index.total_tokens)
    files = sorted(corpus.iterdir())
    assert tokenizer.decode(stream) == "".join(f.read_text() + "<|endoftext|>" for f in files)
    ends = index.documents[1:] - 1
    assert len(ends) == len(files) and (stream[ends] == 0).all()


def finished_tasks(out: Path) -> list[int]:
    """The tasks a running prepare has marked done (``work/task_<t>.done``)."""
    return sorted(int(p.name[5:11]) for p in (out / "work").glob("task_*.done"))


def token_stream(directory: Path) -> np.ndarray:
    index = read_index(str(directory))
    return dataset_of(directory).tokens(0, index.total_tokens)


@pytest.mark.slow
def test_prepare_resumes_after_a_kill_without_redoing_a_finished_task(corpus, bpe_shards, tmp_path):
    """A prepare of ~20 tasks SIGKILLed after two of them, run again with 2 workers instead of
    1, ends with the same files as the uninterrupted run (2 workers, tasks of 1 MiB): the
    killed task is redone, nothing is lost or repeated. A finished task is not redone: a copy
    of the killed run whose task 0 tokens were overwritten by 1s resumes to shards holding those
    1s exactly there."""
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "plait",
        "prepare",
        f"data.path={corpus}",
        f"out={out}",
        "data.tokenizer=bpe",
        "data.vocab_size=512",
        f"data.shard_tokens={1 << 15}",
        "data.task_mb=0.1",
    ]
    first = subprocess.Popen(
        [*command, "data.num_workers=1"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while len(finished_tasks(out)) < 2:
        assert first.poll() is None, "prepare finished before it could be killed"
        time.sleep(0.01)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    finished = finished_tasks(out)
    n_tasks = len(json.loads((out / "work" / "plan.json").read_text())["tasks"])
    assert not (out / "index.json").exists() and 0 in finished and len(finished) < n_tasks
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    task_0 = tampered / "work" / "task_000000.tokens"
    n_0 = task_0.stat().st_size // 2
    task_0.write_bytes(np.ones(n_0, dtype=np.uint16).tobytes())

    again = subprocess.run([*command, "data.num_workers=2"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert f"resuming in {out}: {len(finished)}/{n_tasks} tasks already tokenized" in again.stdout
    assert files_of(out) == files_of(bpe_shards)
    again = subprocess.run(
        [*command[:5], f"out={tampered}", *command[6:]], capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    stream, reference = token_stream(tampered), token_stream(bpe_shards)
    assert (stream[:n_0] == 1).all() and (stream[n_0:] == reference[n_0:]).all()
    assert (reference[:n_0] != 1).any()


def test_prepare_refuses_bad_settings_and_leaves_nothing(tmp_path, corpus, small_shards, capsys):
    out = tmp_path / "out"
    for overrides, message in [
        ([f"data.path={tmp_path}/none*.txt"], "data.path entry .*none\\*.txt matches no file"),
        (
            [f"data.path={corpus}", "data.tokenizer=bpe", "data.vocab_size=100"],
            "data.vocab_size=100 cannot hold byte-level BPE",
        ),
        ([f"data.path={corpus}", "data.tokenizer=gpt9"], "data.tokenizer=gpt9: choose bytes"),
        ([f"data.path={corpus}"], "plait prepare needs out="),
    ]:
        with_out = overrides + ([f"out={out}"] if "needs out" not in message else [])
        assert main(["prepare", *with_out]) == 2
        assert re.search(message, capsys.readouterr().err)
        assert not out.exists()
    # an existing directory of other shards is never overwritten
    assert main(["prepare", f"data.path={corpus}", f"out={small_shards}"]) == 2
    assert "already holds shards of other inputs" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# samples, order, blends
# ---------------------------------------------------------------------------------------------


def test_samples_stay_in_their_document_unless_packed(bpe_shards):
    documents = read_index(str(bpe_shards)).documents
    within = dataset_of(bpe_shards, seq_len=64)
    doc = np.searchsorted(documents, within.starts, side="right") - 1
    assert (within.starts + 64 + 1 <= documents[doc + 1]).all()
    packed = dataset_of(bpe_shards, seq_len=64, pack=True)
    doc = np.searchsorted(documents, packed.starts, side="right") - 1
    assert (packed.starts + 64 + 1 > documents[doc + 1]).sum() > 100
    assert len(packed) > len(within)


def test_epoch_order_is_a_seeded_permutation_that_stays_on_a_few_shards(bpe_shards):
    dataset = dataset_of(bpe_shards, shuffle_block=256)
    order = dataset.epoch_order(7, 0)
    assert sorted(order) == list(range(len(dataset)))
    assert (order == dataset_of(bpe_shards, shuffle_block=256).epoch_order(7, 0)).all()
    assert not (order == dataset.epoch_order(7, 1)).all()
    assert len(dataset.index.shard_sizes) > 15 and len(dataset) / 20 > 256
    for block in range(0, len(order) - 256, 256):  # a block: one or two shards (and the next
        assert len(dataset.shard_keys(order[block : block + 256].tolist())) <= 4  # ones' heads)


def test_a_blend_of_070_030_draws_within_2_percent_over_10000_samples(
    small_shards, other_small_shards
):
    a, b = dataset_of(small_shards), dataset_of(other_small_shards)
    blend = BlendedDataset([a, b], [0.7, 0.3])
    sampler = GlobalOrderSampler(
        len(blend), lambda epoch: blend.epoch_order(3, epoch), 100, 1, 0, 1
    )
    ids = sampler.samples(0, 10_000)
    sources = Counter(j for j, _ in blend.locate(ids))
    assert abs(sources[0] / 10_000 - 0.7) <= 0.02 and abs(sources[1] / 10_000 - 0.3) <= 0.02
    # deterministic, and each source's samples are drawn evenly (its epochs, one after another)
    assert (blend.epoch_order(3, 0) == BlendedDataset([a, b], [0.7, 0.3]).epoch_order(3, 0)).all()
    draws = Counter(i for j, i in blend.locate(ids) if j == 1)
    assert max(draws.values()) - min(draws.values()) <= 1 and len(draws) == len(b)


# ---------------------------------------------------------------------------------------------
# refusals before launch
# ---------------------------------------------------------------------------------------------


def refused(*overrides: str) -> str:
    plan = make_plan(["data=shards", "tracker=none", *SEQ, *overrides], ["slowfs"])
    return "\n".join(plan.problems)


def test_bad_shard_input_is_refused_before_launch(
    tmp_path, small_shards, bpe_shards, other_small_shards, capsys
):
    assert refused(f"data.path={small_shards}") == ""
    # every source's index is checked, and all problems are reported at once
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "work").mkdir()  # what an unfinished prepare leaves
    sources = {
        tmp_path: "holds no index.json: make one with `plait prepare data.path=<text "
        f"files> out={tmp_path}`",
        partial: "its plait prepare did not finish: run the same plait prepare again",
    }
    for name, damage, message in [
        ("index.json", lambda p: p.write_text("{"), "index.json or documents.npy is corrupt"),
        ("documents.npy", lambda p: p.write_bytes(b"x"), "index.json or documents.npy is corrupt"),
        (
            shard_name(1),
            lambda p: p.write_bytes(p.read_bytes()[:100]),
            f"{shard_name(1)} holds 100 bytes, not 5120",
        ),
        (shard_name(2), lambda p: p.unlink(), f"{shard_name(2)} is missing"),
    ]:
        broken = tmp_path / name.replace(".", "_")
        shutil.copytree(small_shards, broken)
        damage(broken / name)
        sources[broken] = f"{message}" + ".*" + f": run plait prepare again with out={broken}$"
    sources["nosuch://x"] = "cannot be reached"
    listed = ", ".join(f"{{path: {path}}}" for path in sources)
    problems = refused(f"data.sources=[{listed}]").splitlines()
    assert len(problems) == len(sources)
    for k, (problem, message) in enumerate(zip(problems, sources.values())):
        assert re.search(f"data.sources\\[{k}\\].path=.*{message}", problem), problem
    # settings that do not fit the data
    assert re.search(
        "the sources were tokenized differently.*\n.*the model's output has 256 ids, "
        "fewer than the tokenizer's vocabulary of 512 .*: set model.vocab_size=512",
        refused(f"data.sources=[{{path: {small_shards}}}, {{path: {bpe_shards}}}]"),
    )
    assert "weights [0.5, -0.5] must be non-negative and sum to a positive number" in refused(
        f"data.sources=[{{path: {small_shards}, weight: 0.5}}, "
        f"{{path: {other_small_shards}, weight: -0.5}}]"
    )
    assert re.search(
        "data.cache_limit_gb=1e-06 is smaller than one shard of slow://.*\n.*fewer "
        "than one global batch of train.batch_size=4096",
        refused(
            f"data.path=slow://{small_shards}",
            "data.cache_limit_gb=0.000001",
            "train.batch_size=4096",
        ),
    )
    assert re.search(
        "train.eval_every=5: the validation split holds 0 samples .* fewer than "
        "one per-rank batch of 4: raise data.val_fraction",
        refused(f"data.path={small_shards}", "train.eval_every=5", "data.val_fraction=0"),
    )
    out_of_range = refused(
        f"data.path={small_shards}",
        "data.shuffle_block=0",
        "data.num_workers=-1",
        "data.prefetch=0",
    )
    for setting in ("data.shuffle_block=0", "data.num_workers=-1", "data.prefetch=0"):
        assert f"{setting} is out of range" in out_of_range
    # what a user sees: exit 2, the message, no run directory
    assert (
        main(
            [
                "train",
                "data=shards",
                f"data.path={tmp_path}",
                f"run.root={tmp_path}/runs",
                "tracker=none",
            ]
        )
        == 2
    )
    assert "holds no index.json" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# the node-local cache
# ---------------------------------------------------------------------------------------------


def test_cache_fetches_once_and_stays_under_its_limit_with_concurrent_readers(
    small_shards, tmp_path, monkeypatch
):
    """Four threads read random windows through a cache holding 2.5 of the 5 shards."""
    monkeypatch.setenv("PLAIT_SLOWFS_LOG", str(tmp_path / "fetches.log"))
    monkeypatch.setenv("PLAIT_SLOWFS_BYTES_PER_S", "2000000")
    index = read_index(f"slow://{small_shards}")
    cache = NodeCache(index.root, tmp_path / "cache", limit_bytes=int(2.5 * index.shard_bytes(0)))
    cache.ensure(shard_name(0), index.shard_bytes(0))
    cache.ensure(shard_name(0), index.shard_bytes(0))
    assert len(slowfs.fetches(tmp_path / "fetches.log")) == 1
    local = LocalShards(read_index(str(small_shards)))
    peak, done, errors = [0], threading.Event(), []

    def watch():
        while not done.wait(0.002):
            peak[0] = max(peak[0], cache.usage())

    def read(seed):
        rng = np.random.default_rng(seed)
        for _ in range(40):
            k = int(rng.integers(len(index.shard_sizes)))
            data = cache.read(shard_name(k), index.shard_bytes(k), 1024 + 2 * 100, 2 * 50)
            if np.frombuffer(data, np.uint16).tolist() != local.read(k, 100, 50).tolist():
                errors.append(k)

    watcher = threading.Thread(target=watch)
    watcher.start()
    readers = [threading.Thread(target=read, args=(s,)) for s in range(4)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    done.set()
    watcher.join()
    assert not errors
    assert peak[0] <= cache.limit_bytes
    assert cache.usage() <= cache.limit_bytes  # what the watcher may have missed
    # 5 shards through room for 2.5: shards were evicted and fetched again (a polling watcher
    # cannot prove the cache filled up on a loaded machine; the fetch log can)
    assert len(slowfs.fetches(tmp_path / "fetches.log")) > len(index.shard_sizes)


def test_cache_evicts_the_least_recently_used_shard(small_shards, tmp_path, monkeypatch):
    """Room for 2 of 3 equal shards. A and B are fetched, A is read again, C is fetched: B, the
    least recently used though fetched after A, is evicted. Then C is read, B fetched again:
    now A goes. (Oldest-fetched-first would evict A first; by name, shard 0 every time.)"""
    monkeypatch.setenv("PLAIT_SLOWFS_LOG", str(tmp_path / "fetches.log"))
    monkeypatch.setenv("PLAIT_SLOWFS_BYTES_PER_S", "1e9")
    index = read_index(f"slow://{small_shards}")
    a, b, c = (shard_name(k) for k in range(3))
    size = index.shard_bytes(0)
    assert index.shard_bytes(1) == index.shard_bytes(2) == size
    cache = NodeCache(index.root, tmp_path / "cache", limit_bytes=2 * size)

    def use(*steps) -> list[str]:
        """Each step ``("fetch" | "read", name)``, 50 ms apart (beyond the file system's
        timestamp granularity); the shards held afterwards."""
        for kind, name in steps:
            time.sleep(0.05)
            if kind == "fetch":
                cache.ensure(name, size)
            else:
                cache.read(name, size, 0, 16)
        return sorted(p.name for p in cache.dir.iterdir() if not p.name.startswith("."))

    assert use(("fetch", a), ("fetch", b), ("read", a), ("fetch", c)) == [a, c]
    assert use(("read", c), ("fetch", b)) == [b, c]
    assert [name for _, _, name in slowfs.fetches(tmp_path / "fetches.log")] == [a, b, c, b]


def test_prefetch_shards_fetches_that_many_shards_ahead_of_the_loader():
    """The order of fetch events against the loader's progress (``advance``), each step reading
    a shard of its own: with ``data.prefetch_shards=2`` the shards of steps 0 and 1 are fetched
    before the loader moves on, and each step it moves on lets one more be fetched; with 3,
    three; with 0, none ahead (the loader fetches what it reads itself)."""
    import threading

    def events_for(depth: int) -> list[str]:
        events, fetched = [], threading.Semaphore(0)

        def fetch(key):
            events.append(f"fetch {key}")
            fetched.release()

        prefetcher = ShardPrefetcher(iter([[k] for k in range(8)]), lambda ids: ids, fetch, depth)
        try:
            for step in range(1, 5):
                for _ in range(depth if step == 1 else min(depth, 1)):
                    assert fetched.acquire(timeout=60), events
                time.sleep(0.2)  # time enough to fetch beyond the depth, had it done so
                if step < 4:
                    events.append(f"advance {step}")
                    prefetcher.advance(step)
        finally:
            prefetcher.stop()
        return events

    assert events_for(2) == [
        "fetch 0",
        "fetch 1",
        "advance 1",
        "fetch 2",
        "advance 2",
        "fetch 3",
        "advance 3",
        "fetch 4",
    ]
    assert events_for(3) == [
        "fetch 0",
        "fetch 1",
        "fetch 2",
        "advance 1",
        "fetch 3",
        "advance 2",
        "fetch 4",
        "advance 3",
        "fetch 5",
    ]
    assert events_for(0) == ["advance 1", "advance 2", "advance 3"]


# ---------------------------------------------------------------------------------------------
# training on shards (real runs)
# ---------------------------------------------------------------------------------------------


def global_steps(record: Path, dp: int) -> list[list[str]]:
    """The rows each step fed the model, ranks in order (one list of attempts per rank)."""
    ranks = [inhouse.recorded_steps(record, r) for r in range(dp)]
    return [
        [row for rank in ranks for row in rank[attempt][step]]
        for attempt in range(len(ranks[0]))
        for step in range(len(ranks[0][attempt]))
    ]


@pytest.mark.slow
def test_dp2_feeds_the_samples_of_dp1_and_a_killed_run_resumes_exactly_at_any_dp(
    small_shards, tmp_path
):
    """dp=1 with 2 accumulation steps is the reference. A dp=2 run whose rank 0 is SIGKILLed
    after step 5 (checkpoint at 4) fed the same rows; resumed at dp=1 it continues with the
    reference's steps 5-8, and resumed at dp=2 as well."""
    common = [
        *SEQ,
        "data=shards",
        f"data.path={small_shards}",
        "train.steps=8",
        "optimizer.decay_steps=8",
        "checkpoint.every=2",
        "checkpoint.keep_last=0",
    ]
    one = [*common, "launcher.nproc_per_node=1", "train.grad_accum_steps=2"]
    reference = run_losses(tmp_path / "ref", one, [inhouse.RecordBatches(tmp_path / "rec_ref")])
    expected = global_steps(tmp_path / "rec_ref", 1)
    assert len(expected) == 8 and len(set(map(tuple, expected))) == 8

    killed = tmp_path / "killed"
    with pytest.raises(Exception):
        run_training(
            killed,
            [*common, "launcher.nproc_per_node=2"],
            [inhouse.RecordBatches(tmp_path / "rec_killed", kill_at=5)],
        )
    assert global_steps(tmp_path / "rec_killed", 2)[:4] == expected[:4]

    # at dp=1, in a new run directory, from the killed run's last checkpoint (step 4)
    run_training(
        tmp_path / "dp1", [*one, f"resume={killed}"], [inhouse.RecordBatches(tmp_path / "rec_dp1")]
    )
    assert global_steps(tmp_path / "rec_dp1", 1) == expected[4:]
    # at dp=2, in place
    run_training(
        killed,
        [*common, "launcher.nproc_per_node=2", "resume=latest"],
        [inhouse.RecordBatches(tmp_path / "rec_killed")],
    )
    assert global_steps(tmp_path / "rec_killed", 2)[-4:] == expected[4:]
    resumed = [m["loss"] for m in read_metrics(killed)][-4:]
    assert resumed == pytest.approx(reference[4:], rel=1e-5)


@pytest.mark.slow
def test_a_slow_remote_is_fetched_once_per_node_then_read_from_the_cache(
    small_shards, tmp_path, monkeypatch
):
    """Two ranks on one node, two epochs from ``slow://``, a DataLoader worker each: every
    shard is fetched once, all in the first epoch, and the cache never exceeds its limit (the
    size of the shards: no room to spare)."""
    log = tmp_path / "fetches.log"
    monkeypatch.setenv("PLAIT_SLOWFS_LOG", str(log))
    monkeypatch.setenv("PLAIT_SLOWFS_BYTES_PER_S", "50000")
    index = read_index(str(small_shards))
    limit = sum(index.shard_bytes(k) for k in range(len(index.shard_sizes)))
    dataset = dataset_of(small_shards)
    needed = sorted(shard_name(k) for k in dataset.shard_keys(list(range(len(dataset)))))
    epoch_steps = -(-len(dataset) // 8)
    cache = NodeCache(f"slow://{small_shards}", tmp_path / "cache", limit)
    peak, done = [0], threading.Event()

    def watch():
        while not done.wait(0.002):
            peak[0] = max(peak[0], cache.usage() if cache.root.exists() else 0)

    watcher = threading.Thread(target=watch)
    watcher.start()
    clock = tmp_path / "clock"
    try:
        run_training(
            tmp_path / "run",
            [
                *SEQ,
                "data=shards",
                f"data.path=slow://{small_shards}",
                f"data.cache_dir={tmp_path / 'cache'}",
                f"data.cache_limit_gb={limit / 2**30}",
                "data.val_fraction=0",
                "data.num_workers=1",
                "launcher.nproc_per_node=2",
                f"train.steps={2 * epoch_steps}",
                "+plugins=[slowfs]",
            ],
            [StepClock(clock)],
        )
    finally:
        done.set()
        watcher.join()
    fetched = slowfs.fetches(log)
    assert len(needed) >= 4 and sorted(name for _, _, name in fetched) == needed
    end_of_epoch_1 = float(clock.read_text().split()[epoch_steps - 1])
    assert max(t for t, _, _ in fetched) < end_of_epoch_1
    assert 0 < peak[0] <= limit


@pytest.mark.slow
def test_a_model_trains_on_bpe_shards(bpe_shards, tmp_path):
    losses = run_losses(
        tmp_path / "run",
        [
            "data=shards",
            f"data.path={bpe_shards}",
            "model.vocab_size=512",
            "train.steps=30",
            "train.seq_len=64",
            "train.batch_size=16",
            "optimizer.lr=3e-3",
            "launcher.nproc_per_node=1",
        ],
    )
    assert losses[0] == pytest.approx(np.log(512), abs=0.3)  # uniform over the 512 ids
    assert np.mean(losses[-5:]) < losses[0] - 0.75
