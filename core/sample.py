"""``plait sample <run or checkpoint dir> prompt="..." max_new_tokens=N temperature=T top_k=K
seed=S``: print a continuation of ``prompt`` by a checkpoint's model, from any layout (nanoGPT's
``sample.py`` for plait's runs).

The checkpoint is read as ``plait export`` reads it (every shard joined, one process) into the
unsplit model. A model with ``transformers``' ``generate`` (``model=hf``) generates itself; any
other runs nanoGPT's loop: the last ``block_size`` tokens, the last position's logits divided by
the temperature, the ``top_k`` most likely kept, one token drawn (``temperature=0``: the most
likely, greedy). The prompt is encoded and the text decoded with the tokenizer the run's data
was made with (``plait_tokenizer``: bytes, a BPE trained by ``plait prepare``, or the model's
own).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from plait.config import AT_LEAST_0, AT_LEAST_1, range_problems
from plait.export import consolidate


@dataclass
class SampleSettings:
    prompt: str = "\n"
    max_new_tokens: int = 100
    temperature: float = 0.8  # 0: greedy
    top_k: Optional[int] = 200  # None: every token
    seed: int = 1337


RANGES = {"max_new_tokens": AT_LEAST_1, "temperature": AT_LEAST_0, "top_k": AT_LEAST_1}
USAGE = (
    'usage: plait sample <run dir | checkpoint dir> [prompt="..."] [max_new_tokens=N] '
    "[temperature=T] [top_k=K|null] [seed=S]"
)


def parse(args: list[str]) -> tuple[str, SampleSettings]:
    """The checkpoint path and the settings (``key=value``; the prompt is taken verbatim, with
    ``\\n`` and ``\\t`` as a newline and a tab)."""
    types = {f.name: f.type for f in fields(SampleSettings)}
    paths: list[str] = []
    values: dict[str, object] = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or key not in types:
            paths.append(arg)
            continue
        if key == "prompt":
            values[key] = value.replace("\\n", "\n").replace("\\t", "\t")  # as typed in a shell
            continue
        try:
            values[key] = (
                None
                if value in ("null", "None") and key == "top_k"
                else (float(value) if key == "temperature" else int(value))
            )
        except ValueError:
            raise ValueError(f"{key}={value} is not a number: {USAGE}") from None
    if len(paths) != 1:
        raise ValueError(USAGE)
    settings = SampleSettings(**values)  # type: ignore[arg-type]  # each parsed to its type
    problems = range_problems("", settings.__dict__, RANGES)
    if problems:
        raise ValueError("; ".join(problems))
    return paths[0], settings


@torch.no_grad()
def continue_ids(model: torch.nn.Module, ids: list[int], settings: SampleSettings) -> list[int]:
    """``ids`` followed by ``max_new_tokens`` more."""
    x = torch.tensor([ids], dtype=torch.long)
    generator = torch.Generator().manual_seed(settings.seed)
    greedy = settings.temperature == 0
    if hasattr(model, "generate"):  # transformers' GenerationMixin
        torch.manual_seed(settings.seed)
        options: dict[str, object] = {
            "do_sample": not greedy,
            "max_new_tokens": settings.max_new_tokens,
        }
        if not greedy:
            options.update(temperature=settings.temperature, top_k=settings.top_k or 0)
        generate = getattr(model, "generate")
        return generate(x, attention_mask=torch.ones_like(x), **options)[0].tolist()
    context = getattr(model, "block_size", None)
    for _ in range(settings.max_new_tokens):
        logits = model(x if context is None else x[:, -context:])[:, -1, :].float()
        if greedy:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / settings.temperature
            if settings.top_k is not None:
                kth = torch.topk(logits, min(settings.top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        x = torch.cat([x, token], dim=1)
    return x[0].tolist()


def sample(checkpoint_path: str, settings: SampleSettings) -> str:
    found = consolidate(checkpoint_path)
    tokenizer = found.pm.hook.plait_tokenizer(cfg=found.cfg)
    if tokenizer is None:
        raise ValueError(
            f"{checkpoint_path}: data={found.cfg.data.name} does not say which "
            "tokenizer made its tokens, so the prompt cannot be encoded: sample a "
            "run trained on data=stdlib|text|shards"
        )
    model = found.model
    model.load_state_dict(found.state, assign=True)
    model.eval()
    ids = tokenizer.encode(settings.prompt)
    if not ids:
        raise ValueError("prompt= encodes to no tokens: give some text")
    return tokenizer.decode(continue_ids(model, ids, settings))


def cmd_sample(args: list[str]) -> int:
    path, settings = parse(args)
    print(sample(path, settings))
    return 0
