"""ZeRO stages through plait vs a hand-written raw ``deepspeed.initialize`` loop, one command.

    DS_ACCELERATOR=cpu python scripts/bench_zero.py                    # 2 processes, stages 0-3
    DS_ACCELERATOR=cpu python scripts/bench_zero.py --world-size 4 --bytes-only
    DS_ACCELERATOR=cpu python scripts/bench_zero.py --stages 1 --steps 20 --reps 1   # quick

For each stage it runs ``plait train strategy=zero<N>`` and a raw DeepSpeed loop with the
identical DeepSpeed config (plait's generated one, ``torch_adam`` AdamW, same model, micro-batch,
accumulation and clipping), alternating plait and raw runs ``--reps`` times so that load from
other work on the machine hits both alike. Both time whole steps as rank 0 sees them: the time
between the ends of consecutive steps (plait: its whole loop, data, metrics and hooks included;
raw: forward/backward/step of every micro-batch plus ``loss.item()``, batches pre-made): the
mean step time from the end of step ``--warmup`` to the end of the last step of each run, then the
median over reps. plait logs every ``--warmup`` steps (``train.log_every``), as a user would
rather than every step. It prints, per stage::

    stage  plait steps/s  raw steps/s  plait/raw  bytes/rank  formula  meas/formula

plait's engine alone against the raw DeepSpeed engine, both in the same processes and timed in
alternating turns, is ``scripts/bench_engine_ab.py --rows zero1 zero2 zero3``.
"model-state bytes/rank" is what plait's engine measured (parameters + gradients + optimizer
states, largest rank); "formula" is the ZeRO paper's (``plait.plugins.zero.estimate``).
``--bytes-only`` skips the raw runs and times nothing (a few steps for the measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# One intra-op thread per process, as torchrun sets for several processes per node: with more,
# processes that share the cores spin against each other (DeepSpeed's stage 0 slowed ~10x here).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from plait import hookimpl  # noqa: E402
from plait.plugins.models.gpt import GPT  # noqa: E402
from plait.plugins.zero.estimate import zero_formula  # noqa: E402
from plait.testing import read_metrics, run_training, spawn  # noqa: E402
from plait.topology import ParallelDims  # noqa: E402


class StepClock:
    """A plugin that records when each step ends on rank 0 (where ``plait_on_step_end``
    runs)."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self.out: Path | None = None

    @hookimpl
    def plait_on_run_start(self, cfg) -> None:
        self.out = Path(cfg.run.dir) / "step_end_times.json"

    @hookimpl
    def plait_on_step_end(self, step) -> None:
        self.times[step] = time.perf_counter()

    @hookimpl
    def plait_on_run_end(self) -> None:
        self.out.write_text(json.dumps(self.times))


def mean_step_time(ends: dict[int, float], warmup: int, steps: int) -> float:
    """Seconds per step from the end of step ``warmup`` to the end of step ``steps``."""
    return (ends[steps] - ends[warmup]) / (steps - warmup)


def model_overrides(args) -> list[str]:
    return [
        "model=gpt_tiny",
        f"model.n_layer={args.n_layer}",
        f"model.n_embd={args.n_embd}",
        f"model.n_head={args.n_head}",
        f"model.block_size={args.seq_len}",
        f"train.seq_len={args.seq_len}",
        f"train.batch_size={args.batch_size}",
        f"train.grad_accum_steps={args.grad_accum}",
        "tracker=none",
        "checkpoint.save_final=false",
        f"launcher.nproc_per_node={args.world_size}",
        "optimizer.warmup_steps=2",
        f"train.log_every={args.warmup}",
    ]


def run_plait(root: Path, name: str, stage: int, steps: int, args) -> Path:
    overrides = [*model_overrides(args), f"strategy=zero{stage}", f"train.steps={steps}"]
    return run_training(root / name, overrides, plugins=[StepClock()])


