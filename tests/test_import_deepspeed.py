"""`plait import-deepspeed`: a DeepSpeed user's JSON becomes a `plait train` line that plait
accepts and that gives DeepSpeed the JSON's numbers (no processes: the plan, the generated
DeepSpeed config, the built optimizer and the LR schedules are compared)."""

import json
import shlex

import pytest

from plait.cli import main
from plait.plan import make_plan
from plait.plugins.zero.config import engine_config
from plait.plugins.zero.engine import optimizer_param_groups
from plait.plugins.zero.import_deepspeed import translate

# The typical file: batch 32, micro-batch 4, accumulation 4, bf16, AdamW 3e-4,
# WarmupCosineLR, ZeRO-2 with a few options.
TYPICAL = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 1000, "warmup_num_steps": 100, "cos_min_ratio": 0.1},
    },
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
    },
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
}
BATCH_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
)


@pytest.fixture
def ds_json(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(TYPICAL))
    return path


def deepspeed_lrs(scheduler: dict, lr: float, steps: int) -> list[float]:
    """The lr of each step under DeepSpeed's own scheduler, stepped after each optimizer step as
    its engine does."""
    import torch
    from deepspeed.runtime import lr_schedules

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler["params"])
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    return lrs


def test_the_json_as_config_file_is_refused_naming_each_conflict(ds_json):
    problems = make_plan(
        ["strategy=zero2", f"strategy.config_file={ds_json}", "device=cpu"]
    ).problems
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    for owner in (
        "optimizer=...",
        "optimizer.*",
        "train.batch_size=16",
        "train.grad_accum_steps=1",
        "precision=fp32",
        "train_micro_batch_size_per_gpu",
    ):
        assert owner in text


def test_printed_overrides_give_an_accepted_plan_with_the_json_numbers(ds_json, tmp_path, capsys):
    assert main(["import-deepspeed", str(ds_json)]) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("plait train ")]
    plan = make_plan([*shlex.split(line)[2:], "device=cpu", "tracker=none", f"run.root={tmp_path}"])
    assert plan.problems == []
    ds = plan.backend_configs["deepspeed"]
    assert {k: ds[k] for k in BATCH_KEYS} == {k: TYPICAL[k] for k in BATCH_KEYS}
    zero = TYPICAL["zero_optimization"]  # every key of the JSON; plait sizes the buffers it omits
    assert ds["bf16"] == {"enabled": True} and {k: ds["zero_optimization"][k] for k in zero} == zero
    assert set(ds["zero_optimization"]) - set(zero) == {"allgather_bucket_size", "sub_group_size"}
    # DeepSpeed's optimizer comes from the AdamW plait builds with these overrides: its section,
    # and the param groups (weight decay on matrices only) DeepSpeed is given
    model = plan.pm.hook.plait_build_model(cfg=plan.cfg)
    optimizer = plan.pm.hook.plait_build_optimizer(cfg=plan.cfg, model=model)
    params = engine_config(plan.cfg, plan.dims, optimizer)["optimizer"]["params"]
    json_params = TYPICAL["optimizer"]["params"]
    assert {k: params[k] for k in ("lr", "betas", "eps")} == {
        k: json_params[k] for k in ("lr", "betas", "eps")
    }
    assert [g["weight_decay"] for g in optimizer_param_groups(optimizer)] == [0.1, 0.0]
    # the schedule: DeepSpeed's WarmupCosineLR and plait's agree after the warm-up, as printed
    lr_at = plan.pm.hook.plait_build_lr_schedule(cfg=plan.cfg)
    expected = deepspeed_lrs(TYPICAL["scheduler"], 3e-4, 1200)
    assert [lr_at(step) for step in range(101, 1200)] == pytest.approx(expected[101:], rel=1e-9)
    assert lr_at(50) != pytest.approx(expected[50], rel=1e-3)  # the warm-up differs, and says so
    assert "from step warmup_steps+1=101 on the two schedules give the same lr" in out
    assert "steps_per_print=100: plait's console and tracker log" in out


def test_other_sections_map_as_deepspeed_would_run_them():
    out = translate(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": "auto",
            "fp16": {"enabled": True, "loss_scale_window": 500},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},  # Adam is AdamW in DeepSpeed
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": 500, "warmup_max_lr": 2e-4, "warmup_num_steps": 50},
            },
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "stage3_max_live_parameters": 1e9,
            },
            "tensorboard": {"enabled": True},
        },
        world_size=4,
    )
    assert out.overrides == [
        "strategy=zero3",
        "strategy.offload_params=cpu",
        "strategy.deepspeed.zero_optimization.stage3_max_live_parameters=1000000000",
        "launcher.nproc_per_node=4",
        "train.batch_size=8",
        "train.grad_accum_steps=1",
        "strategy.deepspeed.fp16.loss_scale_window=500",
        "precision=fp16",
        "train.grad_clip=0",
        "optimizer.lr=0.0002",
        "optimizer.betas=[0.9,0.999]",
        "optimizer.eps=1e-08",
        "optimizer.weight_decay=0",
        "optimizer.warmup_steps=50",
        "optimizer.min_lr=0",
        "optimizer.decay_steps=500",
    ]
    assert any("decays linearly" in d for d in out.differences)
    assert out.not_mapped == [
        'tensorboard={"enabled": true}: plait\'s tracker logs the run (tracker=wandb)'
    ]
    constant = translate(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": "WarmupLR", "params": {}},
        },
        world_size=2,
    )
    assert constant.settings["optimizer.min_lr"] == constant.settings["optimizer.lr"] == 1e-3


def test_batch_numbers_that_disagree_with_the_world_size_exit_2(ds_json, capsys):
    assert main(["import-deepspeed", str(ds_json), "world_size=4"]) == 2
    assert (
        "train_batch_size=32 != train_micro_batch_size_per_gpu=4 * "
        "gradient_accumulation_steps=4 * world_size=4" in capsys.readouterr().err
    )
