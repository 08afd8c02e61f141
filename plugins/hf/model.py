"""``model=hf model.path=<dir>``: any ``transformers`` causal LM from a local directory, its
parallel plans read from its own config, its weights read by each rank slice by slice.

The model is ``transformers``' own class (``AutoModelForCausalLM.from_config``), built on the
meta device, with plait's contract mixed in (:class:`PlaitCausalLM`): ``forward(ids) -> logits``,
``init_parameter`` and, for a pretrained checkpoint, ``read_parameter(name, box)`` (:mod:`plait.
meta`), its plans as plait's (:mod:`.plans`). Parameter names stay ``transformers``' (``model.
layers.3.self_attn.q_proj.weight``); a checkpoint's tensors are found by the names
``transformers`` gives them on load (its conversion mapping's renames, e.g. GPT-NeoX's
``embed_out`` → ``lm_head``, and the base-model prefix added or dropped), and an export is written
under the names ``save_pretrained`` writes. The experts of the mixture-of-experts blocks the
config's ep plan names are kept one module per expert under their stored names (:mod:`.experts`),
so they are read as stored; other weights ``transformers`` converts on load (other fused experts,
split q/k/v) are not read: such a checkpoint is refused before launch. Non-persistent buffers
(the rotary embedding's ``inv_freq``) are computed on the CPU at build time by the model's own
``_init_weights``, as ``from_pretrained`` does after a meta build.

Taken from ``transformers``: the classes, configs, plans, weight init (``_init_weights``) and
``generate``; written here: reading only this rank's boxes, the per-name random init (one
generator per parameter, so every layout starts from the same weights), the stage forward.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from plait.engine.stages import holds
from plait.meta import SkipMetaInit, whole
from plait.plugins.hf import context_parallel, experts, plans
from plait.plugins.hf.checkpoint_files import CheckpointFiles

CONFIG = "config.json"


def resolve_directory(path: str) -> Path:
    """``model.path``: a directory, or the name of a model already in the local Hugging Face
    cache (``org/name``; nothing is ever downloaded). ``ValueError`` naming the fix."""
    directory = Path(str(path)).expanduser()
    if directory.is_dir():
        return directory
    if directory.exists():
        raise ValueError(
            f"model.path={path} is a file: give the directory that holds "
            f"{CONFIG} and the *.safetensors weights"
        )
    if str(path).count("/") == 1 and not str(path).startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(path), local_files_only=True))
        except Exception:
            pass
    raise ValueError(
        f"model.path={path} is neither a directory nor a model in the local Hugging "
        "Face cache, and plait never downloads: give a local directory (save_"
        f"pretrained's output), or fetch it first (huggingface-cli download {path})"
    )


def load_config(directory: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory), local_files_only=True)


class _Shared:
    """Holds objects every copy of the model shares (``copy.deepcopy`` keeps the same one)."""

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


class PlaitCausalLM:
    """plait's model contract, mixed into a ``transformers`` ``*ForCausalLM`` class.

    ``forward(ids)`` returns the logits of the family's own ``*ForCausalLM.forward`` (its
    ``.logits``: whatever it does after the base model, before and after the head, is kept:
    MiniCPM3's and Granite's scalings, Gemma 2's soft-capping, Cohere's ``logit_scale``). A
    pipeline stage after the first receives hidden states (floats) in place of ids and passes
    them as ``inputs_embeds`` (its embedding is then a stage identity); a stage without the head
    runs only the base model and hands on its ``last_hidden_state`` (its final norm is an
    identity too), as ``transformers``' own pipeline does. Called with keywords (``generate``,
    ``labels=``) it is ``transformers``' forward.
    """

    def forward(self, input_ids=None, *args, **kwargs):
        if args or kwargs or input_ids is None:
            return super().forward(input_ids, *args, **kwargs)
        given = {"inputs_embeds" if input_ids.is_floating_point() else "input_ids": input_ids}
        if not holds(self.get_output_embeddings()):  # a stage before the last
            base = getattr(self, self.base_model_prefix)
            return base(**given, use_cache=False).last_hidden_state
        return super().forward(**given, use_cache=False, **self.plait_forward_options).logits

    @property
    def plait_forward_options(self) -> dict:
        """Keywords of the family's forward that plait answers itself: a mixture of experts'
        router losses are plait's (:mod:`.experts`), so ``transformers`` pools none."""
        return {"output_router_logits": False} if self.plait_expert_blocks else {}

    def stand_in(self, seed: int, tp: int = 1) -> nn.Module:
        """A small model of this family with its settings, initialised from ``seed`` on the
        CPU (:mod:`.stand_in`): what the pipeline and tensor-parallel plugins cut as they cut
        this model and compare with its unsplit forward before the first step."""
        from plait.plugins.hf.stand_in import build_stand_in

        return build_stand_in(self, seed, tp)

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """The initial value of the unsplit parameter ``name``: the checkpoint's, or
        ``transformers``' own init of its module (``_init_weights``) drawn from ``generator``
        (one per parameter), so any rank can make any parameter in any layout."""
        if self.plait_checkpoint.value is not None:
            tensor.copy_(self.read_parameter(name, whole(tensor.shape)))
            return
        module_name, _, attr = name.rpartition(".")
        original = self.plait_original_modules.value[module_name]  # the type before any split
        twin = copy.copy(original)
        twin._parameters = {k: tensor if k == attr else v for k, v in original._parameters.items()}
        with torch.random.fork_rng(devices=[]), SkipMetaInit():  # the others stay on meta
            torch.manual_seed(generator.initial_seed())
            self._init_weights(twin)

    def expert_parameter_count(self) -> int:
        return experts.expert_parameter_count(self)

    def flops_per_token(self, seq_len: int) -> int:
        """``6·N`` for the weight matmuls plus ``12·L·E·T`` for attention (PaLM, appendix B),
        ``N`` without the input embedding's lookup table (kept when tied: it is the head)."""
        c = self.config.get_text_config()
        n = sum(p.numel() for p in self.parameters())
        if not c.tie_word_embeddings:
            n -= self.get_input_embeddings().weight.numel()
        for block in (m for m in self.modules() if getattr(m, "is_moe_layer", False)):
            one = sum(p.numel() for p in next(iter(block.experts.values())).parameters())
            n += one * (block.top_k - len(block.experts))  # a token runs top_k of the experts
        return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len


