"""Models on the meta device: built for shapes only, then given real memory part by part.

A model that only fits across ranks must never exist whole anywhere (torchtitan's
``init_weights`` after ``to_empty``). plait builds it on the meta device, lets tensor parallelism,
the pipeline split and a sharding strategy cut it there, and only then materializes what this rank
holds. Initial values must not depend on the layout, so they come from one seeded generator per
parameter, keyed by the parameter's name in the unsplit model::

    value(name) = init_parameter(name, torch.empty(full_shape), Generator(seed_of(seed, name)))

and a rank keeps ``local_part(value(name))``. A model opts in by defining
``init_parameter(name, tensor, generator)`` (plait's GPT does); any other model is built whole on
every rank, seeded, as before. One full parameter at a time is the only transient: the largest
parameter, not the model.

Who cuts a parameter says how to take its part from the full tensor: a parameter built from a
full one on the meta device carries :class:`FullSlice` as ``slice_of_full`` (the tensor-parallel
layers set it), so this module reads no plugin's layout.

A model whose values already exist (a pretrained checkpoint) may also define
``read_parameter(name, box)``: the *box* ``full[box]`` of the unsplit parameter ``name``, one
``slice(start, stop)`` per dimension, read without the rest (safetensors' ``get_slice``). Where
a rank's part is a box of the full value (a tensor-parallel shard of a plain split, and within it
a data-parallel shard, :func:`compose`), only that box is read; the full value is never made.
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn
from omegaconf import DictConfig

from plait.host_memory import return_freed_memory

# In-place initialisers (and all of torch.nn.init): on the meta device there are no values to
# write.
INITIALISERS = frozenset(
    {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_}
)


class SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Returns a meta tensor from an in-place initialiser untouched. torch runs those through its
    Python reference decompositions on meta, which made a meta build of gpt2_small take seconds
    (40x the build without them); a plan builds the model several times, the planner hundreds."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes keywords
        initialiser = func in INITIALISERS or getattr(func, "__module__", "") == "torch.nn.init"
        if initialiser and getattr(tensor, "is_meta", False):
            return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device() -> Iterator[None]:
    """Build modules on the meta device (shapes only: no memory, no initialisation)."""
    with torch.device("meta"), SkipMetaInit():  # the innermost mode sees the call first
        yield


def meta_model(hook, cfg: DictConfig) -> nn.Module | None:
    """The model the model plugin builds, on the meta device (no memory, no initialisation), for
    checks in ``plait_validate``; None when these settings cannot build it (the ``models``
    plugin's own check says why)."""
    try:
        with meta_device():
            return hook.plait_build_model(cfg=cfg)
    except Exception:
        return None


def build_model(hook, cfg: DictConfig) -> tuple[nn.Module, ParameterInit | None]:
    """The model plugin's model and how to initialise it by name: on the meta device when the
    model defines ``init_parameter`` (its parts are materialized later, ``plait_materialize_
    model``), else built whole and seeded, with no init (None)."""
    with meta_device():
        model = hook.plait_build_model(cfg=cfg)
    init = ParameterInit.of(model, cfg.seed)
    if init is None:
        model = hook.plait_build_model(cfg=cfg)
    return model, init


def parameters_per_rank(model: nn.Module, dims) -> tuple[int, int]:
    """``(dense, experts)``: parameters one rank holds of the unsplit ``model`` at layout
    ``dims``, for estimates. Tensor and pipeline parallelism split every weight (approximately);
    expert parallelism also splits the experts ``dims.ep`` ways (a model with experts says how
    many parameters they have: ``expert_parameter_count()``), which are averaged over the
    ``dp / ep`` ranks holding the same ones instead of over dp."""
    total = sum(p.numel() for p in model.parameters())
    count = getattr(model, "expert_parameter_count", None)
    experts = count() if callable(count) else 0
    split = dims.tp * dims.pp
    return (total - experts) // split, experts // (getattr(dims, "ep", 1) * split)


def seed_of(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s generator: a stable hash of the run's seed and the name,
    the same in every process and every layout."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def parameter_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed_of(seed, name))


def init_by_name(model: nn.Module, seed: int) -> None:
    """Fill every (real) parameter of the unsplit ``model`` from its own generator: what a model
    with ``init_parameter`` calls at the end of its constructor, so that ``torch.manual_seed(s);
    Model()`` equals plait's materialized model at ``seed=s``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_meta:
                getattr(model, "init_parameter")(name, p, parameter_generator(seed, name))


Box = tuple[slice, ...]  # full[box]: one slice(start, stop) per dimension, steps of 1


def whole(shape: Sequence[int]) -> Box:
    return tuple(slice(0, n) for n in shape)


def compose(outer: Box, inner: Box) -> Box:
    """The box ``inner`` of ``full[outer]`` as a box of ``full``:
    ``full[outer][inner] == full[compose(outer, inner)]``."""
    return tuple(slice(o.start + i.start, o.start + i.stop) for o, i in zip(outer, inner))


@dataclass(frozen=True)
class FullSlice:
    """How a parameter built on the meta device from a full one takes its part of the full
    value: ``take(full) -> local`` (e.g. a tensor-parallel shard), and where that part is a
    contiguous box of the full value, ``box`` (``take(full) == full[box]``), so a model that
    reads its values can read only the part."""

    full_shape: torch.Size
    take: Callable[[torch.Tensor], torch.Tensor]
    box: Box | None = None


@dataclass(frozen=True)
class ParameterInit:
    """The initial value of every parameter of the unsplit model, by name: the model's
    ``init_parameter`` and the run's seed, and where the model reads its values (a checkpoint)
    its ``read_parameter(name, box)``. Handed to ``plait_materialize_model``."""

    fill: Callable[[str, torch.Tensor, torch.Generator], None]
    seed: int
    read: Callable[[str, Box], torch.Tensor] | None = None

    @classmethod
    def of(cls, model: nn.Module, seed: int) -> ParameterInit | None:
        """The init of a model built on the meta device; None for a model built for real."""
        fill = getattr(model, "init_parameter", None)
        if fill is None or not any(p.is_meta for p in model.parameters()):
            return None
        return cls(fill, seed, getattr(model, "read_parameter", None))

    def full(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        with torch.no_grad():
            self.fill(name, tensor, parameter_generator(self.seed, name))
        return tensor

    def local(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """This rank's value of ``param`` (named as in the unsplit model): the full value, cut
        by the parameter's ``slice_of_full`` where it has one."""
        return self.part(name, param)

    def part(self, name: str, param: torch.Tensor, box: Box | None = None) -> torch.Tensor:
        """``local(name, param)[box]`` (all of it without ``box``), e.g. a data-parallel shard of
        a tensor-parallel shard. A model that reads its values reads only that box when the
        rank's part is one; otherwise the full value is made and cut (one parameter at a
        time)."""
        cut: FullSlice | None = getattr(param, "slice_of_full", None)
        if self.read is not None and (cut is None or cut.box is not None):
            outer = whole(param.shape) if cut is None or cut.box is None else cut.box
            value = self.read(name, outer if box is None else compose(outer, box))
            return value.to(param.dtype)
        if cut is None:
            value = self.full(name, param.shape, param.dtype)
        else:
            value = cut.take(self.full(name, cut.full_shape, param.dtype))
        return value if box is None else value[box].clone()

    def flat(self, name: str, param: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``local(name, param)`` flattened (a ZeRO-3 partition),
        reading only the rows (along dimension 0) that hold them."""
        if param.dim() == 0:
            return self.part(name, param).reshape(-1)[start:stop]
        row = math.prod(param.shape[1:]) or 1
        first, last = start // row, -(-stop // row)
        rows = (slice(first, last), *whole(param.shape[1:]))
        offset = first * row
        return self.part(name, param, rows).reshape(-1)[start - offset : stop - offset]


Made = Callable[[nn.Module, list[nn.Parameter], list[tuple[str, nn.Parameter]]], None]


def materialize(
    model: nn.Module,
    init: ParameterInit,
    device: torch.device | str = "cpu",
    after_module: Made | None = None,
    fill: bool = True,
) -> nn.Module:
    """Give every meta parameter of ``model`` (this rank's part, already cut) real memory on
    ``device`` with its initial value, module by module, in place.

    Parameter objects are replaced, so do this before an optimizer or engine holds them; a
    shared parameter stays shared. ``after_module(module, params, origins)`` runs on each
    module's new parameters as soon as they exist, so a sharding strategy can partition them
    before the next module is made (ZeRO-3); ``origins[i]`` is ``(name, meta parameter)`` of
    ``params[i]``. With ``fill=False`` the new parameters are left unwritten (``torch.empty``:
    no page is touched) for ``after_module`` to give values to the part it keeps
    (``init.flat``). Every buffer must be real already.
    """
    meta_buffers = [name for name, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ValueError(
            f"{type(model).__name__} built on the meta device has buffers "
            f"{meta_buffers[:4]} with no values: a model with init_parameter must "
            "compute its buffers in forward (or register none)"
        )
    names = {id(p): name for name, p in model.named_parameters()}
    real: dict[int, nn.Parameter] = {}
    for module in model.modules():
        made, origins = [], []
        for attr, p in list(module.named_parameters(recurse=False)):
            if id(p) not in real:
                if not p.is_meta:
                    continue
                value = (
                    init.local(names[id(p)], p).to(device)
                    if fill
                    else torch.empty(p.shape, dtype=p.dtype, device=device)
                )
                real[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
                real[id(p)].__dict__.update(
                    {k: v for k, v in p.__dict__.items() if k != "slice_of_full"}
                )
                made.append(real[id(p)])
                origins.append((names[id(p)], p))
            setattr(module, attr, real[id(p)])
        if made and after_module is not None:
            after_module(module, made, origins)
        if made and torch.device(device).type == "cpu":
            return_freed_memory()  # the full values cut here were freed between kept parts
    return model
