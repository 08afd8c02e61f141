"""Pretrained Hugging Face checkpoints in and out (``model=hf``): read slice by slice under every
layout, trained equal to one process, exported back, sampled from.

Tiny random checkpoints of Llama, Qwen2, Mistral, GPT-NeoX and Phi-3 are written here with
``save_pretrained`` (``hf_models.py``; Phi-3 sharded across two files with an index), all with
one byte-level BPE tokenizer, and one set of shards is prepared with ``plait prepare
data.tokenizer=<model dir>``. No network.

What runs:

- Every family, no processes: its plans mapped onto plait's layers as expected (the tp plan's
  styles, the pipeline plan's first / layers / last parts, activation checkpointing on the
  decoder layers); plait's step-0 loss equal to ``transformers``' own forward on the same batch
  (1e-6); its two pipeline stages composed equal to the whole forward (exact).
- Every family, one 2-process spawn: the tensor-parallel split (each rank reading only its boxes
  of the checkpoint, counted) gives the unsplit logits, loss and gradients.
- Every family, 20 steps under ddp (dp=2), zero3 (dp=2), tp=2 (with activation checkpointing),
  pp=2 and pp=2 x tp=2, each against that family's one-process run (the issue's grid: 25 runs
  and 5 references); Llama also under fsdp (dp=2), fsdp x tp=2 (dp=2), zero1 x pp2 x dp2 and
  cp=2 (ring and Ulysses; every family under cp: test_hf_context_parallel.py). Loss within
  1e-5, grad norm within 1e-4 (fp32), and what each rank held (parameter and optimizer-state
  elements: the tensors tp halves, counted per family; each stage's own parameters; ZeRO and
  FSDP partitions) and read from the checkpoint or, under cp, the keys and values its attention
  sent every step proves the layout happened. Runs no test exports write no checkpoint
  (``checkpoint.save_final=false``).
- The pp=2 x tp=2 Llama run also writes ``checkpoint.hf_every=10``; it, the fsdp run and the
  fsdp x tp=2 run are exported with ``format=hf`` (``from_pretrained`` loads each; its logits
  equal plait's one-process logits after the same training, 1e-5), and the pp=2 x tp=2 and fsdp
  x tp=2 checkpoints are sampled with ``plait sample temperature=0`` (the same text as the
  export's greedy ``generate``).
- A 24M-parameter Llama checkpoint loaded under tp=2 x pp=2: each rank's memory peak while
  loading stays below 0.6x the checkpoint, and the export of that run (learning rate 0: no
  change) is the source bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_models import FAMILIES, corpus_files, family_config, write_checkpoint
from inhouse import RecordFirstBatch, RecordHeld, RecordReads

from plait.cli import main
from plait.meta import ParameterInit, materialize, meta_device
from plait.testing import ImportFirst, MemoryProbe, read_metrics, run_training, spawn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

STEPS = 20
LOSS, GRAD_NORM = 1e-5, 1e-4  # absolute, fp32
CLOSE = dict(rtol=1e-4, atol=1e-6)  # a split layer against the unsplit one


# ---------------------------------------------------------------------------------------------
# checkpoints and data, written once
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    first = write_checkpoint(root / "llama", "llama")
    dirs = {"llama": first}
    for family in FAMILIES[1:]:
        dirs[family] = write_checkpoint(
            root / family,
            family,
            seed=1,
            tokenizer_from=first,
            max_shard_size="500KB" if family == "phi3" else None,
        )
    return dirs


@pytest.fixture(scope="module")
def shards(checkpoints, tmp_path_factory) -> Path:
    """``plait prepare data.tokenizer=<the Llama directory>``: the model's own tokenizer."""
    root = tmp_path_factory.mktemp("data")
    corpus = root / "corpus"
    corpus.mkdir()
    for file in corpus_files(20, 6):
        shutil.copy(file, corpus / file.name)
    assert (
        main(
            [
                "prepare",
                f"data.path={corpus}",
                f"out={root / 'shards'}",
                f"data.tokenizer={checkpoints['llama']}",
                "data.num_workers=1",
            ]
        )
        == 0
    )
    return root / "shards"


def plait_model(path: Path, seed: int = 0) -> torch.nn.Module:
    """The model plait builds for ``model=hf model.path=<path>`` in one process (meta build,
    then every parameter read from the checkpoint)."""
    from plait.plugins.hf.model import build_hf

    with meta_device():
        model = build_hf(str(path))
    return materialize(model, ParameterInit.of(model, seed))


