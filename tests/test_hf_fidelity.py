"""Hugging Face families whose forward does more than chain the modules their plans name, trained
exactly as their own forward computes them under every layout (issue 36).

Tiny random checkpoints (``hf_models.SCALED_FAMILIES``: two layers of width 64, with the families'
scaling settings away from their defaults) of Gemma (embedding scaled by sqrt(hidden) inside the
embedding module, a non-persistent buffer), Gemma 2 (final and attention soft-capping, a sliding
window on every other layer), Cohere (``logit_scale`` after the head), MiniCPM3 (``scale_emb``,
residual scales, logits divided by ``hidden / dim_model_base``; multi-head latent attention) and
Granite (multipliers; its base model multiplies ``inputs_embeds``, so no pipeline stage after the
first can run its forward faithfully), written with ``save_pretrained``; one set of shards
prepared with their tokenizer. No network.

What runs:

- No processes: plait's pipeline stages of each family composed equal its whole forward (exact),
  with the layer types of Gemma 2's layers by their places; the stand-ins the load-time checks
  use, of every family's full-size default config (small, the same layers and multipliers);
  Gemma's ``embed_scale`` after a meta build and in its vocab-parallel form; Granite refused
  under ``parallel.pp=2`` before launch, with the difference and the reason.
- Real runs (``plait train``): every family in one process (its step-1 loss equal to
  ``transformers``' own forward on the batch it was fed, 1e-6), and Gemma, Gemma 2, Cohere and
  MiniCPM3 20 steps under tp=2, pp=2 and pp=2 x tp=2 against it (loss 1e-5, grad norm 1e-4),
  each rank holding its shards or its stage; Granite under ddp, ZeRO-3 and FSDP (dp=2) likewise.
  The pp=2 x tp=2 runs are exported with ``format=hf``: ``from_pretrained`` loads each, and its
  logits equal the one-process run's (1e-5). A tensor-parallel plan that loses MiniCPM3's
  rotary-key gradient sum is stopped at load, before the first step, by the shard check.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import SCALED_FAMILIES, corpus_files, family_config, write_checkpoint
from inhouse import RecordFirstBatch, RecordHeld
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from plait.cli import main
from plait.meta import ParameterInit, materialize, meta_device
from plait.testing import read_metrics, run_training

os.environ.setdefault("DS_ACCELERATOR", "cpu")

FAITHFUL = ("gemma", "gemma2", "cohere", "minicpm3")  # every layout
STEPS = 20
LOSS, GRAD_NORM = 1e-5, 1e-4  # absolute, fp32


# ---------------------------------------------------------------------------------------------
# checkpoints and data, written once
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scaled")
    dirs: dict[str, Path] = {}
    for family in SCALED_FAMILIES:
        first = dirs.get(SCALED_FAMILIES[0])
        dirs[family] = write_checkpoint(root / family, family, seed=4, tokenizer_from=first)
    return dirs


@pytest.fixture(scope="module")
def shards(checkpoints, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    corpus = root / "corpus"
    corpus.mkdir()
    for file in corpus_files(20, 6):
        shutil.copy(file, corpus / file.name)
    tokenizer = f"data.tokenizer={checkpoints[SCALED_FAMILIES[0]]}"
    prepared = ["prepare", f"data.path={corpus}", f"out={root / 'shards'}", tokenizer]
    assert main([*prepared, "data.num_workers=1"]) == 0
    return root / "shards"


def plait_model(path: Path) -> torch.nn.Module:
    from plait.plugins.hf.model import build_hf

    with meta_device():
        model = build_hf(str(path))
    return materialize(model, ParameterInit.of(model, 0))


def hf_problems(path: Path, *overrides: str) -> str:
    from plait.plan import make_plan

    base = ["tracker=none", "model=hf", f"model.path={path}"]
    return "\n".join(make_plan([*base, *overrides]).problems)


# ---------------------------------------------------------------------------------------------
# no processes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", SCALED_FAMILIES)
def test_pipeline_stages_compose_to_the_whole_forward_but_granites(family, checkpoints):
    """Two stages, run one after the other, equal the whole forward bit for bit: Gemma 2's
    second layer (full attention) keeps its own mask on the second stage, where it is the
    stage's first layer; Granite's second stage multiplies its input by the embedding
    multiplier again."""
    from plait.plugins.pipeline.split import build_stage_modules, split_stages

    whole = plait_model(checkpoints[family])
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(4))
    split = split_stages(whole, 2, "layers")
    stages = [build_stage_modules(plait_model(checkpoints[family]), split, [s]) for s in (0, 1)]
    composed = stages[1].chunks[0][1](stages[0].chunks[0][1](x))
    assert torch.equal(composed, whole(x)) == (family != "granite")


def test_gemma2s_layers_keep_their_types_on_a_later_stage(checkpoints):
    from plait.engine.stages import StageIdentity
    from plait.plugins.pipeline.split import build_stage_modules, split_stages

    whole = plait_model(checkpoints["gemma2"])
    assert whole.config.layer_types == ["sliding_attention", "full_attention"]
    split = split_stages(whole, 2, "layers")
    second = build_stage_modules(whole, split, [1]).chunks[0][1]
    seen = list(enumerate(second.model.layers[: whole.config.num_hidden_layers]))
    assert isinstance(seen[0][1], StageIdentity) and seen[1][1].self_attn.sliding_window is None


SIZES = (  # the widths of a family's full-size default, put into the test's config
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
KEPT = (  # what the stand-in keeps of its family's settings
    "num_hidden_layers",
    "layer_types",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "query_pre_attn_scalar",
    "logit_scale",
    "scale_emb",
    "scale_depth",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
)


@pytest.mark.parametrize("family", SCALED_FAMILIES)
def test_a_full_size_family_gets_a_small_stand_in_with_its_layers_and_multipliers(family):
    """The checks run on a stand-in: a family at the widths of its full-size default (Gemma 7B,
    Gemma 2 2B, Cohere 35B, MiniCPM3 4B, Granite 3B; built on the meta device, two layers) with
    the test's scalings is shrunk in its widths only; its stages compose faithfully but for
    Granite's."""
    from plait.engine.fidelity import Difference, probe_tokens, run
    from plait.plugins.hf.model import hf_model
    from plait.plugins.pipeline.split import build_stage_modules, split_stages

    default = type(family_config(family))()
    sizes = {key: getattr(default, key) for key in SIZES if getattr(default, key, None)}
    config = family_config(family, **sizes)
    with meta_device():
        full = hf_model(config)
    assert full.plait_parameter_count > 1e8
    whole = full.stand_in(seed=0, tp=2)
    small = whole.config
    assert sum(p.numel() for p in whole.parameters()) < 2e6
    for setting in KEPT:
        assert getattr(small, setting, None) == getattr(config, setting, None), setting
    assert small.get_text_config().num_key_value_heads % 2 == 0 and small.vocab_size % 2 == 0
    if family in ("minicpm3", "granite"):  # MiniCPM3's: hidden / dim_model_base
        assert small.logits_scaling not in (1, 1.0)
    split = split_stages(whole, 2, "layers")
    stages = build_stage_modules(full.stand_in(seed=0, tp=2), split, [0, 1])
    tokens = probe_tokens(small.vocab_size, 32, 0)

    def composed(x):
        return stages.chunks[1][1](stages.chunks[0][1](x))

    found = Difference.of(run(whole, whole, tokens, 0), run(composed, stages, tokens, 0))
    assert found.faithful == (family != "granite"), found


