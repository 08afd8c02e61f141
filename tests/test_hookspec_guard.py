"""The hook spec only grows within a major version: every hook and argument of every released
spec (``tests/hookspec_released/<version>.json``, written once by ``python scripts/hook_docs.py
--release`` and never rewritten) is still there, or has a deprecation entry. After adding a
hook: ``python scripts/hook_docs.py --record`` (the spec now, ``hookspec_signatures.json``); a
removed hook re-recorded stays red here, since the released files are the reference."""

import importlib.util
import json
from pathlib import Path

from plait import HOOKSPEC_VERSION

_spec = importlib.util.spec_from_file_location(
    "hook_docs", Path(__file__).parents[1] / "scripts" / "hook_docs.py"
)
hook_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hook_docs)

RECORDED = json.loads((Path(__file__).parent / "hookspec_signatures.json").read_text())
RELEASED = {
    path.stem: json.loads(path.read_text())
    for path in sorted((Path(__file__).parent / "hookspec_released").glob("*.json"))
}


def lost(released: dict, now: dict, deprecated: dict) -> list[str]:
    """The hooks and arguments of a released spec that ``now`` lacks without a deprecation."""
    return [
        f"{hook}({arg})" if arg else hook
        for hook, args in released["hooks"].items()
        if hook not in deprecated
        for arg in (
            [None]
            if hook not in now
            else [a for a in args if a not in now[hook] and f"{hook}({a})" not in deprecated]
        )
    ]


def test_no_released_hook_or_argument_disappears_without_a_deprecation():
    now, deprecated = hook_docs.signatures(), RECORDED["deprecations"]
    for version, released in RELEASED.items():
        missing = lost(released, now, deprecated)
        assert not missing, (
            f"removed from core/hookspecs.py without a deprecation entry, "
            f"though released in hook spec {version}: {missing}"
        )


def test_a_removed_hook_stays_red_after_a_re_record(tmp_path, monkeypatch):
    """The guard cannot be talked round: a hook dropped from the spec and re-recorded is still
    missing from the released spec it was part of."""
    now = {
        hook: args for hook, args in hook_docs.signatures().items() if hook != "plait_on_run_end"
    }
    monkeypatch.setattr(hook_docs, "SIGNATURES", tmp_path / "hookspec_signatures.json")
    monkeypatch.setattr(hook_docs, "signatures", lambda: now)
    hook_docs.record()  # what a careless re-record would do
    recorded = json.loads((tmp_path / "hookspec_signatures.json").read_text())
    assert recorded["hooks"] == now
    assert lost(RELEASED["1.4.0"], recorded["hooks"], recorded["deprecations"]) == [
        "plait_on_run_end"
    ]


def test_the_record_is_current_and_the_version_is_released():
    assert hook_docs.signatures() == RECORDED["hooks"], "run python scripts/hook_docs.py --record"
    assert HOOKSPEC_VERSION in RELEASED, (
        f"hook spec {HOOKSPEC_VERSION} has no released file: run python scripts/hook_docs.py "
        "--release once for it"
    )
    assert {v.split(".")[0] for v in RELEASED} == {HOOKSPEC_VERSION.split(".")[0]}
