"""Plugin discovery, selection, conflicts and capabilities (no worker processes)."""

import types

import inhouse
import pluggy
import pytest

from plait import hookimpl
from plait.cli import main
from plait.plan import make_plan
from plait.plugin_manager import deciders, keep_selected, make_plugin_manager
from plait.testing import compose
from plait.types import PlanError

BUILT_INS = {
    "adamw",
    "allreduce",
    "checkpoint",
    "console",
    "data",
    "ddp",
    "gpt",
    "local_launcher",
    "metrics_file",
    "models",
    "sharding",
    "wandb",
}


def test_built_ins_come_from_the_entry_point_group():
    pm = make_plugin_manager()
    assert BUILT_INS <= set(pm.records)
    for name in BUILT_INS:
        assert pm.records[name].source.startswith("entry point (plait ")


def test_default_config_selects_one_decider_per_decision():
    cfg = compose(["tracker=none"])
    pm = keep_selected(make_plugin_manager(cfg), cfg)
    made = deciders(pm)
    assert made["plait_build_engine"] == ["ddp"]
    assert made["plait_build_dataset"] == ["data"]
    assert made["plait_grad_reducer"] == ["allreduce"]  # the strategy's built-in all-reduce
    assert "comm" not in pm.records  # the plugin of comm=flat|ring|hierarchical
    assert "wandb" not in pm.records  # tracker=none


def test_dotted_path_plugin_is_loaded_from_the_config():
    cfg = compose(["+plugins=[inhouse:crash_at_step_3]"])
    pm = make_plugin_manager(cfg)
    record = pm.records["inhouse:crash_at_step_3"]
    assert record.source == "config (plugins list)"
    assert record.info.name == "crash_at_step"
    assert record.hooks(pm) == ["plait_on_step_end"]


def test_unimportable_dotted_path_names_the_path():
    with pytest.raises(ValueError, match="cannot load 'no_such_team.plugin'"):
        make_plan(["+plugins=[no_such_team.plugin]"])


def test_two_plugins_deciding_the_same_hook_are_refused_with_both_names():
    plan = make_plan([], objects=[inhouse.FancyEngine()])
    [problem] = [p for p in plan.problems if "plait_build_engine" in p]
    assert "'FancyEngine'" in problem and "'ddp'" in problem
    with pytest.raises(PlanError, match="both decide plait_build_engine"):
        plan.check()


def test_capabilities_refuse_an_unsupported_precision_and_axis():
    plan = make_plan(["precision=bf16", "parallel.tp=2"], objects=[inhouse.Fp32Only()])
    text = "\n".join(plan.problems)
    assert "plugin 'fp32_only' does not support precision=bf16" in text
    assert "plugin 'fp32_only' does not support tp parallelism (parallel.tp=2)" in text


def test_unknown_strategy_name_lists_what_is_installed():
    plan = make_plan(["strategy.name=nope"])
    assert any(
        "strategy.name=nope selects no plugin that decides plait_build_engine; "
        "installed plugins offer: ddp, diloco, fsdp, local_sgd, parameter_server, zero0, zero1, zero2, "
        "zero3" in p
        for p in plan.problems
    )


def test_hook_with_a_typo_is_caught_at_registration():
    class Typo:
        @hookimpl
        def plait_on_step_ends(self, step):  # no such hook
            pass

    with pytest.raises(pluggy.PluginValidationError, match="plait_on_step_ends"):
        make_plugin_manager(objects=[Typo()])


class Slotted:
    __slots__ = ("plait_on_step_end",)

    def __init__(self):
        self.plait_on_step_end = hookimpl(lambda step: None)


class Shapes:
    """A hook in every shape pluggy binds: method, static and class method, a function kept on
    the instance, a property (never a hook: pluggy does not run it)."""

    @hookimpl
    def plait_on_step_end(self, step):
        pass

    @staticmethod
    @hookimpl
    def plait_on_run_start(cfg):
        pass

    @classmethod
    @hookimpl
    def plait_on_run_end(cls):
        pass

    @property
    @hookimpl
    def plait_log_metrics(self):
        return None

    def __init__(self):
        self.plait_sync_replicas = hookimpl(lambda cfg, state, topology: None)


def test_hooks_are_found_as_pluggy_finds_them():
    """plait's manager reads a module's namespace instead of pluggy's static lookup of every
    name (plugin_manager.PlaitPluginManager.parse_hookimpl_opts): it must find what pluggy finds,
    in every built-in and in each shape an in-house plugin may take."""
    plugins = [record.plugin for record in make_plugin_manager().records.values()]
    bound = types.ModuleType("bound_hooks")  # a module whose hook is another object's method
    bound.plait_on_step_end = Shapes().plait_on_step_end
    plugins += [Shapes(), Shapes, Slotted(), bound, inhouse]
    plait_pm, pluggy_pm = make_plugin_manager(load_entrypoints=False), pluggy.PluginManager("plait")
    found = 0
    for plugin in plugins:
        for name in dir(plugin):
            expected = pluggy_pm.parse_hookimpl_opts(plugin, name)
            assert plait_pm.parse_hookimpl_opts(plugin, name) == expected, (plugin, name)
            found += expected is not None
    assert found > 200  # the built-ins' hooks were among them


def test_blocked_plugin_is_left_out(monkeypatch):
    monkeypatch.setenv("PLAIT_BLOCK_PLUGINS", "wandb,console")
    pm = make_plugin_manager()
    assert "wandb" not in pm.records and "console" not in pm.records and "ddp" in pm.records


def test_plait_plugins_lists_every_plugin_with_source_and_hooks(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in BUILT_INS:
        assert f"\n{name}  [entry point (plait " in "\n" + out
    assert "ddp  [entry point (plait 0.1.0)]  selected by: strategy.name=ddp" in out
    assert "hooks:  plait_build_engine, plait_read_model_shards" in out


def test_plait_train_builds_the_manager_of_every_plugin_once(monkeypatch, capsys):
    """Each build loads and checks every entry point (~0.05-0.1 s): the CLI builds the manager of
    every available plugin once and hands it on; the plan builds the run's selected one."""
    import plait.cli
    import plait.plan

    built = []

    def counted(*args, **kwargs):
        built.append(kwargs.get("cfg", args[0] if args else None) is not None)
        return make_plugin_manager(*args, **kwargs)

    monkeypatch.setattr(plait.cli, "make_plugin_manager", counted)
    monkeypatch.setattr(plait.plan, "make_plugin_manager", counted)
    assert main(["train", "train.steps=-1"]) == 2
    assert "train.steps=-1 is out of range" in capsys.readouterr().err
    assert built == [False, True]  # every available plugin; the plan's selected ones


def test_plait_plan_prints_deciders_mesh_and_ok(capsys):
    assert main(["plan", "launcher.nproc_per_node=4", "parallel.dp=-1"]) == 0
    out = capsys.readouterr().out
    assert "mesh: world_size=4 = pp 1 x dp 4 x tp 1 on 1 node(s) x 4 process(es)" in out
    assert "plait_build_engine           ddp" in out
    assert "ok: nothing refused" in out
