"""The house rules: one package per capability, a core that reads no plugin's settings, and
plugins that meet through declared capabilities (a third-party package takes part without
editing a built-in)."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from plait import config as core_config
from plait.plan import make_plan
from plait.plugin_manager import make_plugin_manager

ROOT = Path(__file__).parents[1]


def test_plugins_are_one_package_per_capability_and_all_are_packaged():
    entries = sorted(p for p in (ROOT / "plugins").iterdir() if p.name != "__pycache__")
    assert [p.name for p in entries if not p.is_dir()] == ["__init__.py"]
    listing = re.search(r"\npackages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S)[1]
    packaged = set(re.findall(r'"(plait\.plugins\.\w+)"', listing))
    assert packaged == {f"plait.plugins.{p.name}" for p in entries if p.is_dir()}


def test_the_core_imports_no_plugin():
    for path in (ROOT / "core").glob("*.py"):
        assert "plait.plugins" not in path.read_text(), path.name


def fields_of(schema: type) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def core_fields() -> set[str]:
    """Every field name in the core's schema: the sections it owns and each group's base."""
    bases = [
        cls
        for cls in vars(core_config).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls)
    ]
    return set().union(*(fields_of(cls) for cls in bases))


def plugin_owned_fields() -> set[str]:
    """Field names that plugins add to their group's base schema."""
    cs = ConfigStore.instance()
    core_config.store_core_schemas(cs)
    make_plugin_manager().hook.plait_register_configs(config_store=cs)
    owned = set()
    for group in core_config.GROUPS:
        base = OmegaConf.get_type(cs.repo[group][f"base_{group}.yaml"].node)
        for node in cs.repo[group].values():
            owned |= fields_of(OmegaConf.get_type(node.node)) - fields_of(base)
    return owned


def test_the_core_schema_holds_no_setting_a_plugin_owns():
    owned = plugin_owned_fields()
    # the settings the house-in-order issue names, and the model fields the MFU used to read
    assert {
        "schedule",
        "microbatches",
        "virtual_stages",
        "balance",
        "plan",
        "sequence_parallel",
        "compile",
        "n_layer",
        "n_head",
        "n_embd",
    } <= owned
    assert core_fields() & owned == set()
    metrics = (ROOT / "core" / "metrics.py").read_text()
    assert not [name for name in ("n_layer", "n_head", "n_embd", "block_size") if name in metrics]


# ---------------------------------------------------------------------------------------------
# a third-party package, installed (a dist-info with entry points on sys.path)
# ---------------------------------------------------------------------------------------------

THIRD_PARTY = '''
    """A third-party strategy, model and comm plugin, taking part by capabilities alone."""
    import torch.nn as nn

    from plait import hookimpl
    from plait.types import PluginInfo


    class TinyLM(nn.Module):
        tensor_parallel_plan = {"fc": "colwise", "out": "rowwise"}

        def __init__(self):
            super().__init__()
            self.emb, self.fc, self.out = nn.Embedding(256, 8), nn.Linear(8, 16), nn.Linear(16, 256)

        def forward(self, ids):
            return self.out(self.fc(self.emb(ids)))


    class FancyStrategy:
        @hookimpl
        def plait_declare(self):
            return PluginInfo(name="fancy", selected_by={"strategy.name": "fancy"},
                              provides=frozenset({"engine:tensor_parallel"}))

        @hookimpl
        def plait_build_engine(self):
            raise AssertionError("never built in these tests")


    class TinyLMPlugin:
        @hookimpl
        def plait_declare(self):
            return PluginInfo(name="tinylm", selected_by={"model._target_": "thirdparty.TinyLM"},
                              provides=frozenset({"model:tensor_parallel_plan"}))


    class SparseComm:
        @hookimpl
        def plait_declare(self):
            return PluginInfo(name="sparse_comm", selected_by={"comm.name": "sparse"},
                              requires={"dp": frozenset({"engine:grad_reducer"})})

        @hookimpl
        def plait_grad_reducer(self):
            raise AssertionError("never built in these tests")


    fancy, tinylm, sparse_comm = FancyStrategy(), TinyLMPlugin(), SparseComm()
'''


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    (tmp_path / "thirdparty.py").write_text(textwrap.dedent(THIRD_PARTY))
    dist = tmp_path / "thirdparty-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[plait]\nfancy = thirdparty:fancy\ntinylm = thirdparty:tinylm\n"
        "sparse_comm = thirdparty:sparse_comm\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield


def problems(*overrides: str) -> str:
    return "\n".join(make_plan(["tracker=none", "launcher.nproc_per_node=2", *overrides]).problems)


def test_third_party_plugins_are_found_by_entry_point(third_party):
    pm = make_plugin_manager()
    assert pm.records["fancy"].source == "entry point (thirdparty 1.0)"


def test_third_party_strategy_takes_tensor_parallelism_but_not_pipelines(third_party):
    assert problems("strategy.name=fancy", "parallel.tp=2") == ""
    assert (
        "plugin 'pipeline' needs 'engine:pipeline' for parallel.pp=2, which no active plugin "
        "provides (installed plugins that provide it: ddp (strategy.name=ddp)"
        in problems("strategy.name=fancy", "parallel.pp=2", "pipeline.microbatches=2")
    )


def test_third_party_model_is_split_by_its_own_plan(third_party):
    tiny = ["model=custom", "model._target_=thirdparty.TinyLM", "parallel.tp=2"]
    assert problems(*tiny) == ""
    assert (
        "parallel.pp=2: model._target_=thirdparty.TinyLM has no pipeline_plan: name its layer "
        "list"
        in problems(
            "model=custom",
            "model._target_=thirdparty.TinyLM",
            "parallel.pp=2",
            "pipeline.microbatches=2",
        )
    )
    # without its plugin the same model declares nothing, and tp is refused before launch
    assert "needs 'model:tensor_parallel_plan' for parallel.tp=2" in problems(
        "model=custom", "model._target_=torch.nn.Identity", "parallel.tp=2"
    )


def test_third_party_comm_plugin_needs_a_strategy_that_takes_a_reducer(third_party):
    assert problems("comm.name=sparse") == ""  # ddp provides engine:grad_reducer
    assert (
        "plugin 'sparse_comm' needs 'engine:grad_reducer' for parallel.dp=2, which no "
        "active plugin provides (installed plugins that provide it: ddp (strategy.name=ddp)"
        in problems("comm.name=sparse", "strategy=zero1")
    )
