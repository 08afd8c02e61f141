"""``plait prepare`` on the formats corpora ship in, cut into parallel tasks, and the shards'
checksums on read.

The documents are ~40 of the standard library's source files and a few written here (unicode,
CRLF, blank lines, leading and trailing spaces): ~150 kB. The reference is HF ``tokenizers``
itself: ``Tokenizer.from_file(...).encode_batch`` of each document whole. The S3 endpoint is
moto's standalone server (``moto.server.ThreadedMotoServer``) on 127.0.0.1, reached by s3fs
through ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import slowfs  # noqa: F401  (the slow:// remote of the cache tests)
from omegaconf import OmegaConf

from plait.plugins.data import formats, stdlib_sources
from plait.plugins.data.cache import NodeCache
from plait.plugins.data.cutting import text_cuts
from plait.plugins.data.formats import Piece, Source, open_file
from plait.plugins.data.index import ShardChecksumError, read_index, shard_name
from plait.plugins.data.prepare import PrepareDataConfig, make_plan, prepare
from plait.plugins.data.shard_dataset import CachedShards, LocalShards, ShardDataset
from plait.plugins.data.tokenizer import (
    EOT,
    ByteTokenizer,
    load_model_tokenizer,
    load_tokenizer_file,
    train_bpe,
)
from plait.testing import TEST_OVERRIDES, free_port, run_losses

WRITTEN = [
    "  leading and trailing spaces  ",
    "ünïcödé ☃ 😀 and CRLF\r\nlines\r\n",
    "tabs\tand\n\n\nblank lines\n   indented\nend",
    "x" * 3000 + "\n" + "y " * 500,
]


def prepare_into(out, path, **settings):
    data = OmegaConf.structured(PrepareDataConfig(path=path, **settings))
    return prepare(data, out, log=lambda message: None)


@pytest.fixture(scope="module")
def documents() -> list[str]:
    texts = [p.read_text() for p in stdlib_sources() if 1_000 < p.stat().st_size < 6_000][:40]
    return texts[:20] + WRITTEN + texts[20:]


@pytest.fixture(scope="module")
def tokenizer_file(documents, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_bpe(documents, 512).json)
    return path


def expected_stream(tokenizer_file: Path, documents: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """What HF tokenizers gives for each document whole, each ended by <|endoftext|>: the token
    stream and the document offsets."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eot = tokenizer.token_to_id(EOT)
    ids = [e.ids + [eot] for e in tokenizer.encode_batch(documents)]
    offsets = np.concatenate([[0], np.cumsum([len(i) for i in ids])])
    return np.concatenate(ids), offsets


def stream_of(directory) -> tuple[np.ndarray, np.ndarray]:
    index = read_index(str(directory))
    dataset = ShardDataset(index, LocalShards(index), 8, "train", False, 0.0, False, 1)
    return dataset.tokens(0, index.total_tokens).astype(np.int64), index.documents


def shard_files(directory: Path) -> dict[str, bytes]:
    """Every file but index.json, and index.json without its fingerprint (which names the
    inputs)."""
    files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "index.json"}
    index = json.loads((directory / "index.json").read_text())
    index.pop("fingerprint")
    return files | {"index.json": index}


