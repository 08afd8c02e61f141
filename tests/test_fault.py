"""Fault tolerance proven by real failures: a SIGKILLed worker is restarted by torch elastic and the
run resumes with the uninterrupted run's losses and bytes; a SIGKILL at any moment of a checkpoint
write never leaves a checkpoint that loads wrong; a NaN on one rank skips the step everywhere."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import inhouse
import pytest
import torch

from plait.plugins import checkpoint
from plait.plugins.checkpoint import directory
from plait.testing import TEST_OVERRIDES, compose, read_metrics, run_losses, run_training
from plait.types import TrainState

STEPS = 8
# Dropout on: every step draws from each rank's random generators, so a resume that does not
# restore them (rng_rank<r>.pt) continues with other masks and other losses.
RUN = [
    f"train.steps={STEPS}",
    "optimizer.decay_steps=8",
    "checkpoint.every=3",
    "launcher.nproc_per_node=2",
    "checkpoint.keep_last=0",
    "model.dropout=0.1",
]
LAYOUTS = {
    "ddp": [],
    "zero2": ["strategy=zero2"],
    "pp2": ["parallel.pp=2", "pipeline.microbatches=2"],
    # tensor parallelism: the killed rank 1 holds the other half of every split layer
    # and draws its own dropout masks in them
    "tp2": ["parallel.tp=2"],
}
KILL_STEP = random.Random().randint(4, 7)  # a random step; printed in a failure's report


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the final checkpoint's files except the RNG states, by file and key."""
    flat = {}
    last = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    for path in sorted(last.rglob("*.pt")):
        if path.name.startswith("rng_"):
            continue
        state = torch.load(path, map_location="cpu", weights_only=False)
        stack = [(str(path.relative_to(last)), state)]
        while stack:
            key, value = stack.pop()
            if isinstance(value, dict):
                stack.extend((f"{key}/{k}", v) for k, v in value.items())
            elif isinstance(value, (list, tuple)):
                stack.extend((f"{key}/{i}", v) for i, v in enumerate(value))
            elif isinstance(value, torch.Tensor):
                flat[key] = value
    return flat


