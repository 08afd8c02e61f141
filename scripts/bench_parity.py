"""Every strategy against its own library's plain loop, in one table: steady step time, time from
the command to the first finished step, and the whole job's peak memory, each as a ratio.

    DS_ACCELERATOR=cpu python scripts/bench_parity.py                # every row, 2 CPU processes
    DS_ACCELERATOR=cpu python scripts/bench_parity.py --rows ddp fsdp --repeats 5 --steps 30
    DS_ACCELERATOR=cpu python scripts/bench_parity.py --check-losses --tiny   # losses only
    python scripts/bench_parity.py --device cuda                     # one GPU: GPT-2 small, bf16
    DS_ACCELERATOR=cpu python scripts/bench_parity.py --rows cp2 --steps 200 --alternate 5
    DS_ACCELERATOR=cpu python scripts/bench_parity.py --rows ep2 --repeats 3 --threads

Rows (``--rows``; plait's override | the plain loop, ``scripts/parity_loops.py``)::

    ddp            strategy=ddp                     | torch DDP
    ddp+defaults   the same with W&B offline and     | torch DDP
                   the watchdog on (plait's defaults
                   otherwise: metrics file, phase
                   timing, straggler detector)
    zero1..zero3   strategy=zero1..3                | deepspeed.initialize, plait's DeepSpeed JSON
    fsdp           strategy=fsdp                    | fully_shard per block, then the root
    tp2            parallel.tp=2                    | parallelize_module, Colwise/RowwiseParallel
    pp2            parallel.pp=2, 1f1b              | torch.distributed.pipelining, Schedule1F1B
    ep2            parallel.ep=2 (4 experts, top 2) | all_to_all_single dispatch written there
    cp2            parallel.cp=2                    | DDP + plait's ring attention, zigzag chunks

Both sides are the same GPT (plait's), batch, data (plait's default, the same sample order),
precision, schedule, clipping, cores (``OMP_NUM_THREADS`` the same), process count and
allocator (``--allocator``, plait's ``launcher.allocator``; the plain side gets the same
``LD_PRELOAD``, so only the layer is compared). Each run is a fresh command: ``python -m plait
train ...`` against ``python -m torch.distributed.run --standalone ... parity_loops.py``, in
that order or the reverse, alternating, ``--repeats`` times each (interleaved). Per run:

- steady step time: the median gap between consecutive step ends on rank 0's clock after
  ``--warmup`` steps (plait: every hook, the loader and its metrics included);
- CPU seconds per step: the same on rank 0's process CPU time (all its threads): what each
  side computes per step, which other work on a shared machine changes far less than the wall
  clock (it cannot show time lost waiting for a descheduled peer);
- time to first step: from the command's start to the end of its first step (wall clock);
- peak memory: the whole job's (launcher, forkserver and workers) from a memory cgroup made for
  the run when run as root (``memory.max_usage_in_bytes`` / ``memory.peak``), else the largest
  sum of the job's processes' resident sizes, sampled every 20 ms; on CUDA also the largest
  rank's ``torch.cuda.max_memory_allocated``.
- with ``--threads``, rank 0's CPU time per steady step by thread (``main``, ``gloo_tcp_loop``,
  ``plait-decommit``, ...), the main thread's split into the step itself and the loop around it
  (:class:`parity_loops.ThreadTimes`): what plait adds and in which thread, a figure the host's
  speed moves far less than the wall clock's.

It prints one line per run, then the table of medians over the repeats with the ratios
(plait / plain for time to first step and memory; plain / plait for step time, i.e. plait's
speed relative to the plain loop: targets >= 0.97, <= 1.05 and <= 1.2 or within 3 s) and the
load average (``uptime``) before each row's first run and after its last. The pairs column is
the median of each repeat's ratio of its two neighbouring runs, with a 95% bootstrap interval of
that median. ``--control`` runs the plain loop a third time in each repeat (the three in
rotation) and prints the same figures for plain against plain: the spread this host gives a
layer that costs nothing. ``--alternate SECONDS`` (root, CPU): the sides of a row run at once and
take turns of that many seconds on the cores, the others frozen (:mod:`parity_alternate`), so
that the host's slow and fast spells fall on all of them; the step time is then measured per
turn. ``--check-losses`` runs 5 steps of each row, every step logged, and prints both sides'
losses and their largest relative difference (exit 1 above ``--tolerance``); the suite runs it
at ``--tiny`` sizes (tests/test_parity.py).

On CUDA (``--device cuda``) the defaults are GPT-2 small (``model=gpt2_small``), bf16, batch 16
x 1024, one process, rows ddp zero1 zero2 zero3 fsdp; a row whose library is not installed is
skipped, with the reason printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
from parity_alternate import (  # noqa: E402
    Freezer,
    Turns,
    freezer_problem,
    neighbour_ratios,
    read_clock,
    remove_when_empty,
    take_turns,
    turn_steps,
)

os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROWS = {
    "ddp": ("ddp", []),
    "ddp+defaults": (
        "ddp",
        ["tracker=wandb", "tracker.mode=offline", "fault.collective_timeout_s=300"],
    ),
    "zero1": ("zero1", ["strategy=zero1"]),
    "zero2": ("zero2", ["strategy=zero2"]),
    "zero3": ("zero3", ["strategy=zero3"]),
    "fsdp": ("fsdp", ["strategy=fsdp"]),
    "tp2": ("tp2", ["parallel.tp=2"]),
    "pp2": ("pp2", ["parallel.pp=2", "pipeline.schedule=1f1b"]),
    "ep2": ("ep2", ["parallel.ep=2", "model.n_experts=4", "model.top_k=2"]),
    "cp2": ("cp2", ["parallel.cp=2"]),
}
LIBRARY = {"zero1": "deepspeed", "zero2": "deepspeed", "zero3": "deepspeed"}
GPU_ROWS = ["ddp", "zero1", "zero2", "zero3", "fsdp", "ddp+defaults"]  # one process each
MIB = 2**20


def plait_overrides(args, row: str, run_dir: Path) -> list[str]:
    _, extra = ROWS[row]
    model = (
        ["model=gpt2_small", f"model.block_size={args.seq_len}"]
        if args.model == "gpt2_small"
        else [
            "model=gpt_tiny",
            f"model.n_layer={args.n_layer}",
            f"model.n_embd={args.n_embd}",
            f"model.n_head={args.n_head}",
            f"model.block_size={args.seq_len}",
        ]
    )
    return [
        *model,
        *(["tracker=none"] if not any(o.startswith("tracker=") for o in extra) else []),
        f"device={args.device}",
        f"precision={args.precision}",
        f"launcher.nproc_per_node={args.nproc}",
        f"launcher.allocator={args.allocator}",
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        f"train.seq_len={args.seq_len}",
        f"pipeline.microbatches={args.microbatches}",
        "checkpoint.save_final=false",
        "resume=null",
        f"run.root={run_dir.parent}",
        f"run.name={run_dir.name}",
        *extra,
        *args.plait_overrides,
    ]


def plain_spec(args, row: str, overrides: list[str]) -> dict:
    """What the plain loop trains, read off plait's composed config for the same overrides."""
    from omegaconf import OmegaConf

    from plait.testing import compose

    cfg = compose(overrides)
    loop, _ = ROWS[row]
    opt = cfg.optimizer
    spec = {
        "loop": loop,
        "device": args.device,
        "precision": cfg.precision,
        "seed": cfg.seed,
        "model": {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_target_"},
        "optimizer": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps},
        "schedule": {
            "lr": opt.lr,
            "min_lr": opt.min_lr,
            "warmup": opt.warmup_steps,
            "decay": opt.decay_steps or cfg.train.steps,
        },
        "steps": cfg.train.steps,
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.train.seq_len,
        "grad_clip": cfg.train.grad_clip,
        "microbatches": cfg.pipeline.microbatches,
        "cache_dir": cfg.data.cache_dir,
        "val_fraction": cfg.data.val_fraction,
    }
    spec["optimizer"]["weight_decay"] = opt.weight_decay
    if loop.startswith("zero"):
        spec["deepspeed"] = deepspeed_json(cfg, args.nproc)
    return spec