# ---------------------------------------------------------------------------------------------
# every family, no processes
# ---------------------------------------------------------------------------------------------

LLAMA_LIKE_TP = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab",
}
LLAMA_LIKE_PP = {
    "first": ["model.embed_tokens"],
    "layers": "model.layers",
    "last": ["model.norm", "lm_head"],
}
EXPECTED_PLANS = {
    "llama": (LLAMA_LIKE_TP, LLAMA_LIKE_PP),
    "qwen2": (LLAMA_LIKE_TP, LLAMA_LIKE_PP),
    "mistral": (LLAMA_LIKE_TP, LLAMA_LIKE_PP),
    "gpt_neox": (
        {
            "gpt_neox.embed_in": "vocab",
            "gpt_neox.layers.*.attention.query_key_value": "colwise",
            "gpt_neox.layers.*.attention.dense": "rowwise",
            "gpt_neox.layers.*.mlp.dense_h_to_4h": "colwise",
            "gpt_neox.layers.*.mlp.dense_4h_to_h": "rowwise",
            "lm_head": "vocab",
        },
        {
            "first": ["gpt_neox.embed_in", "gpt_neox.emb_dropout"],
            "layers": "gpt_neox.layers",
            "last": ["gpt_neox.final_layer_norm", "lm_head"],
        },
    ),
    "phi3": (
        {
            "model.embed_tokens": "vocab",
            "model.layers.*.self_attn.qkv_proj": "colwise_gather_output",
            "model.layers.*.self_attn.o_proj": "rowwise_split_input",
            "model.layers.*.mlp.gate_up_proj": "colwise_gather_output",
            "model.layers.*.mlp.down_proj": "rowwise_split_input",
            "lm_head": "vocab",
        },
        LLAMA_LIKE_PP,
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_maps_its_own_plans_onto_plaits_layers(family):
    """The plans come from the config (``base_model_tp_plan`` / ``base_model_pp_plan``) through
    ``transformers``' merge; plait only renames the styles (the head and embedding become the
    vocab-parallel pair)."""
    from plait.plugins.activation_checkpointing import planned_modules
    from plait.plugins.hf.model import hf_model

    with meta_device():
        model = hf_model(family_config(family))
    tp, pp = EXPECTED_PLANS[family]
    assert model.tensor_parallel_plan == tp
    assert {k: v for k, v in model.pipeline_plan.items() if k != "layers_run_alone"} == pp
    layers = [f"{pp['layers']}.{i}" for i in range(4)]
    assert planned_modules(model, "full") == layers  # whole decoder layers are recomputed


@pytest.mark.parametrize("family", FAMILIES)
def test_step_0_loss_through_plait_equals_transformers_own_forward(family, checkpoints):
    from transformers import AutoModelForCausalLM

    sequence = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(3))
    logits = plait_model(checkpoints[family])(sequence[:, :-1])
    ours = F.cross_entropy(logits.flatten(0, 1), sequence[:, 1:].flatten())
    theirs = AutoModelForCausalLM.from_pretrained(str(checkpoints[family]))(
        input_ids=sequence, labels=sequence
    ).loss
    assert abs(ours.item() - theirs.item()) <= 1e-6, family


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_pipeline_stages_compose_to_the_whole_forward(family, checkpoints):
    from plait.plugins.pipeline.split import build_stage_modules, split_stages

    whole = plait_model(checkpoints[family])
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(4))
    split = split_stages(whole, 2, "layers")
    stages = [build_stage_modules(plait_model(checkpoints[family]), split, [s]) for s in (0, 1)]
    hidden = stages[0].chunks[0][1](x)
    assert hidden.shape == (2, 16, 64)  # stage 0 hands on hidden states, not logits
    assert torch.equal(stages[1].chunks[0][1](hidden), whole(x))
    names = [set(dict(s.named_parameters())) for s in stages]
    assert not names[0] & names[1] and names[0] | names[1] == set(dict(whole.named_parameters()))


# ---------------------------------------------------------------------------------------------
# every family's tensor-parallel split, one 2-process spawn
# ---------------------------------------------------------------------------------------------


