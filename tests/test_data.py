"""Token data: the embedded default, caching, and disjoint deterministic shards."""

import numpy as np
import pytest

from plait.plugins import data as data_plugin
from plait.plugins.data.sharding import GlobalOrderSampler, epoch_order_of
from plait.testing import compose


def test_stdlib_default_is_tokenized_once_and_reused(tmp_path, monkeypatch):
    sources = data_plugin.stdlib_sources()[:20]
    calls = []
    real = data_plugin.tokenize_to_cache
    monkeypatch.setattr(
        data_plugin, "tokenize_to_cache", lambda s, f, *rest: (calls.append(f), real(s, f, *rest))
    )
    first = data_plugin.cached_tokens(sources, tmp_path, local_rank=0)
    second = data_plugin.cached_tokens(sources, tmp_path, local_rank=0)
    assert first == second and len(calls) == 1
    tokens = np.memmap(first, dtype=np.uint16, mode="r")
    text = b"".join(p.read_bytes() + b"\n" for p in sources)
    assert bytes(tokens.astype(np.uint8)) == text
    assert any(p.name == "os.py" for p in data_plugin.stdlib_sources())


def test_the_stdlib_cache_is_found_without_listing_the_library(tmp_path, monkeypatch):
    """``data=stdlib``'s cache file is keyed by the interpreter (``stdlib_key``): the library's
    files are listed once, to write the file, not by every worker of every launch."""
    listed = []
    real = data_plugin.stdlib_sources
    monkeypatch.setattr(data_plugin, "stdlib_sources", lambda: listed.append(1) or real()[:20])
    cfg = compose([f"data.cache_dir={tmp_path}"])
    first, _ = data_plugin.token_file(cfg, 0, "train")
    second, _ = data_plugin.token_file(cfg, 1, "train")
    assert first == second == tmp_path / "tokens" / f"{data_plugin.stdlib_key()}.bin"
    assert len(listed) == 1


def test_a_changed_source_is_tokenized_again(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n")
    first = data_plugin.cached_tokens([corpus], tmp_path / "cache", 0)
    corpus.write_text("hello again, world\n")
    second = data_plugin.cached_tokens([corpus], tmp_path / "cache", 0)
    assert first != second


def test_windows_are_inputs_and_next_token_targets():
    windows = data_plugin.TokenWindows(np.arange(100, dtype=np.uint16), seq_len=8)
    assert len(windows) == 12
    x, y = windows.batch([0, 2])
    assert x[1].tolist() == list(range(16, 24)) and y[1].tolist() == list(range(17, 25))


def test_tokens_file_is_used_as_is(tmp_path):
    (np.arange(5000) % 256).astype(np.uint16).tofile(tmp_path / "train.bin")
    cfg = compose(["data=tokens", f"data.path={tmp_path / 'train.bin'}"])
    path, needs_split = data_plugin.token_file(cfg, 0, "train")
    assert path == tmp_path / "train.bin" and needs_split


@pytest.mark.parametrize(
    "magic,version,dtype", [(20240520, 1, np.uint16), (20240801, 7, np.uint32)]
)
def test_llmc_token_files_are_read_after_their_header(tmp_path, magic, version, dtype):
    # llm.c's dev/data/data_common.py write_datafile: 256 int32 (magic, version, count), then ids
    tokens = (np.arange(5000) * 7 % 256).astype(dtype)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [magic, version, len(tokens)]
    (tmp_path / "train.bin").write_bytes(header.tobytes() + tokens.tobytes())
    cfg = compose(["data=tokens", f"data.path={tmp_path / 'train.bin'}", "device=cpu"])
    assert np.array_equal(data_plugin.read_tokens(tmp_path / "train.bin"), tokens)
    windows = data_plugin.plait_build_dataset(cfg=cfg, topology=Local(), split="train")
    x, y = windows.batch([1])
    assert x[0].tolist() == tokens[64:128].tolist() and y[0].tolist() == tokens[65:129].tolist()


class Local:
    """The topology a dataset needs outside a process group: this rank writes the token cache
    (the first trainer on its node) and waits for nobody."""

    local_trainer_rank = 0
    trainer_group = None


def sampler(rank=0, dp=1, accum=1, batch=8, n=100):
    return GlobalOrderSampler(
        n, epoch_order_of(range(n), seed=1, shuffle=True), batch, accum, rank, dp
    )


def take(steps, k):
    return [next(steps) for _ in range(k)]


def test_dp_ranks_get_disjoint_shares_that_make_up_the_global_batch():
    two = [take(sampler(rank, dp=2).steps(0), 30) for rank in range(2)]  # 30 * 8 > 100: epochs
    one = take(sampler(accum=2).steps(0), 30)
    for step in range(30):
        a, b = two[0][step][0], two[1][step][0]
        assert not set(a) & set(b)
        assert one[step] == [a, b]  # same global batch, same micro-batch order


def test_positions_run_through_epochs_each_a_permutation():
    ids = [i for step in take(sampler(batch=10).steps(0), 30) for i in step[0]]
    for epoch in range(3):
        assert sorted(ids[epoch * 100 : (epoch + 1) * 100]) == list(range(100))
    assert ids[:100] != ids[100:200]


def test_an_epochs_order_is_numpys_permutation_of_its_seed():
    """The order earlier plaits drew (``default_rng(seed + epoch).permutation``), though drawn
    over 32-bit ids: a checkpoint they wrote resumes on the same samples."""
    order = epoch_order_of(range(100_003), seed=5, shuffle=True)
    assert np.array_equal(order(2), np.random.default_rng(7).permutation(100_003))


def test_a_position_saved_at_dp2_resumes_at_dp1_without_repeats_or_gaps():
    straight = take(sampler(accum=2).steps(0), 25)
    consumed = 17 * 8  # the state after 17 steps, whatever the dp size
    two = [take(sampler(rank, dp=2).steps(consumed), 8) for rank in range(2)]
    one = take(sampler(accum=2).steps(consumed), 8)
    assert one == straight[17:] == [[a[0], b[0]] for a, b in zip(*two)]


def test_too_little_data_for_one_batch_names_the_setting():
    with pytest.raises(ValueError, match="fewer than one global batch of train.batch_size=64"):
        sampler(batch=64, n=10)


def thread_wakes(native_id: int) -> int:
    """How often the kernel has woken this thread from a sleep (Linux's per-thread count)."""
    status = open(f"/proc/self/task/{native_id}/status").read()
    return int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])


def test_the_loader_thread_sleeps_while_its_queue_is_full():
    """A rank's train loop shares its core with the producer thread: once the queue of
    ``data.prefetch`` steps is full, the producer must sleep until a step is taken, not wake to
    ask again (a put with a 0.1 s timeout woke it ten times a second)."""
    import threading
    import time

    from plait.plugins.data.loader import StepLoader

    windows = data_plugin.TokenWindows(np.arange(10_000, dtype=np.uint16), seq_len=8)
    steps = iter(StepLoader(windows, sampler(n=len(windows)), prefetch=2))
    first = next(steps)
    assert [len(micro) for micro in first[0]] == [8, 8]  # inputs and targets, 8 samples
    (producer,) = [t for t in threading.enumerate() if t.name == "plait-loader"]
    time.sleep(0.2)  # the queue fills (2 steps)
    before = thread_wakes(producer.native_id)
    time.sleep(1.0)
    assert thread_wakes(producer.native_id) - before <= 1
    next(steps)  # a step taken: the producer wakes, makes one more and sleeps again
    steps.close()
    assert not producer.is_alive()
