"""DeepSpeed ZeRO strategy: losses equal to DDP and to 1 process, resume, export, memory, refusals.

The multi-process tests run real DeepSpeed (``DS_ACCELERATOR=cpu``, gloo) through ``plait train``:
one 20-step run per strategy serves both the loss comparison and the model-state bytes that run
measured (``model_state_bytes/*`` in its metrics). The refusal tests start no process.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import inhouse
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from plait import cli, hookimpl
from plait.export import export
from plait.plan import make_plan
from plait.plugin_manager import keep_selected, make_plugin_manager
from plait.plugins.checkpoint.directory import publish
from plait.plugins.planner.estimate import strategy_cost
from plait.plugins.zero import config as zero_config
from plait.plugins.zero.config import engine_config
from plait.plugins.zero.estimate import (
    measure_activation_bytes,
    measure_model_states,
    zero_formula,
)
from plait.testing import TEST_OVERRIDES, compose, read_metrics, run_training
from plait.topology import ParallelDims
from plait.train import cross_entropy, evaluate
from plait.types import PlanError, PluginInfo
from plait.worker import show_each_warning_once

os.environ.setdefault("DS_ACCELERATOR", "cpu")

STEPS = 20
# Global batch 8 = 2 micro-batches x 2 ranks x 2 sequences: every run accumulates gradients.
COMMON = [f"train.steps={STEPS}", "train.grad_accum_steps=2"]
# fp32 on the CPU: DeepSpeed and DDP differ only in the order of float additions (DDP divides
# gradients by dp before its all-reduce, DeepSpeed after; the 1-process run sums micro-batches
# in another order), so after 20 Adam steps losses agree to ~1e-7 relative; 1e-6 leaves margin.
LOSS_RTOL = 1e-6
STAGES = ("zero1", "zero2", "zero3")
# The tiny GPT's partition fits in one sub-group of plait's 2^21 floor: its runs step sub-groups
# of its bucket B (its largest parameter) so that the sub-groups are tested.
SUB_GROUPS = "+strategy.deepspeed.zero_optimization.sub_group_size=16384"
GRAD_NORM_RTOL = 1e-5


def refusal(*overrides: str) -> str:
    with pytest.raises(PlanError) as info:
        compose([*TEST_OVERRIDES, *overrides])
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# the generated DeepSpeed config (no processes)
# ---------------------------------------------------------------------------------------------


def backend_config(*overrides: str) -> dict:
    plan = make_plan([*TEST_OVERRIDES, *overrides]).check()
    return plan.backend_configs["deepspeed"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_config_is_generated_from_plait_settings(stage):
    ds = backend_config(
        f"strategy=zero{stage}",
        "train.batch_size=16",
        "train.grad_accum_steps=2",
        "train.grad_clip=0.5",
        "precision=bf16",
    )
    assert ds["zero_optimization"]["stage"] == stage
    assert (
        ds["train_batch_size"],
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
    ) == (16, 4, 2)  # 16 = 4 x 2 steps x dp 2
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_buffers_are_sized_from_the_model_and_the_user_overrides_them(stage):
    """A GPT of width 256 and 12 layers: 9,625,088 parameters, the largest (the MLP's) 262,144
    elements; 9,625,088 / 32 = 300,784 per bucket (not DeepSpeed's 5e8); under tp=2 half of
    that is below the largest parameter, which sets the bucket. The optimizer's sub-groups are
    never below 2^21 elements."""
    model = ["model.n_embd=256", "model.n_layer=12", f"strategy=zero{stage}"]
    zero = backend_config(*model)["zero_optimization"]
    keys = (
        ["reduce_bucket_size", "allgather_bucket_size", "sub_group_size"]
        if stage < 3
        else ["reduce_bucket_size", "stage3_prefetch_bucket_size", "sub_group_size"]
    )
    assert [zero[k] for k in keys] == [300_784, 300_784, 2**21]
    if stage == 3:
        assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == 601_568
    split = backend_config(*model, "parallel.tp=2", "launcher.nproc_per_node=4")
    assert split["zero_optimization"]["reduce_bucket_size"] == 262_144  # the largest parameter
    mine = backend_config(
        *model,
        "+strategy.deepspeed.zero_optimization.reduce_bucket_size=5",
        "+strategy.deepspeed.zero_optimization.sub_group_size=1000000000",
    )
    assert mine["zero_optimization"]["reduce_bucket_size"] == 5
    assert mine["zero_optimization"]["sub_group_size"] == 10**9


def test_sub_groups_are_cut_to_the_count_every_stage_needs():
    """A stage with fewer ZeRO-1/2 sub-groups than another cuts its largest at parameter
    boundaries (nearest the half of its elements) until the counts match; none grows."""
    from plait.plugins.zero.sizing import param_groups_within, split_to_count

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 4, 2, 6, 1)]
    groups = param_groups_within([{"params": params, "weight_decay": 0.1}], 10)
    assert [[p.numel() for p in g["params"]] for g in groups] == [[4, 4, 2], [6, 1]]
    cut = split_to_count(groups, 4)
    assert [[p.numel() for p in g["params"]] for g in cut] == [[4], [4, 2], [6], [1]]
    assert all(g["weight_decay"] == 0.1 for g in cut)
    with pytest.raises(ValueError, match="cannot cut 5 parameter groups into 6"):
        split_to_count(cut, 6)


def built_optimizer(*overrides: str):
    cfg = compose([*TEST_OVERRIDES, *overrides])
    pm = keep_selected(make_plugin_manager(cfg), cfg)
    model = pm.hook.plait_build_model(cfg=cfg)
    return cfg, pm.hook.plait_build_optimizer(cfg=cfg, model=model)


def test_the_built_adamw_maps_to_deepspeed_torch_adamw():
    cfg, optimizer = built_optimizer(
        "strategy=zero1", "optimizer.lr=3e-4", "optimizer.eps=1e-6", "optimizer.fused=false"
    )
    ds = engine_config(cfg, ParallelDims.from_config(cfg, world_size=2), optimizer)
    assert ds["optimizer"] == {
        "type": "AdamW",
        "params": {
            "lr": 3e-4,
            "betas": [0.9, 0.95],
            "eps": 1e-6,
            "weight_decay": 0.01,
            "torch_adam": True,
        },
    }  # weight decay per parameter group, as plait's adamw built them


def test_offload_maps_to_deepspeed_cpu_adam():
    cfg, optimizer = built_optimizer(
        "strategy=zero3", "strategy.offload_optimizer=cpu", "strategy.offload_params=cpu"
    )
    ds = engine_config(cfg, ParallelDims.from_config(cfg, world_size=2), optimizer)
    zero = ds["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu"}
    assert zero["offload_param"] == {"device": "cpu"}
    assert "torch_adam" not in ds["optimizer"]["params"]  # DeepSpeedCPUAdam runs the step


def test_another_optimizer_goes_to_deepspeed_as_a_client_optimizer():
    cfg = compose([*TEST_OVERRIDES, "strategy=zero1"])
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    ds = engine_config(cfg, ParallelDims.from_config(cfg, world_size=2), sgd)
    assert "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True


def test_passthrough_and_config_file_are_merged(tmp_path):
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "gradient_clipping": 1.0,  # "auto" / same value: accepted
                "zero_optimization": {
                    "stage": 2,
                    "reduce_bucket_size": 1000,
                    "overlap_comm": False,
                },
                "wall_clock_breakdown": True,
            }
        )
    )
    ds = backend_config(
        "strategy=zero2",
        f"strategy.config_file={ds_json}",
        "strategy.deepspeed.zero_optimization.reduce_bucket_size=2000",
        "strategy.deepspeed.communication_data_type=fp32",
    )
    assert ds["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 2000,
        "overlap_comm": False,
        "allgather_bucket_size": 16384,  # sized by plait
        "sub_group_size": 2**21,
    }
    assert ds["wall_clock_breakdown"] is True
    assert ds["communication_data_type"] == "fp32"
    assert ds["train_batch_size"] == 8


# ---------------------------------------------------------------------------------------------
# refusals before launch (no processes)
# ---------------------------------------------------------------------------------------------


def test_offload_params_needs_stage3():
    text = refusal("strategy=zero2", "strategy.offload_params=cpu")
    assert "strategy.offload_params=cpu needs ZeRO-3" in text
    assert "strategy=zero3" in text


def test_conflicting_passthrough_names_both_settings():
    text = refusal(
        "strategy=zero1",
        "strategy.deepspeed.gradient_clipping=0.5",
        "strategy.deepspeed.zero_optimization.stage=3",
    )
    assert "strategy.deepspeed.gradient_clipping=0.5 conflicts with train.grad_clip=1.0" in text
    assert (
        "strategy.deepspeed.zero_optimization.stage=3 conflicts with strategy=zero0..zero3" in text
    )


def test_conflicting_config_file_names_both_settings(tmp_path):
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 16, "scheduler": {"type": "WarmupLR"}})
    )
    text = refusal("strategy=zero2", f"strategy.config_file={ds_json}")
    assert (
        f"strategy.config_file={ds_json} (train_micro_batch_size_per_gpu)=16 conflicts "
        "with train.batch_size / (train.grad_accum_steps * dp)" in text
    )
    assert "sets DeepSpeed's 'scheduler', which plait decides from optimizer.*" in text


def test_missing_config_file_is_refused(tmp_path):
    missing = tmp_path / "nope.json"
    text = refusal("strategy=zero2", f"strategy.config_file={missing}")
    assert f"strategy.config_file={missing}: no such file" in text


def test_nvme_offload_on_the_cpu_is_refused():
    text = refusal("strategy=zero3", "strategy.offload_params=nvme", "device=cpu")
    assert "strategy.offload_params=nvme needs a CUDA device" in text


def test_fp16_on_a_cpu_without_fp16_kernels_is_refused(monkeypatch):
    # Whether or not this machine's CPU has oneDNN fp16 kernels, a CPU without them is stood
    # in for by patching the one probe DeepSpeed's CPU accelerator also uses.
    monkeypatch.setattr(zero_config, "_cpu_supports_fp16", lambda: False)
    text = refusal("strategy=zero2", "precision=fp16", "device=cpu")
    assert "precision=fp16 with DeepSpeed on the CPU: this CPU has no fp16 kernels" in text


def test_cli_refuses_before_any_process_starts(tmp_path, capsys):
    rc = cli.main(
        [
            "train",
            *TEST_OVERRIDES,
            "strategy=zero1",
            "strategy.offload_params=cpu",
            f"run.root={tmp_path}",
            "run.name=refused",
        ]
    )
    assert rc == 2
    assert "strategy.offload_params=cpu needs ZeRO-3" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()  # nothing written, nothing launched


# ---------------------------------------------------------------------------------------------
# estimate (no processes)
# ---------------------------------------------------------------------------------------------


def printed_bytes(out: str, label: str) -> int:
    """The exact byte count ``plait estimate`` printed on the line starting with ``label``."""
    [line] = [line for line in out.splitlines() if line.strip().startswith(label)]
    return int(re.search(r"\(([\d,]+) B\)", line).group(1).replace(",", ""))


def ddp_model_state_bytes(cfg) -> dict[str, int]:
    """DDP keeps everything unsharded, so one process measures what each DDP rank holds: the
    model and plait's AdamW after one step and a second backward."""
    from plait.plugins.optim import plait_build_optimizer

    model = instantiate(cfg.model)
    optimizer = plait_build_optimizer(cfg=cfg, model=model)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len))
    for _ in range(2):
        model(x).float().mean().backward()
        if not optimizer.state:
            optimizer.step()
    return measure_model_states(model, optimizer)


