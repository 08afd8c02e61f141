"""``plait report`` and ``plait compare``: look at runs without a W&B account or server.

    plait report runs/exp1 runs/exp2 out=report.html     # one or more runs, or a sweep's directory
    plait compare runs/ddp runs/zero2                     # "same", or "differs at step k" (exit 1)

Both read only what every run writes: ``metrics.jsonl`` (so ``tracker=none`` runs too, and runs
still training: what is there so far) and ``config.yaml`` for the layout. The report is one HTML
file that works offline, its figures embedded as PNGs (matplotlib, Agg) with the data each plots
as JSON beside it, and the same PNGs written beside the HTML (``<stem>-<figure>.png``). See
docs/report.md.
"""

from __future__ import annotations

from pathlib import Path

from plait import hookimpl
from plait.types import PluginInfo

USAGE = "usage: plait report <run or sweep dir> [<run or sweep dir> ...] [out=report.html]"


def report(paths: list[str], out: str = "report.html") -> tuple[Path, list[Path]]:
    """Write the report of the runs under ``paths`` to ``out`` and its PNGs beside it."""
    from plait.plugins.report.figures import build
    from plait.plugins.report.html import page
    from plait.plugins.report.runs import find_runs

    runs = find_runs(paths)
    figures = build(runs)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    pngs = []
    for figure in figures:
        png = target.with_name(f"{target.stem}-{figure.id}.png")
        png.write_bytes(figure.png)
        pngs.append(png)
    target.write_text(page(runs, figures))
    return target, pngs


def cmd_report(args: list[str]) -> int:
    paths = [a for a in args if not a.startswith("out=")]
    outs = [a.split("=", 1)[1] for a in args if a.startswith("out=")]
    if not paths or len(outs) > 1:
        raise ValueError(USAGE)
    target, pngs = report(paths, *outs)
    print(f"plait: wrote {target} ({len(pngs)} figures, also as {target.stem}-*.png beside it)")
    return 0


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="report",
        description="plait report (HTML with figures) and plait "
        "compare (are two runs the same math?)",
    )


@hookimpl
def plait_register_commands(register) -> None:
    from plait.plugins.report.compare import cmd_compare

    register("report", cmd_report, "an offline HTML report with figures of runs or a sweep")
    register("compare", cmd_compare, "step by step, are two runs the same math? (exit 1 if not)")
