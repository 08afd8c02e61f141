"""Composition of every option, and bad input refused before any worker starts."""

from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from plait.cli import main
from plait.plan import make_plan
from plait.plugins.data.prepare import PrepareDataConfig, prepare
from plait.testing import compose
from plait.types import PlanError

CONF = Path(__file__).parents[1] / "conf"
OPTIONS = sorted(
    (group.name, option.stem)
    for group in CONF.iterdir()
    if group.is_dir() and not group.name.startswith("_")
    for option in group.glob("*.yaml")
)
NEEDS = {
    ("data", "text"): ["data.path=README.md"],
    ("data", "tokens"): ["data.path=__TOKENS__"],
    ("data", "shards"): ["data.path=__SHARDS__"],
    ("model", "custom"): ["model._target_=torch.nn.Identity"],
    ("model", "hf"): ["model.path=__HF__", "model.pretrained=false"],
    # a real submit would ask a cluster first (tests/test_kubernetes.py)
    ("launcher", "kubernetes"): [
        "launcher.image=registry.example/plait:1.0",
        "launcher.dry_run=true",
    ],
}


@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_option_of_every_group_composes_and_passes_the_checks(group, option, tmp_path):
    extra = [
        o.replace("__TOKENS__", str(tmp_path / "t.bin")) for o in NEEDS.get((group, option), [])
    ]
    (tmp_path / "t.bin").write_bytes(b"\0" * 4096)  # 2048 tokens: more than one batch
    extra = [o.replace("README.md", str(CONF.parent / "README.md")) for o in extra]
    if (group, option) == ("data", "shards"):  # the README as byte shards, for the index check
        prepare(
            OmegaConf.structured(
                PrepareDataConfig(path=str(CONF.parent / "README.md"), num_workers=1)
            ),
            tmp_path / "shards",
            log=lambda message: None,
        )
        extra = [o.replace("__SHARDS__", str(tmp_path / "shards")) for o in extra]
    if (group, option) == ("model", "hf"):  # a config-only directory: random weights
        from transformers import LlamaConfig

        LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
        ).save_pretrained(tmp_path / "hf")
        extra = [o.replace("__HF__", str(tmp_path / "hf")) for o in extra]
    cfg = compose([f"{group}={option}", f"run.root={tmp_path}", *extra])
    assert cfg[group] is not None


def test_a_schema_is_stored_again_only_when_the_store_no_longer_holds_it(monkeypatch):
    """Every plan has the core and the plugins store their schemas (``plait.config.SchemaStore``):
    a schema class the store still holds from an earlier plan is not turned into a DictConfig
    again, and one that something else replaced in the store is stored again."""
    from hydra.core.config_store import ConfigStore

    compose(["strategy=zero2"])
    stored = []
    real = ConfigStore.store

    def store(self, name, node, group=None, package=None, provider=None):
        stored.append((group, name))
        real(self, name, node, group, package, provider)

    monkeypatch.setattr(ConfigStore, "store", store)
    compose(["strategy=zero2"])
    assert ("strategy", "base_zero") not in stored and (None, "base_config") not in stored
    ConfigStore.instance().store(group="strategy", name="base_zero", node={"planted": 1})
    stored.clear()
    cfg = compose(["strategy=zero2"])
    assert ("strategy", "base_zero") in stored and "planted" not in cfg.strategy


def test_unknown_option_lists_valid_choices():
    with pytest.raises(PlanError) as err:
        compose(["strategy=nosuch"])
    assert "strategy=nosuch: no such option; choose one of ddp, " in str(err.value)
    assert "base_" not in str(err.value)  # the schemas plugins store are not choices


def test_unknown_key_and_wrong_type_are_errors():
    with pytest.raises(ConfigCompositionException, match="stepz"):
        compose(["train.stepz=3"])
    with pytest.raises(ConfigCompositionException, match="train.steps"):
        compose(["train.steps=many"])


def problems(*overrides):
    return "\n".join(make_plan(overrides).problems)


def test_batch_not_divisible_by_accum_times_dp():
    text = problems("train.batch_size=10", "train.grad_accum_steps=2", "launcher.nproc_per_node=2")
    assert (
        "train.batch_size=10 is not divisible by train.grad_accum_steps(2) * dp(2) = 4: set "
        "train.batch_size to a multiple of 4"
    ) in text


def test_context_longer_than_the_model():
    assert "train.seq_len=128 is longer than the model's context model.block_size=64" in problems(
        "train.seq_len=128"
    )


def test_missing_data_path():
    assert "data.path entry /no/such/file matches no file" in problems(
        "data=text", "data.path=/no/such/file"
    )
    assert "data.path=/no/such/file does not exist" in problems(
        "data=tokens", "data.path=/no/such/file"
    )
    assert "data=text needs data.path" in problems("data=text")


def test_missing_checkpoint(tmp_path):
    text = problems(f"run.root={tmp_path}", "run.name=x", "resume=latest")
    assert f"resume=latest: no complete checkpoint found in {tmp_path}/x/checkpoints" in text
    assert "resume=/nowhere: no complete checkpoint found in /nowhere" in problems(
        "resume=/nowhere"
    )


def test_mesh_that_does_not_fill_the_world():
    assert "dp(3) * tp(1) * pp(1) != world_size(2)" in problems("parallel.dp=3")


def test_refused_train_exits_2_and_writes_nothing(tmp_path, capsys):
    code = main(["train", f"run.root={tmp_path}", "run.name=r", "train.seq_len=999"])
    assert code == 2
    assert "plait: plait refused this plan:" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_no_hydra_state_leaks_between_compositions():
    compose([])
    assert not GlobalHydra.instance().is_initialized()
