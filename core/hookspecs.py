"""The plait hook specification: every point where a plugin can decide or observe.

Hooks are called with keyword arguments; an implementation may accept any subset of a hook's
arguments, so new arguments can be added here without breaking plugins. ``firstresult`` hooks are
decisions: the first non-None result wins, and the core refuses a plan in which two active plugins
implement the same decision (see ``plait.plugin_manager.check_conflicts``).

Order of a run (``plait.train.train`` reads as this list)::

    plait_declare, plait_register_configs, plait_configure,        # CLI, before launch
    plait_comm_spec (asked by plugins and ``plait plan``),
    plait_assign_roles (asked by the plan and the topology),
    plait_validate, plait_backend_config, plait_launch, plait_objective
    plait_strategy_cost (asked by ``plait estimate`` and ``plait plan --search``),
    plait_axis_cost (asked by ``plait plan --search``)
    plait_replica_groups (asked by a plugin that runs replica groups as independent jobs)
    plait_build_topology
    a rank whose role is not "trainer": plait_run_role, and nothing below
    plait_build_dataset, plait_shard_data
    plait_build_model, plait_apply_tensor_parallel, plait_apply_expert_parallel,
    plait_apply_context_parallel,
    plait_apply_activation_checkpointing, plait_split_pipeline, plait_materialize_model,
    plait_build_loss
    plait_build_optimizer, plait_build_lr_schedule, plait_grad_reducer, plait_build_engine
    plait_sync_replicas (state None), else plait_load_checkpoint; plait_on_run_start
    per step:  plait_sync_replicas, plait_check_step (in the engine's step, every rank),
               plait_evaluate (every rank), plait_on_step_end, plait_log_metrics (logged steps),
               plait_save_checkpoint (and, asked by the checkpoint plugin, plait_save_model_copy)
    plait_on_failure (on an exception), plait_on_run_end
    plait export: plait_find_checkpoint, plait_read_model_shards, plait_merge_tensor_parallel_shards,
                  plait_export_model (format=...)
    plait sample: the same, then plait_tokenizer
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from plait import hookspec

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from hydra.core.config_store import ConfigStore
    from omegaconf import DictConfig
    from pluggy import HookRelay

    from plait.meta import ParameterInit
    from plait.topology import ParallelDims, Roles, Topology
    from plait.types import (
        AxisCost,
        BatchLoader,
        CommSpec,
        Engine,
        GradReducer,
        PluginInfo,
        StepOutput,
        StrategyCost,
        TokenDataset,
        Tokenizer,
        TrainState,
    )


# ---------------------------------------------------------------------------------------------
# configure: run in the CLI process, before any worker starts
# ---------------------------------------------------------------------------------------------


@hookspec
def plait_declare() -> PluginInfo:
    """Describe this plugin: its name, the config values that select it, what it supports.

    Called once per plugin when the plugin manager is built, with no arguments.

    :return: a :class:`plait.types.PluginInfo`. A plugin that implements no ``plait_declare`` is
        named after its module and is active in every run it is loaded into.
    """


@hookspec
def plait_register_commands(register: Callable[..., None]) -> None:
    """Add sub-commands to the ``plait`` CLI.

    :param register: call ``register(name, function, help)``; ``function(overrides: list[str])``
        runs the command with the Hydra overrides the user typed after it. A name of the form
        ``"<command> --<flag>"`` (e.g. ``"plan --search"``) adds a flag to a command: the
        function then receives the flag and everything after it.
    """


@hookspec
def plait_register_configs(config_store: ConfigStore) -> None:
    """Store this plugin's structured-config schemas before the config is composed.

    :param config_store: Hydra's ConfigStore; store e.g.
        ``config_store.store(group="strategy", name="base_zero", node=ZeroStrategyConfig)`` and
        list ``base_zero`` first in the defaults of the option's YAML file.
    """


@hookspec
def plait_configure(cfg: DictConfig) -> None:
    """Adjust the composed config in place before it is validated (fill derived values).

    Called on every active plugin, in registration order; the config is writable here only.

    :param cfg: the composed Hydra config.
    """


@hookspec(firstresult=True)
def plait_comm_spec(cfg: DictConfig) -> CommSpec | None:
    """Describe how gradients are communicated: algorithm, compression, fusion bucket size.

    Stops at the first non-None result; the comm plugin answers. Asked before launch, through
    ``plait_validate``'s ``hook``, by strategies that cannot call a reducer and map the choice
    onto their backend's settings instead (DeepSpeed ZeRO), and by ``plait plan``.

    :return: a :class:`plait.types.CommSpec`.
    """


@hookspec(firstresult=True)
def plait_assign_roles(cfg: DictConfig, world_size: int) -> Roles | None:
    """Carve the launched ranks into roles, e.g. parameter servers and trainers.

    Stops at the first non-None result; the strategy answers. None (the default) makes every rank
    a trainer. Asked before launch (the trainers' count is the mesh's world size) and by every
    worker when its topology is built. Only ``trainer`` ranks run the train loop; the core's and
    shared plugins' collectives run over them (``Topology.trainer_group`` / ``step_group``), and
    the first of them logs. Every other role runs ``plait_run_role``.

    :param world_size: the number of processes launched.
    :return: a :class:`plait.topology.Roles`; raise ``ValueError`` naming the setting and the
        fix when the settings leave no trainer (the plan reports it as a problem).
    """


@hookspec
def plait_validate(cfg: DictConfig, dims: ParallelDims, hook: HookRelay) -> list[str] | None:
    """Check the plan for settings this plugin cannot run with.

    Called on every active plugin; all problems from all plugins are reported together.
    Capabilities declared in ``PluginInfo`` are checked by the core before; this is for what
    depends on settings.

    :param cfg: the configured (read-only) config.
    :param dims: the process layout the run will use.
    :param hook: the active plugins' hooks, to ask another plugin instead of reading its
        settings, e.g. the model built on the meta device: ``plait.meta.meta_model(hook, cfg)``
        (None when these settings cannot build it).
    :return: problems, each naming the setting and the fix, e.g.
        ``"parallel.tp=3 does not divide model.n_head=4: choose tp in {1, 2, 4}"``; numbers out
        of range: ``plait.config.range_problems(section, settings, ranges)``.
    """


@hookspec
def plait_backend_config(
    cfg: DictConfig, dims: ParallelDims, hook: HookRelay
) -> dict[str, Any] | None:
    """Return the configuration this plugin generates for a backend, for ``plait plan`` to show.

    :param hook: the active plugins' hooks, as for ``plait_validate`` (e.g. ask
        ``hook.plait_comm_spec(cfg=cfg)`` to map the gradient communication onto the backend).

    :return: ``{"deepspeed": {...}}`` or similar, or None when the plugin generates nothing.
    """


@hookspec(firstresult=True)
def plait_strategy_cost(
    cfg: DictConfig, strategy: str, model: torch.nn.Module, dims: ParallelDims
) -> StrategyCost | None:
    """Estimate one rank of ``strategy``: its model-state and buffer bytes, and its
    data-parallel traffic per step.

    Stops at the first non-None result. ``plait estimate`` asks for the chosen strategy and
    ``plait plan --search`` for every ``strategy.name`` an installed plugin is selected by, so a
    strategy plugin that answers is estimated and searched like a built-in one; answer only for
    your own ``strategy.name`` values, None for any other.

    :param cfg: the run's config (its ``precision``; ``cfg.strategy`` holds the strategy's own
        settings only when ``cfg.strategy.name == strategy``, else assume its defaults).
    :param model: the unsplit model, on the meta device.
    :param dims: the layout; tensor and pipeline parallelism hold about ``1/(tp·pp)`` of the
        parameters per rank.
    :return: a :class:`plait.types.StrategyCost`.
    """


@hookspec
def plait_axis_cost(
    cfg: DictConfig,
    axis: str,
    model: torch.nn.Module,
    dims: ParallelDims,
    seq_len: int,
    micro_batch_size: int,
    microbatches: int,
    bytes_per_value: int,
    recompute: str,
) -> AxisCost | None:
    """Estimate what one rank's share of parallel ``axis`` costs per optimizer step (since hook
    spec 1.5): the bytes it sends over that axis, and for pipeline stages how many
    micro-batches' activations a rank holds at once.

    Called on every active plugin: the plugins of several axes are active together, so this is
    not a decision; ``plait plan --search`` asks for each axis of a layout larger than 1
    (``"tp"``, ``"pp"``, ``"cp"``, ``"ep"``), as it asks strategies ``plait_strategy_cost``, and
    takes the first answer. Answer only for the axis your plugin carries out, and only while
    your plugin is the one ``cfg`` selects for it, None otherwise.

    :param cfg: the run's config (your own group's settings).
    :param model: the unsplit model, on the meta device.
    :param dims: the layout being estimated.
    :param seq_len: tokens per sequence (all of them: a rank holds ``seq_len / cp``).
    :param micro_batch_size: sequences per micro-batch on one rank.
    :param bytes_per_value: bytes of an activation element in the run's precision.
    :param microbatches: micro-batches per optimizer step (the pipeline's under ``pp > 1``).
    :param recompute: ``train.activation_checkpointing`` of the layout (none, full, selective).
    :return: a :class:`plait.types.AxisCost`.
    """


@hookspec(firstresult=True)
def plait_replica_groups(cfg: DictConfig, dims: ParallelDims) -> int | None:
    """How many replica groups this strategy's data-parallel ranks form: groups of whole model
    replicas (each group's tensor, pipeline, context- and expert-parallel ranks together) that a
    fault-tolerance plugin may run as independent torch jobs, averaging their gradients per step
    over the groups its quorum admits (since hook spec 1.5).

    Stops at the first non-None result; the strategy answers, for its own ``strategy.name``
    only. Asked before launch (``dims``: every rank's layout) by a plugin that declares
    ``fault:replica_groups`` (``fault=torchft``), and by the launcher, which then starts each
    group with its own agent. A strategy that answers provides ``engine:replica_groups``.

    :return: the number of groups (it divides ``dims.dp``); None: the strategy cannot run as
        independent replica groups (its engine shares state across data-parallel ranks, e.g.
        partitioned optimizer states, or its replicas do not step together).
    """


@hookspec(firstresult=True)
def plait_launch(
    cfg: DictConfig,
    entrypoint: Callable[..., Any],
    args: tuple,
    hook: HookRelay,
    dims: ParallelDims,
) -> dict[int, Any] | None:
    """Start the worker processes and wait for them.

    Stops at the first non-None result.

    :param cfg: the resolved config, already written to ``cfg.run.dir``.
    :param dims: the planned layout; ``dims.nodes`` is ``launcher.nnodes`` as ``(MIN, MAX)``
        (since hook spec 1.3).
    :param entrypoint: a module-level (picklable) function; ``entrypoint(*args)`` runs training
        in one process and returns, on the logging rank, the run's summary (last metrics, last
        checkpoint), elsewhere None.
    :param hook: the active plugins' hooks, e.g. to ask ``plait_assign_roles`` which ranks the
        strategy lets die without ending the job (``Roles.expendable``).
    :return: once the workers have finished, what ``entrypoint`` returned in each worker this
        process started or ran, by rank (``{}`` when it ran none).
    """


@hookspec(firstresult=True)
def plait_objective(cfg: DictConfig, metrics: dict[str, float]) -> float | None:
    """The number a sweep minimises or maximises for this run (``plait.api.RunResult.objective``,
    what the task function of ``plait train -m`` hands to the sweeper).

    Stops at the first non-None result; None when no plugin answers.

    :param metrics: the last logged value of every metric of the run (``loss``, ``eval/loss``,
        ...), from the logging rank.
    """


@hookspec(firstresult=True)
def plait_tokenizer(cfg: DictConfig) -> Tokenizer | None:
    """The tokenizer the run's data was tokenized with (since hook spec 1.4).

    Stops at the first non-None result; the data plugin answers (None where it does not know,
    e.g. token files made elsewhere). Asked before launch, through ``plait_validate``'s
    ``hook``, by a model plugin whose model has a tokenizer of its own (is the data the model's
    vocabulary?), and by ``plait sample`` to encode the prompt and decode the continuation.

    :return: a :class:`plait.types.Tokenizer` (``encode``, ``decode``, ``identity``,
        ``vocab_size``).
    """


# ---------------------------------------------------------------------------------------------
# build: run in every worker, in this order
# ---------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def plait_build_topology(cfg: DictConfig) -> Topology | None:
    """Initialise the process group and build the dp × tp × pp mesh.

    Stops at the first non-None result; when no plugin answers, the core's
    :meth:`plait.topology.Topology.initialize` builds it.
    """


@hookspec(firstresult=True)
def plait_run_role(cfg: DictConfig, topology: Topology, hook: HookRelay) -> bool | None:
    """Run this rank's whole job when its role is not ``trainer`` (e.g. a parameter server's
    loop), in place of the train loop. Called right after ``plait_build_topology``.

    Stops at the first non-None result; the plugin that assigned the role answers.

    :param topology: ``topology.role`` says which loop to run.
    :param hook: the active plugins' hooks, to build what the role needs (model, optimizer,
        learning-rate schedule) exactly as the trainers do.
    :return: True once the role's work is done.
    """


@hookspec(firstresult=True)
def plait_build_dataset(cfg: DictConfig, topology: Topology, split: str) -> TokenDataset | None:
    """Build the tokenized dataset for ``split`` ("train" or "val").

    Stops at the first non-None result. Tokenize once (cache on disk); every rank may call this.
    """


@hookspec(firstresult=True)
def plait_shard_data(
    cfg: DictConfig, dataset: TokenDataset, topology: Topology
) -> BatchLoader | None:
    """Give this data-parallel rank its disjoint, deterministic share of the samples, as a
    loader of ready micro-batches.

    Stops at the first non-None result.

    :return: a :class:`plait.types.BatchLoader` yielding, per optimizer step,
        ``grad_accum_steps`` micro-batches ``(inputs, targets)``; the loop calls ``next`` on it
        once per step. Its ``state_dict`` (a small dict keyed by global sample position, the
        same at any data-parallel size) goes into every checkpoint, and ``load_state_dict``
        makes a resumed run continue exactly where it stopped.
    """


@hookspec(firstresult=True)
def plait_build_model(cfg: DictConfig) -> torch.nn.Module | None:
    """Build the full (unsplit) model on the CPU, seeded, so every rank builds the same weights.

    Stops at the first non-None result. Also called under ``torch.device("meta")`` before launch
    (to check a plan against the model's layers) and by ``plait estimate``. In the workers it is
    called on the meta device first: a model that defines ``init_parameter(name, tensor,
    generator)`` (fill the unsplit parameter ``name`` from ``generator``) stays there, is cut,
    and each rank materializes only its part (``plait_materialize_model``, :mod:`plait.meta`);
    any other model is built again, whole, on every rank. The model may carry
    ``tensor_parallel_plan`` (a model plugin then declares ``model:tensor_parallel_plan``),
    ``flops_per_token(seq_len)`` (for MFU; without it plait counts 6·N) and
    ``activation_bytes(batch_size, seq_len, bytes_per_value)`` (for ``plait estimate``; without
    it no activation figure is printed).
    """


@hookspec
def plait_apply_tensor_parallel(
    cfg: DictConfig, model: torch.nn.Module, topology: Topology
) -> None:
    """Split the model's layers across the tensor-parallel group, in place.

    Called on every active plugin; a plugin does nothing when ``topology.dims.tp == 1``.
    """


@hookspec
def plait_apply_expert_parallel(
    cfg: DictConfig, model: torch.nn.Module, topology: Topology
) -> None:
    """Spread the model's experts over the expert-parallel group, in place: each rank keeps its
    share of every mixture-of-experts layer's experts (under their global names) and the layer
    exchanges tokens with its peers.

    Called on every active plugin after tensor parallelism and before context parallelism and
    activation checkpointing (torchtitan's order); a plugin does nothing when
    ``topology.dims.ep == 1``. Added in hook spec 1.4.
    """


@hookspec
def plait_apply_context_parallel(
    cfg: DictConfig, model: torch.nn.Module, topology: Topology
) -> None:
    """Make the model hold only this rank's part of each sequence, in place: its input is cut
    along the sequence and its attention exchanges keys and values with the other
    context-parallel ranks (``topology.group("cp")``).

    Called on every active plugin after tensor and expert parallelism and before activation
    checkpointing (so a checkpointed block recomputes the exchanging attention), on the meta
    device where the model is built there; a plugin does nothing when ``topology.dims.cp == 1``.
    Added in hook spec 1.4.
    """


@hookspec
def plait_apply_activation_checkpointing(
    cfg: DictConfig, model: torch.nn.Module, topology: Topology
) -> None:
    """Make the model recompute activations in the backward instead of keeping them, in place
    (``train.activation_checkpointing``), keeping its parameter names.

    Called on every active plugin after tensor parallelism and before the pipeline split and the
    engine (torchtitan's order: TP, activation checkpointing, compile, data parallel).
    """


@hookspec(firstresult=True)
def plait_split_pipeline(
    cfg: DictConfig, model: torch.nn.Module, topology: Topology
) -> torch.nn.Module | None:
    """Cut the model into pipeline stages and return this rank's stage.

    Stops at the first non-None result; None keeps the whole model (``pp == 1``).
    """


@hookspec(firstresult=True)
def plait_materialize_model(
    cfg: DictConfig, model: torch.nn.Module, init: ParameterInit, topology: Topology
) -> torch.nn.Module | None:
    """Give the model, built on the meta device and already cut (tensor parallel, pipeline
    stage), real memory on this rank: only what this rank keeps, with its initial values.

    Stops at the first non-None result; a strategy that shards parameters answers (ZeRO-3, FSDP)
    and materializes only its partition. None: the core allocates every local parameter and fills
    it (:func:`plait.meta.materialize`). Called only for a model that defines
    ``init_parameter(name, tensor, generator)``; any other is built whole by
    ``plait_build_model``.

    :param init: ``init.local(name, param)`` is this rank's initial value of ``param``, named as
        in the unsplit model (one full parameter is made, then cut); ``init.full(name, shape,
        dtype)`` the whole value.
    :return: the model holding real parameters (the same object, or a wrapper).
    """


@hookspec(firstresult=True)
def plait_build_loss(
    cfg: DictConfig, model: torch.nn.Module, topology: Topology
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """Return ``loss_fn(logits, targets) -> scalar``; None means plain cross-entropy.

    Stops at the first non-None result. A tensor-parallel plugin returns a vocab-parallel loss.
    """


@hookspec(firstresult=True)
def plait_build_optimizer(cfg: DictConfig, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """Build the optimizer over the (already split) model's parameters.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def plait_build_lr_schedule(cfg: DictConfig) -> Callable[[int], float] | None:
    """Return ``lr_at(step) -> float``; the loop sets this learning rate before each step.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def plait_grad_reducer(cfg: DictConfig, topology: Topology) -> GradReducer | None:
    """Build the reducer that averages gradient buckets over data-parallel ranks.

    Stops at the first non-None result; the comm plugin answers. Called on every rank in the
    same order (a reducer may build process groups, e.g. ``topology.node_groups("dp")``).

    :return: a :class:`plait.types.GradReducer`: ``reduce(bucket, group)`` averages
        ``bucket.buffer()`` over ``group`` and returns a future; its ``spec`` says what it does
        (an engine may run its built-in all-reduce instead when ``spec.native``). None leaves
        every engine its built-in all-reduce.
    """


@hookspec(
    firstresult=True,
    warn_on_impl=FutureWarning(  # shown to users, unlike DeprecationWarning
        "plait_comm_hook is deprecated since hook spec 1.1 and goes in 2.0: implement "
        "plait_grad_reducer (a plait.types.GradReducer) instead; strategy=ddp adapts it meanwhile"
    ),
)
def plait_comm_hook(cfg: DictConfig, topology: Topology) -> tuple[Any, Callable] | None:
    """Deprecated (hook spec 1.1): use ``plait_grad_reducer``. A torch DDP comm hook.

    Stops at the first non-None result. Only ``strategy=ddp`` takes it (through an adapter onto
    the reducer contract, in place of the comm plugin's reducer); a plan whose engine cannot
    take a reducer refuses it.

    :return: ``(state, hook)`` in the form of ``DistributedDataParallel.register_comm_hook``.
    """


@hookspec(firstresult=True)
def plait_build_engine(
    cfg: DictConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    grad_reducer: GradReducer | None,
    topology: Topology,
    hook: HookRelay,
) -> Engine | None:
    """Wrap model and optimizer for the chosen strategy (DDP, DeepSpeed ZeRO, …).

    Stops at the first non-None result. The engine calls ``hook.plait_check_step`` once per
    optimizer step, between backward and the optimizer step, on every rank.

    :param grad_reducer: what ``plait_grad_reducer`` returned; an engine that provides
        ``engine:grad_reducer`` hands it its gradient buckets.

    :return: an :class:`plait.types.Engine`.
    """


@hookspec
def plait_check_step(
    cfg: DictConfig, loss: torch.Tensor, grad_norm: torch.Tensor, topology: Topology
) -> bool | None:
    """Decide whether this optimizer step may update the model; called by the engine on every
    rank, after backward (and the gradient reduction) and before the optimizer step.

    The step is skipped when any implementation returns True: the engine drops the gradients and
    leaves parameters and optimizer state untouched, and the loop does not advance the step
    counter. An implementation must return the same answer on every rank (agree through a
    collective when it looks at rank-local values), or the ranks would diverge. It may raise to
    end the attempt (the launcher's restart then resumes from the last checkpoint).

    :param loss: this rank's mean loss over its micro-batches (a 0-d tensor).
    :param grad_norm: the global gradient norm before clipping (a 0-d tensor).
    """


@hookspec(firstresult=True)
def plait_sync_replicas(
    cfg: DictConfig, engine: Engine, state: TrainState | None, topology: Topology
) -> TrainState | None:
    """Join the replica groups' quorum for the next step (since hook spec 1.5); called on every
    rank once before the checkpoint is loaded (``state`` None: the quorum of the run's first
    step) and at the top of every step, before its learning rate and batch.

    Stops at the first non-None result; a fault-tolerance plugin answers (``fault=torchft``),
    only in a job whose replica groups run as independent torch jobs
    (``topology.dims.replica_groups > 1``). When this rank's group was behind the quorum (a
    group restarted by its agent, or one that missed a step), it has received a healthy peer's
    state over the network and loaded model and optimizer into ``engine``; it returns the
    peer's :class:`plait.types.TrainState` (step, data position), and the loop continues from
    it: before the first step no checkpoint is read, in a step the loader is moved to the
    peer's data position.

    :param state: the loop's state (None before a checkpoint is loaded).
    :return: the state received from a peer, or None to go on with this group's own.
    """


# ---------------------------------------------------------------------------------------------
# evaluate: called on every trainer rank after each step
# ---------------------------------------------------------------------------------------------


@hookspec
def plait_evaluate(
    cfg: DictConfig,
    engine: Engine,
    state: TrainState,
    topology: Topology,
    final: bool,
    hook: HookRelay,
) -> dict[str, float] | None:
    """Score the model as it is sharded, if an evaluation is due after ``state.step``; called on
    every trainer rank after each optimizer step (since hook spec 1.5), beside the core's own
    validation loss (``train.eval_every``, ``eval/loss``).

    Called on every active plugin; every rank must make the same collectives (forwards through
    ``engine.eval_loss``, whose loss ``plait_build_loss`` may wrap, and any gather). The
    dicts returned on the logging rank are merged into the step's metrics, so they reach
    ``plait_log_metrics`` (``metrics.jsonl``, W&B) and a sweep's objective
    (``plait_objective``).

    :param final: True after the job's last step.
    :param hook: the active plugins' hooks, e.g. ``hook.plait_tokenizer(cfg=cfg)``.
    :return: metrics by name (e.g. ``{"eval/<task>/acc": 0.5}``) on the logging rank; None on
        the other ranks and on steps with no evaluation.
    """


# ---------------------------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def plait_load_checkpoint(
    cfg: DictConfig, engine: Engine, topology: Topology, hook: HookRelay
) -> TrainState | None:
    """Resume from ``cfg.resume`` (``latest`` or a path) if set; called on every rank.

    Stops at the first non-None result.

    :param hook: the active plugins' hooks (since hook spec 1.3), e.g. to learn which optional
        engine surfaces the strategy declared: ``plait.plugin_manager.provided(hook)``.

    :return: the restored :class:`plait.types.TrainState`, or None to start from step 0.
    """


@hookspec(firstresult=True)
def plait_save_checkpoint(
    cfg: DictConfig,
    engine: Engine,
    state: TrainState,
    topology: Topology,
    final: bool,
    hook: HookRelay,
) -> Path | None:
    """Save a checkpoint if one is due after ``state.step``; called on every rank after each step.

    Stops at the first non-None result. The write must be atomic: a crash part-way leaves the
    previous checkpoint as ``latest``.

    :param final: True after the last step.
    :param hook: the active plugins' hooks (since hook spec 1.3), as for
        ``plait_load_checkpoint``.
    :return: the checkpoint directory written, or None when none was due.
    """


@hookspec(firstresult=True)
def plait_save_model_copy(
    cfg: DictConfig,
    engine: Engine,
    topology: Topology,
    step: int,
    format: str,
    hook: HookRelay,
) -> Path | None:
    """Write the model being trained in another ``format`` than plait's checkpoints (since hook
    spec 1.5), e.g. ``"hf"``: Hugging Face's, for ``from_pretrained``; called on every rank by
    the checkpoint plugin when a copy is due (``checkpoint.hf_every``), after its own checkpoint.

    Stops at the first non-None result: answer only for a format you write, for a model you
    can write it for, and declare that you can (``model:hf_format`` for ``"hf"``), so the
    checkpoint plugin refuses the setting before launch where no plugin would answer.

    :param engine: the run's engine; its model state by name is ``engine.layout_free_state()``
        (capability ``engine:layout_free_state``, which the checkpoint plugin checks).
    :param hook: the active plugins' hooks (e.g. to build the model on the meta device).
    :return: the directory written (on every rank), or None for a format you do not write.
    """


@hookspec(firstresult=True)
def plait_find_checkpoint(cfg: DictConfig, path: str) -> Path | None:
    """Resolve ``path`` ("latest", a run directory or a checkpoint directory) to a checkpoint.

    Stops at the first non-None result. Used by ``plait export``.
    """


@hookspec(firstresult=True)
def plait_read_model_shards(
    cfg: DictConfig, checkpoint: Path
) -> dict[tuple[int, int], dict] | None:
    """Read a checkpoint's model weights offline (one process, no process group), fp32.

    Stops at the first non-None result; the strategy that wrote the checkpoint answers.

    :return: ``{(pp_rank, tp_rank): state_dict}``, each state dict holding the full tensors of
        that pipeline stage's tensor-parallel shard (data-parallel / ZeRO shards already joined).
    """


@hookspec(firstresult=True)
def plait_merge_tensor_parallel_shards(
    cfg: DictConfig, shards: list[dict], model: torch.nn.Module
) -> dict | None:
    """Join the tensor-parallel shards of one pipeline stage (``shards[tp_rank]``) into the
    unsplit state dict. Stops at the first non-None result; None is right only when tp == 1.

    :param model: the unsplit model on the meta device (its plan says how each tensor was split).
    """


@hookspec(firstresult=True)
def plait_export_model(
    cfg: DictConfig, state_dict: dict, model: torch.nn.Module, format: str, out: Path
) -> Path | None:
    """Write a checkpoint's unsplit model in ``format`` (``plait export <run> format=<format>
    out=<dir>``; since hook spec 1.4); the default format (``pt``, a ``torch.save`` of the state
    dict) is the core's.

    Stops at the first non-None result; the plugin that knows the format answers (``hf``: the
    ``model=hf`` plugin writes Hugging Face safetensors, config and tokenizer files). No answer
    refuses the format.

    :param state_dict: the unsplit model's fp32 tensors by name (every shard joined).
    :param model: the unsplit model on the meta device.
    :return: what was written.
    """


# ---------------------------------------------------------------------------------------------
# step: tracking, called on the logging rank only (the first trainer: global rank 0 unless a
# strategy assigns roles)
# ---------------------------------------------------------------------------------------------


@hookspec
def plait_on_run_start(cfg: DictConfig, state: TrainState, topology: Topology) -> None:
    """A run (new or resumed at ``state.step``) starts; a tracker opens its run here.

    A tracker that continues an earlier run reads ``state.tracker_run_id`` and sets it for a new
    one, so the id is stored with every checkpoint.
    """


@hookspec(
    warn_on_impl_args={
        "metrics": FutureWarning(
            "plait_on_step_end's argument metrics is deprecated since hook spec 1.2 and goes in 2.0: "
            "read output (output.loss, output.grad_norm, output.metrics: the engine's figures), or "
            "implement plait_log_metrics(step, metrics) for every logged metric"
        )
    }
)
def plait_on_step_end(
    step: int, output: StepOutput, state: TrainState, metrics: dict[str, float]
) -> None:
    """Every optimizer step has finished: ``output`` is what the engine reported (the global
    mean loss, the global gradient norm, engine figures). No collective happened for it, so this
    is the cheap per-step point, e.g. for early stopping or a profiler's step marker.

    :param metrics: deprecated (hook spec 1.2; hook spec 1.0's argument, kept working until
        2.0): on a logged step the dict ``plait_log_metrics`` gets; on the other steps loss, lr,
        grad_norm and the engine's figures. Read ``output``, or implement ``plait_log_metrics``.
    """


@hookspec
def plait_log_metrics(step: int, metrics: dict[str, float], state: TrainState) -> None:
    """A logged step (every ``train.log_every`` steps and the last): ``metrics`` holds loss, lr,
    grad_norm, tokens_per_s, tokens, step time and peak memory (min and max over ranks), each
    rank's figures as ``<figure>/rank<r>`` (peak memory, and the means since the last logged
    step of step time, data wait and the phases a timing plugin measured), mfu where the
    device's peak is known, the engine's own figures, and ``eval/loss`` when evaluated."""


@hookspec
def plait_on_run_end(state: TrainState, status: str, cfg: DictConfig) -> None:
    """The run ended with ``status`` "finished", "failed", or "left" (this worker left the job
    on purpose, e.g. a replica group excluded as a straggler, while the others go on: since hook
    spec 1.5); trackers close their run. Called whenever ``plait_on_run_start`` was, even if
    that failed part-way.

    :param cfg: the run's config (since hook spec 1.3), so that a plugin needs no state of its
        own kept from ``plait_on_run_start``.
    """


# ---------------------------------------------------------------------------------------------
# failure
# ---------------------------------------------------------------------------------------------


@hookspec
def plait_on_failure(cfg: DictConfig, error: BaseException, state: TrainState) -> None:
    """A worker raised ``error`` at ``state.step``; called on that rank before the error
    propagates to the launcher (which may restart the workers; see ``launcher.max_restarts``)."""
