"""The ``strategy=zero0..zero3`` schema and the DeepSpeed config generated from plait's config.

plait owns every number it already has a setting for, so the user never keeps one number in two
places. The generated config is, in order of precedence (later wins for keys plait does not own)::

    generated from plait  <-  strategy.config_file (a DeepSpeed JSON)  <-  strategy.deepspeed.*

A key plait owns (``OWNED``) may appear in the file or the passthrough only with the same value
(or DeepSpeed/HF's ``"auto"``); any other value is refused naming both settings.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from plait.config import StrategyConfig, runs_on_cpu
from plait.plugins.zero.comm import comm_settings
from plait.plugins.zero.sizing import working_memory_settings
from plait.types import CommSpec

if TYPE_CHECKING:
    from plait.topology import ParallelDims

STAGES = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
QUIET = 10**9  # steps_per_print: plait's console and trackers log, not DeepSpeed


@dataclass
class ZeroStrategyConfig(StrategyConfig):
    name: str = "zero1"  # zero0 | zero1 | zero2 | zero3: the ZeRO stage
    offload_optimizer: str = "none"  # none | cpu | nvme (DeepSpeed's CPU Adam runs the step)
    offload_params: str = "none"  # none | cpu | nvme, stage 3 only
    config_file: Optional[str] = None  # an existing DeepSpeed JSON to import
    # Any DeepSpeed key, merged last. Not in struct mode, so `strategy.deepspeed.a.b=1` works
    # without Hydra's `+` for keys no schema can list.
    deepspeed: Any = field(default_factory=lambda: OmegaConf.create({}, flags={"struct": False}))


def stage_of(cfg: DictConfig) -> int:
    return STAGES[cfg.strategy.name]


def micro_batch_size(cfg: DictConfig, dims: ParallelDims) -> int:
    return cfg.train.batch_size // (dims.grad_accum_steps * dims.dp)


def generated_config(
    cfg: DictConfig,
    dims: ParallelDims,
    comm: CommSpec | None = None,
    model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config that follows from plait's settings and the layout ``dims`` (its
    accumulation is an elastic job's at its present size), the comm plugin's
    :class:`~plait.types.CommSpec` (``comm.py``) and, given the unsplit ``model`` (meta device),
    buffer sizes for it (``sizing.py``); the optimizer section is added from the built
    optimizer: :func:`optimizer_section`."""
    strategy, train = cfg.strategy, cfg.train
    zero: dict[str, Any] = {"stage": stage_of(cfg)}
    if model is not None:
        zero.update(
            working_memory_settings(model, stage_of(cfg), cfg.parallel.tp * cfg.parallel.pp)
        )
    if strategy.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": strategy.offload_optimizer}
    if strategy.offload_params != "none":
        zero["offload_param"] = {"device": strategy.offload_params}
    generated = {
        "train_batch_size": train.batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size(cfg, dims),
        "gradient_accumulation_steps": dims.grad_accum_steps,
        "gradient_clipping": float(train.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision == "bf16"},
        # loss_scale 0 is DeepSpeed's dynamic loss scaling
        "fp16": {"enabled": cfg.precision == "fp16", "loss_scale": 0},
        "steps_per_print": QUIET,
    }
    return deep_merge(generated, comm_config(cfg, dims, comm)[0])


def comm_config(cfg: DictConfig, dims: ParallelDims, comm: CommSpec | None):
    """The comm plugin's choice as DeepSpeed settings: ``(settings, owners, problems)``."""
    return comm_settings(comm, cfg, stage_of(cfg), dims.nodes.max, dims.tp)