def write_corpus(root: Path, documents: list[str], hf_cache: Path) -> dict[str, str]:
    """The documents in every format, each a value of data.path."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir()
    lines = b"".join(
        json.dumps({"id": i, "text": t}).encode() + b"\n" for i, t in enumerate(documents)
    )
    (root / "corpus.jsonl").write_bytes(lines)
    (root / "corpus.jsonl.gz").write_bytes(gzip.compress(lines))
    half = lines.index(b"\n", len(lines) // 2) + 1  # two zstd frames, as pzstd writes
    (root / "corpus.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(lines[:half])
        + zstandard.ZstdCompressor().compress(lines[half:])
    )
    (root / "corpus.json.bz2").write_bytes(bz2.compress(lines))
    (root / "corpus.ndjson.xz").write_bytes(lzma.compress(lines))
    table = pa.table(
        {
            "id": list(range(len(documents))),
            "text": documents,
            "url": [f"https://example.org/{i}" for i in range(len(documents))],
        }
    )
    pq.write_table(table, root / "corpus.parquet", row_group_size=5)
    (root / "text").mkdir()
    for i, t in enumerate(documents):
        (root / "text" / f"{i:04d}.txt").write_bytes(t.encode())
    rows = datasets.Dataset.from_dict({"text": documents, "id": list(range(len(documents)))})
    datasets.DatasetDict({"train": rows, "validation": rows.select([0])}).save_to_disk(
        root / "saved"
    )
    write_hf_cache(root / "corpus.jsonl", hf_cache)
    return {
        "jsonl": str(root / "corpus.jsonl"),
        "jsonl.gz": str(root / "corpus.jsonl.gz"),
        "jsonl.zst": str(root / "corpus.jsonl.zst"),
        "json.bz2": str(root / "corpus.json.bz2"),
        "ndjson.xz": str(root / "corpus.ndjson.xz"),
        "parquet": str(root / "corpus.parquet"),
        "text files": str(root / "text"),
        "save_to_disk": str(root / "saved"),
        "HF cache": "plait-test/tiny-corpus",
    }


def write_hf_cache(jsonl: Path, cache: Path) -> None:
    """``plait-test/tiny-corpus`` in a Hugging Face datasets cache as ``load_dataset`` leaves a
    hub dataset (``<org>___<name>/default/0.0.0/<revision>/``), made offline with datasets'
    own json builder; nothing is downloaded."""
    from datasets.packaged_modules.json.json import Json

    builder = Json(
        cache_dir=str(cache),
        dataset_name="tiny-corpus",
        hash="0" * 40,
        data_files={"train": [str(jsonl)]},
    )
    builder.download_and_prepare()
    built = Path(builder.cache_dir).parents[1]  # <cache>/tiny-corpus/default-<hash>
    target = cache / "plait-test___tiny-corpus"
    target.mkdir()
    shutil.move(built, target / "default")


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """A Hugging Face datasets cache of this module's own, and the hub switched off."""
    import datasets.config

    cache = tmp_path_factory.mktemp("hf-cache")
    previous = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(cache)
    os.environ["HF_DATASETS_CACHE"] = str(cache)
    yield cache
    datasets.config.HF_DATASETS_CACHE = previous
    os.environ.pop("HF_DATASETS_CACHE")


@pytest.fixture(scope="module")
def corpus(documents, hf_cache, tmp_path_factory) -> dict[str, str]:
    return write_corpus(tmp_path_factory.mktemp("formats") / "corpus", documents, hf_cache)


@pytest.fixture(scope="module")
def jsonl_shards(corpus, tokenizer_file, tmp_path_factory) -> Path:
    return prepare_into(
        tmp_path_factory.mktemp("ref") / "out",
        corpus["jsonl"],
        tokenizer=str(tokenizer_file),
        shard_tokens=4096,
        num_workers=1,
    )


# ---------------------------------------------------------------------------------------------
# every format: HF tokenizers on each document whole, and the .jsonl's shards
# ---------------------------------------------------------------------------------------------

FORMATS = [
    "jsonl",
    "jsonl.gz",
    "jsonl.zst",
    "json.bz2",
    "ndjson.xz",
    "parquet",
    "text files",
    "save_to_disk",
    "HF cache",
]


@pytest.mark.parametrize("kind", FORMATS)
def test_each_format_gives_the_tokens_of_each_document_encoded_whole(
    kind, corpus, documents, tokenizer_file, jsonl_shards, tmp_path
):
    """2 workers, tasks of ~20 kB (JSON lines cut at lines, parquet at its row groups of 5,
    datasets at rows); the reference .jsonl was prepared by 1 worker in one task."""
    out = prepare_into(
        tmp_path / "out",
        corpus[kind],
        tokenizer=str(tokenizer_file),
        shard_tokens=4096,
        num_workers=2,
        task_mb=0.02,
    )
    stream, documents_at = stream_of(out)
    expected, offsets = expected_stream(tokenizer_file, documents)
    assert len(documents_at) == len(documents) + 1 and (documents_at == offsets).all()
    assert np.array_equal(stream, expected)
    assert shard_files(out) == shard_files(jsonl_shards)