def _tensor_parallel_equals_unsplit(rank, world_size, dirs, out):
    from plait.plugins.hf.checkpoint_files import CheckpointFiles
    from plait.plugins.hf.model import build_hf
    from plait.plugins.tensor_parallel.layers import VocabParallelCrossEntropy, split_tensor
    from plait.plugins.tensor_parallel.plan import TensorParallelPlan, apply_plan

    read = CheckpointFiles.read
    counts = {}
    for family, path in dirs.items():
        full = plait_model(Path(path))
        with meta_device():
            split = build_hf(path)
        apply_plan(
            split,
            TensorParallelPlan(split.tensor_parallel_plan),
            dist.group.WORLD,
            rank,
            world_size,
            sequence_parallel=False,
        )
        elements_read = []

        def counting_read(self, name, box=None, dtype=torch.float32):
            value = read(self, name, box, dtype)
            elements_read.append(value.numel())
            return value

        CheckpointFiles.read = counting_read
        try:
            materialize(split, ParameterInit.of(split, 0))
        finally:
            CheckpointFiles.read = read
        x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(5))
        y = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(6))
        logits_full = full(x)
        loss_full = F.cross_entropy(logits_full.flatten(0, 1), y.flatten())
        loss_full.backward()
        logits = split(x)
        loss = VocabParallelCrossEntropy(dist.group.WORLD, rank)(logits, y)
        loss.backward()
        torch.testing.assert_close(logits, logits_full.chunk(world_size, dim=-1)[rank], **CLOSE)
        torch.testing.assert_close(loss, loss_full, **CLOSE)
        unsplit = dict(full.named_parameters())
        held = halves = 0
        for name, p in split.named_parameters():
            expected = unsplit[name].grad
            if getattr(p, "tensor_model_parallel", False):
                expected = split_tensor(
                    expected, p.partition_dim, p.partition_stride, rank, world_size
                )
                halves += p.numel() * world_size == unsplit[name].numel()
            torch.testing.assert_close(p.grad, expected, **CLOSE, msg=f"{family} {name}")
            held += p.numel()
        counts[family] = {
            "held": held,
            "read": sum(elements_read),
            "halves": halves,
            "whole": sum(p.numel() for p in full.parameters()),
        }
    if rank == 0:
        Path(out).write_text(json.dumps(counts))


# The tensors tp=2 halves: in each of the 4 layers every split weight (Llama-like: q, k, v, o,
# gate, up, down; GPT-NeoX: qkv, dense, h_to_4h, 4h_to_h; Phi-3: qkv, o, gate_up, down) and the
# biases of the column-parallel ones (Qwen2's q, k, v; GPT-NeoX's qkv and h_to_4h), plus the
# embedding and the head.
HALVED = {
    "llama": 4 * 7 + 2,
    "qwen2": 4 * (7 + 3) + 2,
    "mistral": 4 * 7 + 2,
    "gpt_neox": 4 * (4 + 2) + 2,
    "phi3": 4 * 4 + 2,
}


@pytest.mark.slow
def test_each_familys_tensor_parallel_split_equals_unsplit_reading_only_its_boxes(
    checkpoints, tmp_path
):
    out = tmp_path / "counts.json"
    spawn(_tensor_parallel_equals_unsplit, 2, {f: str(p) for f, p in checkpoints.items()}, str(out))
    counts = json.loads(out.read_text())
    for family, c in counts.items():
        assert c["read"] == c["held"] < c["whole"], family  # each element it holds, read once
        assert c["halves"] == HALVED[family], family


# ---------------------------------------------------------------------------------------------
# 20 steps under each layout against one process
# ---------------------------------------------------------------------------------------------

