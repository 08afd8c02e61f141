"""The plugin API people build on: hook spec 1.0 plugins installed by a real entry point keep
working, and a broken plugin is named, never a traceback."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plait import HOOKSPEC_VERSION, plugin_manager
from plait.plan import format_plan, make_plan
from plait.plugin_manager import make_plugin_manager
from plait.testing import read_metrics, run_training

HERE = Path(__file__).parent / "first_spec"


def install(site: Path, module: str, requires: str = "") -> None:
    """A real distribution on ``site``: the module and a ``*.dist-info`` with its entry point."""
    site.mkdir(exist_ok=True)
    shutil.copy(HERE / f"{module}.py", site)
    info = site / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n"
        + (f"Requires-Dist: {requires}\n" if requires else "")
    )
    (info / "entry_points.txt").write_text(f"[plait]\n{module} = {module}\n")


def plait(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "plait", *args], env=env, capture_output=True, text=True, timeout=120
    )


BROKEN = {
    "broken_unknown_hook": "plait_on_epoch_end, which is not in plait's hook spec",
    "broken_unknown_arg": "its plait_log_metrics takes 'wallclock', which hook spec",
    "broken_import": "importing broken_import raised ModuleNotFoundError",
}


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    for module in BROKEN:
        install(
            site, module, requires="plait>=0.0.1,<0.1" if module == "broken_unknown_arg" else ""
        )
    return site


@pytest.mark.parametrize("args", [["train", "train.steps=1"], ["plugins", "--check"]])
def test_broken_plugins_refuse_with_their_names_and_no_traceback(broken_site, args):
    done = plait(broken_site, *args)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    for module, reason in BROKEN.items():
        assert f"plugin {module!r} [entry point ({module} 1.0: {module} = {module})]" in done.stderr
        assert reason in done.stderr
    assert "plait_log_metrics has (step, metrics, state)" in done.stderr
    assert (
        f"written for plait>=0.0.1,<0.1; this is plait 0.1.0 (hook spec {HOOKSPEC_VERSION})"
        in done.stderr
    )


def test_plait_plugins_lists_the_broken_ones_and_exits_0(broken_site):
    done = plait(broken_site, "plugins")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    for module, reason in BROKEN.items():
        assert f"{module}  [entry point ({module} 1.0: {module} = {module})]  BROKEN" in done.stdout
        assert reason in done.stdout
    assert "ddp  [entry point (plait" in done.stdout  # the working ones are still listed


@pytest.fixture
def first_spec_site(tmp_path, monkeypatch):
    """The frozen hook spec 1.0 plugins, installed by entry point for this process and its
    workers."""
    site = tmp_path / "site"
    install(site, "first_spec_observer")
    install(site, "first_spec_comm_hook")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("FIRST_SPEC_OBSERVED", str(tmp_path / "observed.jsonl"))
    monkeypatch.setenv("FIRST_SPEC_CALLS", str(tmp_path / "calls"))
    monkeypatch.setattr(plugin_manager, "_WARNED", set())  # this process has not warned yet
    return tmp_path


def test_the_deprecated_comm_hook_warns_once_naming_its_replacement(first_spec_site):
    with pytest.warns(FutureWarning) as warned:
        pm = make_plugin_manager()
        make_plugin_manager()
    [warning] = [w for w in warned if "plait_comm_hook" in str(w.message)]
    assert "implement plait_grad_reducer" in str(warning.message)
    assert warning.filename.endswith("first_spec_comm_hook.py")  # the user's own line
    [warning] = [w for w in warned if "argument metrics is deprecated" in str(w.message)]
    assert "read output" in str(warning.message) and "plait_log_metrics" in str(warning.message)
    assert warning.filename.endswith("first_spec_observer.py")
    assert {"first_spec_observer", "first_spec_comm_hook"} <= set(pm.records)
    done = plait(first_spec_site / "site", "plan")  # builds its plugin manager several times
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("FutureWarning: plait_comm_hook is deprecated") == 1
    assert done.stderr.count("argument metrics is deprecated") == 1


@pytest.mark.slow
def test_first_spec_plugins_run_and_equal_the_built_in_fp16_compression(first_spec_site):
    steps, overrides = 4, ["train.steps=4", "train.log_every=2"]
    with pytest.warns(FutureWarning, match="plait_comm_hook is deprecated"):
        run_training(first_spec_site / "mine", overrides)
    observed = [json.loads(line) for line in (first_spec_site / "observed.jsonl").open()]
    mine = read_metrics(first_spec_site / "mine")
    assert [o["step"] for o in observed] == [1, 2, 3, 4]  # every step's loss, logged or not
    assert [o["loss"] for o in observed][1::2] == [m["loss"] for m in mine]
    for rank in (0, 1):  # once per bucket per step
        calls = Path(f"{first_spec_site / 'calls'}.{rank}").read_text().split()
        assert calls and all(calls.count(index) == steps for index in set(calls))

    # the built-in fp16 compression run, without the plugins
    os.environ["PLAIT_BLOCK_PLUGINS"] = "first_spec_observer,first_spec_comm_hook"
    try:
        builtin = read_metrics(
            run_training(first_spec_site / "builtin", [*overrides, "comm.compression=fp16"])
        )
    finally:
        del os.environ["PLAIT_BLOCK_PLUGINS"]
    assert [m["loss"] for m in mine] == pytest.approx([m["loss"] for m in builtin], rel=1e-6)


@pytest.mark.filterwarnings("ignore:plait_comm_hook is deprecated:FutureWarning")
def test_a_strategy_that_cannot_take_the_comm_hook_refuses_it(first_spec_site):
    problems = "\n".join(make_plan(["strategy=zero1", "tracker=none"]).problems)
    assert (
        "plugin 'first_spec_comm_hook' implements plait_comm_hook (a torch DDP comm hook), "
        "which only strategy=ddp takes, not strategy=zero1"
    ) in problems


@pytest.fixture
def selected_comm_hook_site(tmp_path, monkeypatch):
    """A hook spec 1.0 comm plugin selected by ``comm.name=inhouse_fp16``, implementing only the
    deprecated ``plait_comm_hook``, installed by entry point as a new user would."""
    site = tmp_path / "site"
    install(site, "first_spec_selected_comm_hook")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("FIRST_SPEC_CALLS", str(tmp_path / "calls"))
    return tmp_path


@pytest.mark.filterwarnings("ignore:plait_comm_hook is deprecated:FutureWarning")
def test_a_deprecated_hook_counts_as_its_replacement_for_selection(selected_comm_hook_site):
    """``comm.name=inhouse_fp16`` selects a plugin that decides ``plait_grad_reducer`` through
    the deprecated hook it replaces; DDP adapts the call (``engine:comm_hook``), a strategy that
    cannot is refused by that capability."""
    plan = make_plan(["tracker=none", "comm.name=inhouse_fp16"])
    assert plan.problems == []
    assert "plait_grad_reducer           first_spec_selected_comm_hook" in format_plan(plan)
    problems = "\n".join(
        make_plan(["tracker=none", "comm.name=inhouse_fp16", "strategy=zero1"]).problems
    )
    assert "plugin 'first_spec_selected_comm_hook' implements plait_comm_hook" in problems
    assert "selects no plugin that decides" not in problems


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:plait_comm_hook is deprecated:FutureWarning")
def test_the_selected_deprecated_comm_hook_trains_like_the_built_in_fp16_compression(
    selected_comm_hook_site,
):
    overrides = ["train.steps=4", "train.log_every=2"]
    mine = read_metrics(
        run_training(selected_comm_hook_site / "mine", [*overrides, "comm.name=inhouse_fp16"])
    )
    for rank in (0, 1):  # once per bucket per step
        calls = Path(f"{selected_comm_hook_site / 'calls'}.{rank}").read_text().split()
        assert calls and all(calls.count(index) == 4 for index in set(calls))
    builtin = read_metrics(
        run_training(selected_comm_hook_site / "builtin", [*overrides, "comm.compression=fp16"])
    )
    assert [m["loss"] for m in mine] == pytest.approx([m["loss"] for m in builtin], rel=1e-6)


class LayoutFreeWithoutLoad:
    """An engine that gives its layout-free state but cannot take it back."""

    def layout_free_state(self) -> dict:
        return {}


def test_an_engine_lacking_a_surface_its_plugin_declares_is_named_when_built():
    """Capabilities promise engine methods (``plait.types`` Protocols); the core checks a built
    engine against every surface its plugins declared, naming the plugin and what is missing,
    instead of an AttributeError at the first checkpoint."""
    from types import SimpleNamespace

    from plait.plugin_manager import check_engine
    from plait.types import PluginInfo

    declares = SimpleNamespace(
        plait_declare=lambda: [
            PluginInfo("my_strategy", provides=frozenset({"engine:layout_free_state"}))
        ]
    )
    with pytest.raises(
        TypeError,
        match="plugin 'my_strategy' declares 'engine:layout_free_state'"
        ", but its engine LayoutFreeWithoutLoad lacks "
        "load_layout_free_state",
    ):
        check_engine(LayoutFreeWithoutLoad(), declares)
    silent = SimpleNamespace(plait_declare=lambda: [PluginInfo("my_strategy")])
    engine = LayoutFreeWithoutLoad()
    assert check_engine(engine, silent) is engine  # nothing declared, nothing required