def assert_same_bytes(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ after resume: {different[:5]}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(layout)``: settings, per-step losses and final checkpoint tensors of a run
    that never failed; each layout (``LAYOUTS``) runs once per module."""
    runs = {}

    def get(layout: str):
        if layout not in runs:
            settings = [*RUN, *LAYOUTS[layout]]
            run_dir = tmp_path_factory.mktemp("fault") / f"straight_{layout}"
            runs[layout] = settings, run_losses(run_dir, settings), final_state(run_dir)
        return runs[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sigkilled_worker_is_restarted_and_the_run_matches_the_uninterrupted_one(
    uninterrupted, layout, tmp_path
):
    settings, losses, state = uninterrupted(layout)
    run_dir = tmp_path / "killed"
    run_training(
        run_dir, [*settings, "launcher.max_restarts=1"], plugins=[inhouse.KillAt(KILL_STEP)]
    )
    assert (run_dir / "killed").exists(), "the worker was never killed"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), f"kill at {KILL_STEP}"
    assert [m["loss"] for m in metrics] == losses  # bit-identical
    resumed_at = KILL_STEP // 3 * 3  # the last checkpoint before the kill
    assert [m["restarts"] for m in metrics] == [0.0] * resumed_at + [1.0] * (STEPS - resumed_at)
    assert_same_bytes(final_state(run_dir), state)


# What is made NaN, on which rank: DDP's loss; under ZeRO and in a pipeline a gradient (the
# guard sits in DeepSpeed's norm computation; pp rank 0's grads are NaN, its peer's are not).
POISON = {
    "ddp": {"what": "loss", "rank": 1},
    "zero2": {"what": "grad", "rank": 1},
    "pp2": {"what": "grad", "rank": 0},
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "zero2", "pp2"])
def test_nan_on_one_rank_skips_the_step_everywhere_and_k_in_a_row_roll_back(
    uninterrupted, layout, tmp_path
):
    """fault.max_bad_steps=2: the first NaN step is skipped on both ranks with parameters and
    optimizer state unchanged; the second in a row ends the attempt, and the restart resumes
    from the step-3 checkpoint with the uninterrupted losses."""
    settings, straight, _ = uninterrupted(layout)
    run_dir = tmp_path / "nan"
    run_training(
        run_dir,
        [*settings, "launcher.max_restarts=1", "fault.max_bad_steps=2"],
        plugins=[inhouse.NanLoss(tmp_path, first=5, count=2, **POISON[layout])],
    )
    for rank in (0, 1):
        record = json.loads((tmp_path / f"skip_rank{rank}_call5.json").read_text())
        assert record == {"skipped": True, "unchanged": True}, f"rank {rank}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics] == straight
    assert [m["restarts"] for m in metrics][3:] == [1.0] * (STEPS - 3)


@pytest.mark.slow
def test_a_loss_spike_skips_the_step_on_every_rank(tmp_path):
    """fault.spike_factor=3: rank 1's loss at the 7th step is 100 times what it is (6 steps
    taken: the running median is judged), so the step is skipped on both ranks with parameters
    and optimizer state unchanged, counted, and the run takes one more batch for its 8 steps."""
    run_dir = tmp_path / "spike"
    run_training(
        run_dir,
        [*RUN, "fault.spike_factor=3"],
        plugins=[inhouse.NanLoss(tmp_path, first=7, count=1, rank=1, factor=100.0)],
    )
    for rank in (0, 1):
        record = json.loads((tmp_path / f"skip_rank{rank}_call7.json").read_text())
        assert record == {"skipped": True, "unchanged": True}, f"rank {rank}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss_spikes"] for m in metrics] == [0.0] * 6 + [1.0] * (STEPS - 6)


@pytest.mark.slow
def test_external_torchrun_restart_and_a_rerun_of_the_same_command_resume(uninterrupted, tmp_path):
    """Under the user's own ``torchrun --max-restarts=1`` a killed worker's restart resumes; a job
    killed without restarts, started again with the same command (a SLURM requeue), resumes
    through the default resume=auto. Both give the uninterrupted losses."""
    straight = uninterrupted("ddp")[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}

    def torchrun(name: str, restarts: int) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            f"--max-restarts={restarts}",
            "-m",
            "plait",
            "train",
            *TEST_OVERRIDES,
            *RUN,
            f"run.root={tmp_path}",
            f"run.name={name}",
            "+plugins=[inhouse:kill_rank1_at_5]",
        ]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=500)

    restarted = torchrun("restarted", restarts=1)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert [m["loss"] for m in read_metrics(tmp_path / "restarted")] == straight

    failed = torchrun("requeued", restarts=0)
    assert failed.returncode != 0
    again = torchrun("requeued", restarts=0)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout
    assert [m["loss"] for m in read_metrics(tmp_path / "requeued")] == straight


def weights(step: int) -> torch.Tensor:
    return torch.full((256, 256), float(step))


class TorchEngine:
    """Writes a model file the way the DDP engine does (one ``torch.save`` per file). The tensor
    is made before any fork: a forked child must not start torch's thread pool."""

    def __init__(self, step: int):
        self.weights = weights(step)

    def save_state(self, directory: Path) -> None:
        torch.save({"w": self.weights}, directory / "model.pt")


KILLABLE = [
    (os, "replace"),
    (os, "fsync"),
    (os, "mkdir"),
    (os, "unlink"),
    (shutil, "rmtree"),
    (torch, "save"),
]