_CLASSES: dict[type, type] = {}


def plait_class(base: type) -> type:
    """``base`` with plait's contract, under the same name (``transformers`` looks its weight
    renames up by class name): ``LlamaForCausalLM(PlaitCausalLM, LlamaForCausalLM)``, made once
    per class, a name of this module (so it pickles)."""
    if base not in _CLASSES:
        cls = type(
            base.__name__,
            (PlaitCausalLM, base),
            {"__module__": __name__, "transformers_class": base},
        )
        globals()[cls.__name__] = cls
        _CLASSES[base] = cls
    return _CLASSES[base]


@contextmanager
def as_transformers_class(model: nn.Module):
    """``model`` seen as ``transformers``' own class, for its functions that treat classes
    defined outside ``transformers`` as remote code (and skip their weight renames)."""
    cls = type(model)
    model.__class__ = cls.transformers_class
    try:
        yield model
    finally:
        model.__class__ = cls


def checkpoint_names(model: nn.Module, checkpoint: CheckpointFiles) -> dict[str, str]:
    """``{model name: checkpoint name}`` as ``from_pretrained`` renames a checkpoint's keys:
    the conversion mapping's renames and the base-model prefix. Keys a converter must transform
    (fuse, split) are left out, so the model's parameter is missing and refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    with as_transformers_class(model):
        transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = experts.kept_converters(
        model, [t for t in transforms if isinstance(t, WeightConverter)]
    )
    meta = model.state_dict()
    names = {}
    for key in sorted(checkpoint.weight_map):
        renamed, converted = rename_source_key(
            key, renamings, converters, model.base_model_prefix, meta
        )
        if converted is None:
            names.setdefault(renamed, key)
    return names


def real_buffers(model: nn.Module) -> None:
    """Compute the buffers a meta build left without values (the rotary embedding's
    ``inv_freq``) on the CPU, with the model's own ``_init_weights``."""
    for module in model.modules():
        names = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not names:
            continue
        for n in names:
            b = module._buffers[n]
            module._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
        with torch.device("cpu"):
            model._init_weights(module)


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's other names in a checkpoint (tied weights are stored under one)."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    aliases: dict[str, list[str]] = {}
    for target, source in tied.items():
        aliases.setdefault(source, []).append(target)
        aliases.setdefault(target, []).append(source)
    return aliases


