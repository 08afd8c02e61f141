"""``plait import-deepspeed ds_config.json [world_size=N]``: the plait overrides equivalent to a
DeepSpeed JSON config, printed as a ``plait train ...`` line, with what differs and what could not
be mapped as ``#`` comments below it.

plait decides some of DeepSpeed's numbers itself (``config.OWNED``: batch, accumulation,
clipping, precision, ZeRO stage and offload, the optimizer and the LR schedule), so a JSON that
sets them is refused as ``strategy.config_file``; this command moves each into the plait setting
that owns it, and every other key into ``strategy.deepspeed.<key>=<value>``. DeepSpeed's defaults
fill what the JSON leaves out (e.g. AdamW's ``weight_decay`` 0, no gradient clipping), so the
plait run does what DeepSpeed would have done.

Batch: ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
world_size`` (DeepSpeed's rule); plait's ``train.batch_size`` is the same global batch. With all
three numbers in the JSON the world size follows; otherwise give ``world_size=N``, the
data-parallel size the JSON was written for.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.plugins.zero.config import STAGES, flatten

ZERO_OFFLOAD = {
    "offload_optimizer": "strategy.offload_optimizer",
    "offload_param": "strategy.offload_params",
}
DEPRECATED_OFFLOAD = {
    "cpu_offload": "strategy.offload_optimizer",
    "cpu_offload_param": "strategy.offload_params",
}
# Top-level keys plait covers otherwise: dropped, with the reason.
NOT_MAPPED = {
    "steps_per_print": "plait's console and tracker log every train.log_every steps",
    "wall_clock_breakdown": "plait logs step time per rank (step_time_s/min, /max)",
    "wandb": "plait's tracker logs the run: tracker=wandb tracker.project=<project>",
    "tensorboard": "plait's tracker logs the run (tracker=wandb)",
    "csv_monitor": "plait writes run.dir/metrics.jsonl",
    "comet": "plait's tracker logs the run (tracker=wandb)",
    "amp": "plait's mixed precision is DeepSpeed's bf16/fp16: precision=bf16 or fp16",
}
# DeepSpeed's optimizer defaults where the JSON gives none (FusedAdam / DeepSpeedCPUAdam).
ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


@dataclass
class Translation:
    settings: dict[str, Any] = field(default_factory=dict)  # plait setting -> value, in order
    differences: list[str] = field(default_factory=list)  # mapped, but not exactly the same
    not_mapped: list[str] = field(default_factory=list)  # "key=value: why"
    summary: str = ""

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={hydra_value(value)}" for key, value in self.settings.items()]

    def set(self, key: str, value: Any) -> None:
        self.settings[key] = value

    def drop(self, key: str, value: Any, why: str) -> None:
        self.not_mapped.append(f"{key}={json.dumps(value)}: {why}")


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (integral floats such as JSON's 5e8 as integers,
    floats to 12 significant digits)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"  # 0.1 * 3e-4 prints as 3e-05, not 2.9999999999999997e-05
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    plain = re.fullmatch(r"[A-Za-z_/.][\w./-]*", value) and value not in ("true", "false", "null")
    return value if plain else json.dumps(value)


def is_set(value: Any) -> bool:
    return value is not None and value != "auto"  # "auto": HF Trainer's "fill in for me"


def translate(ds: dict[str, Any], world_size: int | None = None) -> Translation:
    """The plait overrides for the DeepSpeed config ``ds`` (see the module docstring)."""
    ds, out = dict(ds), Translation()
    out.set("strategy", None)  # first in the line; the stage is known after the zero section
    out.set("strategy", f"zero{zero_overrides(ds.pop('zero_optimization', None) or {}, out)}")
    batch_overrides(ds, world_size, out)
    precision_overrides(ds, out)
    out.set("train.grad_clip", ds.pop("gradient_clipping", 0.0))  # DeepSpeed's default: off
    lr = optimizer_overrides(ds.pop("optimizer", None), out)
    scheduler_overrides(ds.pop("scheduler", None), lr, out)
    for key, value in ds.items():
        if key in NOT_MAPPED:
            out.drop(key, value, NOT_MAPPED[key])
        elif is_set(value):
            passthrough(key, value, out)
    return out


def passthrough(key: str, value: Any, out: Translation) -> None:
    settings = flatten({key: value}) if isinstance(value, dict) else {key: value}
    for path, leaf in settings.items():
        if is_set(leaf) and leaf != {}:
            out.set(f"strategy.deepspeed.{path}", leaf)


def zero_overrides(zero: dict[str, Any], out: Translation) -> int:
    zero = dict(zero)
    stage = zero.pop("stage", 0)  # DeepSpeed's default: no ZeRO
    if f"zero{stage}" not in STAGES:
        raise ValueError(f"zero_optimization.stage={stage}: DeepSpeed has stages 0 to 3")
    for key, setting in ZERO_OFFLOAD.items():
        section = dict(zero.pop(key, None) or {})
        device = section.pop("device", "none")
        if device != "none":
            out.set(setting, device)
            passthrough(f"zero_optimization.{key}", section, out)
    for key, setting in DEPRECATED_OFFLOAD.items():
        if zero.pop(key, False):
            out.set(setting, "cpu")
    passthrough("zero_optimization", zero, out)
    return stage


def batch_overrides(ds: dict[str, Any], world_size: int | None, out: Translation) -> None:
    """DeepSpeed's ``_set_batch_related_parameters``: the missing number from the other two."""
    batch, micro, accum = (
        ds.pop(k, None)
        for k in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
        )
    )
    batch, micro, accum = (v if is_set(v) else None for v in (batch, micro, accum))
    if batch is None and micro is None:
        out.differences.append(
            'no train_batch_size or micro-batch size (or "auto"): plait\'s '
            "train.batch_size and train.grad_accum_steps apply"
        )
        return
    if None not in (batch, micro, accum):
        derived, rest = divmod(batch, micro * accum)
        if rest or derived < 1 or (world_size is not None and world_size != derived):
            raise ValueError(
                f"train_batch_size={batch} != train_micro_batch_size_per_gpu={micro}"
                f" * gradient_accumulation_steps={accum} * world_size"
                f"={world_size if world_size is not None else '?'}: fix the JSON or "
                "world_size="
            )
        world_size = derived
    if world_size is None:
        raise ValueError(
            "the JSON does not give all of train_batch_size, "
            "train_micro_batch_size_per_gpu and gradient_accumulation_steps: give "
            "world_size=N, the data-parallel size they are meant for"
        )
    if accum is None:
        accum = batch // (micro * world_size) if None not in (batch, micro) else 1
    if micro is None:
        micro = batch // (world_size * accum)
    if batch is None:
        batch = micro * accum * world_size
    if batch != micro * accum * world_size or min(batch, micro, accum) < 1:
        raise ValueError(
            f"train_batch_size={batch} is not train_micro_batch_size_per_gpu={micro}"
            f" * gradient_accumulation_steps={accum} * world_size={world_size}"
        )
    out.set("launcher.nproc_per_node", world_size)
    out.set("train.batch_size", batch)
    out.set("train.grad_accum_steps", accum)
    out.summary = (
        f"world size {world_size}: train_batch_size {batch} = micro-batch {micro} x "
        f"accumulation {accum} x {world_size} processes (on N nodes: launcher.nnodes=N "
        f"launcher.nproc_per_node={world_size}/N)"
    )