COMMON = [
    f"train.steps={STEPS}",
    "train.batch_size=8",
    "train.seq_len=32",
    "optimizer.warmup_steps=2",
    "checkpoint.keep_last=1",
]
PIPELINE = ["parallel.pp=2", "pipeline.microbatches=2"]
LAYOUTS = {
    "ddp_dp2": ["launcher.nproc_per_node=2"],
    "zero3_dp2": ["strategy=zero3", "launcher.nproc_per_node=2"],
    "fsdp_dp2": ["strategy=fsdp", "launcher.nproc_per_node=2"],
    "fsdp_dp2_tp2": ["strategy=fsdp", "parallel.tp=2", "launcher.nproc_per_node=4"],
    "tp2": ["parallel.tp=2", "launcher.nproc_per_node=2", "train.activation_checkpointing=full"],
    "pp2": [*PIPELINE, "launcher.nproc_per_node=2"],
    "pp2_tp2": [*PIPELINE, "parallel.tp=2", "launcher.nproc_per_node=4"],
    "zero1_pp2_dp2": [*PIPELINE, "strategy=zero1", "launcher.nproc_per_node=4"],
    "cp2_ring": ["parallel.cp=2", "launcher.nproc_per_node=2"],
    "cp2_ulysses": [
        "parallel.cp=2",
        "context_parallel.backend=ulysses",
        "launcher.nproc_per_node=2",
    ],
}
# every family under these (pp2 x tp2 cuts by both of its plans, zero3 materializes it by name
# from its shards); Llama under every layout of LAYOUTS, ddp, tp2 and pp2 alone included
FAMILY_LAYOUTS = ("zero3_dp2", "pp2_tp2")
EXPORTED = ("pp2_tp2", "fsdp_dp2", "fsdp_dp2_tp2")  # Llama's runs exported with format=hf
ONE = ["launcher.nproc_per_node=1", "train.grad_accum_steps=2"]
UNREAD = ["checkpoint.save_final=false"]  # no test reads these runs' checkpoints: none is written
RUNS = {
    ("llama", "one"): ONE,  # its checkpoint: the one-process weights the exports equal
    **{
        ("llama", layout): [*overrides, *([] if layout in EXPORTED else UNREAD)]
        for layout, overrides in LAYOUTS.items()
    },
    ("llama", "pp2_tp2"): [*LAYOUTS["pp2_tp2"], "checkpoint.hf_every=10"],
    **{(family, "one"): [*ONE, *UNREAD] for family in FAMILIES[1:]},
    **{
        (family, layout): [*LAYOUTS[layout], *UNREAD]
        for family in FAMILIES[1:]
        for layout in FAMILY_LAYOUTS
    },
}


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
                    *RUNS[family, layout],
                ],
                plugins=[RecordFirstBatch(), RecordHeld(), RecordReads()],
            )
            done[family, layout] = run_dir
        return done[family, layout]

    return run


def per_rank(run_dir: Path, what: str) -> list[dict]:
    files = sorted(
        run_dir.glob(f"{what}_rank*.json"), key=lambda p: int(p.stem.removeprefix(f"{what}_rank"))
    )
    return [json.loads(p.read_text()) for p in files]