def deepspeed_json(cfg, world_size: int) -> dict:
    """The DeepSpeed config plait's ZeRO engine is given for this run (``engine_config``)."""
    import torch

    from plait.meta import meta_model
    from plait.plugin_manager import keep_selected, make_plugin_manager
    from plait.plugins.optim import param_groups
    from plait.plugins.zero.config import engine_config
    from plait.topology import ParallelDims

    pm = keep_selected(make_plugin_manager(cfg), cfg)
    model = meta_model(pm.hook, cfg)
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(
        param_groups(torch.nn.Linear(1, 1), opt.weight_decay),
        lr=opt.lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
    )
    dims = ParallelDims.from_config(cfg, world_size=world_size)
    return engine_config(cfg, dims, optimizer, None, model)


# -- running a command and measuring it ------------------------------------------------------------


class JobMemory:
    """The whole job's peak memory: a memory cgroup of its own when root (v1 or v2), else the
    largest sum of its processes' resident sizes, sampled."""

    def __init__(self, name: str):
        self.group: Path | None = None
        self.v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        base = Path("/sys/fs/cgroup" if self.v2 else "/sys/fs/cgroup/memory")
        if os.geteuid() == 0 and base.is_dir():
            self.group = base / f"plait-parity-{os.getpid()}-{name}"
            self.group.mkdir()
        self.sampled = 0
        self._stop = threading.Event()

    @property
    def procs(self) -> Path | None:
        return None if self.group is None else self.group / "cgroup.procs"

    def prefix(self) -> list[str]:
        """Run the command inside the group (it joins before it execs)."""
        if self.group is None:
            return []
        return ["sh", "-c", f'echo $$ > {self.procs} && exec "$@"', "sh"]

    def sample(self, pid: int) -> None:
        if self.group is None:
            threading.Thread(target=self._sample, args=(pid,), daemon=True).start()

    def _sample(self, root: int) -> None:
        while not self._stop.wait(0.02):
            self.sampled = max(self.sampled, tree_rss(root))

    def peak(self) -> float:
        self._stop.set()
        if self.group is None:
            return float(self.sampled)
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return float((self.group / name).read_text())

    def close(self) -> None:
        if self.group is not None:
            remove_when_empty(self.group)


