"""plait.composed: a config composed from a remembered merge equals Hydra's own compose of the
same overrides, value by value and error by error, and the merge is remembered only while what
it was read from is unchanged."""

from __future__ import annotations

import pytest
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict

from plait.composed import COMPOSED, compose
from plait.plan import CONFIG_NAME, compose_config, hydra_app
from plait.plugin_manager import make_plugin_manager
from plait.testing import TEST_OVERRIDES

PM = make_plugin_manager()


def hydras_own(overrides: list[str]) -> dict:
    with hydra_app(PM) as hydra:
        cfg = compose(hydra, CONFIG_NAME, overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg)


@pytest.mark.parametrize(
    "values",
    [
        ["run.root=/a", "train.steps=7"],
        ["run.root=/b", "++train.steps=9", "++train.new_setting=3"],
        ["model={n_layer:3,n_embd:48}", "train.seq_len=64", "parallel.tp=2"],
        ["+plugins=[my_team.fancy]", "hydra.job.chdir=true", "train.batch_size=4"],
    ],
)
def test_each_call_equals_hydras_compose_of_its_overrides(values):
    """The first call merges (``hydra.*`` settings choose what is merged), the second applies
    the values to the remembered merge."""
    overrides = [*TEST_OVERRIDES, "strategy=zero3", "comm=hierarchical", *values]
    assert OmegaConf.to_container(compose_config(overrides, PM)) == hydras_own(overrides)
    hits = COMPOSED.hits
    assert OmegaConf.to_container(compose_config(overrides, PM)) == hydras_own(overrides)
    assert COMPOSED.hits == hits + 1


def test_a_changed_returned_config_does_not_change_the_next():
    first = compose_config(["strategy=fsdp"], PM)
    first.train.steps = 12345
    del first.model
    again = compose_config(["strategy=fsdp"], PM)
    assert OmegaConf.to_container(again) == hydras_own(["strategy=fsdp"])


def test_bad_values_raise_hydras_errors():
    compose_config(["strategy=zero2"], PM)
    for bad in (["train.stepz=3"], ["train.steps=many"], ["+train.steps=3"], ["~train.nope"]):
        with pytest.raises(ConfigCompositionException) as ours:
            compose_config(["strategy=zero2", *bad], PM)
        with pytest.raises(ConfigCompositionException) as theirs:
            hydras_own(["strategy=zero2", *bad])
        assert str(ours.value) == str(theirs.value)
        assert str(ours.value.__cause__) == str(theirs.value.__cause__)
    with pytest.raises(ConfigCompositionException, match="Ambiguous value"):
        compose_config(["strategy=zero2", "train.steps=1,2"], PM)  # a sweep, as Hydra says


def test_a_node_stored_again_is_merged_again():
    """A config of the user's own, stored in Hydra's ConfigStore and then replaced, is read
    afresh: the remembered merge names the nodes it was read from."""
    store = ConfigStore.instance()
    try:
        store.store(group="model", name="mine_for_test", node={"_target_": "mine.First"})
        assert compose_config(["model=mine_for_test"], PM).model._target_ == "mine.First"
        store.store(group="model", name="mine_for_test", node={"_target_": "mine.Second"})
        assert compose_config(["model=mine_for_test"], PM).model._target_ == "mine.Second"
    finally:  # the store is the process's: later tests list every model option in it
        del store.repo["model"]["mine_for_test.yaml"]


def test_a_search_path_given_as_a_hydra_setting_is_read(tmp_path):
    """``hydra.searchpath`` decides where options are read, so it chooses what is merged."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "from_dir.yaml").write_text(
        "defaults:\n  - gpt_tiny\n  - _self_\nn_layer: 5\n"
    )
    overrides = [f"hydra.searchpath=[file://{tmp_path}]", "model=from_dir"]
    assert compose_config(overrides, PM).model.n_layer == 5
    assert OmegaConf.to_container(compose_config(overrides, PM)) == hydras_own(overrides)
