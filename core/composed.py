"""Hydra's compose, remembered per process by the overrides that choose what is read.

Composing plait's config reads ~20 YAML files and ~40 structured schemas and merges them: ~0.45 s
of CPU here, nearly all of it OmegaConf's merges and copies. What is read and merged depends only
on the overrides that choose config group options (``strategy=zero3``, ``model=hf``), on
Hydra's own settings (``hydra.*``) and on the schemas in Hydra's ConfigStore (the core's and the
plugins', each stored once and kept: ``plait.config.SchemaStore``). The other overrides, the
values (``train.steps=4``), Hydra applies afterwards to the merged config, one by one
(``ConfigLoaderImpl._apply_overrides_to_config``). So a process that composes many configs (a test
session, the planner's search) merges each choice of options once, keeps that config, and applies
each call's values to a copy of it with Hydra's own function: ~25 ms a config, all told
(``scripts/bench_compose.py``).

Which override is a value is Hydra's own split (``hydra._internal.defaults_list.Overrides``, on the
same repository). A sweep (``a=1,2``) is composed by Hydra as before: it is refused there. The
YAML files are read once per choice: a process does not see a file edited after its first read.
"""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, cast

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.defaults_list import Overrides
from hydra._internal.hydra import Hydra
from hydra.core.config_store import ConfigNode, ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException


class ComposedConfigs:
    """The last ``size`` merged configs of this process, by config name, choosing overrides and
    the ConfigStore's nodes. Each entry holds the nodes it was merged from, so that their ids,
    its key, name no other node while it is kept."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.merged: OrderedDict[Hashable, tuple[list[ConfigNode], DictConfig]] = OrderedDict()
        self.hits = 0

    def compose(self, hydra: Hydra, config_name: str, overrides: Sequence[str]) -> DictConfig:
        """What ``hydra.compose_config(config_name, overrides)`` returns for one run."""
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        if any(o.is_sweep_override() for o in parsed):
            return compose(hydra, config_name, overrides)
        split = Overrides(cast(ConfigLoaderImpl, hydra.config_loader).repository, parsed)
        values = [o for o in split.config_overrides if not o.key_or_group.startswith("hydra")]
        choosing = tuple(str(o.input_line) for o in parsed if o not in values)
        nodes = list(stored_nodes(ConfigStore.instance().repo))
        key = (config_name, choosing, tuple(map(id, nodes)))
        if key in self.merged:
            self.hits += 1
            self.merged.move_to_end(key)
            merged = self.merged[key][1]
        else:
            merged = compose(hydra, config_name, choosing)
            self.merged[key] = (nodes, merged)
            if len(self.merged) > self.size:
                self.merged.popitem(last=False)
        cfg = copy.deepcopy(merged)
        try:
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        except OmegaConfBaseException as e:  # as Hydra's load_configuration raises it
            raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from e
        return cfg


def stored_nodes(repo: dict[str, Any]) -> Iterator[ConfigNode]:
    for entry in repo.values():
        yield from stored_nodes(entry) if isinstance(entry, dict) else [entry]


def compose(hydra: Hydra, config_name: str, overrides: Sequence[str]) -> DictConfig:
    return hydra.compose_config(
        config_name,
        list(overrides),
        run_mode=RunMode.RUN,
        from_shell=False,
        with_log_configuration=False,
    )


COMPOSED = ComposedConfigs()