def measured_activation_bytes(cfg, micro_batch_size: int, dtype: torch.dtype) -> int:
    """What the model saves for backward on one micro-batch, in ``dtype`` (DeepSpeed casts the
    whole model to bf16)."""
    model = instantiate(cfg.model).to(dtype)
    ids = torch.randint(0, cfg.model.vocab_size, (micro_batch_size, cfg.train.seq_len + 1))
    return measure_activation_bytes(model, cross_entropy, ids[:, :-1], ids[:, 1:])


# (overrides, micro-batch size, activation dtype): fp32 DDP, whose model states one process
# measures, and bf16 ZeRO-3 (DeepSpeed's estimator line; its model states are measured in the
# multi-process runs below).
ESTIMATES = [
    (["strategy=ddp", "launcher.nproc_per_node=2"], 4, torch.float32),
    (["strategy=zero3", "launcher.nproc_per_node=4", "precision=bf16"], 2, torch.bfloat16),
]


@pytest.mark.parametrize("overrides, micro, dtype", ESTIMATES, ids=["ddp-fp32", "zero3-bf16"])
def test_plait_estimate_prints_the_measured_bytes(capsys, overrides, micro, dtype):
    """``plait estimate``'s printed figures against what the built model really holds: model
    states within 1% (observed: 0.005%, the optimizer's step counters), activations within
    0.1% (observed: 4 bytes, the scalar loss)."""
    rc = cli.main(["estimate", *TEST_OVERRIDES, *overrides])
    out = capsys.readouterr().out
    assert rc == 0
    cfg = compose([*TEST_OVERRIDES, *overrides])
    n_params = sum(p.numel() for p in instantiate(cfg.model).parameters())
    assert f"model: {n_params:,} parameters" in out
    assert f"activations per micro-batch of {micro} " in out
    assert printed_bytes(out, "activations") == pytest.approx(
        measured_activation_bytes(cfg, micro, dtype), rel=1e-3
    )
    if cfg.strategy.name == "ddp":
        assert printed_bytes(out, "total  ") == pytest.approx(
            sum(ddp_model_state_bytes(cfg).values()), rel=1e-2
        )
    else:
        assert "DeepSpeed's estimator" in out