@pytest.mark.parametrize("kind", ["jsonl.zst", "parquet", "save_to_disk"])
def test_data_text_reads_the_formats_too(kind, corpus, documents, tmp_path):
    """``data=text`` on compressed JSON lines, parquet, a datasets directory: the byte tokens
    of each document and a newline, as for the same documents in text files."""
    from plait.plugins import data as data_plugin
    from plait.testing import compose

    cfg = compose(
        ["data=text", f"data.path={corpus[kind]}", f"data.cache_dir={tmp_path}", "device=cpu"]
    )
    path, _ = data_plugin.token_file(cfg, 0, "train")
    expected = b"".join(d.encode() + b"\n" for d in documents)
    assert bytes(np.fromfile(path, dtype=np.uint16).astype(np.uint8)) == expected


# ---------------------------------------------------------------------------------------------
# one large text file, cut into parallel tasks
# ---------------------------------------------------------------------------------------------

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
    r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def llama3_style(documents: list[str], directory: Path) -> Path:
    """A model directory whose tokenizer is Llama 3's kind: its split pattern before byte-level
    BPE, a template adding <|begin_of_text|> to every sequence, <|end_of_text|> as the model's
    end-of-text (tokenizer_config.json)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        documents,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<|end_of_text|>"}')
    return directory


def metaspace_style(documents: list[str], path: Path) -> Path:
    """SentencePiece's kind: '▁' for spaces, prepended to the first word of every input: a cut
    would add one, so its documents are never cut."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.train_from_iterator(
        documents, trainers.BpeTrainer(vocab_size=600, special_tokens=[EOT], show_progress=False)
    )
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def big_file(documents, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big") / "book.txt"
    path.write_text("\n".join(documents))
    return path


@pytest.mark.parametrize("kind", ["bytes", "bpe", "llama3", "metaspace"])
def test_one_large_file_cut_into_tasks_gives_the_tokens_of_the_file_encoded_whole(
    kind, big_file, documents, tokenizer_file, tmp_path
):
    """~150 kB in one file, pieces of ~10 kB: as many tasks as cuts the tokenizer makes exactly
    (none for SentencePiece's kind), and the tokens of the whole file encoded at once,
    with the document's special tokens once (Llama 3's <|begin_of_text|> first,
    <|end_of_text|> last); the same for 1 worker in 1 task and 2 workers in ~15."""
    spec = {
        "bytes": "bytes",
        "bpe": str(tokenizer_file),
        "llama3": str(llama3_style(documents, tmp_path / "llama3")),
        "metaspace": str(metaspace_style(documents, tmp_path / "metaspace.json")),
    }[kind]
    tokenizer = {
        "bytes": None,
        "bpe": lambda: load_tokenizer_file(spec),
        "llama3": lambda: load_model_tokenizer(spec),
        "metaspace": lambda: load_tokenizer_file(spec),
    }[kind]
    text = big_file.read_bytes()
    if tokenizer is None:
        expected = np.frombuffer(text, dtype=np.uint8)
        cuts = text_cuts(lambda a, n: text[a : a + n], len(text), 10_000, ByteTokenizer())
    else:
        wrapped = tokenizer()
        plain = wrapped.tokenizer.encode(text.decode()).ids  # the library, whole, specials on
        expected = np.array(plain + [wrapped.eot], dtype=np.int64)
        cuts = text_cuts(lambda a, n: text[a : a + n], len(text), 10_000, wrapped)
    assert (len(cuts) > 10) == (kind != "metaspace") and len(cuts) < 16
    assert all(text[c - 1 : c] == b"\n" for c in cuts)
    one = prepare_into(
        tmp_path / "one", str(big_file), tokenizer=spec, shard_tokens=8192, num_workers=1
    )
    many = prepare_into(
        tmp_path / "many",
        str(big_file),
        tokenizer=spec,
        shard_tokens=8192,
        num_workers=2,
        task_mb=0.01,
    )
    stream, documents_at = stream_of(many)
    assert np.array_equal(stream, expected) and documents_at.tolist() == [0, len(expected)]
    assert shard_files(many) == shard_files(one)


# ---------------------------------------------------------------------------------------------
# tasks sized for speed: guided sizes, a compressed file decompressed once per worker
# ---------------------------------------------------------------------------------------------


def test_tasks_shrink_as_the_text_left_does_so_the_workers_finish_together():
    """data.task_mb=null, 22 pieces of 1 MiB of JSON lines, 2 workers: each task takes a
    quarter of what is left (whole pieces, at least 1 MiB), large first, 1 MiB ones last --
    not 8 tasks of 3 MiB, where one worker does 4 and the other 3 (22 against 18 MiB of work)."""
    mb = 1 << 20
    source = Source("corpus.jsonl", "jsonl", None, "key", 22 * mb)
    pieces = [[Piece(0, i * mb, (i + 1) * mb, mb) for i in range(22)]]
    data = OmegaConf.structured(PrepareDataConfig(path="corpus.jsonl"))
    plan = make_plan([source], pieces, ByteTokenizer(), data, slots=2, print_="print")
    assert [b // mb for b in plan["task_bytes"]] == [6, 4, 3, 3, 2, 1, 1, 1, 1]
    assert plan["tasks"][0] == [[0, 0, 6 * mb]]


def test_a_worker_decompresses_a_compressed_file_once_across_its_tasks(
    corpus, tokenizer_file, jsonl_shards, tmp_path, monkeypatch
):
    """One worker, ~7 tasks of one .jsonl.gz: the file is opened twice (the scan, then the
    tasks, each going on from where the last one stopped), not once per task; same shards."""
    opened = []

    def counting_open(path):
        opened.append(path)
        return open_file(path)

    monkeypatch.setattr(formats, "open_file", counting_open)
    out = prepare_into(
        tmp_path / "out",
        corpus["jsonl.gz"],
        tokenizer=str(tokenizer_file),
        shard_tokens=4096,
        num_workers=1,
        task_mb=0.02,
    )
    assert opened == [corpus["jsonl.gz"]] * 2
    assert shard_files(out) == shard_files(jsonl_shards)


# ---------------------------------------------------------------------------------------------
# checksums on read
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def shards_copy(jsonl_shards, tmp_path) -> Path:
    return Path(shutil.copytree(jsonl_shards, tmp_path / "shards"))


def flip_byte(path: Path, at: int = 2000) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-2])


