"""Write docs/plugins.md, the hook reference, from core/hookspecs.py.

    python scripts/hook_docs.py          # rewrite docs/plugins.md
    python scripts/hook_docs.py --check  # exit 1 if docs/plugins.md is out of date (a test runs this)
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from plait import hookspecs

DOC = Path(__file__).parents[1] / "docs" / "plugins.md"

INTRO = """# Hook reference

Generated from `core/hookspecs.py` by `python scripts/hook_docs.py`; do not edit by hand.

A plugin implements any of these with `@plait.hookimpl`, taking only the arguments it needs.
Hooks appear in the order a run calls them. Hooks marked *firstresult* are decisions: the first non-None answer wins, and two active plugins
answering the same one are refused before launch. See the README for a complete example.
"""


def render() -> str:
    parts = [INTRO]
    specs = [(n, f) for n, f in inspect.getmembers(hookspecs, inspect.isfunction)
             if n.startswith("plait_")]
    for name, fn in sorted(specs, key=lambda item: item[1].__code__.co_firstlineno):
        opts = getattr(fn, "plait_spec", {})
        kind = " *(firstresult)*" if opts.get("firstresult") else ""
        parts.append(f"## `{name}`{kind}\n\n```python\ndef {name}{inspect.signature(fn)}\n```\n\n"
                     f"{inspect.cleandoc(fn.__doc__ or '')}\n")
    return "\n".join(parts)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if DOC.exists() and DOC.read_text() == text else 1)
    DOC.write_text(text)