def test_gemmas_embedding_scale_is_rebuilt_after_a_meta_build_and_kept_when_split(checkpoints):
    """``embed_scale`` is a non-persistent buffer (no checkpoint holds it): the meta build
    computes it as ``from_pretrained`` does; the vocab-parallel form keeps the module's class,
    forward and buffer (here rank 1 of 2, cut on the meta device)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    from plait.plugins.hf.model import build_hf
    from plait.plugins.tensor_parallel.plan import TensorParallelPlan, apply_plan

    ours = plait_model(checkpoints["gemma"]).model.embed_tokens.embed_scale
    theirs = AutoModelForCausalLM.from_pretrained(str(checkpoints["gemma"]))
    assert ours.item() == theirs.model.embed_tokens.embed_scale.item() == 8.0  # sqrt(64)
    with meta_device():
        model = build_hf(str(checkpoints["gemma"]))
    apply_plan(model, TensorParallelPlan(model.tensor_parallel_plan), None, 1, 2, False)
    split = model.model.embed_tokens
    assert isinstance(split, GemmaTextScaledWordEmbedding) and split.embed_scale.item() == 8.0
    assert (split.vocab_start, split.vocab_end, tuple(split.weight.shape)) == (256, 512, (256, 64))


def test_granite_is_refused_under_pipeline_stages_before_launch_with_the_reason(
    checkpoints, shards
):
    stages = ("parallel.pp=2", "pipeline.microbatches=2", "train.seq_len=32")
    data = ("data=shards", f"data.path={shards}")
    problems = hf_problems(checkpoints["granite"], *stages, *data)
    assert (
        "parallel.pp=2 (2 stages of [1, 1] layers): GraniteForCausalLM's pipeline stages do "
        "not compute its own forward: on a seeded stand-in of it (2 x 32 tokens) the stages run "
        "one after the other differ from the unsplit forward by "
    ) in problems
    assert "a multiplier on inputs_embeds, which each later stage's input would get again" in (
        problems
    )
    assert "set parallel.pp=1 (ddp, ZeRO and FSDP run its forward whole)" in problems
    assert hf_problems(checkpoints["granite"], *data) == ""  # it trains without stages
    layout = (*stages, "parallel.tp=2", "launcher.nproc_per_node=4", *data)
    for family in FAITHFUL:  # the check ran, and passed them
        assert hf_problems(checkpoints[family], *layout) == "", family


# ---------------------------------------------------------------------------------------------
# real runs
# ---------------------------------------------------------------------------------------------

COMMON = [
    f"train.steps={STEPS}",
    "train.batch_size=4",
    "train.seq_len=32",
    "optimizer.warmup_steps=2",
    "checkpoint.keep_last=1",
]
UNREAD = ["checkpoint.save_final=false"]  # no test reads these runs' checkpoints
PIPELINE = ["parallel.pp=2", "pipeline.microbatches=2"]
LAYOUTS = {
    "one": ["launcher.nproc_per_node=1", "train.grad_accum_steps=2"],
    "tp2": ["parallel.tp=2", "launcher.nproc_per_node=2", *UNREAD],
    "pp2": [*PIPELINE, "launcher.nproc_per_node=2", *UNREAD],
    "pp2_tp2": [*PIPELINE, "parallel.tp=2", "launcher.nproc_per_node=4"],
    "ddp_dp2": ["launcher.nproc_per_node=2", *UNREAD],
    "zero3_dp2": ["strategy=zero3", "launcher.nproc_per_node=2", *UNREAD],
    "fsdp_dp2": ["strategy=fsdp", "launcher.nproc_per_node=2", *UNREAD],
}
COMPARED = [
    *((family, layout) for family in FAITHFUL for layout in ("tp2", "pp2", "pp2_tp2")),
    *(("granite", layout) for layout in ("ddp_dp2", "zero3_dp2", "fsdp_dp2")),
]


@pytest.fixture(scope="module")
def trained(checkpoints, shards, tmp_path_factory):
    """``trained(family, layout)``: the run directory, trained once per module."""
    root, done = tmp_path_factory.mktemp("runs"), {}

    def run(family: str, layout: str) -> Path:
        if (family, layout) not in done:
            run_dir = root / f"{family}_{layout}"
            run_training(
                run_dir,
                [
                    *COMMON,
                    "model=hf",
                    f"model.path={checkpoints[family]}",
                    "data=shards",
                    f"data.path={shards}",
                    *LAYOUTS[layout],
                ],
                plugins=[RecordFirstBatch(), RecordHeld()],
            )
            done[family, layout] = run_dir
        return done[family, layout]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("family", SCALED_FAMILIES)
def test_step_1_loss_of_a_one_process_run_equals_transformers_own_forward(
    family, trained, checkpoints
):
    """On the batch the run was fed: Gemma 2's soft caps, Cohere's logit scale, MiniCPM3's and
    Granite's scalings included."""
    from transformers import AutoModelForCausalLM

    run_dir = trained(family, "one")
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[family]))
    losses = []
    for x, y in torch.load(run_dir / "first_batch.pt"):
        sequence = torch.cat([x, y[:, -1:]], dim=1)
        losses.append(hf(input_ids=sequence, labels=sequence).loss)
    assert abs(read_metrics(run_dir)[0]["loss"] - torch.stack(losses).mean().item()) <= 1e-6