def tree_rss(root: int) -> int:
    """Bytes resident in ``root`` and every process below it (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            rss[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            children.setdefault(int(fields[1]), []).append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def run(command: list[str], env: dict, name: str, clock: Path) -> dict:
    """One command: its step ends (rank 0's wall clock), time to first step, job peak."""
    memory = JobMemory(name)
    try:
        started = time.time()
        process = subprocess.Popen(
            [*memory.prefix(), *command],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        memory.sample(process.pid)
        output, _ = process.communicate()
        peak = memory.peak()
    finally:
        memory.close()
    if process.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {process.returncode}):\n{output[-4000:]}")
    ends, cpu = read_clock(clock)
    threads = Path(f"{clock}.threads")
    return {
        "ends": ends,
        "cpu": cpu,
        "first": ends[0] - started,
        "peak": peak,
        "threads": json.loads(threads.read_text()) if threads.exists() else {},
    }


def steady(ends: list[float], warmup: int) -> float:
    """The median gap between consecutive step ends after ``warmup`` steps."""
    gaps = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :])]
    return statistics.median(gaps)


def plait_command(args, row: str, root: Path, name: str, env: dict) -> tuple[list, dict, Path]:
    """plait's side of a row: its command, environment and clock file."""
    clock = root / f"{name}.clock"
    command = [
        sys.executable,
        "-m",
        "plait",
        "train",
        *plait_overrides(args, row, root / name),
        "+plugins=[parity_loops:clock]",
        *(["train.log_every=1"] if args.check_losses else []),
    ]
    return command, {**env, "PARITY_CLOCK": str(clock)}, clock


