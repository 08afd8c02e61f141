"""Find plugins, keep where each came from, and choose the ones a config turns on.

Plugins arrive three ways, all through one :class:`PlaitPluginManager`, registered in this order:

1. objects handed over from Python (``plait.api.train(..., plugins=[obj])``),
2. dotted paths listed in the config (``plugins: [my_team.plugins.fancy_sync]``, or
   ``module:object`` for an object),
3. the ``plait`` entry-point group, which is how plait's own built-ins are found too.

``PLAIT_BLOCK_PLUGINS=name,name`` keeps the named plugins out. The manager is built by a factory,
never at import time, so importing plait loads no plugin.
"""

from __future__ import annotations

import importlib
import os
import types
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, cast

import pluggy
from omegaconf import DictConfig, OmegaConf
from pluggy._hooks import varnames  # pluggy's own reading of a hookimpl's arguments

from plait import HOOKSPEC_VERSION, PROJECT_NAME, __version__, hookspecs
from plait.types import PluginInfo, engine_problems

BLOCK_ENV = "PLAIT_BLOCK_PLUGINS"
# What pluggy's hook discovery can bind (pluggy._manager._static_hook_attr; a slot's value).
HOOKABLE = (
    types.FunctionType,
    staticmethod,
    classmethod,
    types.MethodType,
    types.MemberDescriptorType,
)
_WARNED: set[tuple[str, str]] = set()  # (plugin, message): a deprecation warns once per process


@dataclass(frozen=True)
class PluginRecord:
    """A registered plugin with its declaration and where it came from."""

    name: str
    plugin: Any
    source: str
    info: PluginInfo

    def hooks(self, pm: pluggy.PluginManager) -> list[str]:
        return sorted(
            c.name for c in pm.get_hookcallers(self.plugin) or [] if c.name != "plait_declare"
        )


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry-point plugin that could not be loaded: not registered, refused by every command
    but ``plait plugins``, which lists it with ``reason``."""

    name: str
    source: str
    reason: str

    def message(self) -> str:
        return f"plugin {self.name!r} [{self.source}] is broken: {self.reason}"


class PlaitPluginManager(pluggy.PluginManager):
    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.broken: dict[str, BrokenPlugin] = {}

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> pluggy.HookimplOpts | None:
        """pluggy's answer, without its static lookup where the answer is plain: pluggy reads
        every name of ``dir(plugin)`` through ``inspect.getattr_static``, and most are a plugin
        module's imports or an object's inherited dunders (a plugin manager of the built-ins
        0.039 -> 0.022 s; a run builds three or more: a plan's two, every worker's). A module's
        function is a hook when ``HookimplMarker`` marked it; a name none of whose values (the
        object's own, its classes') is a function, static or class method, bound method or slot
        is not a hook."""
        if isinstance(plugin, types.ModuleType):
            value = vars(plugin).get(name)
            if isinstance(value, types.FunctionType):
                opts = getattr(value, f"{self.project_name}_impl", None)
                return cast(pluggy.HookimplOpts, opts) if isinstance(opts, dict) else None
        if not any(isinstance(v, HOOKABLE) for v in values_named(plugin, name)):
            return None
        return super().parse_hookimpl_opts(plugin, name)

    def register_plugin(self, plugin: Any, name: str, source: str) -> None:
        if name in self.records:
            raise ValueError(
                f"two plugins are named {name!r}: {self.records[name].source} and {source}; "
                "rename one of them"
            )
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            self.register(plugin, name=name)
        for warning in warned:  # pluggy's deprecation warnings, once per process
            key = (name, str(warning.message))
            if key not in _WARNED:
                _WARNED.add(key)
                warnings.warn_explicit(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
        self.records[name] = PluginRecord(name, plugin, source, declaration_of(self, plugin, name))

    def unregister_plugin(self, name: str) -> None:
        self.unregister(name=name)
        del self.records[name]


def values_named(obj: Any, name: str) -> Iterator[Any]:
    """Every value ``inspect.getattr_static(obj, name)`` can return: the object's own, then its
    classes' (and a class's metaclasses'), read from their namespaces without running any code."""
    try:
        own = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        own = {}
    classes = [*(obj.__mro__ if isinstance(obj, type) else ()), *type(obj).__mro__]
    for namespace in (own, *(vars(c) for c in classes)):
        if isinstance(namespace, (dict, types.MappingProxyType)) and name in namespace:
            yield namespace[name]


