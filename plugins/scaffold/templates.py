"""The files ``plait new-plugin`` writes, as ``str.format`` templates (``{{``/``}}`` are braces).

Fields: name, package, dist, kind, plait_version, hookspec.
"""

COMMON = {
    "pyproject.toml": """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A plait {kind} plugin"
# written against plait {plait_version}, hook spec {hookspec}: any 1.x hook spec keeps it working
dependencies = ["plait>={plait_version}"]

[project.entry-points.plait]
{name} = "{package}"

[tool.setuptools]
packages = ["{package}"]
""",
    "README.md": """
# {dist}

A plait {kind} plugin, registered through the `plait` entry-point group as `{name}`.

    pip install -e .
    plait plugins --check          # loads every installed plugin; exit 2 if one is broken
    python -m pytest tests         # trains the tiny GPT on 2 processes with this plugin
""",
}

OBSERVER = {
    "{package}/__init__.py": '''
"""{name}: a plait observer. It sees every optimizer step's metrics on the logging rank.

Active in every run once installed; ``PLAIT_BLOCK_PLUGINS={name}`` keeps it out.
"""

import json
import os

from plait import hookimpl

OUT_ENV = "PLAIT_{upper}_OUT"


@hookimpl
def plait_on_step_end(step, output):
    """Called on the logging rank after every optimizer step.

    :param step: the optimizer step just finished (1 for the first).
    :param output: what the engine reported: ``loss`` (the global batch's mean), ``grad_norm``,
        ``metrics`` (the engine's own figures). Every logged metric (step times, memory, eval
        loss) comes to ``plait_log_metrics(step, metrics)`` instead.
    """
    line = json.dumps({{"step": step, "loss": output.loss}})
    path = os.environ.get(OUT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(line + "\\n")
    else:
        print(f"{name}: {{line}}", flush=True)
''',
    "tests/test_{package}.py": '''
"""{name} in a real 2-process training run, through plait.testing."""

import json

from plait.plugin_manager import make_plugin_manager
from plait.testing import read_metrics, run_training

from {package} import OUT_ENV


def test_installed_and_loads():
    pm = make_plugin_manager()
    assert "{name}" in pm.records and not pm.broken


def test_sees_every_step_loss(tmp_path, monkeypatch):
    monkeypatch.setenv(OUT_ENV, str(tmp_path / "seen.jsonl"))
    run_dir = run_training(tmp_path / "run", ["train.steps=3", "launcher.nproc_per_node=2"])
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").open()]
    assert [s["step"] for s in seen] == [1, 2, 3]
    assert [s["loss"] for s in seen] == [m["loss"] for m in read_metrics(run_dir)]
''',
}

COMM = {
    "{package}/__init__.py": '''
"""{name}: a plait comm plugin, a gradient reducer selected by ``comm.name={name}``.

It averages each gradient bucket with one all-reduce (the contract of
``plait.types.GradReducer``); change ``reduce`` to compress, or to reduce in stages.
"""

import torch.distributed as dist

from plait import hookimpl
from plait.types import CommSpec, PluginInfo


class MeanAllReduce:
    """``reduce(bucket, group)``: start averaging ``bucket.buffer()`` over ``group``; return a
    future of the averaged flat buffer (written in place)."""

    def __init__(self, bucket_bytes):
        self.spec = CommSpec(algorithm="{name}", bucket_bytes=bucket_bytes)
        self.calls = 0

    def reduce(self, bucket, group):
        self.calls += 1
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(group))
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])


@hookimpl
def plait_declare():
    return PluginInfo(name="{name}", selected_by={{"comm.name": "{name}"}},
                      requires={{"dp": frozenset({{"engine:grad_reducer"}})}},
                      description="mean all-reduce of gradient buckets")


@hookimpl
def plait_grad_reducer(cfg, topology):
    """Build the reducer; called on every rank in the same order. Stops at the first non-None
    result, so only the selected comm plugin answers."""
    bucket_mb = cfg.comm.get("bucket_mb")
    return MeanAllReduce(bucket_bytes=None if bucket_mb is None else int(bucket_mb * 2**20))
''',
    "tests/test_{package}.py": '''
"""{name} in a real 2-process training run, through plait.testing."""

import pytest

from plait.plugin_manager import make_plugin_manager
from plait.testing import compose, run_losses


def test_installed_and_selected():
    assert "{name}" in make_plugin_manager().records
    assert compose(["comm.name={name}"]).comm.name == "{name}"


def test_trains_like_the_built_in_all_reduce(tmp_path):
    steps = ["train.steps=3", "launcher.nproc_per_node=2"]
    built_in = run_losses(tmp_path / "built_in", steps)
    mine = run_losses(tmp_path / "mine", [*steps, "comm.name={name}"])
    assert mine == pytest.approx(built_in, rel=1e-4)
''',
}

