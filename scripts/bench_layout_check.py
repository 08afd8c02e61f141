"""What the check that pipeline stages compute a Hugging Face model's own forward costs before
launch (``plugins/pipeline/fidelity.py``), against the model's meta-device build, which the
validation of every ``model=hf`` plan already pays, in one command.

    DS_ACCELERATOR=cpu python scripts/bench_layout_check.py                # every case, 3 repeats
    DS_ACCELERATOR=cpu python scripts/bench_layout_check.py --cases gemma2_tiny --repeats 1

For each case (a config: the test families at two layers of width 64, and full-size
configurations built on the meta device), ``--repeats`` times each, alternating:

- ``meta build`` (the baseline): ``model=hf``'s model of the config on the meta device;
- ``pp check``: the check of a ``parallel.pp=2`` layout (its stand-in built, cut into the two
  stages, run whole and cut, forward and backward, compared).

Printed: one line per case with the medians and the ratio check / meta build, the stand-in's
parameter count, then the repeat count and the load average. The tensor-parallel check at load
prints its own seconds on the logging rank of every ``parallel.tp>1`` run. Timings on a shared
machine are noise: run it on an idle one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def configs() -> dict:
    import transformers as T

    small = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return {
        "gemma2_tiny": lambda: T.Gemma2Config(head_dim=16, sliding_window=8, **small),
        "minicpm3_tiny": lambda: T.MiniCPM3Config(
            **{**small, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=32
        ),
        "gemma_7b": lambda: T.GemmaConfig(tie_word_embeddings=False),
        "minicpm3_4b": lambda: T.MiniCPM3Config(tie_word_embeddings=False),
        "llama_70b": lambda: T.LlamaConfig(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(configs()))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from omegaconf import OmegaConf

    from plait.meta import meta_device
    from plait.plugins.hf.model import hf_model
    from plait.plugins.pipeline.fidelity import stage_composition_problems
    from plait.plugins.pipeline.split import model_plan, split_stages

    cfg = OmegaConf.create({"parallel": {"pp": 2}, "seed": 0, "train": {"seq_len": 32}})
    print(f"{'case':16s} {'meta build s':>12s} {'pp check s':>10s} {'ratio':>6s}  stand-in")
    for case in args.cases.split(","):
        make = configs()[case]
        builds, checks = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            with meta_device():
                model = hf_model(make())
            builds.append(time.perf_counter() - started)
            plan = model_plan(model)
            split = split_stages(model, 2, "layers", plan=plan)
            started = time.perf_counter()
            problems = stage_composition_problems(cfg, model, plan, split)
            checks.append(time.perf_counter() - started)
            assert not problems, problems
        build, check = statistics.median(builds), statistics.median(checks)
        stand_in = sum(p.numel() for p in model.stand_in(0).parameters())
        print(
            f"{case:16s} {build:12.3f} {check:10.3f} {check / build:6.2f}  "
            f"{stand_in / 1e6:.2f}M of {model.plait_parameter_count / 1e6:,.2f}M parameters"
        )
    print(f"medians of {args.repeats} repeat(s); load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
