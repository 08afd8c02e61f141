"""What the checkpoint plugin refuses before launch: a resume that finds nothing or would
overwrite, a resume at another layout the checkpoint or the strategy cannot convert, and
node-local storage settings that protect nothing."""

from __future__ import annotations

from plait.engine import layout_free
from plait.meta import meta_model
from plait.plugin_manager import offered_by
from plait.plugins.checkpoint.directory import (
    AUTO,
    LATEST,
    checkpoint_root,
    newest_visible,
    resolve_resume,
    restarted,
    visible_roots,
)
from plait.plugins.checkpoint.save_load import (
    current_layout,
    describe,
    needs_conversion,
    saved_layout,
)

RESHARDABLE = "engine:layout_free_state"


def storage_problems(cfg, dims, hook) -> list[str]:
    """Replicas need node-local checkpoints and fewer replicas than nodes."""
    checkpoint, problems = cfg.checkpoint, []
    if checkpoint.replicas > 0 and checkpoint.local_dir is None:
        problems.append(
            f"checkpoint.replicas={checkpoint.replicas} keeps each node's checkpoint part on peer nodes' "
            f"own disks, but without checkpoint.local_dir every node writes into the shared "
            f"{checkpoint_root(cfg)}, where a copy protects nothing: set checkpoint.local_dir=<a "
            "directory on each node's own disk>, or checkpoint.replicas=0"
        )
    if checkpoint.replicas > 0 and checkpoint.replicas >= dims.nnodes:
        problems.append(
            f"checkpoint.replicas={checkpoint.replicas} with {dims.nnodes} node(s): a node's part is kept "
            f"on checkpoint.replicas other nodes, so it must be below the node count: set "
            f"checkpoint.replicas={dims.nnodes - 1}"
            + (" (launcher.nnodes=1 has no peer node)" if dims.nnodes == 1 else "")
        )
    if checkpoint.local_dir is not None and checkpoint.async_save:
        problems.append(
            "checkpoint.async_save=true cannot write node-local checkpoints "
            "(checkpoint.local_dir): set checkpoint.async_save=false, or unset checkpoint.local_dir"
        )
    if checkpoint.local_dir is not None and has_other_roles(cfg, dims, hook):
        problems.append(
            f"strategy={cfg.strategy.name} runs ranks of other roles (e.g. parameter "
            "servers) that write their own checkpoint files, which checkpoint.local_dir "
            "does not place: unset checkpoint.local_dir"
        )
    return problems


def has_other_roles(cfg, dims, hook) -> bool:
    try:
        roles = hook.plait_assign_roles(cfg=cfg, world_size=dims.world_size)
    except ValueError:
        return False
    return roles is not None and not roles.single


def reshard_problems(cfg, dims, hook, reshardable: bool) -> list[str]:
    """A resume that needs a conversion the checkpoint or the strategy cannot do."""
    if dims is None:
        return []
    path = resolve_resume(cfg, cfg.resume)
    layout = current_layout(cfg, dims)
    saved = saved_layout(path) if path is not None else None
    if not needs_conversion(saved, layout):
        return []
    was = describe(saved)
    if not saved["layout_free"]:
        return [
            f"resume: checkpoint {path} was written with {was}, which saves no layout-free "
            f"copy, so it cannot be converted to {describe(layout)}: resume with {was}"
        ]
    if not reshardable:
        return [
            f"resume: checkpoint {path} was written with {was}; strategy="
            f"{cfg.strategy.name} cannot load another layout's checkpoint: resume with {was}, "
            f"or with {offered_by(RESHARDABLE)} at any parallel.dp/tp/pp"
        ]
    model = meta_model(hook, cfg)
    if model is None:
        return []
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    stored = layout_free.saved_shapes(path)
    missing = sorted(shapes.keys() - stored.keys())
    resized = [
        f"{k}: {stored[k]} in the checkpoint, {shapes[k]} in the model"
        for k in sorted(shapes.keys() & stored.keys())
        if shapes[k] != stored[k]
    ]
    if missing or resized:
        what = "; ".join(
            resized[:3]
            + ([f"{len(missing)} parameters missing, e.g. {missing[:3]}"] if missing else [])
        )
        return [
            f"resume: checkpoint {path} holds another model ({what}): resume with the "
            "model._target_ and settings that wrote it, or start fresh with resume=null "
            "and another run.name"
        ]
    return []


def resume_problems(cfg) -> list[str]:
    root = ", ".join(map(str, visible_roots(cfg)))
    if cfg.resume == AUTO or (cfg.resume == LATEST and cfg.checkpoint.local_dir):
        return []  # node-local: the nodes learn what survives when they meet
    if cfg.resume is not None:
        if resolve_resume(cfg, cfg.resume) is None:
            where = root if cfg.resume == LATEST else cfg.resume
            return [
                f"resume={cfg.resume}: no complete checkpoint found in {where}; start with "
                "resume=auto (resumes only if there is one), or give a checkpoint or run "
                "directory that holds one"
            ]
        return []
    existing = newest_visible(cfg)
    if existing is not None and not restarted():
        return [
            f"run.dir={cfg.run.dir} already holds checkpoints (latest: {existing.name}) and "
            "resume=null starts fresh: continue it with resume=auto, or start a new run "
            "with another run.name"
        ]
    return []
