"""The runs a report or a comparison reads: each run directory's ``metrics.jsonl`` (the only file
needed) and, where present, its ``config.yaml`` (the layout) and Hydra's record of a sweep job.

A directory without ``metrics.jsonl`` whose sub-directories hold one is a sweep (``plait train
-m``): each job is a run, labelled with the overrides Hydra recorded for it. A run still training
is read as far as it got: a last line cut short by the writer is left out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

PER_RANK = re.compile(r"^(?P<figure>.+)/rank(?P<rank>\d+)$")


@dataclass
class Run:
    directory: Path
    label: str
    steps: list[dict]  # the logged steps, in order
    config: dict = field(default_factory=dict)  # config.yaml, {} when absent

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of one metric, on the steps that logged it."""
        pairs = [(m["step"], m[name]) for m in self.steps if name in m]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def has(self, name: str) -> bool:
        return any(name in m for m in self.steps)

    def ranks(self, figure: str) -> list[int]:
        """The ranks that logged ``<figure>/rank<r>``, in order."""
        found = {
            int(m.group("rank"))
            for step in self.steps
            for key in step
            if (m := PER_RANK.match(key)) and m.group("figure") == figure
        }
        return sorted(found)

    @property
    def planned_steps(self) -> int | None:
        return self.config.get("train", {}).get("steps")

    @property
    def tokens_per_step(self) -> int | None:
        train = self.config.get("train", {})
        if "batch_size" in train and "seq_len" in train:
            return train["batch_size"] * train["seq_len"]
        return None

    def tokens(self) -> tuple[list[float], str]:
        """Tokens seen at each logged step: the logged ``tokens``, else step x the config's
        global batch (plait keeps the global batch at every size); with how it was got."""
        if all("tokens" in m for m in self.steps):
            return [m["tokens"] for m in self.steps], "logged"
        per_step = self.tokens_per_step
        if per_step is None:
            return [], "unknown"
        return [m["step"] * per_step for m in self.steps], "step x train.batch_size x seq_len"


def read_metrics(path: Path) -> list[dict]:
    """The complete lines of a ``metrics.jsonl``, possibly being written."""
    text = path.read_text()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # being written: the last line is not complete yet
    return [json.loads(line) for line in lines if line.strip()]


def read_run(directory: Path, label: str) -> Run:
    config = {}
    if (directory / "config.yaml").exists():
        config = yaml.safe_load((directory / "config.yaml").read_text()) or {}
    return Run(directory, label, read_metrics(directory / "metrics.jsonl"), config)


def swept_overrides(jobs: list[Path]) -> list[list[str]]:
    """Each job's overrides that differ between the sweep's jobs (what the sweep varied), from
    Hydra's record of each job (``.hydra/overrides.yaml``)."""
    recorded = []
    for job in jobs:
        path = job / ".hydra" / "overrides.yaml"
        given = yaml.safe_load(path.read_text()) if path.exists() else []
        recorded.append(dict(str(o).split("=", 1) for o in given or [] if "=" in str(o)))
    keys = {k for overrides in recorded for k in overrides}
    varied = [k for k in sorted(keys) if len({o.get(k) for o in recorded}) > 1]
    return [[f"{k}={o[k]}" for k in varied if k in o] for o in recorded]


def find_runs(paths: list[str]) -> list[Run]:
    """Every run of the given directories, a sweep's jobs in job order. ``ValueError`` naming a
    directory that holds no run."""
    runs = []
    for given in paths:
        directory = Path(given)
        if (directory / "metrics.jsonl").exists():
            runs.append(read_run(directory, directory.name))
            continue
        jobs = sorted(
            (m.parent for m in directory.glob("**/metrics.jsonl")),
            key=lambda p: [int(t) if t.isdigit() else t for t in p.parts],
        )
        if not jobs:
            raise ValueError(
                f"{given}: no metrics.jsonl in it or in its sub-directories; give a "
                "plait run directory (runs/<run.name>) or a sweep's directory"
            )
        for job, swept in zip(jobs, swept_overrides(jobs)):
            label = " ".join([f"{directory.name}/{job.relative_to(directory)}", *swept])
            runs.append(read_run(job, label))
    return runs


def layout(run: Run) -> dict[str, str]:
    """The run's layout as a table row, from its ``config.yaml`` (and the sizes an elastic run
    logged)."""
    cfg = run.config
    if not cfg:
        return {"layout": "no config.yaml"}
    launcher, parallel = cfg.get("launcher", {}), cfg.get("parallel", {})
    nnodes = str(launcher.get("nnodes", 1))
    per_node = launcher.get("nproc_per_node", 1)
    most = int(nnodes.split(":")[-1])
    world = most * per_node
    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    dp = parallel.get("dp", -1)
    dp = world // (tp * pp) if dp == -1 else dp
    comm = cfg.get("comm", {})
    compression = comm.get("compression", "none")
    row = {
        "strategy": cfg.get("strategy", {}).get("name", "?"),
        "processes": f"{nnodes} node(s) x {per_node}",
        "dp x tp x pp": f"{dp} x {tp} x {pp}",
        "comm": comm.get("name", "?") + (f" + {compression}" if compression != "none" else ""),
        "precision": cfg.get("precision", "?"),
        "model": str(cfg.get("model", {}).get("_target_", "?")).rsplit(".", 1)[-1],
        "batch x seq": f"{cfg.get('train', {}).get('batch_size')} x "
        f"{cfg.get('train', {}).get('seq_len')}",
    }
    sizes = sorted({int(m["world_size"]) for m in run.steps if "world_size" in m})
    if len(sizes) > 1:
        row["processes"] += f" (world size {', '.join(map(str, sizes))} over the run)"
    return row
