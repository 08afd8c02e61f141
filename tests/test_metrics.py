"""MFU's two halves: FLOPs per token from the model, the peak from the device (no processes);
the logged step's gather of every rank's figures (2 processes)."""

import json
import types

import pytest
import torch
import torch.distributed as dist

import plait.metrics
from plait.metrics import PEAK_BF16_FLOPS, StepMeter, device_peak_flops, flops_per_token
from plait.plugins.hf.llama import build_llama
from plait.plugins.models.gpt import GPT
from plait.testing import spawn


def test_gpt_counts_attention_on_top_of_six_n():
    model = GPT(n_layer=2, n_head=4, n_embd=64, block_size=64)
    weights = sum(p.numel() for p in model.parameters()) - model.embed.pos.weight.numel()
    assert flops_per_token(model, 64) == 6 * weights + 12 * 2 * 64 * 64


def test_llama_counts_its_own_attention_term():
    model = build_llama(num_hidden_layers=2, hidden_size=64)
    n = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert flops_per_token(model, 32) == 6 * n + 12 * 2 * 64 * 32


def test_any_other_model_gets_six_n():
    model = torch.nn.Linear(10, 10)
    assert flops_per_token(model, 64) == 6 * 110


def test_no_peak_on_a_cpu_and_h100_sxm_is_989_tflops(monkeypatch):
    assert device_peak_flops(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert device_peak_flops(torch.device("cuda", 0)) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert device_peak_flops(torch.device("cuda", 0)) == PEAK_BF16_FLOPS["H100 PCIe"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert device_peak_flops(torch.device("cuda", 0)) is None


def _gather_both_ways(rank, world_size, out):
    meter = StepMeter.__new__(StepMeter)  # only its gather: the step group is the world
    meter.topology = types.SimpleNamespace(step_group=None)
    mine = {"step_time_s": 0.1 * (rank + 1), "means": {"x" * (rank + 1): float(rank)}}
    calls = []
    objects = dist.all_gather_object
    plait.metrics.dist.all_gather_object = lambda *a, **k: calls.append(1) or objects(*a, **k)
    try:
        one_gather = meter._gather(mine)  # fixed-size buffers
        object_calls = [len(calls)]
        plait.metrics.GATHER_BYTES = 16  # too small for any rank's figures: gathered as objects
        as_objects = meter._gather(mine)
        object_calls.append(len(calls) - object_calls[0])
    finally:
        plait.metrics.dist.all_gather_object = objects
    if rank == 0:
        rows = {"one_gather": one_gather, "as_objects": as_objects, "object_calls": object_calls}
        with open(out, "w") as f:
            json.dump(rows, f)


@pytest.mark.slow
def test_every_ranks_figures_arrive_in_one_gather_and_through_objects_when_too_large(tmp_path):
    out = tmp_path / "gathered.json"
    spawn(_gather_both_ways, 2, str(out))
    got = json.loads(out.read_text())
    expected = {
        "0": {"step_time_s": 0.1, "means": {"x": 0.0}},
        "1": {"step_time_s": 0.2, "means": {"xx": 1.0}},
    }
    assert got["one_gather"] == expected
    assert got["as_objects"] == expected
    assert got["object_calls"] == [0, 1]  # objects only when a rank's figures do not fit
