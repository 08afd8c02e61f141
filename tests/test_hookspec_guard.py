"""The hook spec only grows within a major version: every recorded hook and argument is still
there, or has a deprecation entry. After adding a hook: ``python scripts/hook_docs.py --record``."""

import importlib.util
import json
from pathlib import Path

from plait import HOOKSPEC_VERSION

_spec = importlib.util.spec_from_file_location(
    "hook_docs", Path(__file__).parents[1] / "scripts" / "hook_docs.py")
hook_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hook_docs)

RECORDED = json.loads((Path(__file__).parent / "hookspec_signatures.json").read_text())


def test_no_hook_or_argument_disappears_without_a_deprecation():
    now, deprecated = hook_docs.signatures(), RECORDED["deprecations"]
    lost = [f"{hook}({arg})" if arg else hook
            for hook, args in RECORDED["hooks"].items() if hook not in deprecated
            for arg in ([None] if hook not in now else [a for a in args if a not in now[hook]])]
    assert not lost, f"removed from core/hookspecs.py without a deprecation entry: {lost}"


def test_the_record_is_current_and_the_major_version_unchanged():
    assert hook_docs.signatures() == RECORDED["hooks"], "run python scripts/hook_docs.py --record"
    assert HOOKSPEC_VERSION.split(".")[0] == RECORDED["version"].split(".")[0]
