"""One self-contained HTML page: the runs' layouts, each figure as an embedded PNG (a ``data:``
URI) with the data it plots as JSON beside it, and the markers; no script, no style sheet or
font from elsewhere, so it opens offline and can be mailed as one file."""

from __future__ import annotations

import base64
import html
import json
from datetime import datetime

from plait.plugins.report.figures import Figure, markers
from plait.plugins.report.runs import Run, layout

STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
figure { margin: 2em 0; } img { max-width: 100%; }
figcaption, .note { color: #555; font-size: 0.9em; }
"""


def page(runs: list[Run], figures: list[Figure]) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>plait report</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>plait report</h1><p class=note>{len(runs)} run(s), written "
        f"{datetime.now().isoformat(timespec='seconds')}</p>",
        runs_table(runs),
        markers_table(runs),
    ]
    for figure in figures:
        picture = base64.b64encode(figure.png).decode()
        notes = "".join(f"<br>{html.escape(n)}" for n in figure.notes)
        parts.append(
            f'<figure id="figure-{figure.id}"><img alt="{html.escape(figure.title)}" '
            f'src="data:image/png;base64,{picture}"><figcaption>{html.escape(figure.title)}'
            f"{notes}</figcaption></figure>"
            f'<script type="application/json" id="data-{figure.id}">'
            f"{embedded_json(figure.data)}</script>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def embedded_json(data) -> str:
    """JSON that cannot end the ``<script>`` element it sits in."""
    return json.dumps(data).replace("</", "<\\/")


def runs_table(runs: list[Run]) -> str:
    rows = [(run, layout(run)) for run in runs]
    columns = list(dict.fromkeys(key for _, row in rows for key in row))
    head = "".join(
        f"<th>{html.escape(c)}</th>" for c in ["run", "directory", "logged steps", *columns]
    )
    body = []
    for run, row in rows:
        last = run.steps[-1]["step"] if run.steps else 0
        planned = run.planned_steps
        logged = f"{len(run.steps)} (last step {last}" + (f" of {planned})" if planned else ")")
        cells = [run.label, str(run.directory), logged, *(row.get(c, "") for c in columns)]
        body.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f'<h2>Runs</h2><table id="runs"><tr>{head}</tr>{"".join(body)}</table>'


def markers_table(runs: list[Run]) -> str:
    rows = [(run.label, m) for run in runs for m in markers(run)]
    if not rows:
        return "<p class=note>No restarts, skipped steps, membership or quorum changes, or stragglers.</p>"
    body = "".join(
        f"<tr><td>{html.escape(label)}</td><td>{m['step']}</td>"
        f"<td>{html.escape(m['kind'])}</td><td>{html.escape(m['label'])}</td></tr>"
        for label, m in rows
    )
    return (
        f'<h2>Events</h2><table id="events"><tr><th>run</th><th>step</th><th>event</th>'
        f"<th>what</th></tr>{body}</table>"
    )