def plain_command(args, root: Path, name: str, env: dict, spec: dict) -> tuple[list, dict, Path]:
    """The plain loop's side of a row: its command, environment and clock file."""
    spec = {
        **spec,
        "clock": str(root / f"{name}.clock"),
        "losses": str(root / f"{name}.losses") if args.check_losses else None,
    }
    path = root / f"{name}.json"
    path.write_text(json.dumps(spec))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        str(SCRIPTS / "parity_loops.py"),
        str(path),
    ]
    return command, env, Path(spec["clock"])


def run_plait(args, row: str, root: Path, name: str, env: dict) -> dict:
    run_dir = root / name
    command, env, clock = plait_command(args, row, root, name, env)
    got = run(command, env, name, clock)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    got["losses"] = [m["loss"] for m in metrics]
    got["device_peak"] = metrics[-1]["peak_memory_bytes/max"] if args.device == "cuda" else 0
    return got


def run_plain(args, row: str, root: Path, name: str, env: dict, spec: dict) -> dict:
    command, env, clock = plain_command(args, root, name, env, spec)
    got = run(command, env, name, clock)
    if args.check_losses:
        losses = root / f"{name}.losses"
        ranks = [json.loads(Path(f"{losses}.rank{r}").read_text()) for r in range(args.nproc)]
        got["losses"] = [statistics.fmean(v for v in step if v is not None) for step in zip(*ranks)]
    peaks = [float(Path(f"{clock}.device_peak.rank{r}").read_text()) for r in range(args.nproc)]
    got["device_peak"] = max(peaks)
    return got