def test_plait_estimate_says_when_the_model_cannot_count_its_activations(capsys):
    rc = cli.main(["estimate", *TEST_OVERRIDES, "model=llama_tiny"])
    assert rc == 0
    assert "activations: unknown (the model has no activation_bytes(" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# real runs: 1 process, ddp, zero1..3 on 2 processes (one run each, reused below)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zero-runs")
    extra = {
        "one": ["launcher.nproc_per_node=1"],
        "ddp": [],
        "zero0": ["strategy=zero0"],
        "zero1": ["strategy=zero1", SUB_GROUPS],
        "zero2": ["strategy=zero2", SUB_GROUPS, "checkpoint.every=10"],
        "zero3": ["strategy=zero3", SUB_GROUPS, "checkpoint.every=10", f"train.eval_every={STEPS}"],
    }
    runs = {}
    for name, overrides in extra.items():
        with inhouse.stderr_into(root / f"{name}.stderr"):
            runs[name] = run_training(
                root / name,
                [*COMMON, *overrides],
                [inhouse.DescribeZeroGroups()] if name in STAGES else [],
            )
    return runs


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def grad_norms(run_dir: Path) -> list[float]:
    return [m["grad_norm"] for m in read_metrics(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ("zero0", *STAGES))
def test_zero_losses_equal_ddp_and_one_process(runs, stage):
    reference = losses(runs["one"])
    assert len(reference) == STEPS
    assert losses(runs["ddp"]) == pytest.approx(reference, rel=LOSS_RTOL)
    assert losses(runs[stage]) == pytest.approx(reference, rel=LOSS_RTOL)
    assert losses(runs[stage]) == pytest.approx(losses(runs["ddp"]), rel=LOSS_RTOL)
    # the pre-clipping global norm DeepSpeed reports (clipping is active: norms are > 1)
    assert grad_norms(runs[stage]) == pytest.approx(grad_norms(runs["ddp"]), rel=GRAD_NORM_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_the_optimizer_steps_sub_groups_of_the_parameters_themselves(runs, stage):
    """The losses above ran with DeepSpeed stepping this rank's partition in sub-groups of at
    most ``sub_group_size`` elements (``sizing.py``; the tiny GPT's 16,384: 68,480 per rank in
    5 or more pieces, not 2: ZeRO-1/2 as parameter groups of dp x 16,384, ZeRO-3 as its own
    sub-groups, which close once past the size: by less than one parameter's share), and, in
    fp32, the optimizer stepping the parameter partition itself, not a master copy of it
    (``fp32_master.py``)."""
    groups = json.loads((runs[stage] / "zero_groups.json").read_text())
    size = groups["sub_group_size"]
    assert size == 256 * 64  # the largest parameter sets B for the tiny GPT
    assert len(groups["partitions"]) >= 5
    assert sum(groups["partitions"]) >= 136_960 // 2  # the rank's whole partition is stepped
    assert max(groups["partitions"]) < size + 256 * 64 // 2  # not one partition of 68,480
    assert all(groups["master_is_the_parameter"])


@pytest.mark.slow
def test_zero3_resume_continues_with_the_same_losses(runs, tmp_path):
    k = 10
    checkpoint = runs["zero3"] / "checkpoints" / f"step_{k:08d}"
    assert (checkpoint / "deepspeed").is_dir()  # DeepSpeed's own sharded files
    resumed = run_training(
        tmp_path / "resumed", [*COMMON, "strategy=zero3", SUB_GROUPS, f"resume={checkpoint}"]
    )
    steps = read_metrics(resumed)
    assert [m["step"] for m in steps] == list(range(k + 1, STEPS + 1))
    uninterrupted = losses(runs["zero3"])[k:]
    assert [m["loss"] for m in steps] == pytest.approx(uninterrupted, rel=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_checkpoint_of_other_sub_groups_resumes_from_its_layout_free_copy(
    runs, tmp_path, capfd, stage
):
    """The checkpoint was written with sub-groups of 16,384 elements (as an earlier plait's
    ``B`` made them); resumed with plait's own 2^21, DeepSpeed's files cannot be loaded (ZeRO-2:
    its ``The ZeRO checkpoint parameter-alignment layout does not match``; ZeRO-3: torch's
    ``loaded state dict contains a parameter group that doesn't match``), so the layout-free
    copy is, and the run continues with the same losses."""
    k = 10
    checkpoint = runs[stage] / "checkpoints" / f"step_{k:08d}"
    resumed = run_training(
        tmp_path / "resumed", [*COMMON, f"strategy={stage}", f"resume={checkpoint}"]
    )
    assert (
        f"checkpoint {checkpoint} was written with "
        "strategy.deepspeed.zero_optimization.sub_group_size=16384, which this run's engine "
        "cannot load: loading its layout-free DCP copy"
    ) in capfd.readouterr().out
    steps = read_metrics(resumed)
    assert [m["step"] for m in steps] == list(range(k + 1, STEPS + 1))
    uninterrupted = losses(runs[stage])[k:]
    assert [m["loss"] for m in steps] == pytest.approx(uninterrupted, rel=LOSS_RTOL)


@pytest.mark.slow
def test_other_sub_groups_without_a_layout_free_copy_are_refused_naming_the_setting(runs, tmp_path):
    """The same checkpoint as an earlier plait wrote it, without the layout-free copy: the
    resume stops with the setting to resume with, not DeepSpeed's error from inside its load."""
    partial = tmp_path / "earlier"
    shutil.copytree(runs["zero2"] / "checkpoints" / "step_00000010", partial)
    shutil.rmtree(partial / "layout_free")
    (partial / "complete.json").unlink()
    layout = json.loads((partial / "layout.json").read_text())
    (partial / "layout.json").write_text(json.dumps({**layout, "layout_free": False}))
    checkpoint = publish(tmp_path, partial, "step_00000010")  # complete.json of these files
    with pytest.raises(ChildFailedError) as stopped:
        run_training(tmp_path / "resumed", [*COMMON, "strategy=zero2", f"resume={checkpoint}"])
    assert (
        f"ValueError: resume: checkpoint {checkpoint}'s zero2 files were written with "
        "strategy.deepspeed.zero_optimization.sub_group_size=16384 and hold no layout-free "
        "copy: resume with ++strategy.deepspeed.zero_optimization.sub_group_size=16384"
    ) in str(stopped.value)


class PlainEngine:
    """The exported weights in the plain model, evaluated as the run's engine evaluates."""

    def __init__(self, model):
        self.model = model.eval()

    @torch.no_grad()
    def eval_loss(self, batch) -> float:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten()).item()


@pytest.mark.slow
def test_export_of_zero3_checkpoint_loads_into_the_plain_model(runs, tmp_path):
    from plait.plugins.data import plait_build_dataset
    from plait.plugins.models.gpt import GPT

    out = export(str(runs["zero3"]), str(tmp_path / "model.pt"))
    cfg = OmegaConf.load(runs["zero3"] / "config.yaml")
    model = GPT(**{k: v for k, v in cfg.model.items() if k != "_target_"})
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: every key, no extra

    val = plait_build_dataset(
        cfg=cfg, topology=SimpleNamespace(local_trainer_rank=0, trainer_group=None), split="val"
    )
    engine, dp = PlainEngine(model), 2
    per_rank = [
        evaluate(
            cfg,
            engine,
            val,
            SimpleNamespace(dims=SimpleNamespace(data_parallel=dp), data_parallel_rank=r),
        )
        for r in range(dp)
    ]
    logged = read_metrics(runs["zero3"])[-1]["eval/loss"]
    assert sum(per_rank) / dp == pytest.approx(logged, rel=1e-6)


@pytest.mark.slow
def test_model_state_bytes_shrink_with_each_stage_as_the_zero_paper_says(runs):
    cfg = OmegaConf.load(runs["ddp"] / "config.yaml")
    measured = {"ddp": sum(ddp_model_state_bytes(cfg).values())}
    for stage in STAGES:
        last = read_metrics(runs[stage])[-1]
        measured[stage] = sum(v for k, v in last.items() if k.startswith("model_state_bytes/"))
    assert measured["zero1"] < measured["ddp"]
    assert measured["zero2"] < measured["zero1"]
    assert measured["zero3"] < measured["zero2"]

    n_params = sum(
        p.numel()
        for p in torch.load(
            export(str(runs["zero3"]), str(runs["zero3"] / "export.pt")), weights_only=True
        ).values()
    )
    last = read_metrics(runs["zero0"])[-1]
    measured["zero0"] = sum(v for k, v in last.items() if k.startswith("model_state_bytes/"))
    for name, stage in (("ddp", 0), ("zero0", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)):
        formula = zero_formula(n_params, stage, 2, "fp32").total
        assert measured[name] == pytest.approx(formula, rel=0.10), name
        # plait estimate's figure for the same plan, from the config alone
        overrides = [*TEST_OVERRIDES, *COMMON, f"strategy={name}"]
        plan = make_plan(overrides).check()
        estimate = strategy_cost(plan, plan.pm.hook.plait_build_model(cfg=plan.cfg)).states
        assert measured[name] == pytest.approx(estimate, rel=0.10), name


@pytest.mark.slow
def test_offload_to_cpu_gives_the_same_losses(runs, tmp_path):
    """ZeRO-3 with optimizer states and parameters offloaded: DeepSpeed's CPU Adam (a C++ op
    DeepSpeed compiles once per environment, into $TORCH_EXTENSIONS_DIR) steps instead of torch
    AdamW, with the same math; the first steps' losses equal DDP's."""
    steps = 3
    offloaded = run_training(
        tmp_path / "offload",
        [
            *COMMON,
            f"train.steps={steps}",
            f"optimizer.decay_steps={STEPS}",
            "strategy=zero3",
            "strategy.offload_optimizer=cpu",
            "strategy.offload_params=cpu",
        ],
        [inhouse.DescribeZeroOptimizer()],
    )
    assert losses(offloaded) == pytest.approx(losses(runs["ddp"])[:steps], rel=LOSS_RTOL)
    # and offload really was on: CPU Adam stepped, its states on the host (on this CPU-only
    # machine everything is; on a GPU the same check tells host from device)
    assert json.loads((offloaded / "zero_optimizer.json").read_text()) == {
        "stepping": "DeepSpeedCPUAdam",
        "offload_optimizer": True,
        "offload_param": True,
        "state_devices": ["cpu"],
    }


MIXED_STEPS = 10
# DeepSpeed casts the whole model to 16 bits (no autocast; the optimizer keeps fp32 master
# weights): the first 10 losses within 2% of fp32's, as test_ddp asks of autocast.
MIXED_RTOL = 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_mixed_precision_trains_close_to_fp32(runs, tmp_path, monkeypatch, stage, precision):
    mixed = run_training(
        tmp_path / precision,
        [
            *COMMON,
            f"train.steps={MIXED_STEPS}",
            f"optimizer.decay_steps={STEPS}",
            f"strategy={stage}",
            f"precision={precision}",
        ],
        inhouse.with_precision(precision, monkeypatch),
    )
    fp32 = losses(runs[stage])[:MIXED_STEPS]
    assert losses(mixed) == pytest.approx(fp32, rel=MIXED_RTOL)
    assert losses(mixed) != fp32  # 16 bits really ran
    if precision == "fp16":  # the tiny GPT never overflows at DeepSpeed's initial scale 2^16
        assert [m["skipped_steps"] for m in read_metrics(mixed)] == [0] * MIXED_STEPS


@pytest.mark.slow
def test_fp16_loss_scaler_skips_the_steps_that_overflow(tmp_path, monkeypatch):
    """DeepSpeed's dynamic loss scaler under ZeRO-2, through loss spikes at steps 2 and 3 of 4
    (``inhouse.OverflowAtSteps``): both steps are skipped; the scale halves on the second
    overflow in a row (DeepSpeed's default ``fp16.hysteresis=2``)."""
    run = run_training(
        tmp_path / "fp16",
        [*COMMON, *inhouse.OVERFLOW_RUN, "strategy=zero2", "precision=fp16"],
        [inhouse.OverflowAtSteps(2, 3), *inhouse.with_precision("fp16", monkeypatch)],
    )
    inhouse.assert_steps_2_and_3_skipped(run, scales=[1, 1, 0.5, 0.5])


class InHouseSGD:
    """An in-house optimizer plugin: DeepSpeed gets its torch optimizer as a client optimizer."""

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(name="inhouse_sgd", selected_by={"optimizer.name": "inhouse_sgd"})

    @hookimpl
    def plait_build_optimizer(self, cfg, model):
        return torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr, momentum=0.9)

    @hookimpl
    def plait_build_lr_schedule(self, cfg):
        return lambda step: cfg.optimizer.lr


@pytest.mark.slow
def test_an_in_house_optimizer_runs_as_a_deepspeed_client_optimizer(tmp_path):
    overrides = [*COMMON, "train.steps=6", "optimizer.name=inhouse_sgd", "optimizer.lr=0.05"]
    plugins = [InHouseSGD()]
    ddp = run_training(tmp_path / "ddp", overrides, plugins)
    zero2 = run_training(tmp_path / "zero2", [*overrides, "strategy=zero2"], plugins)
    assert (
        "optimizer"
        not in make_plan([*TEST_OVERRIDES, *overrides, "strategy=zero2"], plugins).backend_configs[
            "deepspeed"
        ]
    )
    assert losses(zero2) == pytest.approx(losses(ddp), rel=LOSS_RTOL)
    assert losses(zero2)[-1] < losses(zero2)[0]  # SGD with momentum is training


@pytest.mark.slow
def test_export_gives_the_same_weights_from_every_stage(runs, tmp_path):
    """Stage 0 checkpoints are read directly, stages 1-3 through zero-to-fp32; the runs trained
    to the same weights (their losses agree), so the exports must too. Up to float rounding:
    Adam turns a ~1e-7 difference in a near-zero gradient into a visible step, so near-zero
    biases differ by up to ~4e-6 after 20 steps (weights are up to ~1 in size)."""
    exported = {
        name: torch.load(export(str(runs[name]), str(tmp_path / f"{name}.pt")), weights_only=True)
        for name in ("zero0", *STAGES)
    }
    reference = exported.pop("zero3")
    for name, state in exported.items():
        assert state.keys() == reference.keys(), name
        for key, tensor in state.items():
            torch.testing.assert_close(
                tensor, reference[key], rtol=1e-4, atol=2e-5, msg=f"{name} {key}"
            )


# ---------------------------------------------------------------------------------------------
# warnings a user reads: each distinct one once per worker, not once per step
# ---------------------------------------------------------------------------------------------


def deprecated_collective() -> None:
    warnings.warn("`all_gather_into_tensor` is deprecated", FutureWarning)


def test_a_warning_a_library_repeats_every_step_shows_once_and_others_still_show(monkeypatch):
    """Python's "default" action forgets what it showed whenever code enters
    ``warnings.catch_warnings`` (torch and DeepSpeed do on hot paths): without the worker's
    filter this deprecation shows 5 times."""
    shown = []
    monkeypatch.setattr(
        warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        show_each_warning_once()
        for _ in range(5):  # five steps
            deprecated_collective()
            with warnings.catch_warnings():
                pass
        warnings.warn("a genuine warning", UserWarning)
        warnings.warn("`all_gather_into_tensor` is deprecated", FutureWarning)  # elsewhere
    assert shown == [
        "`all_gather_into_tensor` is deprecated",
        "a genuine warning",
        "`all_gather_into_tensor` is deprecated",
    ]


@pytest.mark.slow
def test_deepspeeds_deprecated_collectives_warn_once_per_rank_not_every_step(runs):
    """DeepSpeed's ZeRO-3 calls ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which
    torch 2.13 deprecates: each such warning reaches the user's terminal once per rank, not on
    every step (4 per step and rank before)."""
    root = runs["zero3"].parent
    lines = (root / "zero3.stderr").read_text().splitlines()
    warned = collections.Counter(line for line in lines if "FutureWarning" in line)
    assert any("is deprecated" in line for line in warned), "the warnings must stay visible"
    assert max(warned.values()) <= 2, warned  # 2 ranks; the run has 20 steps