def figures(run_dir: Path) -> tuple[list[float], list[float]]:
    metrics = read_metrics(run_dir)
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


def held(run_dir: Path) -> list[dict[str, int]]:
    files = sorted(run_dir.glob("held_rank*.json"), key=lambda p: int(p.stem[len("held_rank") :]))
    return [
        {k.removeprefix("module."): v for k, v in json.loads(p.read_text())["params"].items()}
        for p in files
    ]


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", COMPARED)
def test_twenty_steps_under_a_layout_equal_one_process(family, layout, trained, checkpoints):
    """Loss within 1e-5 and grad norm within 1e-4 of the one-process run at every step; what
    each rank held proves the layout (tp: the embedding and the head halved over the
    vocabulary; pp: disjoint stages, the embedding on the first, the head on the last)."""
    from plait.plugins.hf.model import build_hf

    loss, grad_norm = figures(trained(family, layout))
    loss_1, grad_norm_1 = figures(trained(family, "one"))
    assert len(loss) == STEPS
    assert loss == pytest.approx(loss_1, abs=LOSS)
    assert grad_norm == pytest.approx(grad_norm_1, abs=GRAD_NORM)
    assert loss[-1] < loss[0] - 0.02  # it learned (MiniCPM3 slowest: its logits are divided by 4)
    with meta_device():
        whole = {n: p.numel() for n, p in build_hf(str(checkpoints[family])).named_parameters()}
    ranks = held(trained(family, layout))
    vocabulary = ("model.embed_tokens.weight", "lm_head.weight")
    if "tp2" in layout:  # ranks are laid out (pp, dp, tp): tp rank 0 is even
        halves = {n for r in ranks[::2] for n, size in r.items() if 2 * size == whole[n]}
        assert set(vocabulary) <= halves and len(halves) > len(vocabulary)
    if "pp2" in layout:
        first, last = set(ranks[0]), set(ranks[-1])
        assert not first & last and {n for r in ranks for n in r} == set(whole)
        assert vocabulary[0] in first and vocabulary[1] in last
    if layout.endswith("dp2"):  # ddp: whole replicas; ZeRO-3, FSDP: halves of the whole
        total = sum(whole.values())
        assert [sum(r.values()) for r in ranks] == (
            [total] * 2 if layout == "ddp_dp2" else [sum(ranks[0].values())] * 2
        )
        assert layout == "ddp_dp2" or sum(ranks[0].values()) < 0.55 * total