def raw_rank(
    rank: int, world_size: int, ds_config: dict, model_cfg: dict, steps: int, seq_len: int, out: str
) -> None:
    """The loop a DeepSpeed user writes by hand (DeepSpeed's getting-started shape)."""
    import deepspeed

    from plait.plugins.optim import param_groups

    torch.manual_seed(1337)
    model = GPT(**model_cfg)
    weight_decay = ds_config["optimizer"]["params"]["weight_decay"]
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, weight_decay),
        config=ds_config,
        dist_init_required=False,
    )
    micro, gas = (
        ds_config["train_micro_batch_size_per_gpu"],
        ds_config["gradient_accumulation_steps"],
    )
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(
        0, model_cfg["vocab_size"], (steps, gas, micro, seq_len + 1), generator=gen
    )
    ends = []
    for step in range(steps):
        for i in range(gas):
            x, y = tokens[step, i, :, :-1], tokens[step, i, :, 1:]
            loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
        loss.item()
        ends.append(time.perf_counter())
    if rank == 0:
        Path(out).write_text(json.dumps(ends))


def run_raw(plait_run: Path, steps: int, args) -> dict[int, float]:
    from plait.plugins.zero.config import engine_config

    cfg = OmegaConf.load(plait_run / "config.yaml")
    opt = cfg.optimizer  # the same hyperparameters plait's run used, as DeepSpeed's AdamW
    optimizer = torch.optim.AdamW(
        [torch.zeros(1, requires_grad=True)],
        lr=opt.lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
    )
    ds_config = engine_config(
        cfg, ParallelDims.from_config(cfg, world_size=args.world_size), optimizer
    )
    model_cfg = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_target_"}
    out = plait_run.parent / f"raw-{plait_run.name}.json"
    spawn(raw_rank, args.world_size, ds_config, model_cfg, steps, args.seq_len, str(out))
    return {step + 1: t for step, t in enumerate(json.loads(out.read_text()))}


def model_state_bytes(run: Path) -> int:
    last = read_metrics(run)[-1]
    return int(sum(v for k, v in last.items() if k.startswith("model_state_bytes/")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--bytes-only", action="store_true")
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    steps = args.warmup if args.bytes_only else args.steps
    if steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (plait logs every --warmup steps)")
    reps = 1 if args.bytes_only else args.reps

    plait_times = {s: [] for s in stages}
    raw_times = {s: [] for s in stages}
    measured = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rep in range(reps):
            for stage in stages:
                run = run_plait(root, f"zero{stage}-{rep}", stage, steps, args)
                measured[stage] = model_state_bytes(run)
                if args.bytes_only:
                    continue
                ends = {
                    int(k): v
                    for k, v in json.loads((run / "step_end_times.json").read_text()).items()
                }
                plait_times[stage].append(mean_step_time(ends, args.warmup, steps))
                raw = run_raw(run, steps, args)
                raw_times[stage].append(mean_step_time(raw, args.warmup, steps))
                print(
                    f"rep {rep} zero{stage}: plait {plait_times[stage][-1] * 1e3:.1f} ms/step, "
                    f"raw {raw_times[stage][-1] * 1e3:.1f} ms/step",
                    flush=True,
                )
        cfg = OmegaConf.load(next(root.glob("zero*")) / "config.yaml")
    model_cfg = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_target_"}
    n_params = sum(p.numel() for p in GPT(**model_cfg).parameters())

    print(
        f"world size {args.world_size}, {n_params:,} parameters, fp32, micro-batch "
        f"{args.batch_size // (args.grad_accum * args.world_size)} x {args.grad_accum} "
        f"accumulation, seq {args.seq_len}; {reps} alternating rep(s) of {steps} steps, "
        f"first {args.warmup} not timed; median over reps"
    )
    print(
        f"{'stage':>6} {'plait steps/s':>14} {'raw steps/s':>12} {'plait/raw':>10} "
        f"{'bytes/rank':>12} {'formula':>12} {'meas/formula':>13}"
    )
    for stage in stages:
        formula = zero_formula(n_params, stage, args.world_size, "fp32").total
        if args.bytes_only:
            speed = f"{'-':>14} {'-':>12} {'-':>10}"
        else:
            plait_sps = 1 / statistics.median(plait_times[stage])
            raw_sps = 1 / statistics.median(raw_times[stage])
            speed = f"{plait_sps:14.2f} {raw_sps:12.2f} {plait_sps / raw_sps:10.3f}"
        print(
            f"{'zero' + str(stage):>6} {speed} {measured[stage]:12,} {formula:12,} "
            f"{measured[stage] / formula:13.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