def precision_overrides(ds: dict[str, Any], out: Translation) -> None:
    chosen = "fp32"
    for precision in ("bf16", "fp16"):
        section = dict(ds.pop(precision, None) or {})
        if section.pop("enabled", False) is True:
            chosen = precision
            passthrough(precision, section, out)  # loss-scale settings and the like
    out.set("precision", chosen)


def optimizer_overrides(optimizer: dict[str, Any] | None, out: Translation) -> float | None:
    """AdamW (or DeepSpeed's "Adam", which is AdamW unless adam_w_mode=false) -> optimizer.*;
    returns the learning rate."""
    if optimizer is None:
        out.differences.append(
            "no optimizer section: plait's optimizer=adamw with its own "
            "settings (optimizer.lr, ...) runs"
        )
        return None
    kind, params = str(optimizer.get("type", "")), dict(optimizer.get("params", {}))
    adam_w = kind.lower() == "adamw" or (kind.lower() == "adam" and params.get("adam_w_mode", True))
    if not adam_w:
        out.drop(
            "optimizer",
            optimizer,
            "plait's optimizer plugin builds AdamW (decoupled weight "
            "decay); another optimizer needs an optimizer plugin of its own",
        )
        return None
    for key, default in ADAM_DEFAULTS.items():
        out.set(f"optimizer.{key}", params.pop(key, default))
    params.pop("adam_w_mode", None)
    for key in ("torch_adam", "fused"):
        params.pop(key, None)  # plait picks the kernel: torch's, fused on CUDA; CPU Adam offloaded
    for key, value in params.items():
        out.drop(f"optimizer.params.{key}", value, "plait's AdamW has no such setting")
    out.differences.append(
        "optimizer: plait's AdamW decays only weights of 2 or more dimensions "
        "(not biases and norms, as nanoGPT and Megatron do); DeepSpeed decays "
        "every parameter it is given"
    )
    return out.settings["optimizer.lr"]