def import_plugin(path: str) -> Any:
    """Import ``pkg.module`` (a module of hook functions) or ``pkg.module:attr`` (an object)."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr) if attr else module
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"plugins: cannot load {path!r} ({e}); give an importable 'package.module' or "
            "'package.module:object' and check that its package is installed"
        ) from e


def declaration_of(pm: pluggy.PluginManager, plugin: Any, fallback_name: str) -> PluginInfo:
    for impl in pm.hook.plait_declare.get_hookimpls():
        if impl.plugin is plugin:
            return cast(PluginInfo, impl.function())
    return PluginInfo(name=fallback_name)


def make_plugin_manager(
    cfg: DictConfig | None = None,
    objects: Iterable[Any] = (),
    load_entrypoints: bool = True,
) -> PlaitPluginManager:
    """Build a manager holding every available plugin (active or not)."""
    pm = PlaitPluginManager()
    blocked = {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}
    for obj in objects:
        name = getattr(obj, "__name__", None) or type(obj).__name__
        if name not in blocked:
            pm.register_plugin(obj, name, "python object")
    dotted = list(cfg.get("plugins") or []) if cfg is not None else []
    for path in dotted:
        if path in blocked:
            continue
        pm.register_plugin(import_plugin(path), path, "config (plugins list)")
    if load_entrypoints:
        from importlib.metadata import entry_points

        # a distribution's "name version", read once: each read parses its METADATA file, and
        # plait's own entry points are 42 of one distribution (0.5 s a plan, read per entry)
        described: dict[int, str] = {}
        for ep in sorted(entry_points(group=PROJECT_NAME), key=lambda e: e.name):
            if ep.name in blocked or ep.value in dotted:
                continue
            if id(ep.dist) not in described:
                described[id(ep.dist)] = (
                    f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
                )
            dist = described[id(ep.dist)]
            reason = load_entry_point(pm, ep, f"entry point ({dist})")
            if reason:
                pm.broken[ep.name] = BrokenPlugin(
                    ep.name,
                    f"entry point ({dist}: {ep.name} = {ep.value})",
                    f"{reason}; {written_for(ep)}",
                )
    pm.check_pending()
    return pm


def load_entry_point(pm: PlaitPluginManager, ep: Any, source: str) -> str | None:
    """Import and register one entry point; the reason it is broken, or None when it loaded."""
    try:
        plugin = ep.load()
    except Exception as e:  # noqa: BLE001 - any import failure makes the plugin broken
        return f"importing {ep.value} raised {type(e).__name__}: {e}"
    reason = hook_problem(pm, plugin)
    if reason:
        return reason
    try:
        pm.register_plugin(plugin, ep.name, source)
    except pluggy.PluginValidationError as e:
        if pm.get_plugin(ep.name) is not None:
            pm.unregister(name=ep.name)
        return str(e)
    return None


def hook_problem(pm: pluggy.PluginManager, plugin: Any) -> str | None:
    """An implementation of a hook the spec lacks, or taking an argument its spec lacks."""
    for attr in dir(plugin):
        if pm.parse_hookimpl_opts(plugin, attr) is None:
            continue
        function = getattr(plugin, attr)
        caller = getattr(pm.hook, attr, None)
        if caller is None or caller.spec is None:
            return (
                f"it implements {attr}, which is not in plait's hook spec "
                f"{HOOKSPEC_VERSION}; see docs/plugins.md for the hooks there are"
            )
        spec_args = caller.spec.argnames
        unknown = [a for a in varnames(function)[0] if a not in spec_args]
        if unknown:
            return (
                f"its {attr} takes {', '.join(map(repr, unknown))}, which hook spec "
                f"{HOOKSPEC_VERSION} does not have; {attr} has ({', '.join(spec_args)})"
            )
    return None


def written_for(ep: Any) -> str:
    """The plait versions a plugin's distribution declares it was written for."""
    wanted = (
        [
            r
            for r in (ep.dist.requires or [])
            if r.split(";")[0].strip().startswith(PROJECT_NAME)
            and r[len(PROJECT_NAME) : len(PROJECT_NAME) + 1] in " <>=!~(["
        ]
        if ep.dist
        else []
    )
    have = f"this is plait {__version__} (hook spec {HOOKSPEC_VERSION})"
    if wanted:
        return f"it was written for {', '.join(wanted)}; {have}"
    return (
        f"it declares no plait version, so it was probably written for a plait other than "
        f"{__version__}; {have}"
    )


def broken_problems(pm: PlaitPluginManager) -> list[str]:
    """One refusal per broken plugin, naming it and the fix."""
    return [
        f"{b.message()}. Fix or uninstall its distribution, or keep it out with "
        f"{BLOCK_ENV}={b.name}"
        for b in pm.broken.values()
    ]