def optimizer_section(optimizer: torch.optim.Optimizer, offload: bool) -> dict[str, Any] | None:
    """DeepSpeed's ``optimizer`` section for the torch optimizer the optimizer plugin built.

    A ``torch.optim.AdamW`` (whichever plugin built it) maps onto DeepSpeed's AdamW with the
    hyperparameters it was built with: ``torch_adam`` (the same math as under DDP, with torch's
    fused kernel where the plugin chose it), or DeepSpeed's CPU Adam when offloading, which must
    be DeepSpeed's own. Any other optimizer goes to DeepSpeed as a client optimizer: None.
    """
    if type(optimizer) is not torch.optim.AdamW:
        return None
    d = optimizer.defaults
    params = {
        "lr": d["lr"],
        "betas": list(d["betas"]),
        "eps": d["eps"],
        "weight_decay": d["weight_decay"],
    }
    if not offload:
        params["torch_adam"] = True
        if d.get("fused"):
            params["fused"] = True
    return {"type": "AdamW", "params": params}


def engine_config(
    cfg: DictConfig,
    dims: ParallelDims,
    optimizer: torch.optim.Optimizer,
    comm: CommSpec | None = None,
    model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """What ``deepspeed.initialize`` gets: :func:`deepspeed_config` plus the optimizer section."""
    ds = deepspeed_config(cfg, dims, comm, model)
    section = optimizer_section(optimizer, cfg.strategy.offload_optimizer != "none")
    if section is None:
        return {**ds, "zero_allow_untested_optimizer": True}
    return {**ds, "optimizer": section}


# Keys plait owns -> the plait setting that decides each (for the error message).
OWNED = {
    "train_batch_size": "train.batch_size",
    "train_micro_batch_size_per_gpu": "train.batch_size / (train.grad_accum_steps * dp)",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "gradient_clipping": "train.grad_clip",
    "zero_optimization.stage": "strategy=zero0..zero3",
    "zero_optimization.offload_optimizer.device": "strategy.offload_optimizer",
    "zero_optimization.offload_param.device": "strategy.offload_params",
    "bf16.enabled": "precision",
    "fp16.enabled": "precision",
}

# Whole sections plait decides itself, refused from the user whatever their content.
OWNED_SECTIONS = {
    "optimizer": "optimizer=... (plait's optimizer plugin builds it; `plait import-deepspeed` "
    "prints the overrides for a DeepSpeed JSON's optimizer)",
    "scheduler": "optimizer.* (plait's LR schedule, e.g. optimizer.warmup_steps, optimizer.min_lr)",
}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def without_auto(d: dict[str, Any]) -> dict[str, Any]:
    """Drop ``"auto"`` values (HF Trainer's convention in DeepSpeed JSONs): plait fills them."""
    return {k: without_auto(v) if isinstance(v, dict) else v for k, v in d.items() if v != "auto"}


def read_config_file(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def user_sources(cfg: DictConfig) -> list[tuple[str, dict[str, Any]]]:
    """The user's DeepSpeed settings, each with the name of where it came from."""
    sources = []
    if cfg.strategy.config_file:
        sources.append(
            (
                f"strategy.config_file={cfg.strategy.config_file}",
                without_auto(read_config_file(cfg.strategy.config_file)),
            )
        )
    passthrough = OmegaConf.to_container(cfg.strategy.deepspeed, resolve=True) or {}
    if passthrough:
        sources.append(("strategy.deepspeed", without_auto(passthrough)))
    return sources


def conflicts(cfg: DictConfig, dims: ParallelDims, comm: CommSpec | None = None) -> list[str]:
    """Every user-given DeepSpeed key that contradicts a plait setting, naming both. The keys
    the comm plugin's choice sets are owned too; where it sets none, the user's value stands."""
    generated = flatten(generated_config(cfg, dims, comm))
    owned = {**OWNED, **comm_config(cfg, dims, comm)[1]}
    problems = []
    for source, settings in user_sources(cfg):
        for section, owner in OWNED_SECTIONS.items():
            if section in settings:
                problems.append(
                    f"{source} sets DeepSpeed's {section!r}, which plait decides from "
                    f"{owner}: remove it there and set {owner.split(' ')[0]} instead"
                )
        for key, value in flatten(settings).items():
            if key not in owned:
                continue
            ours = generated.get(key)
            if ours is None or not same(value, ours):
                where = f"{source}.{key}" if source == "strategy.deepspeed" else f"{source} ({key})"
                owner = owned[key]
                plait_value = OmegaConf.select(cfg, owner, default=None)
                named = f"{owner}={plait_value}" if plait_value is not None else owner
                problems.append(
                    f"{where}={json.dumps(value)} conflicts with {named} (DeepSpeed's "
                    f"{key}={json.dumps(ours)}): set {owner} instead, or drop the key"
                )
    return problems


def deepspeed_config(
    cfg: DictConfig,
    dims: ParallelDims,
    comm: CommSpec | None = None,
    model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config a run uses: generated, then the file, then the passthrough."""
    ds = generated_config(cfg, dims, comm, model)
    for _, settings in user_sources(cfg):
        ds = deep_merge(ds, settings)
    return ds


def validate(cfg: DictConfig, dims, comm: CommSpec | None = None) -> list[str]:
    """Refusals before launch (the capability checks of ``PluginInfo`` cover devices/axes)."""
    strategy, stage = cfg.strategy, stage_of(cfg)
    problems = (
        list(comm_config(cfg, dims, comm)[2])
        + pipeline_problems(cfg, dims)
        + expert_parallel_problems(cfg, dims)
    )
    for setting in ("offload_optimizer", "offload_params"):
        value = strategy[setting]
        if value not in OFFLOAD_DEVICES:
            problems.append(
                f"strategy.{setting}={value}: choose one of {', '.join(OFFLOAD_DEVICES)}"
            )
    if strategy.offload_params != "none" and stage != 3:
        problems.append(
            f"strategy.offload_params={strategy.offload_params} needs ZeRO-3 (only "
            f"stage 3 partitions parameters), but strategy={strategy.name}: use "
            "strategy=zero3 or set strategy.offload_params=none"
        )
    if strategy.offload_optimizer != "none" and stage == 0:
        problems.append(
            f"strategy.offload_optimizer={strategy.offload_optimizer} needs ZeRO-1 or "
            "higher (stage 0 keeps the torch optimizer): use strategy=zero1..zero3"
        )
    on_cpu = runs_on_cpu(cfg)
    for setting in ("offload_optimizer", "offload_params"):
        if strategy[setting] == "nvme" and on_cpu:
            problems.append(
                f"strategy.{setting}=nvme needs a CUDA device (DeepSpeed's async_io "
                f"swaps to NVMe from GPU memory), but device={cfg.device} runs on the "
                "CPU: use cpu or none"
            )
    if cfg.precision == "fp16" and on_cpu and not _cpu_supports_fp16():
        problems.append(
            "precision=fp16 with DeepSpeed on the CPU: this CPU has no fp16 kernels "
            "(DeepSpeed's CPU accelerator reports no fp16 support); use precision=bf16 "
            "or fp32, or a CUDA device"
        )
    if strategy.config_file and not Path(strategy.config_file).is_file():
        problems.append(
            f"strategy.config_file={strategy.config_file}: no such file; give the path "
            "of an existing DeepSpeed JSON config"
        )
        return problems
    if strategy.config_file:
        try:
            read_config_file(strategy.config_file)
        except (OSError, ValueError) as e:
            problems.append(f"strategy.config_file={strategy.config_file} is not valid JSON ({e})")
            return problems
    return problems + conflicts(cfg, dims, comm) + zero_section_problems(cfg, dims)


def expert_parallel_problems(cfg: DictConfig, dims) -> list[str]:
    """Expert parallelism runs on ZeRO-1 and ZeRO-2 (DeepSpeed-MoE's expert param groups,
    partitioned over the expert-data-parallel groups)."""
    if dims.ep == 1:
        return []
    stage, ep = stage_of(cfg), f"parallel.ep={dims.ep}"
    if stage == 3:
        return [
            f"strategy=zero3 with {ep}: DeepSpeed partitions ZeRO-3 parameters over the whole "
            "dp group, not expert parameters over their expert-data-parallel group (it "
            "refuses its own MoE layers under stage 3); use strategy=zero1 or zero2, or ddp"
        ]
    if stage == 0:
        return [
            f"strategy=zero0 with {ep}: DeepSpeed's stage-0 gradient norm averages the "
            "ranks' norms instead of adding their experts' squares, so clipping would "
            "differ from one process; use strategy=zero1 or zero2, or ddp"
        ]
    if dims.pp > 1:
        return [
            f"strategy={cfg.strategy.name} with {ep} and parallel.pp={dims.pp}: expert "
            "parameters under DeepSpeed's pipeline ZeRO-1 path are not supported by plait "
            "yet; use strategy=ddp with pipeline stages, or parallel.pp=1"
        ]
    return []


def pipeline_problems(cfg: DictConfig, dims) -> list[str]:
    """Pipeline stages take ZeRO-1 only, as in DeepSpeed's own pipeline engine: ZeRO-2 reduces
    and partitions gradients inside each micro-batch's backward, which the pipeline schedule runs
    outside DeepSpeed, and ZeRO-3 also gathers parameters around every module's forward."""
    stage = stage_of(cfg)
    if dims.pp > 1 and dims.cp > 1:
        return [
            f"strategy={cfg.strategy.name} with parallel.pp={dims.pp} and parallel.cp="
            f"{dims.cp}: DeepSpeed sums gradients over the context-parallel ranks, which the "
            "pipeline schedule's loss is not scaled for (not built): use strategy=ddp with "
            "pipeline and context parallelism, or one of them with ZeRO"
        ]
    if dims.pp > 1 and stage == 1 and cfg.precision == "fp16":
        return [
            f"strategy=zero1 precision=fp16 with parallel.pp={dims.pp}: the pipeline "
            "schedule runs the backward outside DeepSpeed, so DeepSpeed's loss scaler never "
            "scales it; use precision=bf16 (or strategy=ddp, whose pipeline engine scales)"
        ]
    if dims.pp == 1 or stage == 1:
        return []
    if stage == 0:
        return [
            f"strategy=zero0 with parallel.pp={dims.pp}: stage 0 partitions nothing; use "
            "strategy=ddp (the same data parallelism) or strategy=zero1"
        ]
    return [
        f"strategy={cfg.strategy.name} with parallel.pp={dims.pp}: DeepSpeed supports only "
        "ZeRO-1 under pipeline parallelism (its pipeline engine refuses ZeRO-2 and ZeRO-3: "
        f"ZeRO-{stage} {'partitions gradients' if stage == 2 else 'partitions parameters'} "
        "inside each micro-batch's backward, which the pipeline schedule runs); use "
        "strategy=zero1 (optimizer states partitioned over each stage's dp group)"
    ]


def zero_section_problems(cfg: DictConfig, dims: ParallelDims) -> list[str]:
    """DeepSpeed's own checks (its pydantic model) of the ``zero_optimization`` section, run only
    when the user's file or passthrough sets keys in it: importing DeepSpeed takes seconds."""
    sources = [
        (source, flatten(settings))
        for source, settings in user_sources(cfg)
        if "zero_optimization" in settings
    ]
    if not sources:
        return []
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**deepspeed_config(cfg, dims)["zero_optimization"])
    except ValidationError as e:
        problems = []
        for error in e.errors():
            key = "zero_optimization." + ".".join(map(str, error["loc"]))
            source = next((s for s, keys in reversed(sources) if key in keys), sources[-1][0])
            where = f"{source}.{key}" if source == "strategy.deepspeed" else f"{source} ({key})"
            problems.append(
                f"{where}={json.dumps(error.get('input'))} is refused by DeepSpeed "
                f"({error['msg']}): change or drop it"
            )
        return problems
    return []


def _cpu_supports_fp16() -> bool:
    """What DeepSpeed's CPU accelerator checks (oneDNN fp16), without importing DeepSpeed."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
