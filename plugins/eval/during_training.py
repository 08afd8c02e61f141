"""``eval.tasks`` during training: the harness on the logging rank, the scoring on every rank
with the model as it is sharded (:mod:`.distributed`), the results as ``eval/<task>/<metric>``
(and the evaluation's wall seconds on the logging rank as ``eval/time_s``) and the harness's JSON
in ``run.dir/eval/step<N>.json``."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from pluggy import HookRelay

from plait.plugins.eval.distributed import EngineScorer
from plait.plugins.eval.harness import HarnessSettings, evaluate, metrics_of, table, write_json
from plait.plugins.eval.scoring import ScoringLoss
from plait.topology import Topology
from plait.types import Engine, TrainState


def settings_of(cfg: DictConfig) -> HarnessSettings:
    e = cfg.eval
    return HarnessSettings(
        tasks=list(e.tasks),
        limit=e.limit,
        num_fewshot=e.num_fewshot,
        batch_size=e.micro_batch_size,
        include_path=e.include_path,
    )


@torch.no_grad()
def evaluate_sharded(
    cfg: DictConfig,
    engine: Engine,
    loss: ScoringLoss,
    state: TrainState,
    topology: Topology,
    hook: HookRelay,
) -> dict[str, float] | None:
    """Every trainer calls this at the same step; the logging rank returns the metrics."""
    from plait.plugins.eval.lm import PlaitLM

    started = time.perf_counter()
    scorer = EngineScorer(engine, loss, topology, cfg.eval.micro_batch_size, cfg.train.seq_len)
    if not scorer.is_leader:
        scorer.follow()
        return None
    try:
        lm = PlaitLM(scorer, hook.plait_tokenizer(cfg=cfg), cfg.train.seq_len)
        results = evaluate(lm, settings_of(cfg))
    finally:
        scorer.finish()  # the other ranks stop following, even when the harness raised
    print(f"plait: step {state.step}, lm-evaluation-harness:\n{table(results)}", flush=True)
    write_json(results, Path(cfg.run.dir) / "eval" / f"step{state.step}.json")
    return {**metrics_of(results), "eval/time_s": time.perf_counter() - started}