@pytest.mark.parametrize("damage", [flip_byte, truncate])
def test_a_damaged_shard_is_refused_as_it_enters_the_cache(damage, shards_copy, tmp_path):
    """The remote (slow://, read after its index was) has shard 1 damaged: fetching it
    raises, naming the shard, its checksum and the index's (or both sizes); nothing of it is
    left in the cache. The other shards enter."""
    index = read_index(f"slow://{shards_copy}")
    damage(shards_copy / shard_name(1))
    cache = NodeCache(index.root, tmp_path / "cache", None)
    cache.ensure(shard_name(0), index.shard_bytes(0), index.checksums[0])
    with pytest.raises(ShardChecksumError) as refused:
        cache.ensure(shard_name(1), index.shard_bytes(1), index.checksums[1])
    message = str(refused.value)
    assert f"shard slow://{shards_copy}/{shard_name(1)} is" in message
    if damage is flip_byte:
        assert f"index.json records {index.checksums[1]}" in message
    else:
        assert (
            f"{index.shard_bytes(1) - 2} bytes, but index.json records "
            f"{index.shard_bytes(1)}" in message
        )
    assert sorted(p.name for p in cache.dir.iterdir() if not p.name.endswith(".lock")) == [
        shard_name(0)
    ]


@pytest.mark.parametrize("damage", [flip_byte, truncate])
def test_data_verify_refuses_a_damaged_shard_read_in_place_or_from_the_cache(
    damage, shards_copy, tmp_path
):
    """A local directory read in place, and a cached copy damaged after it entered the cache:
    with verify (data.verify=true) the first read of the damaged shard raises, naming the file
    and both checksums; without it (the default) the local one is read as it is."""
    index = read_index(str(shards_copy))
    cached = NodeCache(f"file://{shards_copy}", tmp_path / "cache", None)
    remote = read_index(cached.remote)
    path = cached.ensure(shard_name(1), remote.shard_bytes(1), remote.checksums[1])
    damage(path)
    damage(shards_copy / shard_name(1))
    for reader, name in [
        (LocalShards(index, verify=True), shards_copy / shard_name(1)),
        (CachedShards(remote, cached, verify=True), path),
    ]:
        reader.read(0, 0, 16)
        with pytest.raises(ShardChecksumError, match=f"shard {name} is"):
            reader.read(1, 0, 16)
    assert len(LocalShards(index, verify=False).read(1, 0, 16)) == 16


