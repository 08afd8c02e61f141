"""``eval=lm_eval`` (the default): lm-evaluation-harness tasks on plait's models.

- ``plait eval <run or checkpoint dir> tasks=[...]`` (:mod:`.command`): a checkpoint of any
  layout, read whole into one process.
- During training, ``eval.tasks=[...]`` (every ``eval.every`` steps and at the job's last step;
  :mod:`.during_training`): the ranks split the harness's requests data-parallel and score them
  with the model as it is sharded, through the engine's ``eval_loss`` with the run's loss
  wrapped (``plait_build_loss``, :class:`.scoring.ScoringLoss`); the logging rank gathers them,
  and the harness computes the metrics there. They are logged as ``eval/<task>/<metric>``.

The harness (``lm_eval``, the ``eval`` extra) does the tasks and metrics; plait supplies the
model (:class:`.lm.PlaitLM`) and ships two tiny local tasks (``tasks/``). Nothing is downloaded.
See docs/eval.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from plait import hookimpl
from plait.config import AT_LEAST_0, AT_LEAST_1, EvalConfig, range_problems
from plait.types import PluginInfo


@dataclass
class LmEvalConfig(EvalConfig):
    name: str = "lm_eval"
    tasks: list[str] = field(default_factory=list)  # empty: no downstream evaluation
    every: Optional[int] = None  # steps between evaluations; None: the job's last step only
    limit: Optional[int] = None  # documents per task (the harness's limit); None: all
    num_fewshot: Optional[int] = None  # None: each task's own
    micro_batch_size: int = 8  # sequences per forward, per data-parallel replica
    include_path: Optional[str] = None  # a directory of the user's task YAML files


RANGES = {
    "every": AT_LEAST_1,
    "limit": AT_LEAST_1,
    "num_fewshot": AT_LEAST_0,
    "micro_batch_size": AT_LEAST_1,
}
NO_TOKENIZER = (
    "the run's data does not say which tokenizer made its tokens (data=tokens); "
    "train on data=stdlib|text|shards"
)


class LmEval:
    def __init__(self) -> None:
        self.loss = None  # the run's loss, wrapped to score while evaluating

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(
            name="lm_eval",
            selected_by={"eval.name": "lm_eval"},
            description="lm-evaluation-harness tasks: plait eval, and eval.tasks during training",
        )

    @hookimpl
    def plait_register_configs(self, config_store) -> None:
        config_store.store(group="eval", name="base_lm_eval", node=LmEvalConfig)

    @hookimpl
    def plait_register_commands(self, register) -> None:
        from plait.plugins.eval.command import cmd_eval

        register("eval", cmd_eval, "score a checkpoint on lm-evaluation-harness tasks=[...]")

    @hookimpl
    def plait_validate(self, cfg, dims, hook) -> list[str]:
        e = cfg.eval
        problems = range_problems("eval", e, RANGES)
        if e.every is not None and not e.tasks:
            problems.append(
                f"eval.every={e.every} evaluates nothing without eval.tasks: name "
                "the tasks (eval.tasks=[plait_tiny_mc]) or drop eval.every (the "
                "validation loss is train.eval_every)"
            )
        if not e.tasks:
            return problems
        if dims.cp > 1:
            problems.append(
                f"eval.tasks with parallel.cp={dims.cp}: scoring a sequence split "
                "over context-parallel ranks is not supported; evaluate the "
                "checkpoint with plait eval"
            )
        from plait.plugins.eval import registry

        missing = registry.harness_problems("eval.tasks")
        if missing:
            return problems + missing
        if e.include_path and not Path(e.include_path).is_dir():
            return problems + [
                f"eval.include_path={e.include_path} is not a directory: give "
                "the directory holding your task YAML files"
            ]
        manager = registry.task_manager(e.include_path, tuple(e.tasks))
        return problems + registry.task_problems(
            manager,
            list(e.tasks),
            "eval.tasks",
            hook.plait_tokenizer(cfg=cfg) is not None,
            NO_TOKENIZER,
        )

    @hookimpl(wrapper=True)
    def plait_build_loss(self, cfg, model, topology):
        """The decided loss (or cross-entropy), wrapped so that evaluation can score tokens
        through the engine's own forward."""
        loss_fn = yield
        if not cfg.eval.tasks:
            return loss_fn
        from plait.plugins.eval.scoring import ScoringLoss
        from plait.train import cross_entropy

        vocab_parallel = topology.dims.tp > 1 and any(
            getattr(m, "is_vocab_parallel_output", False) for m in model.modules()
        )
        self.loss = ScoringLoss(
            loss_fn or cross_entropy,
            topology.get_tensor_model_parallel_group() if vocab_parallel else None,
            topology.tp_rank,
        )
        return self.loss

    @hookimpl
    def plait_evaluate(self, cfg, engine, state, topology, final, hook):
        e = cfg.eval
        if not e.tasks or not (final or (e.every and state.step % e.every == 0)):
            return None
        from plait.plugins.eval.during_training import evaluate_sharded

        return evaluate_sharded(cfg, engine, self.loss, state, topology, hook)


plugin = LmEval()