def checkpoint_name(names: dict[str, str], aliases: dict[str, list[str]], name: str) -> str | None:
    """The name the parameter ``name`` is stored under in the checkpoint, or None."""
    for candidate in (name, *aliases.get(name, ())):
        if candidate in names:
            return names[candidate]
    return None


def read_parameter(
    checkpoint: CheckpointFiles,
    names: dict[str, str],
    aliases: dict[str, list[str]],
    name: str,
    box,
) -> torch.Tensor:
    stored = checkpoint_name(names, aliases, name)
    if stored is None:
        raise KeyError(f"{checkpoint.directory} holds no tensor {name}")
    return checkpoint.read(stored, box)


def hf_model(
    config, checkpoint: CheckpointFiles | None = None, directory: Path | None = None
) -> nn.Module:
    """A ``transformers`` causal LM for ``config`` with plait's contract and plans, fp32; its
    values from ``checkpoint`` (box by box) or, without one, initialised by name. ``directory``:
    where it came from (its tokenizer files go with an export)."""
    from transformers import AutoModelForCausalLM

    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    architecture = type(model).__name__
    model.__class__ = plait_class(type(model))
    real_buffers(model)
    model.plait_architecture = architecture
    model.plait_parameter_count = sum(p.numel() for p in model.parameters())
    model.plait_expert_blocks = experts.adopt_experts(model)  # base_model_ep_plan's blocks
    model.plait_checkpoint = _Shared(checkpoint)
    model.plait_source_directory = _Shared(directory)
    model.plait_aliases = _Shared(tied_aliases(model))
    model.plait_original_modules = _Shared(dict(model.named_modules()))
    model.plait_names = _Shared(checkpoint_names(model, checkpoint) if checkpoint else {})
    if checkpoint is not None:
        model.read_parameter = partial(
            read_parameter, checkpoint, model.plait_names.value, model.plait_aliases.value
        )
    model.tensor_parallel_plan = plans.tensor_parallel_plan(model)
    plans.give_rotary_key_widths(model, model.tensor_parallel_plan)
    model.pipeline_plan = plans.pipeline_plan(model)
    if model.pipeline_plan is not None:  # whole decoder layers; the attention core is a function
        model.activation_checkpointing_plan = {"full": f"{model.pipeline_plan['layers']}.*"}
        # a decoder layer returns the whole hidden state, and a forward may look a layer's
        # settings up by its index: other stages' layers are identities in their places
        model.pipeline_identities_for_other_layers = True
    else:  # its forward mixes the embedding into later layers' inputs: no layer list will do
        model.no_pipeline_plan_reason = (
            f"{architecture} has no base_model_pp_plan in its "
            "config, so transformers names no pipeline stages"
        )
    context_parallel.prepare(model, config)
    return model


def build_hf(path: str, pretrained: bool = True) -> nn.Module:
    """``model=hf``'s ``_target_``: the model in ``path`` (a directory or a cached name)."""
    directory = resolve_directory(path)
    return hf_model(
        load_config(directory), CheckpointFiles(directory) if pretrained else None, directory
    )