@pytest.mark.slow
@pytest.mark.parametrize("family", FAITHFUL)
def test_export_of_a_pp2_tp2_run_loads_with_the_one_process_runs_logits(family, trained, tmp_path):
    """``from_pretrained`` loads the export (each stage's tp shards joined); its logits are
    those of the one-process run's weights, within 1e-5 of the largest logit."""
    from transformers import AutoModelForCausalLM

    from plait.export import consolidate

    out = tmp_path / "hf"
    assert main(["export", str(trained(family, "pp2_tp2")), "format=hf", f"out={out}"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    one = consolidate(str(trained(family, "one")))
    one.model.load_state_dict(one.state, assign=True)
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        theirs, ours = hf(input_ids=x).logits, one.model(x)
    # 1e-5 of the largest logit: Cohere's logit_scale (3) and Gemma 2's cap (3) make logits of
    # 3-10, whose rounding after 20 steps in another layout is 1.7e-5 and 3.3e-5 (measured)
    assert (theirs - ours).abs().max().item() <= 1e-5 * ours.abs().max().item()


WITHOUT_ROTARY_KEY_SUM = (  # MiniCPM3's own plan but for kv_a_proj_with_mqa (then replicated)
    "tensor_parallel.plan={lm_head: vocab, model.embed_tokens: vocab, "
    "model.layers.*.self_attn.q_b_proj: colwise, model.layers.*.self_attn.kv_b_proj: colwise, "
    "model.layers.*.self_attn.o_proj: rowwise, model.layers.*.mlp.gate_proj: colwise, "
    "model.layers.*.mlp.up_proj: colwise, model.layers.*.mlp.down_proj: rowwise}"
)


@pytest.mark.slow
def test_a_layout_whose_shards_lose_arithmetic_is_stopped_at_load(checkpoints, shards, tmp_path):
    """A plan that keeps MiniCPM3's key/value down-projection whole without summing its rotary
    key's gradient over tp computes the same logits but other gradients (each rank's heads' part
    only, so the replicas drift apart): the shard check stops the run before its first step."""
    run_dir = tmp_path / "run"
    with pytest.raises(ChildFailedError) as stopped:
        run_training(
            run_dir,
            [
                *COMMON,
                "model=hf",
                f"model.path={checkpoints['minicpm3']}",
                "data=shards",
                f"data.path={shards}",
                *LAYOUTS["tp2"],
                WITHOUT_ROTARY_KEY_SUM,
            ],
        )
    err = str(stopped.value)  # the worker's error, as torch's launcher reports it
    assert (
        "UnfaithfulLayout: parallel.tp=2: MiniCPM3ForCausalLM's tensor-parallel shards do not "
        "compute its own forward: on a seeded stand-in of it, split by the same plan over this "
        "run's tensor-parallel group, the shards differ from the unsplit forward by "
    ) in err
    assert "in the gradients (relative to the largest value; worst model.layers." in err
    assert not (run_dir / "metrics.jsonl").exists()  # no step was taken