def save_then_die(cfg, engines: list[TorchEngine], steps: list[int], die_at_call: int) -> None:
    """In a forked child: save checkpoints for ``steps``, SIGKILLed at the ``die_at_call``-th
    call of any file operation the save makes (every gap between two of them is a moment)."""
    calls = [0]
    for module, name in KILLABLE:

        def counted(*args, _real=getattr(module, name), **kwargs):
            calls[0] += 1
            if calls[0] == die_at_call:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*args, **kwargs)

        setattr(module, name, counted)
    try:
        for step, engine in zip(steps, engines):
            checkpoint.plait_save_checkpoint(
                cfg=cfg,
                engine=engine,
                topology=inhouse.Rank0(),
                state=TrainState(step=step),
                final=False,
                hook=inhouse.NoCapabilities,
            )
    except BaseException as e:  # never return into pytest from the fork
        print(f"child failed: {e!r}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


def assert_loads_whole(root: Path, at_least: int) -> int:
    newest = directory.latest_checkpoint(root)
    assert newest is not None and not newest.name.startswith(".")
    step = json.loads((newest / "trainer_state.json").read_text())["step"]
    assert newest.name == f"step_{step:08d}" and step >= at_least
    assert torch.equal(torch.load(newest / "model.pt", weights_only=True)["w"], weights(step))
    if (root / "latest").exists():  # latest, when present, names a complete checkpoint
        assert directory.checkpoint_problem(root / (root / "latest").read_text()) is None
    return step


@pytest.mark.slow
def test_sigkill_at_every_moment_of_a_checkpoint_write_never_leaves_a_bad_checkpoint(tmp_path):
    """Saves of steps 2, 4 and 4 again (the replace path), killed at each of their file
    operations in turn: the newest complete checkpoint always loads whole, no partial write is
    ever chosen, and the next save clears what the killed one left."""
    cfg = compose(
        [f"run.root={tmp_path}", "run.name=r", "checkpoint.every=2", "checkpoint.keep_last=2"]
    )
    root = tmp_path / "r" / "checkpoints"
    checkpoint.plait_save_checkpoint(
        cfg=cfg,
        engine=TorchEngine(0),
        topology=inhouse.Rank0(),
        state=TrainState(step=0),
        final=False,
        hook=inhouse.NoCapabilities,
    )
    steps = [2, 4, 4]
    engines = [TorchEngine(step) for step in steps]
    moments, finished = 0, False
    while not finished:
        moments += 1
        pid = os.fork()
        if pid == 0:
            save_then_die(cfg, engines, steps, die_at_call=moments)
        _, status = os.waitpid(pid, 0)
        finished = os.WIFEXITED(status)
        assert not finished or os.WEXITSTATUS(status) == 0
        assert finished or os.WTERMSIG(status) == signal.SIGKILL
        newest = assert_loads_whole(root, at_least=0)
        partial = root / ".step_00000004.partial"
        if partial.exists():
            assert directory.latest_checkpoint(root) != partial
    print(f"killed at {moments - 1} moments")
    assert moments >= 10 and newest == 4
    checkpoint.plait_save_checkpoint(
        cfg=cfg,
        engine=TorchEngine(6),
        topology=inhouse.Rank0(),
        state=TrainState(step=6),
        final=False,
        hook=inhouse.NoCapabilities,
    )
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000006"]


def test_a_damaged_checkpoint_is_skipped_with_a_message(tmp_path, capsys):
    cfg = compose(
        [f"run.root={tmp_path}", "run.name=r", "checkpoint.every=2", "checkpoint.keep_last=0"]
    )
    root = tmp_path / "r" / "checkpoints"
    for step in (2, 4):
        checkpoint.plait_save_checkpoint(
            cfg=cfg,
            engine=TorchEngine(step),
            topology=inhouse.Rank0(),
            state=TrainState(step=step),
            final=False,
            hook=inhouse.NoCapabilities,
        )
    model = root / "step_00000004" / "model.pt"
    model.write_bytes(model.read_bytes()[:1000])  # truncated by a failing disk
    assert directory.resolve_resume(cfg, "auto") == root / "step_00000002"
    assert (
        f"plait: skipping checkpoint {root / 'step_00000004'}: model.pt has 1000 bytes, "
        "complete.json says"
    ) in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a complete checkpoint: model.pt has 1000 bytes"):
        directory.resolve_resume(cfg, str(root / "step_00000004"))


# One process, a ZeroEngine each (zero2 runs in the tests above): stage and precision.
ZERO_CASES = {
    "zero0": (0, "fp32"),
    "zero1": (1, "fp32"),
    "zero3": (3, "fp32"),
    "zero0-bf16": (0, "bf16"),
    "zero0-fp16": (0, "fp16"),
}


def _zero_stages_skip_a_nan_step(rank, world_size, out_file):
    """A good step, one with a NaN loss, one with a NaN gradient (the loss finite), a good step
    again; records what each engine did."""
    from deepspeed.accelerator import get_accelerator
    from omegaconf import OmegaConf

    from plait.plugins.fault import StepGuard
    from plait.plugins.models.gpt import GPT
    from plait.plugins.optim import param_groups
    from plait.plugins.zero import config as zero_config
    from plait.plugins.zero.engine import ZeroEngine
    from plait.topology import Topology
    from plait.train import cross_entropy

    # fp16 runs on torch's generic CPU kernels where oneDNN has none (inhouse.with_precision)
    zero_config._cpu_supports_fp16 = lambda: True
    get_accelerator().is_fp16_supported = lambda: True
    results = {}
    topology = Topology.initialize(compose(["launcher.nproc_per_node=1"]))
    for name, (stage, precision) in ZERO_CASES.items():
        cfg = compose(
            [f"strategy=zero{stage}", f"precision={precision}", "launcher.nproc_per_node=1"]
        )
        model_cfg = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_target_"}
        torch.manual_seed(0)
        model = GPT(**model_cfg)
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
        guard = StepGuard()

        def check_step(**step):
            return [guard.plait_check_step(cfg=cfg, topology=topology, **step)]

        engine = ZeroEngine(
            model,
            optimizer,
            cross_entropy,
            topology,
            zero_config.engine_config(cfg, topology.dims, optimizer),
            check_step,
        )
        nan_grad = [False]
        next(engine.model.parameters()).register_hook(
            lambda g: g * float("nan") if nan_grad[0] else g
        )
        tokens = torch.randint(0, model_cfg["vocab_size"], (2, cfg.train.seq_len + 1))
        batches = [(tokens[:, :-1], tokens[:, 1:])]
        outputs = [engine.train_step(batches, lr=1e-3)]
        before = inhouse.snapshot(engine)
        engine.loss_fn = lambda y, t: cross_entropy(y, t) * float("nan")
        outputs.append(engine.train_step(batches, lr=1e-3))
        engine.loss_fn, nan_grad[0] = cross_entropy, True
        outputs.append(engine.train_step(batches, lr=1e-3))
        after = inhouse.snapshot(engine)
        nan_grad[0] = False
        outputs.append(engine.train_step(batches, lr=1e-3))
        moved = inhouse.snapshot(engine)
        results[name] = {
            "skipped": [out.skipped for out in outputs],
            "unchanged": all(inhouse.torch_equal(before[k], after[k]) for k in before),
            "finite_after": all(bool(torch.isfinite(v.float()).all()) for v in moved.values()),
            "moved_after": any(not inhouse.torch_equal(after[k], moved[k]) for k in after),
            "loss_scale": [out.metrics.get("loss_scale") for out in outputs],
        }
    Path(out_file).write_text(json.dumps(results))


@pytest.mark.slow
def test_zero_stages_0_1_3_skip_a_nan_step_through_deepspeeds_overflow_path(tmp_path):
    """Every stage and precision skips the NaN-loss and the NaN-gradient step with parameters,
    master weights and optimizer state unchanged, and counts both as bad steps (``skipped``:
    the step counter does not advance), except that under fp16 a non-finite gradient with a
    finite loss is the loss scaler's overflow: skipped and the scale halved, not counted. Stage
    0 in bf16/fp16 runs DeepSpeed's ``FP16_UnfusedOptimizer``, which skips non-finite
    gradients on its own; plait's guards are asked there too."""
    from plait.testing import spawn

    out = tmp_path / "stages.json"
    spawn(_zero_stages_skip_a_nan_step, 1, str(out))
    results = json.loads(out.read_text())
    assert results.keys() == ZERO_CASES.keys()
    for name, result in results.items():
        fp16 = name.endswith("fp16")
        scales = result.pop("loss_scale")
        assert result == {
            "skipped": [False, True, not fp16, False],
            "unchanged": True,
            "finite_after": True,
            "moved_after": True,
        }, name
        if fp16:  # DeepSpeed's stage-0 scaler halves on every overflow (no hysteresis)
            assert [s / scales[0] for s in scales] == [1, 0.5, 0.25, 0.25], name
