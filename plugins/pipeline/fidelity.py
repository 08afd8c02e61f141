"""Before launch: do this layout's pipeline stages compute the model's own forward?

A model that can make a stand-in of itself (``model.stand_in(seed)``, ``model=hf``) is cut into
the stages this run would make (the same plan, the same layer counts, every stage in this one
process), and the stages run one after the other on a few seeded tokens; their logits and
gradients are compared with the stand-in's unsplit forward (:mod:`plait.engine.fidelity`). A
family whose forward does arithmetic between the plan's parts that a stage cannot repeat
faithfully (Granite multiplies ``inputs_embeds``, so a later stage would multiply its input
hidden states again) is refused here, with the difference; dp, ZeRO and FSDP run its forward
whole. A model without a stand-in (plait's GPT, whose forward is a plain chain of its parts)
is not checked.
"""

from __future__ import annotations

import copy

import torch.nn as nn

from plait.engine.fidelity import Difference, one_thread, probe_tokens, run
from plait.plugins.pipeline.split import PipelinePlan, StageSplit, build_stage_modules


def stage_composition_problems(
    cfg, model: nn.Module, plan: PipelinePlan, split: StageSplit
) -> list[str]:
    with one_thread():
        return _problems(cfg, model, plan, split)


def _problems(cfg, model: nn.Module, plan: PipelinePlan, split: StageSplit) -> list[str]:
    make = getattr(model, "stand_in", None)
    if make is None:
        return []
    pp, family = cfg.parallel.pp, getattr(model, "plait_architecture", type(model).__name__)
    layout = f"parallel.pp={pp} ({len(split.counts)} stages of {list(split.counts)} layers)"
    try:
        whole = make(cfg.seed)
    except ValueError as e:
        return [
            f"{layout}: plait checks that pipeline stages compute {family}'s own forward on "
            f"a small stand-in of it, and cannot make one ({e}): set parallel.pp=1"
        ]
    stages = build_stage_modules(copy.deepcopy(whole), split, range(len(split.counts)), plan)
    vocab = next(m for m in whole.modules() if isinstance(m, nn.Embedding)).num_embeddings
    tokens = probe_tokens(vocab, cfg.train.seq_len, cfg.seed)

    def composed(x):
        for _, chunk in stages.chunks:
            x = chunk(x)
        return x

    difference = Difference.of(
        run(whole, whole, tokens, cfg.seed), run(composed, stages, tokens, cfg.seed)
    )
    if difference.faithful:
        return []
    return [
        f"{layout}: {family}'s pipeline stages do not compute its own forward: on a seeded "
        f"stand-in of it ({len(tokens)} x {tokens.shape[1]} tokens) the stages run one after "
        f"the other differ from the unsplit forward by {difference.describe()}. Its forward "
        "does arithmetic between the pipeline plan's parts that a stage repeats or loses (e.g. "
        "a multiplier on inputs_embeds, which each later stage's input would get again): set "
        "parallel.pp=1 (ddp, ZeRO and FSDP run its forward whole)"
    ]
