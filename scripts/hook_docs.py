"""Write docs/plugins.md, the hook reference, from core/hookspecs.py.

    python scripts/hook_docs.py          # rewrite docs/plugins.md
    python scripts/hook_docs.py --check  # exit 1 if docs/plugins.md is out of date (a test runs this)
    python scripts/hook_docs.py --record # rewrite tests/hookspec_signatures.json, the recorded
                                         # hook names and arguments of the spec now (its
                                         # "deprecations" are kept)
    python scripts/hook_docs.py --release  # write tests/hookspec_released/<HOOKSPEC_VERSION>.json
                                           # once, when a hook spec version is released; exit 1
                                           # if it exists (a released spec is never rewritten)

tests/test_hookspec_guard.py checks removals against every released spec, which --record never
touches: a hook removed from core/hookspecs.py and re-recorded stays red until a deprecation
entry names it.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

from plait import HOOKSPEC_VERSION, hookspecs

DOC = Path(__file__).parents[1] / "docs" / "plugins.md"
SIGNATURES = Path(__file__).parents[1] / "tests" / "hookspec_signatures.json"
RELEASED = Path(__file__).parents[1] / "tests" / "hookspec_released"

INTRO = """# Hook reference

Generated from `core/hookspecs.py` by `python scripts/hook_docs.py`; do not edit by hand.

A plugin implements any of these with `@plait.hookimpl`, taking only the arguments it needs.

## Stability

The hook spec has its own version, `plait.HOOKSPEC_VERSION`, which follows semver. Within a major
version hooks and arguments are only added, never removed or renamed, so a plugin written against
1.0 runs on every 1.x. A removal or rename goes through a deprecation first: the old hook or
argument keeps working, registering it warns (`FutureWarning`) naming the replacement, and it
stays for at least one minor version. Each released hook spec is written once to
`tests/hookspec_released/<version>.json` (`python scripts/hook_docs.py --release`, never
rewritten), and a test fails when a hook or argument of any released spec disappears without a
deprecation entry (in `tests/hookspec_signatures.json`, which `--record` keeps current). Deprecated
now: `plait_comm_hook` (since 1.1, use `plait_grad_reducer`; `strategy=ddp` adapts it, and a
plugin implementing only it counts as deciding `plait_grad_reducer`, so `comm.name=<yours>`
selects it), and `plait_on_step_end`'s argument `metrics` (since 1.2, read `output` or implement
`plait_log_metrics`); both go in 2.0. Since 1.5 the topology's Megatron-style group names
(`topology.get_data_parallel_group()`, ...) warn and name `topology.group("dp")`, the one scheme;
settings a release moved (`PluginInfo.renamed`) keep their old names for one minor version, with
a `FutureWarning`.

A plugin that cannot be loaded (its import raises, it implements a hook the spec lacks, or a hook
with an argument the spec lacks) is named with its distribution and entry point, the hook, the
argument, the spec's arguments and the plait version it declares: every command but
`plait plugins` refuses with exit 2, `plait plugins` lists it as BROKEN with the reason, and
`plait plugins --check` exits 2 when any plugin is broken (put it in your plugin's CI).
`plait.testing` (`compose`, `run_training`, `run_losses`, `read_metrics`, `spawn`) is the
supported way to test a plugin and is kept stable under the same policy.

## A new plugin, step by step

    plait new-plugin demo --kind observer   # or comm, model, data, strategy
    pip install -e plait-demo               # registers the entry point `demo` in the plait group
    plait plugins --check                   # lists demo; exit 2 if any plugin is broken
    plait train train.steps=20              # an observer is active in every run
    python -m pytest plait-demo/tests       # the generated test: 2 processes, plait.testing

`plait-demo/plait_demo/__init__.py` holds the hookimpl: for `observer`, `plait_on_step_end(step,
metrics)`, which prints each step's loss (or appends it to `$PLAIT_DEMO_OUT`); for `comm`,
`plait_declare` (selected by `comm.name=demo`) and `plait_grad_reducer`, which returns a
`plait.types.GradReducer` averaging each gradient bucket with one all-reduce. The generated test
reads the run back with `plait.testing.read_metrics` (observer: every step's loss; comm: the same
losses as the built-in all-reduce). For `model`, a `TinyLM` module with its schema stored as the
`model=demo` option (`plait_register_configs`); for `data`, `plait_build_dataset` returning a
`plait.types.TokenDataset` (a counting stream, `data=demo`); for `strategy`, `plait_build_engine`
returning the smallest `plait.types.Engine` (`strategy=demo`: a per-parameter all-reduce, whose
test equals one process). Change the hookimpl, keep the test.

## Hooks

Hooks appear in the order a run calls them. Hooks marked *firstresult* are decisions: the first non-None answer wins, and two active plugins
answering the same one are refused before launch. See the README for a complete example.
"""


def render() -> str:
    parts = [INTRO]
    specs = [
        (n, f)
        for n, f in inspect.getmembers(hookspecs, inspect.isfunction)
        if n.startswith("plait_")
    ]
    for name, fn in sorted(specs, key=lambda item: item[1].__code__.co_firstlineno):
        opts = getattr(fn, "plait_spec", {})
        kind = " *(firstresult)*" if opts.get("firstresult") else ""
        parts.append(
            f"## `{name}`{kind}\n\n```python\ndef {name}{inspect.signature(fn)}\n```\n\n"
            f"{inspect.cleandoc(fn.__doc__ or '')}\n"
        )
    return "\n".join(parts)


def signatures() -> dict[str, list[str]]:
    """Every hook's name and argument names, as the spec has them now."""
    return {
        n: list(inspect.signature(f).parameters)
        for n, f in inspect.getmembers(hookspecs, inspect.isfunction)
        if n.startswith("plait_")
    }


def record() -> None:
    old = json.loads(SIGNATURES.read_text()) if SIGNATURES.exists() else {}
    SIGNATURES.write_text(
        json.dumps(
            {
                "version": HOOKSPEC_VERSION,
                "hooks": signatures(),
                "deprecations": old.get("deprecations", {}),
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )


def release() -> int:
    """The spec as released, written once: 1 (and nothing written) when the file exists."""
    target = RELEASED / f"{HOOKSPEC_VERSION}.json"
    if target.exists():
        print(
            f"{target} exists: a released hook spec is never rewritten; bump HOOKSPEC_VERSION",
            file=sys.stderr,
        )
        return 1
    target.write_text(
        json.dumps({"version": HOOKSPEC_VERSION, "hooks": signatures()}, indent=1, sort_keys=True)
        + "\n"
    )
    return 0


if __name__ == "__main__":
    if "--record" in sys.argv:
        sys.exit(record())
    if "--release" in sys.argv:
        sys.exit(release())
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if DOC.exists() and DOC.read_text() == text else 1)
    DOC.write_text(text)