def assert_layout_happened(
    family: str, layout: str, ranks: list[dict], reads: list[dict], whole: dict[str, int]
) -> None:
    """What each rank held proves the layout: shards of a tp split, disjoint stages, ZeRO
    partitions, or (ddp) whole replicas on each of 2 ranks; and each rank read from the
    checkpoint only what it holds (ZeRO-3: the rows that hold its flat partition)."""
    total = sum(whole.values())
    read = [r["elements"] for r in reads]
    params = [{k.removeprefix("module."): v for k, v in r["params"].items()} for r in ranks]
    sizes = [sum(p.values()) for p in params]
    optimizer = [r["optimizer_elements"] for r in ranks]
    if layout == "zero3_dp2":  # each rank a 1/2 partition of every parameter, read by rows
        assert [sum(p.values()) for p in params] == [sum(-(-n // 2) for n in whole.values())] * 2
        assert all(o < 0.51 * total for o in optimizer)
        assert all(sizes[0] <= r < 0.55 * total for r in read), read
    else:
        assert read == sizes, (read, sizes)
    if layout == "ddp_dp2":
        assert len(ranks) == 2 and sizes == [total, total] and optimizer == [total, total]
    elif layout == "fsdp_dp2":  # each rank the dim-0 half of every parameter
        assert sum(sizes) == total and all(size < 0.51 * total for size in sizes)
        assert sum(optimizer) == total
    elif layout == "fsdp_dp2_tp2":  # each rank the dim-0 half of its tp shard or of a replica
        summed = {n: sum(p[n] for p in params) for n in whole}
        split = {n for n in whole if summed[n] == whole[n]}
        assert len(split) == HALVED[family]
        assert all(summed[n] == 2 * whole[n] for n in set(whole) - split)
        assert all(p[n] * 4 == whole[n] for p in params for n in split)
        assert sum(optimizer) == sum(sizes)
    elif layout in ("tp2", "pp2_tp2"):  # ranks are laid out (pp, dp, tp): tp rank 0 is even
        halved = {n for p in params[::2] for n, held in p.items() if held * 2 == whole[n]}
        assert len(halved) == HALVED[family], (layout, sorted(halved))
    if layout in ("pp2", "pp2_tp2", "zero1_pp2_dp2"):
        first, last = set(params[0]), set(params[-1])
        embedding = EXPECTED_PLANS[family][1]["first"][0] + ".weight"
        assert not first & last and "lm_head.weight" in last and embedding in first
        assert {n for p in params for n in p} == set(whole)
        if layout == "zero1_pp2_dp2":  # the stage's Adam moments split over its 2 dp ranks
            stage_sizes = [sizes[0], sizes[-1]]
            assert optimizer[0] + optimizer[1] in range(stage_sizes[0], stage_sizes[0] + 64)
            assert max(optimizer) < 0.6 * max(stage_sizes), optimizer


def figures(run_dir: Path) -> tuple[list[float], list[float]]:
    metrics = read_metrics(run_dir)
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, layout",
    [
        *(("llama", layout) for layout in LAYOUTS),
        *((family, layout) for family in FAMILIES[1:] for layout in FAMILY_LAYOUTS),
    ],
)
def test_twenty_steps_under_a_layout_equal_one_process(family, layout, trained, checkpoints):
    from plait.plugins.hf.model import build_hf

    loss, grad_norm = figures(trained(family, layout))
    loss_1, grad_norm_1 = figures(trained(family, "one"))
    assert len(loss) == STEPS
    assert loss == pytest.approx(loss_1, abs=LOSS), layout
    assert grad_norm == pytest.approx(grad_norm_1, abs=GRAD_NORM), layout
    assert loss[-1] < loss[0] - 0.05  # it learned
    with meta_device():  # element counts by the model's names (GPT-NeoX's embed_out: lm_head)
        whole = {n: p.numel() for n, p in build_hf(str(checkpoints[family])).named_parameters()}
    run_dir = trained(family, layout)
    assert_layout_happened(
        family, layout, per_rank(run_dir, "held"), per_rank(run_dir, "reads"), whole
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ring", "ulysses"])
def test_cp2_exchanged_keys_and_values_every_step(trained, backend):
    """``parallel.cp=2``: every logged step, rank 0's attention sent what the theory says for 4
    layers, 8 sequences of 32 tokens, 4 query heads and 2 key/value heads of 16, fp32 (ring
    passes only the key/value heads); a run whose attention did not exchange sends nothing."""
    from plait.plugins.context_parallel.apply import exchange_bytes

    metrics = read_metrics(trained("llama", f"cp2_{backend}"))
    per_layer = {"ring": 3 * 2 - 2, "ulysses": 8}[backend]
    assert [m["context_parallel/exchanges"] for m in metrics] == [4 * per_layer] * STEPS
    assert [m["context_parallel/exchange_bytes"] for m in metrics] == [
        4 * exchange_bytes(backend, 32, 8, 64, 2, 4, kv_width=32)
    ] * STEPS


@pytest.mark.slow
def test_step_0_loss_of_a_real_run_equals_transformers_forward(trained, checkpoints):
    """The one-process run's first logged loss, on the batch it was fed."""
    from transformers import AutoModelForCausalLM

    run_dir = trained("llama", "one")
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"]))
    losses = [
        hf(input_ids=torch.cat([x, y[:, -1:]], dim=1), labels=torch.cat([x, y[:, -1:]], dim=1)).loss
        for x, y in torch.load(run_dir / "first_batch.pt")
    ]
    assert abs(read_metrics(run_dir)[0]["loss"] - torch.stack(losses).mean().item()) <= 1e-6


@pytest.mark.slow
def test_activation_checkpointing_recomputed_the_decoder_layers(trained):
    """The tp=2 run recomputed its 4 decoder layers in every step's backward, and still equals
    one process (above)."""
    recomputes = [
        m["activation_checkpointing/recomputes"] for m in read_metrics(trained("llama", "tp2"))
    ]
    assert recomputes and all(r == 4 for r in recomputes)


# ---------------------------------------------------------------------------------------------
# out: format=hf, checkpoint.hf_every, plait sample
# ---------------------------------------------------------------------------------------------


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """``exported(layout)``: ``plait export <Llama's run under layout> format=hf``, once."""
    root, done = tmp_path_factory.mktemp("export"), {}

    def export(layout: str) -> Path:
        if layout not in done:
            out = root / f"llama_{layout}"
            assert main(["export", str(trained("llama", layout)), "format=hf", f"out={out}"]) == 0
            done[layout] = out
        return done[layout]

    return export


@pytest.mark.slow
@pytest.mark.parametrize("layout", EXPORTED)
def test_export_after_a_layout_loads_in_transformers_with_one_process_logits(
    layout, exported, trained
):
    """pp=2 x tp=2 (each stage's tp shards joined), fsdp and fsdp x tp=2 (its layout-free copy,
    read offline with DCP): ``from_pretrained`` loads the result, and its logits equal those of
    the one-process run's weights after the same 20 steps."""
    from transformers import AutoModelForCausalLM

    from plait.export import consolidate

    hf = AutoModelForCausalLM.from_pretrained(str(exported(layout)))
    one = consolidate(str(trained("llama", "one")))
    one.model.load_state_dict(one.state, assign=True)
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, one.model(x), rtol=0, atol=1e-5)
    assert {p.name for p in exported(layout).iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


@pytest.mark.slow
def test_hf_every_writes_the_exported_weights_during_training(exported, trained):
    from transformers import AutoModelForCausalLM

    hf_dir = trained("llama", "pp2_tp2") / "hf"
    assert sorted(p.name for p in hf_dir.iterdir()) == ["latest", "step_00000010", "step_00000020"]
    assert (hf_dir / "latest").read_text() == "step_00000020"
    last = hf_dir / "step_00000020"  # one file per pipeline stage, with an index
    assert sorted(p.name for p in last.glob("*.safetensors*")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    during, after = safetensors_of(last), safetensors_of(exported("pp2_tp2"))
    assert during.keys() == after.keys()
    assert all(torch.equal(during[k], after[k]) for k in after)
    AutoModelForCausalLM.from_pretrained(str(hf_dir / "step_00000010"))  # loads


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2_tp2", "fsdp_dp2_tp2"])
def test_sample_from_a_checkpoint_is_the_exported_models_greedy_text(
    layout, exported, trained, capsys
):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    out = exported(layout)
    capsys.readouterr()
    assert (
        main(
            [
                "sample",
                str(trained("llama", layout)),
                "prompt=def main(",
                "max_new_tokens=16",
                "temperature=0",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode("def main(").ids])
    greedy = AutoModelForCausalLM.from_pretrained(str(out)).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
    )
    assert greedy.shape[1] > ids.shape[1]
    assert printed == tokenizer.decode(greedy[0].tolist(), skip_special_tokens=False) + "\n"


@pytest.mark.parametrize("family, dtype", [("llama", torch.bfloat16), ("gpt_neox", torch.float32)])
def test_hf_to_plait_to_hf_without_training_is_bit_exact(family, dtype, checkpoints, tmp_path):
    """bf16 weights held in fp32 and written back as bf16; GPT-NeoX's head stored as
    ``embed_out`` (transformers renames it on load and back on save)."""
    from plait.plugins.hf.writer import write_model

    source = write_checkpoint(
        tmp_path / "source", family, seed=2, dtype=dtype, tokenizer_from=checkpoints["llama"]
    )
    model = plait_model(source)
    out = write_model(model, model.state_dict(), tmp_path / "out")
    before, after = safetensors_of(source), safetensors_of(out)
    assert after.keys() == before.keys()
    assert all(
        after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before
    )
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------------------------------------
# memory while loading, and a round trip through a tp=2 x pp=2 run
# ---------------------------------------------------------------------------------------------

BIG = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
)  # 23.7M parameters, 95 MB in fp32; no tensor above 2.8 MB
LIMIT = 0.6  # of the checkpoint's bytes, above each rank's resident memory before the build


@pytest.fixture(scope="module")
def big_run(checkpoints, shards, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("big")
    source = write_checkpoint(
        root / "source", "llama", seed=3, tokenizer_from=checkpoints["llama"], **BIG
    )
    libraries = ImportFirst(
        "transformers",
        "transformers.models.llama.modeling_llama",
        "safetensors.torch",
        "torch.distributed.pipelining",
    )
    run_dir = root / "run"
    run_training(
        run_dir,
        [
            "model=hf",
            f"model.path={source}",
            "data=shards",
            f"data.path={shards}",
            "train.steps=1",
            "train.batch_size=4",
            "train.seq_len=16",
            "optimizer.lr=0",
            "optimizer.warmup_steps=0",
            *PIPELINE,
            "parallel.tp=2",
            "launcher.nproc_per_node=4",
            "checkpoint.save_final=false",
            "checkpoint.hf_every=1",
        ],
        plugins=[libraries, MemoryProbe()],
    )
    return source, run_dir


@pytest.mark.slow
def test_loading_under_tp2_pp2_holds_less_than_0_6_of_the_checkpoint_per_rank(big_run):
    from plait.plugins.hf.checkpoint_files import CheckpointFiles

    source, run_dir = big_run
    size = CheckpointFiles(source).nbytes
    peaks = [
        json.loads((run_dir / "memory" / f"rank{r}.json").read_text())["build_peak"]
        for r in range(4)
    ]
    assert max(peaks) < LIMIT * size, [round(p / size, 3) for p in peaks]


@pytest.mark.slow
def test_a_tp2_pp2_run_writes_the_source_back_bit_for_bit(big_run):
    """HF -> plait (4 ranks, each reading its quarter) -> HF (one file per stage), learning
    rate 0: the same tensors, names and dtypes as the source."""
    source, run_dir = big_run
    before, after = safetensors_of(source), safetensors_of(run_dir / "hf" / "step_00000001")
    assert after.keys() == before.keys()
    assert all(
        after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before
    )


# ---------------------------------------------------------------------------------------------
# refused before launch (no processes)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad(checkpoints, tmp_path_factory) -> Path:
    """Checkpoint directories each broken one way."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad")
    llama, phi3 = checkpoints["llama"], checkpoints["phi3"]
    shutil.copytree(llama, root / "no_config")
    (root / "no_config" / "config.json").unlink()
    shutil.copytree(phi3, root / "truncated")
    second = root / "truncated" / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-100])
    shutil.copytree(phi3, root / "missing_shard")
    (root / "missing_shard" / "model-00002-of-00002.safetensors").unlink()
    shutil.copytree(llama, root / "int8")
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.int8)
    save_file(tensors, str(root / "int8" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(llama, root / "lacks_head")
    del tensors["lm_head.weight"]
    save_file(tensors, str(root / "lacks_head" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(llama, root / "quantized")
    config = json.loads((llama / "config.json").read_text())
    (root / "quantized" / "config.json").write_text(
        json.dumps(
            {
                **config,
                "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True},
            }
        )
    )
    write_checkpoint(root / "bf16", "llama", dtype=torch.bfloat16, tokenizer_from=llama)
    write_checkpoint(root / "small_vocab", "llama", tokenizer_from=llama, vocab_size=256)
    from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

    GPT2LMHeadModel(
        GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    ).save_pretrained(root / "gpt2")
    MixtralForCausalLM(
        MixtralConfig(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=2,
        )
    ).save_pretrained(root / "mixtral")
    return root


def hf_problems(path, *overrides: str, data=("data=stdlib",)) -> str:
    from plait.plan import make_plan

    return "\n".join(
        make_plan(["tracker=none", "model=hf", f"model.path={path}", *data, *overrides]).problems
    )


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        (
            "nowhere",
            [],
            "model.path={bad}/nowhere is neither a directory nor a model in the local "
            "Hugging Face cache, and plait never downloads",
        ),
        (
            "no_config",
            [],
            "model.path={bad}/no_config holds no config.json: give a directory written "
            "by save_pretrained",
        ),
        ("truncated", [], "model-00002-of-00002.safetensors is truncated: "),
        (
            "missing_shard",
            [],
            "model-00002-of-00002.safetensors is missing (named by "
            "model.safetensors.index.json): copy the whole checkpoint directory",
        ),
        ("int8", [], "holds I8 tensors (e.g. lm_head.weight), a dtype the run cannot hold"),
        (
            "quantized",
            [],
            "model.path={bad}/quantized is quantized (bitsandbytes), a dtype the run cannot hold",
        ),
        (
            "bf16",
            ["precision=fp16"],
            "precision=fp16 cannot hold model.path={bad}/bf16's bf16 weights",
        ),
        (
            "lacks_head",
            [],
            "model.path={bad}/lacks_head lacks 1 of the model's parameters, e.g. "
            "['lm_head.weight']",
        ),
        (
            "gpt2",
            ["parallel.pp=2", "pipeline.microbatches=2"],
            "parallel.pp=2: GPT2LMHeadModel has no base_model_pp_plan in its config, so transformers "
            "names no pipeline stages: set parallel.pp=1",
        ),
        (
            "gpt2",
            ["parallel.tp=2"],
            "parallel.tp=2: GPT2LMHeadModel has no base_model_tp_plan in its "
            "config: set parallel.tp=1",
        ),
        (
            "mixtral",
            ["parallel.tp=2"],
            "MixtralForCausalLM's tensor-parallel plan gives 'model.layers.*.mlp.experts.gate_up_proj' "
            "the style 'packed_colwise', which plait does not honour (plait spreads a mixture of "
            "experts' experts with parallel.ep, not by tensor parallelism): set parallel.tp=1",
        ),
        (
            "llama",
            ["parallel.tp=3", "launcher.nproc_per_node=3"],
            "parallel.tp=3 does not divide num_attention_heads=4 (attention heads) of model.path=",
        ),
        ("llama", ["train.seq_len=65"], "train.seq_len=65 is longer than model.path="),
        (
            "llama",
            [],
            "the data was tokenized with the bytes tokenizer (bytes-v1), not model.path=",
        ),
    ],
)
def test_bad_checkpoints_are_refused_before_launch(name, overrides, message, bad, checkpoints):
    path = checkpoints[name] if name in checkpoints else bad / name
    assert message.format(bad=bad) in hf_problems(path, *overrides)


def test_data_tokenized_beyond_the_models_vocabulary_is_refused(bad, shards):
    assert "the data's tokenizer has 512 ids, model.path=" in hf_problems(
        bad / "small_vocab", data=("data=shards", f"data.path={shards}")
    )


def test_the_models_own_tokenizer_and_a_cached_model_name_plan(
    checkpoints, shards, tmp_path, monkeypatch
):
    """No refusal with the data prepared by the model's tokenizer; a name in the local Hugging
    Face cache resolves without the network (``local_files_only``)."""
    import huggingface_hub

    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(checkpoints["llama"], snapshot)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = ("data=shards", f"data.path={shards}")
    assert (
        hf_problems(
            checkpoints["llama"],
            "parallel.tp=2",
            "parallel.pp=2",
            "pipeline.microbatches=2",
            "launcher.nproc_per_node=4",
            data=data,
        )
        == ""
    )
    assert hf_problems("org/tiny", data=data) == ""
    assert "org/other is neither a directory" in hf_problems("org/other", data=data)


def test_prepare_with_a_model_directory_uses_its_tokenizer_and_end_of_text(checkpoints, shards):
    from plait.plugins.data.tokenizer import load_tokenizer_file

    index = json.loads((shards / "index.json").read_text())
    own = load_tokenizer_file(checkpoints["llama"] / "tokenizer.json")
    assert index["tokenizer"]["identity"] == own.identity
    assert index["tokenizer"]["name"] == "model" and index["tokenizer"]["vocab_size"] == 512
    assert index["tokenizer"]["eot"] == own.tokenizer.token_to_id("<|endoftext|>") == 0


def test_prepare_with_a_model_directory_without_a_tokenizer_is_refused(bad, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text")
    assert (
        main(
            [
                "prepare",
                f"data.path={tmp_path / 'a.txt'}",
                f"out={tmp_path / 'out'}",
                f"data.tokenizer={bad / 'gpt2'}",
            ]
        )
        == 2
    )
    assert (
        f"data.tokenizer={bad / 'gpt2'} is a directory without tokenizer.json"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def test_random_init_is_transformers_own_by_name_and_the_same_in_every_layout(checkpoints):
    """``model.pretrained=false``: each parameter drawn by ``transformers``' ``_init_weights``
    from its own generator, so a tensor-parallel shard (cut on the meta device, made alone) is
    the slice of the one-process value (here rank 1 of 2, no process group needed to build)."""
    from plait.plugins.hf.model import build_hf
    from plait.plugins.tensor_parallel.layers import split_tensor
    from plait.plugins.tensor_parallel.plan import TensorParallelPlan, apply_plan

    def built(tensor_parallel: bool):
        with meta_device():
            model = build_hf(str(checkpoints["llama"]), pretrained=False)
        if tensor_parallel:
            apply_plan(model, TensorParallelPlan(model.tensor_parallel_plan), None, 1, 2, False)
        return materialize(model, ParameterInit.of(model, 11))

    whole, shard = built(False), built(True)
    state = whole.state_dict()
    std = 0.02  # LlamaConfig's initializer_range
    assert abs(state["model.layers.0.mlp.up_proj.weight"].std().item() - std) < 0.002
    assert torch.equal(state["model.norm.weight"], torch.ones(64))
    assert not torch.equal(
        state["lm_head.weight"], plait_model(checkpoints["llama"]).state_dict()["lm_head.weight"]
    )  # not the checkpoint's
    for name, p in shard.named_parameters():
        expected = state[name]
        if getattr(p, "tensor_model_parallel", False):
            expected = split_tensor(expected, p.partition_dim, p.partition_stride, 1, 2)
        assert torch.equal(p, expected), name
