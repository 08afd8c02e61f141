"""Settings that moved: a plugin lists its old names in ``PluginInfo.renamed`` (``{"fault.
checkpoint_every": "checkpoint.every"}``, or a group's option, ``{"checkpoint=hf":
"checkpoint=default"}``), and every override typed with an old name, on a
command line or in a sweep, is rewritten to the new one with a ``FutureWarning`` naming it, the
way the hook spec deprecates a hook: the old name keeps working for one minor version of the
hook spec after the one that renamed it.

Overrides are rewritten before Hydra composes (``plait train``, ``plait plan``, ``-m`` sweeps
and the Python API all pass through here), since the new schema no longer has the old field. A
config file that still sets an old name is refused by Hydra, naming the key, never ignored.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Iterable, Mapping

from plait import HOOKSPEC_VERSION

OVERRIDE = re.compile(
    r"^(?P<prefix>~|\+\+|\+)?(?P<key>[\w.]+)(?P<rest>@[\w.]*)?(?P<value>=.*)?$", re.S
)


def renamed_settings(pm: Any) -> dict[str, str]:
    """Every installed plugin's ``PluginInfo.renamed``: old setting name to new."""
    return {old: new for record in pm.records.values() for old, new in record.info.renamed.items()}


def rename_overrides(overrides: Iterable[str], renamed: Mapping[str, str]) -> list[str]:
    """``overrides`` with every old setting name replaced by its new one, each warning once
    (``FutureWarning``, naming the new name); the values (a sweep's ``1,2``) are kept."""
    result = []
    for override in overrides:
        if override in renamed:  # a renamed option of a group: checkpoint=hf
            warnings.warn(
                f"{override} is deprecated since hook spec {HOOKSPEC_VERSION} and goes "
                f"in the next minor version: use {renamed[override]}",
                FutureWarning,
                stacklevel=2,
            )
            result.append(renamed[override])
            continue
        match = OVERRIDE.match(override)
        if match is None or match["key"] not in renamed:
            result.append(override)
            continue
        new = renamed[match["key"]]
        warnings.warn(
            f"{match['key']} is deprecated since hook spec {HOOKSPEC_VERSION} and goes "
            f"in the next minor version: use {new} (here {match['key']}"
            f"{match['value'] or ''} is read as {new}{match['value'] or ''})",
            FutureWarning,
            stacklevel=2,
        )
        result.append(f"{match['prefix'] or ''}{new}{match['rest'] or ''}{match['value'] or ''}")
    return result
