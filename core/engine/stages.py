"""A pipeline rank's stages as one module: what the pipeline plugin cuts a model into and what a
strategy's engine wraps (DDP and ZeRO as a whole, FSDP chunk by chunk), and the stand-ins a cut
leaves in a model's place for the parts other stages hold (a model plugin's forward asks which
of its parts are here: :func:`holds`)."""

from __future__ import annotations

import torch.nn as nn


class StageIdentity(nn.Module):
    """Stands in for a part another stage holds: returns its first input unchanged (the hidden
    states a later stage receives pass through the embedding's place, and through the places of
    the layers it does not hold), as ``transformers``' ``PipelineIdentityLayer`` does."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def holds(module: nn.Module | None) -> bool:
    """Whether ``module`` is a part this stage holds (not another stage's stand-in)."""
    return module is not None and not isinstance(module, StageIdentity)


class StageLayerList(nn.ModuleList):
    """A stage's share of a ``ModuleList`` of ``total`` layers, under their indices in the whole
    list; only the stage's own layers are registered (``children()``, ``state_dict()``,
    ``parameters()``).

    Read as the model's forward reads it (iterated, sliced ``layers[:n]`` as ``transformers``
    does, indexed), it visits the stage's layers in order, or with ``identities`` the whole list
    with a :class:`StageIdentity` in the place of each layer another stage holds, as
    ``transformers``' own pipeline leaves them: a forward that looks layer ``i``'s settings up by
    its place (``config.layer_types[i]`` in ``enumerate(self.layers)``) then sees the right ones.
    Identities suit layers that return the whole hidden state (``transformers``' decoder layers);
    a layer that returns only its residual branch (``x = x + layer(x)``) must be skipped instead.
    """

    def __init__(self, layers: dict[str, nn.Module], total: int, identities: bool = False):
        super().__init__()
        self.total = total
        self.identities = identities
        for key, layer in layers.items():
            self.add_module(key, layer)
        self.__dict__["elsewhere"] = StageIdentity()  # not registered: no module of this stage

    def layer_at(self, index: int) -> nn.Module:
        layer = self._modules.get(str(index))
        if layer is None and not self.identities:
            raise KeyError(f"layer {index} is on another pipeline stage")
        return self.__dict__["elsewhere"] if layer is None else layer

    def places(self, indices: range) -> list[int]:
        held = {int(key) for key in self._modules}
        return [i for i in indices if self.identities or i in held]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.layer_at(i) for i in self.places(range(*index.indices(self.total)))]
        return self.layer_at(index % self.total)

    def __iter__(self):
        return (self.layer_at(i) for i in self.places(range(self.total)))

    def __len__(self) -> int:
        return self.total if self.identities else len(self._modules)


class PipelineStageModules(nn.Module):
    """This rank's pipeline chunks under the unsplit model's parameter names.

    The model with every part this rank holds (and identities for the others) is registered
    here child by child, so ``state_dict()`` keeps the original names (``plait export`` unites
    the stages' disjoint names) and the optimizer sees every local parameter once. ``chunks``
    lists ``(stage_index, module)`` for the pipeline schedule; each chunk is a copy of the
    model's shell sharing these parts.
    """

    def __init__(self, union: nn.Module, chunks: list[tuple[int, nn.Module]], n_stages: int):
        super().__init__()
        self.n_stages = n_stages
        for name, child in union.named_children():
            self.add_module(name, child)
        self.chunks = chunks  # a plain list: the parts are registered above, once