# ---------------------------------------------------------------------------------------------
# an S3 corpus, prepared and trained on
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server on 127.0.0.1 (a real HTTP endpoint, in a thread of this process),
    and the environment that points boto (s3fs, in every process) at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }.items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield s3fs.S3FileSystem()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.mark.slow
def test_an_s3_corpus_is_prepared_and_trained_on_through_data_shards(
    s3, corpus, tokenizer_file, jsonl_shards, tmp_path
):
    """A .jsonl.zst and a parquet file in s3://corpus, prepared by `plait prepare` into
    s3://shards, equal the local .jsonl's shards (the documents twice over); `plait train
    data=shards data.path=s3://shards/run` trains on them through the node-local cache. A shard
    with a flipped byte in the bucket then stops a run with a fresh cache, by name."""
    s3.mkdir("corpus")
    s3.mkdir("shards")
    s3.put(corpus["jsonl.zst"], "corpus/web/part-0.jsonl.zst")
    s3.put(corpus["parquet"], "corpus/web/part-1.parquet")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "prepare",
            "data.path=s3://corpus/web",
            "out=s3://shards/run",
            f"data.tokenizer={tokenizer_file}",
            "data.shard_tokens=4096",
            "data.task_mb=0.05",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    local = prepare_into(
        tmp_path / "twice",
        [corpus["jsonl"], corpus["save_to_disk"]],
        tokenizer=str(tokenizer_file),
        shard_tokens=4096,
    )
    s3.get("shards/run", str(tmp_path / "from_s3"), recursive=True)
    assert shard_files(tmp_path / "from_s3") == shard_files(local)
    assert len(shard_files(local)) > 4

    train = [
        "data=shards",
        "data.path=s3://shards/run",
        "model.vocab_size=512",
        "train.steps=4",
        "train.seq_len=32",
        "train.batch_size=8",
        "checkpoint.save_final=false",
        "launcher.nproc_per_node=1",
    ]
    losses = run_losses(tmp_path / "run", [*train, f"data.cache_dir={tmp_path}/cache"])
    assert len(losses) == 4 and np.isfinite(losses).all()
    assert len(list((tmp_path / "cache" / "shards").glob("*/shard_*.bin"))) >= 1

    blob = bytearray(s3.cat_file(f"shards/run/{shard_name(0)}"))
    blob[3000] ^= 0x01
    s3.pipe_file(f"shards/run/{shard_name(0)}", bytes(blob))
    expected = read_index("s3://shards/run").checksums[0]
    failed = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "train",
            *TEST_OVERRIDES,
            *train,
            "train.steps=2",
            "data.shuffle=false",
            "tracker=none",
            f"data.cache_dir={tmp_path}/fresh",
            f"run.root={tmp_path}/runs",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert failed.returncode != 0
    assert f"shard s3://shards/run/{shard_name(0)} is corrupt or truncated" in failed.stderr
    assert f"index.json records {expected}" in failed.stderr