def is_selected(info: PluginInfo, cfg: DictConfig) -> bool:
    """True when every config path in ``info.selected_by`` holds the value (or one of the values)."""
    for path, wanted in info.selected_by.items():
        value = OmegaConf.select(cfg, path, default=None)
        options = wanted if isinstance(wanted, (list, tuple, set, frozenset)) else (wanted,)
        if value not in options:
            return False
    return True


def keep_selected(pm: PlaitPluginManager, cfg: DictConfig) -> PlaitPluginManager:
    """Unregister the plugins this config does not select, so decisions have one answer."""
    for name, record in list(pm.records.items()):
        if not is_selected(record.info, cfg):
            pm.unregister_plugin(name)
    return pm


# A deprecated hook and the hook that replaces it. A plugin written for the old spec that
# implements only the old hook decides the new one: it makes a plan's required decision (a comm
# plugin selected by comm.name with only plait_comm_hook is the run's comm choice) and its call
# is adapted by the plugins that declare they can (engine:comm_hook: DDP wraps the DDP comm hook
# as a GradReducer).
REPLACED_BY = {"plait_comm_hook": "plait_grad_reducer"}


def deciders(pm: pluggy.PluginManager, bridged: bool = False) -> dict[str, list[str]]:
    """For each ``firstresult`` hook, the plugins that implement it (wrappers do not decide).
    ``bridged``: a replacing hook no plugin implements is decided by the implementers of the
    deprecated hook it replaces (:data:`REPLACED_BY`)."""
    result = {}
    for name in dir(pm.hook):
        caller = getattr(pm.hook, name)
        if not isinstance(caller, pluggy.HookCaller) or caller.spec is None:
            continue
        if not caller.spec.opts.get("firstresult"):
            continue
        impls = [i for i in caller.get_hookimpls() if not (i.hookwrapper or i.wrapper)]
        result[name] = [i.plugin_name for i in reversed(impls)]
    if bridged:
        for old, new in REPLACED_BY.items():
            if not result.get(new):
                result[new] = result.get(old, [])
    return result


def check_conflicts(pm: pluggy.PluginManager) -> list[str]:
    """Two active plugins answering the same decision is an error that names both."""
    return [
        f"plugins {' and '.join(repr(p) for p in names)} both decide {hook}: select only one "
        "through the config (e.g. strategy=..., data=...) or remove one from `plugins`"
        for hook, names in deciders(pm).items()
        if len(names) > 1
    ]


def provided(hook: Any) -> dict[str, list[str]]:
    """The capabilities the active plugins provide (``PluginInfo.provides``), each with the
    plugins that provide it: what the plan matched before launch, asked through ``hook`` (a run's
    hook relay) where a plugin acts on it, instead of probing objects for methods."""
    found: dict[str, list[str]] = {}
    for info in hook.plait_declare():
        for capability in sorted(info.provides):
            found.setdefault(capability, []).append(info.name)
    return found


def check_engine(engine: Any, hook: Any) -> Any:
    """``engine``, once it has every surface its plugins declared (``plait.types.ENGINE_SURFACES``);
    ``TypeError`` naming the plugin and the missing methods otherwise."""
    declared = [(c, info) for info in hook.plait_declare() for c in sorted(info.provides)]
    problems = engine_problems(engine, declared)
    if problems:
        raise TypeError("; ".join(problems))
    return engine


def selection(info: PluginInfo) -> str:
    """The setting that turns a plugin on, as a user types it: ``strategy=zero0|zero1|zero2``
    (a group's ``name`` as the group's option), ``tensor_parallel=megatron``; "" for a plugin
    that is always on."""

    def typed(key: str, value: Any) -> str:
        values = value if isinstance(value, (list, tuple, set, frozenset)) else (value,)
        return f"{key.removesuffix('.name')}={'|'.join(map(str, values))}"

    return " ".join(typed(key, value) for key, value in info.selected_by.items())


def offered_by(capability: str, pm: PlaitPluginManager | None = None) -> str:
    """The installed plugins that provide ``capability``, as the settings that select them
    (``strategy=ddp or strategy=zero0|zero1|zero2|zero3``), for refusals that suggest another
    choice without naming plugins in code; "another plugin" when none is installed."""
    pm = pm or make_plugin_manager()
    options = [
        selection(r.info) or r.info.name
        for r in pm.records.values()
        if capability in r.info.provides
    ]
    return " or ".join(options) if options else f"a plugin that provides {capability!r}"
