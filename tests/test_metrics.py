"""MFU's two halves: FLOPs per token from the model, the peak from the device (no processes)."""

import torch

from plait.metrics import PEAK_BF16_FLOPS, device_peak_flops, flops_per_token
from plait.plugins.hf.llama import build_llama
from plait.plugins.models.gpt import GPT


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