MODEL = {
    "{package}/__init__.py": """
\"\"\"{name}: a plait model plugin. ``plait train model={name}`` trains :class:`TinyLM`.

plait builds any ``nn.Module`` whose forward maps token ids ``[batch, seq]`` to logits
``[batch, seq, vocab]``; the schema below makes its arguments settings (``model.width=128``). To
be split by tensor or pipeline parallelism a model also declares a ``tensor_parallel_plan`` or
a ``blocks`` layout (see plait's ``plugins/models/gpt.py``).
\"\"\"

from dataclasses import dataclass

import torch
import torch.nn as nn

from plait import hookimpl
from plait.config import ModelConfig
from plait.types import PluginInfo


@dataclass
class TinyLMConfig(ModelConfig):
    _target_: str = "{package}.TinyLM"
    vocab_size: int = 256
    width: int = 64


class TinyLM(nn.Module):
    \"\"\"``logits = head(tanh(mix(embed(ids))))``: each position predicts the next from itself.\"\"\"

    def __init__(self, vocab_size: int = 256, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


@hookimpl
def plait_declare():
    return PluginInfo(name="{name}", selected_by={{"model._target_": "{package}.TinyLM"}},
                      description="TinyLM: embedding, one mixing layer, head")


@hookimpl
def plait_register_configs(config_store):
    \"\"\"``model={name}``: the schema is the option (no YAML file needed).\"\"\"
    config_store.store(group="model", name="{name}", node=TinyLMConfig)
""",
    "tests/test_{package}.py": """
\"\"\"{name} in a real 2-process training run, through plait.testing.\"\"\"

import math

from plait.testing import compose, run_losses


def test_selected_by_its_option():
    assert compose(["model={name}"]).model._target_ == "{package}.TinyLM"


def test_trains_on_2_processes(tmp_path):
    losses = run_losses(tmp_path / "run", ["model={name}", "train.steps=3",
                                           "launcher.nproc_per_node=2"])
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
""",
}

DATA = {
    "{package}/__init__.py": """
\"\"\"{name}: a plait data plugin. ``plait train data={name}`` trains on :class:`CountingTokens`.

A dataset is fixed-length samples with ids ``0 .. len-1`` and ``batch(indices) -> (inputs,
targets)``, both ``[len(indices), seq_len]`` int64 (``plait.types.TokenDataset``); plait's
sharding plugin gives each data-parallel rank its samples and checkpoints the position.
\"\"\"

from dataclasses import dataclass

import torch

from plait import hookimpl
from plait.config import DataConfig
from plait.types import PluginInfo


@dataclass
class CountingConfig(DataConfig):
    name: str = "{name}"
    period: int = 7  # the stream is 0, 1, ..., period-1, 0, 1, ...
    samples: int = 1024


class CountingTokens:
    \"\"\"Sample ``i`` is the window of ``seq_len + 1`` tokens starting at ``i`` of the stream.\"\"\"

    def __init__(self, seq_len: int, period: int, samples: int):
        self.seq_len, self.period, self.samples = seq_len, period, samples

    def __len__(self) -> int:
        return self.samples

    def batch(self, indices):
        windows = torch.stack([torch.arange(i, i + self.seq_len + 1) % self.period
                               for i in indices])
        return windows[:, :-1], windows[:, 1:]


@hookimpl
def plait_declare():
    return PluginInfo(name="{name}", selected_by={{"data.name": "{name}"}},
                      description="a counting token stream")


@hookimpl
def plait_register_configs(config_store):
    \"\"\"``data={name}``: the schema is the option (no YAML file needed).\"\"\"
    config_store.store(group="data", name="{name}", node=CountingConfig)


@hookimpl
def plait_build_dataset(cfg, split):
    \"\"\"Called on every rank for ``split`` "train" and, when evaluating, "val". Stops at the
    first non-None result: only the selected data plugin answers.\"\"\"
    return CountingTokens(cfg.train.seq_len, cfg.data.period, cfg.data.samples)
""",
    "tests/test_{package}.py": """
\"\"\"{name} in a real 2-process training run, through plait.testing.\"\"\"

from plait.testing import run_losses


def test_a_counting_stream_is_learnt_on_2_processes(tmp_path):
    losses = run_losses(tmp_path / "run", ["data={name}", "train.steps=6",
                                           "optimizer.lr=1e-2", "launcher.nproc_per_node=2"])
    assert len(losses) == 6 and losses[-1] < losses[0]
""",
}

