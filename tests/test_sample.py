"""``plait sample``: a continuation of a prompt by a checkpoint's model, decoded with the tokenizer
the run's data was made with. plait's GPT runs nanoGPT's loop (here on bytes, ``data=stdlib``);
a ``model=hf`` run uses ``transformers``' ``generate`` (``tests/test_hf.py``, from a pp=2 x tp=2
checkpoint). One 1-process run of 3 steps serves every test."""

from __future__ import annotations

import pytest
import torch

from plait.cli import main
from plait.export import consolidate
from plait.testing import run_training


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sample") / "gpt"
    run_training(run_dir, ["train.steps=3", "launcher.nproc_per_node=1"])
    return run_dir


def sampled(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["sample", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_greedy_sample_is_the_checkpoints_most_likely_bytes(gpt_run, capsys):
    found = consolidate(str(gpt_run))
    found.model.load_state_dict(found.state, assign=True)
    ids = list(b"def ")
    with torch.no_grad():
        for _ in range(20):
            ids.append(int(found.model(torch.tensor([ids[-64:]]))[0, -1].argmax()))
    expected = bytes(ids).decode("utf-8", errors="replace")
    assert (
        sampled(capsys, str(gpt_run), "prompt=def ", "max_new_tokens=20", "temperature=0")
        == expected + "\n"
    )


@pytest.mark.slow
def test_sampling_follows_its_seed_and_top_k(gpt_run, capsys):
    args = [str(gpt_run), "prompt=import ", "max_new_tokens=30", "temperature=1.0"]
    first = sampled(capsys, *args, "seed=1")
    assert sampled(capsys, *args, "seed=1") == first
    assert sampled(capsys, *args, "seed=2") != first
    greedy = sampled(capsys, str(gpt_run), "prompt=import ", "max_new_tokens=30", "temperature=0")
    assert sampled(capsys, *args, "top_k=1", "seed=3") == greedy  # only the likeliest is left
    assert len(first.encode()) >= len("import ") + 30  # 30 new bytes (a few may not decode)


@pytest.mark.slow
def test_bad_sample_and_export_settings_are_refused(gpt_run, capsys):
    capsys.readouterr()
    assert main(["sample", str(gpt_run), "max_new_tokens=0", "temperature=-1", "top_k=0"]) == 2
    err = capsys.readouterr().err
    for message in (
        "max_new_tokens=0 is out of range: set max_new_tokens >= 1",
        "temperature=-1.0 is out of range: set temperature >= 0",
        "top_k=0 is out of range: set top_k >= 1",
    ):
        assert message in err
    assert "Traceback" not in err
    assert main(["sample", str(gpt_run), "temperature=hot"]) == 2
    assert "temperature=hot is not a number" in capsys.readouterr().err
    assert main(["export", str(gpt_run), "format=hf"]) == 2
    assert (
        "format=hf: no active plugin writes it; choose format=pt or a format of the run's "
        "model (format=hf for model=hf)" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_a_checkpoint_no_plugin_reads_is_refused_by_name(gpt_run, tmp_path, capsys):
    """The run's copy, as if strategy=local_sgd (whose plugin has no offline reader) had written
    it: export and sample say so, without a traceback."""
    import shutil

    from omegaconf import OmegaConf

    copy = tmp_path / "local_sgd"
    shutil.copytree(gpt_run, copy)
    cfg = OmegaConf.load(copy / "config.yaml")
    cfg.strategy.name = "local_sgd"
    OmegaConf.save(cfg, copy / "config.yaml")
    for command in (["export", str(copy)], ["sample", str(copy), "max_new_tokens=1"]):
        capsys.readouterr()
        assert main(command) == 2
        err = capsys.readouterr().err
        assert (
            "no active plugin reads the checkpoints of strategy=local_sgd offline "
            "(plait_read_model_shards), so it cannot be exported or sampled from" in err
        )
        assert "Traceback" not in err
