"""The report's figures: each one's data (what it plots, kept to embed beside the picture) and its
PNG, drawn by matplotlib's Agg renderer (no display, no browser, nothing fetched).

Every figure that plots a metric shows every run given (a sweep: every job), one line each:

    loss_by_step, loss_by_tokens   loss (solid) and eval/loss (dashed, where evaluated)
    eval_scores                    downstream task scores by step (eval/<task>/<metric>, not
                                   their stderr), where evaluated
    tokens_per_s, mfu              throughput; MFU where the device's peak is known
    peak_memory                    each rank's peak memory at the last logged step, bars per run
    step_time_band                 step time: min to max over ranks as a band, per run
    step_time_heatmap              each rank's mean step time per logged step, one panel per run
    phases                         each rank's mean forward / backward / optimizer / collective
                                   wait / data wait per step over the run, one panel per run

Restarts, skipped steps, elastic membership changes, changes of a ``fault=torchft`` quorum (the
replica groups a step was taken by) and named stragglers are drawn as markers (vertical lines) on
the step figures.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any

from plait.plugins.report.runs import Run

PHASES = ("forward_s", "backward_s", "optimizer_s", "comm_wait_s", "data_wait_s")
MARKER_STYLE = {
    "restart": ("tab:red", "-"),
    "skipped step": ("tab:orange", ":"),
    "membership": ("tab:purple", "--"),
    "straggler": ("tab:brown", "-."),
    "quorum": ("tab:green", "--"),
}


@dataclass
class Figure:
    id: str
    title: str
    data: dict[str, Any]  # what is plotted, embedded in the report as JSON
    png: bytes = b""
    notes: list[str] = field(default_factory=list)


def markers(run: Run) -> list[dict[str, Any]]:
    """Steps where the run restarted, skipped steps, changed size, its quorum of replica groups
    changed, or it named a straggler."""
    found, previous = [], {}
    for m in run.steps:
        for key, kind in (
            ("restarts", "restart"),
            ("skipped_steps", "skipped step"),
            ("world_size", "membership"),
            ("quorum/participants", "quorum"),  # fault=torchft: replica groups in the step
        ):
            if key in m and key in previous and m[key] != previous[key]:
                found.append(
                    {
                        "step": m["step"],
                        "kind": kind,
                        "label": f"{key} {previous[key]:g} -> {m[key]:g}",
                    }
                )
            if key in m:
                previous[key] = m[key]
        if "straggler/rank" in m and previous.get("straggler/rank") != m["straggler/rank"]:
            found.append(
                {
                    "step": m["step"],
                    "kind": "straggler",
                    "label": f"straggler: rank {m['straggler/rank']:g} "
                    f"({m['straggler/slowdown']:.2f}x)",
                }
            )
        previous["straggler/rank"] = m.get("straggler/rank")
    return found


def build(runs: list[Run]) -> list[Figure]:
    """The figures these runs have data for, drawn."""
    figures = [
        loss_figure(runs, "step"),
        loss_figure(runs, "tokens"),
        scores_figure(runs),
        line_figure(runs, "tokens_per_s", "tokens / s"),
        line_figure(runs, "mfu", "MFU"),
        memory_figure(runs),
        band_figure(runs),
        heatmap_figure(runs),
        phases_figure(runs),
    ]
    figures = [f for f in figures if f is not None]
    for figure in figures:
        figure.png = DRAW[figure.id](figure)
    return figures


def loss_figure(runs: list[Run], axis: str) -> Figure | None:
    series = []
    for run in runs:
        x_of = (
            dict(zip((m["step"] for m in run.steps), run.tokens()[0])) if axis == "tokens" else None
        )
        for name in ("loss", "eval/loss"):
            steps, values = run.series(name)
            if not steps or (x_of is not None and not x_of):
                continue
            x = [x_of[s] for s in steps] if x_of is not None else steps
            series.append({"run": run.label, "metric": name, "x": x, "y": values})
    if not series:
        return None
    notes = [f"{run.label}: tokens = {run.tokens()[1]}" for run in runs] if axis == "tokens" else []
    return Figure(
        f"loss_by_{axis}",
        f"loss and eval loss by {axis}",
        {
            "xlabel": axis,
            "series": series,
            "markers": {r.label: markers(r) for r in runs} if axis == "step" else {},
        },
        notes=notes,
    )


def task_scores(run: Run) -> list[str]:
    """The downstream task metrics a run logged: ``eval/<task>/<metric>`` (``eval/loss`` and
    standard errors left out)."""
    names = {k for m in run.steps for k in m if k.startswith("eval/") and k.count("/") >= 2}
    return sorted(n for n in names if not n.split("/")[2].endswith("_stderr"))


def scores_figure(runs: list[Run]) -> Figure | None:
    series = [
        {"run": r.label, "metric": name, "x": s, "y": v}
        for r in runs
        for name in task_scores(r)
        for s, v in [r.series(name)]
        if s
    ]
    if not series:
        return None
    return Figure(
        "eval_scores",
        "downstream task scores by step",
        {
            "xlabel": "step",
            "ylabel": "score",
            "series": series,
            "markers": {r.label: markers(r) for r in runs},
        },
    )


def line_figure(runs: list[Run], metric: str, ylabel: str) -> Figure | None:
    series = [
        {"run": r.label, "metric": metric, "x": s, "y": v}
        for r in runs
        for s, v in [r.series(metric)]
        if s
    ]
    if not series:
        return None
    return Figure(
        metric,
        ylabel,
        {
            "xlabel": "step",
            "ylabel": ylabel,
            "series": series,
            "markers": {r.label: markers(r) for r in runs},
        },
    )


def memory_figure(runs: list[Run]) -> Figure | None:
    bars = []
    for run in runs:
        last = next(
            (
                m
                for m in reversed(run.steps)
                if any(k.startswith("peak_memory_bytes/rank") for k in m)
            ),
            None,
        )
        if last is not None:  # the ranks of the last group (an elastic run changes size)
            ranks = [
                r for r in run.ranks("peak_memory_bytes") if f"peak_memory_bytes/rank{r}" in last
            ]
            bars.append(
                {
                    "run": run.label,
                    "step": last["step"],
                    "ranks": ranks,
                    "bytes": [last[f"peak_memory_bytes/rank{r}"] for r in ranks],
                }
            )
    if not bars:
        return None
    return Figure("peak_memory", "peak memory per rank (last logged step)", {"bars": bars})


def band_figure(runs: list[Run]) -> Figure | None:
    bands = []
    for run in runs:
        steps, low = run.series("step_time_s/min")
        _, high = run.series("step_time_s/max")
        if steps:
            bands.append({"run": run.label, "x": steps, "min": low, "max": high})
    if not bands:
        return None
    return Figure(
        "step_time_band",
        "step time, min to max over ranks",
        {"bands": bands, "markers": {r.label: markers(r) for r in runs}},
    )


def heatmap_figure(runs: list[Run]) -> Figure | None:
    panels = []
    for run in runs:
        ranks = run.ranks("step_time_s")
        rows = [m for m in run.steps if any(f"step_time_s/rank{r}" in m for r in ranks)]
        if ranks and rows:  # null where a rank was not in the group (an elastic run)
            panels.append(
                {
                    "run": run.label,
                    "ranks": ranks,
                    "steps": [m["step"] for m in rows],
                    "seconds": [[m.get(f"step_time_s/rank{r}") for m in rows] for r in ranks],
                }
            )
    if not panels:
        return None
    return Figure(
        "step_time_heatmap", "step time per rank (mean per logged step)", {"panels": panels}
    )


def phases_figure(runs: list[Run]) -> Figure | None:
    panels = []
    for run in runs:
        ranks = run.ranks("step_time_s")
        phases = [p for p in PHASES if run.ranks(p)]
        if not ranks or not phases:
            continue
        means = {
            p: [mean([m[f"{p}/rank{r}"] for m in run.steps if f"{p}/rank{r}" in m]) for r in ranks]
            for p in phases
        }
        panels.append({"run": run.label, "ranks": ranks, "seconds": means})
    if not panels:
        return None
    return Figure(
        "phases", "where each rank's step goes (mean seconds per step)", {"panels": panels}
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# ---------------------------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------------------------


def _canvas(panels: int = 1, height: float = 3.6):
    from matplotlib.figure import Figure as MplFigure

    figure = MplFigure(figsize=(8, height * panels), layout="constrained")
    return figure, [figure.add_subplot(panels, 1, i + 1) for i in range(panels)]


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=96)
    return buffer.getvalue()


def _draw_markers(axes, data: dict[str, Any]) -> None:
    seen = set()
    for found in data.get("markers", {}).values():
        for marker in found:
            color, style = MARKER_STYLE[marker["kind"]]
            axes.axvline(
                marker["step"],
                color=color,
                linestyle=style,
                linewidth=1,
                label=None if marker["kind"] in seen else marker["kind"],
            )
            seen.add(marker["kind"])


def draw_lines(figure: Figure) -> bytes:
    canvas, [axes] = _canvas()
    data = figure.data
    for series in data["series"]:
        dashed = series["metric"].startswith("eval/")
        axes.plot(
            series["x"],
            series["y"],
            linestyle="--" if dashed else "-",
            marker="o" if dashed or len(series["x"]) < 3 else None,
            markersize=3,
            label=f"{series['run']} {series['metric']}"
            if dashed or figure.id.startswith("loss")
            else series["run"],
        )
    _draw_markers(axes, data)
    axes.set(
        title=figure.title, xlabel=data.get("xlabel", "step"), ylabel=data.get("ylabel", "loss")
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return _png(canvas)


def draw_memory(figure: Figure) -> bytes:
    canvas, [axes] = _canvas()
    bars = figure.data["bars"]
    width = 0.8 / len(bars)
    for i, run in enumerate(bars):
        axes.bar(
            [r + i * width for r in run["ranks"]],
            [b / 2**20 for b in run["bytes"]],
            width=width,
            label=run["run"],
        )
    axes.set(title=figure.title, xlabel="rank", ylabel="MiB")
    axes.legend(fontsize="small")
    return _png(canvas)


def draw_band(figure: Figure) -> bytes:
    canvas, [axes] = _canvas()
    for band in figure.data["bands"]:
        axes.fill_between(
            band["x"],
            band["min"],
            band["max"],
            alpha=0.35,
            step="mid",
            label=f"{band['run']} min-max",
        )
        axes.plot(band["x"], band["max"], linewidth=0.8)
    _draw_markers(axes, figure.data)
    axes.set(title=figure.title, xlabel="step", ylabel="seconds")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return _png(canvas)


def draw_heatmap(figure: Figure) -> bytes:
    panels = figure.data["panels"]
    canvas, axes_list = _canvas(
        len(panels), height=1.2 + 0.35 * max(len(p["ranks"]) for p in panels)
    )
    for axes, panel in zip(axes_list, panels):
        steps = panel["steps"]
        seconds = [[math.nan if v is None else v for v in row] for row in panel["seconds"]]
        image = axes.imshow(
            seconds,
            aspect="auto",
            interpolation="nearest",
            extent=(
                steps[0] - 0.5,
                steps[-1] + 0.5,
                panel["ranks"][-1] + 0.5,
                panel["ranks"][0] - 0.5,
            ),
        )
        axes.set(
            title=f"{panel['run']}: step time per rank",
            xlabel="step",
            ylabel="rank",
            yticks=panel["ranks"],
        )
        canvas.colorbar(image, ax=axes, label="seconds")
    return _png(canvas)


def draw_phases(figure: Figure) -> bytes:
    panels = figure.data["panels"]
    canvas, axes_list = _canvas(
        len(panels), height=1.6 + 0.3 * max(len(p["ranks"]) for p in panels)
    )
    for axes, panel in zip(axes_list, panels):
        left = [0.0] * len(panel["ranks"])
        for phase, seconds in panel["seconds"].items():
            axes.barh(panel["ranks"], seconds, left=left, label=phase.removesuffix("_s"))
            left = [a + b for a, b in zip(left, seconds)]
        axes.set(
            title=f"{panel['run']}: mean seconds per step",
            xlabel="seconds",
            ylabel="rank",
            yticks=panel["ranks"],
        )
        axes.invert_yaxis()
        axes.legend(fontsize="small", ncols=5, loc="lower right")
    return _png(canvas)


DRAW = {
    "loss_by_step": draw_lines,
    "loss_by_tokens": draw_lines,
    "eval_scores": draw_lines,
    "tokens_per_s": draw_lines,
    "mfu": draw_lines,
    "peak_memory": draw_memory,
    "step_time_band": draw_band,
    "step_time_heatmap": draw_heatmap,
    "phases": draw_phases,
}