def scheduler_overrides(
    scheduler: dict[str, Any] | None, lr: float | None, out: Translation
) -> None:
    """DeepSpeed's warm-up schedules onto plait's cosine with linear warm-up
    (``optimizer.warmup_steps``, ``min_lr``, ``decay_steps``)."""
    if scheduler is None:
        out.set("optimizer.warmup_steps", 0)  # DeepSpeed without a scheduler: a constant lr
        if lr is not None:
            out.set("optimizer.min_lr", lr)
        return
    kind, params = scheduler.get("type"), dict(scheduler.get("params", {}))
    if kind not in ("WarmupCosineLR", "WarmupLR", "WarmupDecayLR"):
        out.drop(
            "scheduler",
            scheduler,
            "plait's schedule is a cosine with linear warm-up; "
            "set optimizer.warmup_steps, optimizer.min_lr, optimizer.decay_steps",
        )
        return
    if kind == "WarmupCosineLR" and lr is None:
        out.drop(
            "scheduler",
            scheduler,
            "WarmupCosineLR scales the optimizer's lr, and the optimizer was not mapped",
        )
        return
    if kind != "WarmupLR" and "total_num_steps" not in params:
        raise ValueError(
            f"scheduler {kind} needs params.total_num_steps (DeepSpeed has no default for it)"
        )
    warmup = max(2, params.get("warmup_num_steps", 1000))  # DeepSpeed's floor of 2
    start = (
        "warmup_min_ratio * lr"
        if kind == "WarmupCosineLR"
        else f"warmup_min_lr={params.get('warmup_min_lr', 0)}"
    )
    out.differences.append(
        f"scheduler {kind}: the warm-up differs (DeepSpeed's is {params.get('warmup_type', 'log')}"
        f"-shaped from {start} and one step later; plait's is linear from lr/warmup_steps); from "
        f"step warmup_steps+1={warmup + 1} on the two schedules give the same lr"
    )
    out.set("optimizer.warmup_steps", warmup)
    if kind == "WarmupCosineLR":
        out.set("optimizer.min_lr", params.get("cos_min_ratio", 0.0001) * lr)
        out.set("optimizer.decay_steps", params["total_num_steps"])
        return
    # WarmupLR / WarmupDecayLR set the lr themselves (warmup_max_lr), whatever the optimizer's.
    peak = params.get("warmup_max_lr", lr if kind == "WarmupLR" else 0.001)
    out.set("optimizer.lr", peak)
    if kind == "WarmupLR":
        out.set("optimizer.min_lr", peak)  # constant after the warm-up
        return
    out.set("optimizer.min_lr", params.get("warmup_min_lr", 0.0))
    out.set("optimizer.decay_steps", params["total_num_steps"])
    out.differences.append(
        "scheduler WarmupDecayLR decays linearly to warmup_min_lr; plait's "
        "decay is a cosine between the same end points"
    )


def format_translation(source: str, out: Translation) -> str:
    lines = [
        f"# plait overrides for {source}" + (f"; {out.summary}" if out.summary else ""),
        shlex.join(["plait", "train", *out.overrides]),
    ]
    for title, items in (("differences", out.differences), ("not mapped", out.not_mapped)):
        if items:
            lines.append(f"# {title}:")
            lines += [f"#   - {item}" for item in items]
    return "\n".join(lines)


def cmd_import_deepspeed(args: list[str]) -> int:
    paths = [a for a in args if "=" not in a]
    options = dict(a.split("=", 1) for a in args if "=" in a)
    if len(paths) != 1 or set(options) - {"world_size"}:
        raise ValueError("usage: plait import-deepspeed ds_config.json [world_size=N]")
    path = Path(paths[0])
    try:
        ds = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable DeepSpeed JSON config ({e})") from e
    world_size = int(options["world_size"]) if "world_size" in options else None
    print(format_translation(str(path), translate(ds, world_size)))
    return 0
