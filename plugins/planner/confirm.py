"""``plait plan --search ... --confirm K``: train the top K layouts for a few steps, as one Hydra
multirun, and print what they took against the estimates.

The K layouts differ in several settings at once (a grid over them would give every
combination), so each becomes an option of a config group ``layout`` in
``<run.root>/<run.name>/layouts/`` (``# @package _global_`` overlays, Hydra's experiment
pattern, that also pick the strategy), and the sweep is ``plait train -m --config-dir
<that directory> +layout=0,1,...`` through :func:`plait.api.multirun`: the same command reruns
them by hand. Measured: the last logged step's ``step_time_s/max`` and
``peak_memory_bytes/max`` (on CUDA the allocator's peak; on a CPU the process's peak RSS,
which includes the Python and torch runtime).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from plait import api
from plait.plan import default_run_name
from plait.plugins.planner.cost import Cost, Layout

CONFIRM_STEPS = 5


def layout_yaml(index: int, layout: Layout, estimate: Cost) -> str:
    lines = [
        "# @package _global_",
        f"# layout {index} of plait plan --search: estimated {estimate.step_s * 1e3:.2f} ms "
        f"per step, {estimate.memory_bytes / 2**30:.3f} GiB per rank",
        "defaults:",
        f"  - override /strategy: {layout.strategy}",
    ]
    settings = OmegaConf.from_dotlist(layout.overrides()[1:])  # the strategy is a default above
    return "\n".join(lines) + "\n" + OmegaConf.to_yaml(settings)


def confirm(top: list[tuple[Layout, Cost]], overrides: list[str], cfg: DictConfig) -> str:
    keys = {o.partition("=")[0] for o in overrides}
    name = cfg.run.name if "run.name" in keys else f"plan-{default_run_name()}"
    config_dir = Path(cfg.run.root) / name / "layouts"
    (config_dir / "layout").mkdir(parents=True, exist_ok=True)
    for i, (layout, estimate) in enumerate(top):
        (config_dir / "layout" / f"top{i + 1}.yaml").write_text(
            layout_yaml(i + 1, layout, estimate)
        )
    sweep = [o for o in overrides if not o.startswith("run.name=")] + [f"run.name={name}"]
    if "train.steps" not in keys:
        sweep.append(f"train.steps={CONFIRM_STEPS}")
    sweep.append("+layout=" + ",".join(f"top{i + 1}" for i in range(len(top))))
    print(f"plait train -m --config-dir {config_dir} {' '.join(sweep)}", flush=True)
    jobs = api.job_returns(api.multirun(sweep, config_dir=str(config_dir)))
    lines = [
        f"{'#':>3} {'layout':50} {'est. step ms':>12} {'measured':>9} "
        f"{'est. mem GiB':>12} {'measured':>9}"
    ]
    for job in jobs:
        index = int(next(o for o in job.overrides if o.startswith("+layout=top"))[11:]) - 1
        layout, estimate = top[index]
        metrics = job.return_value.metrics
        lines.append(
            f"{index + 1:>3} {layout.describe():50} {estimate.step_s * 1e3:>12.2f} "
            f"{metrics['step_time_s/max'] * 1e3:>9.2f} "
            f"{estimate.memory_bytes / 2**30:>12.3f} "
            f"{metrics['peak_memory_bytes/max'] / 2**30:>9.3f}"
        )
    return "\n".join(lines)