def environment(args) -> dict:
    """Both sides' environment: the same intra-op threads and allocator."""
    from plait.host_memory import preload, with_preload

    threads = str(max(1, (os.cpu_count() or 1) // args.nproc))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])),
        "WANDB_MODE": "offline",
        **({"PARITY_THREADS": str(args.warmup)} if args.threads else {}),
    }
    plain = with_preload(env, preload(args.allocator) if args.device == "cpu" else None)
    return {"plait": env, "plain": plain}


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


# -- the table ------------------------------------------------------------------------------------


def sides_in_turn(args, repeat: int) -> list[str]:
    """The sides of a row in the order repeat ``repeat`` runs them: plait, the plain loop and,
    with ``--control``, the plain loop again; who goes first rotates (with two: alternates)."""
    sides = ["plait", "plain", *(["control"] if args.control else [])]
    shift = repeat % len(sides)
    return sides[shift:] + sides[:shift]


def run_name(row: str, side: str, repeat: int) -> str:
    return f"{row.replace('+', '_')}-{side}-{repeat}"


def measure(args, rows: list[str], root: Path) -> dict[str, dict]:
    envs = environment(args)
    results: dict[str, dict] = {
        row: {"plait": [], "plain": [], "control": [], "load_before": load(), "load_after": ""}
        for row in rows
    }
    specs = {
        row: plain_spec(args, row, plait_overrides(args, row, root / "compose")) for row in rows
    }
    for repeat in range(args.repeats):
        for row in rows:
            for side in sides_in_turn(args, repeat):
                name = run_name(row, side, repeat)
                env = envs["plait" if side == "plait" else "plain"]
                if args.profile:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    env = {**env, "PARITY_PROFILE": str(args.profile / f"{name}.txt")}
                if side == "plait":
                    got = run_plait(args, row, root, name, env)
                else:
                    got = run_plain(args, row, root, name, env, specs[row])
                results[row][side].append(got)
                if not args.check_losses:
                    print(
                        f"{row} {side} repeat {repeat}: step {steady(got['ends'], args.warmup):.4f} s, "
                        f"first step after {got['first']:.2f} s, peak {got['peak'] / MIB:.0f} MiB "
                        f"(load {load()})",
                        flush=True,
                    )
            results[row]["load_after"] = load()
    return results


def measure_alternating(args, rows: list[str], root: Path) -> dict[str, dict]:
    """``--alternate``: each repeat starts every side of a row once, and they take turns on the
    cores, ``args.alternate`` seconds each (:mod:`parity_alternate`)."""
    envs = environment(args)
    results: dict[str, dict] = {}
    for row in rows:
        spec = plain_spec(args, row, plait_overrides(args, row, root / "compose"))
        got = {side: {"turns": [], "cpu": [], "peak": []} for side in sides_in_turn(args, 0)}
        got["load_before"] = load()
        for repeat in range(args.repeats):
            jobs, memories, freezers = [], {}, {}
            for side in sides_in_turn(args, repeat):
                name = run_name(row, side, repeat)
                if side == "plait":
                    command, env, clock = plait_command(args, row, root, name, envs["plait"])
                else:
                    command, env, clock = plain_command(args, root, name, envs["plain"], spec)
                jobs.append(Turns(side, command, env, clock, root / f"{name}.log"))
                memories[side] = JobMemory(name)
                freezers[side] = Freezer(memories[side].group, name)
            try:
                take_turns(jobs, args.alternate, memories, freezers)
                for job in jobs:
                    ends, cpu = read_clock(job.clock)
                    turns = turn_steps(ends, job.turns, args.warmup, ends)
                    got[job.name]["turns"] += turns
                    got[job.name]["cpu"] += turn_steps(ends, job.turns, args.warmup, cpu)
                    got[job.name]["peak"].append(memories[job.name].peak())
                    steps = timed(turns)
                    print(
                        f"{row} {job.name} repeat {repeat}: {len(steps)} of {len(turns)} turns "
                        f"timed, step {statistics.median(steps):.4f} s (load {load()})",
                        flush=True,
                    )
            finally:
                for side in freezers:
                    freezers[side].close()
                    memories[side].close()
        got["load_after"] = load()
        results[row] = got
    return results


def print_alternating(args, results: dict[str, dict]) -> None:
    print(
        f"\n{run_description(args)}; {args.repeats} repeat(s), the sides taking turns of "
        f"{args.alternate:g} s; step: median of the turns' medians\n"
    )
    control_column = " control plain/plain: median [95%] (range) |" if args.control else ""
    print(
        "| row | turns timed plait / plain | step s plait | step s plain "
        "| speed plain/plait: turns median [95%] (range) | CPU s/step plait | plain | x "
        f"| peak MiB plait | plain | x | load before / after |{control_column}"
    )
    print("| --- |" + " ---: |" * 10 + " --- |" + " ---: |" * args.control)
    for row, got in results.items():
        step = {side: timed(got[side]["turns"]) for side in ("plait", "plain")}
        cpu = {side: timed(got[side]["cpu"]) for side in ("plait", "plain")}
        peak = {side: statistics.median(got[side]["peak"]) for side in ("plait", "plain")}
        ratios = neighbour_ratios(got["plain"]["turns"], got["plait"]["turns"])
        a, b = statistics.median(step["plait"]), statistics.median(step["plain"])
        ca, cb = statistics.median(cpu["plait"]), statistics.median(cpu["plain"])
        control = (
            f" {summary(neighbour_ratios(got['plain']['turns'], got['control']['turns']))} |"
            if args.control
            else ""
        )
        print(
            f"| {row} | {len(step['plait'])} / {len(step['plain'])} | {a:.4f} | {b:.4f} "
            f"| {summary(ratios)} | {ca:.4f} | {cb:.4f} | {ca / cb:.3f} "
            f"| {peak['plait'] / MIB:.0f} | {peak['plain'] / MIB:.0f} "
            f"| {peak['plait'] / peak['plain']:.3f} "
            f"| {got['load_before']} / {got['load_after']} |{control}",
            flush=True,
        )


def timed(turns: list[tuple[float, float | None]]) -> list[float]:
    return [step for _, step in turns if step is not None]


def run_description(args) -> str:
    """What both sides ran: device, processes, precision, model, batch, steps, allocator."""
    model = args.model if args.model == "gpt2_small" else f"{args.n_layer}x{args.n_embd}"
    return (
        f"{args.device}, {args.nproc} process(es), {args.precision}, model {model}, batch "
        f"{args.batch_size} x {args.seq_len}, {args.steps} steps ({args.warmup} warm-up), "
        f"allocator {args.allocator}"
    )


def print_table(args, results: dict[str, dict]) -> None:
    print(f"\n{run_description(args)}; medians of {args.repeats} interleaved repeats\n")
    control_column = " control plain/plain: median [95%] (range) |" if args.control else ""
    print(
        "| row | step s plait | step s plain | speed plain/plait | pairs: median [95%] (range) "
        "| CPU s/step plait | plain | x | first step s plait | plain | x "
        f"| peak MiB plait | plain | x | load before / after |{control_column}"
    )
    print("| --- |" + " ---: |" * 13 + " --- |" + " ---: |" * args.control)
    for row, got in results.items():
        med = {
            side: {
                "step": statistics.median(steady(r["ends"], args.warmup) for r in got[side]),
                "cpu": statistics.median(steady(r["cpu"], args.warmup) for r in got[side]),
                "first": statistics.median(r["first"] for r in got[side]),
                "peak": statistics.median(
                    r["device_peak"] if args.device == "cuda" else r["peak"] for r in got[side]
                ),
            }
            for side in ("plait", "plain")
        }
        a, b = med["plait"], med["plain"]
        pairs = pair_ratios(args, got["plain"], got["plait"])
        control = pair_ratios(args, got["plain"], got["control"])
        print(
            f"| {row} | {a['step']:.4f} | {b['step']:.4f} | {b['step'] / a['step']:.3f} "
            f"| {summary(pairs)} "
            f"| {a['cpu']:.4f} | {b['cpu']:.4f} | {a['cpu'] / b['cpu']:.3f} "
            f"| {a['first']:.2f} | {b['first']:.2f} | {a['first'] / b['first']:.2f} "
            f"| {a['peak'] / MIB:.0f} | {b['peak'] / MIB:.0f} | {a['peak'] / b['peak']:.3f} "
            f"| {got['load_before']} / {got['load_after']} |"
            + (f" {summary(control)} |" if control else ""),
            flush=True,
        )


def print_threads(args, results: dict[str, dict]) -> None:
    """Rank 0's CPU time per steady step by thread, medians over the repeats: where each side's
    CPU goes, and so what the layer adds and where (the main thread's loop around the step:
    data, hooks, metrics; threads of its own)."""
    print(f"\nrank 0's CPU ms per steady step by thread, medians of {args.repeats} repeats\n")
    print("| row | side | main thread | in the step | around it | other threads | all threads |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: |")
    for row, got in results.items():
        for side in ("plait", "plain"):
            runs = [r["threads"] for r in got[side] if r["threads"]]
            if not runs:
                continue
            names = {n for r in runs for n in r}
            ms = {n: 1000 * statistics.median(r.get(n, 0.0) for r in runs) for n in names}
            main, in_step = ms.pop("main", 0.0), ms.pop("main: in the step", None)
            split = "- | -" if in_step is None else f"{in_step:.1f} | {main - in_step:.1f}"
            others = ", ".join(
                f"{n} {v:.1f}" for n, v in sorted(ms.items(), key=lambda kv: -kv[1]) if v >= 0.05
            )
            total = 1000 * statistics.median(
                sum(v for n, v in r.items() if n != "main: in the step") for r in runs
            )
            print(
                f"| {row} | {side} | {main:.1f} | {split} | {others or '-'} | {total:.1f} |",
                flush=True,
            )


def pair_ratios(args, numerators: list[dict], denominators: list[dict]) -> list[float]:
    """Each repeat's steady step time of one side over the other's: runs next to each other in
    time, so that the host's slow and fast spells mostly fall on both."""
    return [
        steady(top["ends"], args.warmup) / steady(bottom["ends"], args.warmup)
        for top, bottom in zip(numerators, denominators)
    ]


def median_interval(values: list[float], rounds: int = 2000) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median of ``values`` (seeded: the same
    values give the same interval)."""
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def summary(ratios: list[float]) -> str:
    """``median [95% interval] (smallest-largest)``."""
    low, high = median_interval(ratios)
    return (
        f"{statistics.median(ratios):.3f} [{low:.3f}-{high:.3f}] "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )


def check_losses(args, results: dict[str, dict]) -> bool:
    print("\n| row | step | plait loss | plain loss | relative difference |")
    print("| --- | ---: | ---: | ---: | ---: |")
    good = True
    for row, got in results.items():
        ours, theirs = got["plait"][0]["losses"], got["plain"][0]["losses"]
        worst = 0.0
        for step, (a, b) in enumerate(zip(ours, theirs), 1):
            diff = abs(a - b) / abs(b)
            worst = max(worst, diff)
            print(f"| {row} | {step} | {a:.6f} | {b:.6f} | {diff:.2e} |")
        same = len(ours) == len(theirs) == args.steps and worst <= args.tolerance
        good &= same
        print(f"{row}: {'same' if same else 'DIFFERENT'} losses (worst {worst:.2e})", flush=True)
    return good


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--nproc", type=int)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", choices=["gpt", "gpt2_small"])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--microbatches", type=int, default=4, help="pp2's pipeline micro-batches")
    parser.add_argument("--precision", choices=["fp32", "bf16"])
    parser.add_argument("--allocator", default="auto", help="plait's launcher.allocator")
    parser.add_argument(
        "--plait-overrides",
        nargs="*",
        default=[],
        help="more overrides for plait's side of every row (e.g. train.log_every=10)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="write rank 0's torch.profiler operator table of steps 10-20 per run into this folder",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="run the plain loop a second time in each repeat: plain against plain, the noise",
    )
    parser.add_argument(
        "--alternate",
        type=float,
        metavar="SECONDS",
        help="run a row's sides at once, taking turns of SECONDS on the cores (root; with "
        "--steps 200 or so): the host's spells fall on both",
    )
    parser.add_argument(
        "--threads",
        action="store_true",
        help="also rank 0's CPU time per steady step by thread, and the main thread's inside "
        "the step against around it (the loop's own cost)",
    )
    parser.add_argument("--check-losses", action="store_true")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest relative loss gap")
    parser.add_argument("--tiny", action="store_true", help="1 layer x 32, batch 4 x 16")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.nproc = args.nproc or (1 if cuda else 2)
    args.model = args.model or ("gpt2_small" if cuda else "gpt")
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.batch_size = args.batch_size or 16
    args.seq_len = args.seq_len or (1024 if cuda else 128)
    if args.tiny:
        args.n_layer, args.n_embd, args.n_head = 2, 32, 2
        args.batch_size, args.seq_len, args.microbatches = 4, 16, 2
    if args.check_losses:
        args.steps, args.repeats, args.warmup = 5, 1, 0
    rows = args.rows or (
        GPU_ROWS if cuda else [r for r in ROWS if r != "ddp+defaults"] + ["ddp+defaults"]
    )
    if cuda:
        import torch

        if not torch.cuda.is_available():
            print("bench_parity.py --device cuda: no CUDA device here", file=sys.stderr)
            return 2
    for row in list(rows):
        library = LIBRARY.get(row)
        if library and importlib.util.find_spec(library) is None:
            print(f"{row}: skipped ({library} is not installed)", flush=True)
            rows.remove(row)
        elif cuda and row not in GPU_ROWS:
            print(f"{row}: skipped (needs 2 processes; one GPU here)", flush=True)
            rows.remove(row)
    if args.alternate:
        problem = freezer_problem() or (
            "--alternate times CPU rows (--device cpu)" if cuda else None
        )
        if problem:
            print(f"bench_parity.py: {problem}", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="bench_parity-") as tmp:
            print_alternating(args, measure_alternating(args, rows, Path(tmp)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_parity-") as tmp:
        results = measure(args, rows, Path(tmp))
    if args.check_losses:
        return 0 if check_losses(args, results) else 1
    print_table(args, results)
    if args.threads:
        print_threads(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