STRATEGY = {
    "{package}/__init__.py": """
\"\"\"{name}: a plait strategy plugin. ``plait train strategy={name}`` trains with
:class:`AllReduceEngine`, the smallest data-parallel engine.

An engine (``plait.types.Engine``) runs one optimizer step over a global batch's micro-batches,
an evaluation loss, and saves and loads its state; plait's loop, data, checkpoints and trackers
do the rest. Declare the parallel axes it can run (``parallel_axes``) so that other layouts are
refused before launch.
\"\"\"

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait import hookimpl
from plait.config import StrategyConfig
from plait.types import PluginInfo, StepOutput, model_inputs


@dataclass
class AllReduceConfig(StrategyConfig):
    name: str = "{name}"


class AllReduceEngine:
    \"\"\"Gradients accumulate over the micro-batches, then each is averaged over the data-
    parallel group with one all-reduce (``SUM`` then divide: gloo has no ``AVG``), clipped to
    ``train.grad_clip`` and stepped.\"\"\"

    def __init__(self, model, optimizer, loss_fn, topology, grad_clip: float):
        self.device = topology.device
        self.max_norm = grad_clip if grad_clip > 0 else math.inf  # train.grad_clip, 0: off
        self.model = model.to(self.device)
        self.optimizer, self.loss_fn = optimizer, loss_fn
        self.group, self.dp = topology.group("dp"), topology.dims.dp
        self.saves = topology.rank == 0

    def _mean(self, value: float) -> float:
        total = torch.tensor(value, device=self.device)
        dist.all_reduce(total, group=self.group)
        return total.item() / self.dp

    def train_step(self, micro_batches, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for batch in micro_batches:  # (inputs, targets[, position_ids of packed documents])
            x, kwargs, y = model_inputs(batch, self.device)
            loss = self.loss_fn(self.model(x, **kwargs), y)
            (loss / len(micro_batches)).backward()
            total += loss.item()
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= self.dp
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(loss=self._mean(total / len(micro_batches)), grad_norm=float(norm))

    @torch.no_grad()
    def eval_loss(self, batch):
        x, kwargs, y = model_inputs(batch, self.device)
        return self._mean(self.loss_fn(self.model(x, **kwargs), y).item())

    def save_state(self, directory):
        if self.saves:
            torch.save({{"model": self.model.state_dict(),
                        "optimizer": self.optimizer.state_dict()}}, directory / "{name}.pt")

    def load_state(self, directory):
        state = torch.load(directory / "{name}.pt", map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


@hookimpl
def plait_declare():
    return PluginInfo(name="{name}", selected_by={{"strategy.name": "{name}"}},
                      parallel_axes=frozenset({{"dp"}}),
                      description="per-parameter all-reduce data parallelism")


@hookimpl
def plait_register_configs(config_store):
    \"\"\"``strategy={name}``: the schema is the option (no YAML file needed).\"\"\"
    config_store.store(group="strategy", name="{name}", node=AllReduceConfig)


@hookimpl
def plait_build_engine(cfg, model, optimizer, loss_fn, topology):
    \"\"\"Wrap the model and optimizer plait built; stops at the first non-None result, so
    only the selected strategy answers.\"\"\"
    return AllReduceEngine(model, optimizer, loss_fn, topology, cfg.train.grad_clip)
""",
    "tests/test_{package}.py": """
\"\"\"{name} in a real 2-process training run, through plait.testing.\"\"\"

import pytest

from plait.testing import run_losses


def test_trains_like_one_process(tmp_path):
    steps = ["train.steps=3", "checkpoint.save_final=false"]
    one = run_losses(tmp_path / "one", [*steps, "launcher.nproc_per_node=1"])
    mine = run_losses(tmp_path / "mine", [*steps, "strategy={name}",
                                          "launcher.nproc_per_node=2"])
    assert mine == pytest.approx(one, rel=1e-5)
""",
}

KINDS = {"observer": OBSERVER, "comm": COMM, "model": MODEL, "data": DATA, "strategy": STRATEGY}
