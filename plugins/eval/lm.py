"""plait's model as lm-evaluation-harness sees it: an ``lm_eval.api.model.TemplateLM`` (a
subclass of ``LM``) whose three request types run on a scorer (``scoring.LocalScorer`` in one
process, ``distributed.EngineScorer`` during training).

What the harness does is kept: ``TemplateLM.loglikelihood`` encodes each context/continuation
pair (trailing spaces moved to the continuation, the pair encoded whole and split), the rolling
windows of ``loglikelihood_rolling`` are the harness's ``get_rolling_token_windows``, and
generation options are read by its ``normalize_gen_kwargs`` / ``handle_stop_sequences`` /
``postprocess_generated_text``. What is plait's: requests longer than the window keep their last
``max_length + 1`` tokens (as the harness's Hugging Face backend does), and generation is greedy,
token by token, through the same scorer.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from plait.plugins.eval.scoring import Item, Scores
from plait.types import Tokenizer


class Scorer(Protocol):
    def score(self, items: Sequence[Item]) -> list[Scores]: ...


def end_of_text(tokenizer: Tokenizer) -> int:
    """The tokenizer's end-of-text id; plait's byte tokenizer has none (every id is a byte), so
    a newline stands in (the prefix of an empty context, the end of a generation)."""
    eot = getattr(tokenizer, "eot", None)
    return eot if eot is not None else tokenizer.encode("\n")[-1]


class PlaitLM(TemplateLM):
    def __init__(self, scorer: Scorer, tokenizer: Tokenizer, max_length: int):
        super().__init__()
        self.scorer, self.plait_tokenizer, self.max_length = scorer, tokenizer, max_length

    @property
    def eot_token_id(self) -> int:
        return end_of_text(self.plait_tokenizer)

    @property
    def tokenizer_name(self) -> str:
        return self.plait_tokenizer.name

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        return self.plait_tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.plait_tokenizer.decode(list(tokens))

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        items = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens is longer than "
                    f"the model's window ({self.max_length} tokens)"
                )
            items.append(((context + continuation)[-(self.max_length + 1) :], len(continuation)))
        out = []
        for (logprobs, best), (_, _, continuation) in zip(self.scorer.score(items), requests):
            greedy = bool((best == torch.as_tensor(continuation)).all())
            out.append((float(logprobs.sum()), greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, *window))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[index] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy: each step scores every unfinished context and appends its most likely next
        token, until a stop sequence, the end-of-text token or ``max_gen_toks``."""
        eos = self.tok_decode([self.eot_token_id])
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            options = normalize_gen_kwargs(dict(gen_kwargs), 256)
            if options.get("do_sample") or options.get("temperature", 0) > 0:
                raise ValueError(
                    "plait eval generates greedily: set do_sample: false in the "
                    "task's generation_kwargs"
                )
            until = handle_stop_sequences(options.get("until"), eos=eos)
            budget = options["max_gen_toks"]
            if budget >= self.max_length:
                raise ValueError(
                    f"max_gen_toks={budget} leaves no room for the context in the "
                    f"model's {self.max_length}-token window"
                )
            prompt = self.tok_encode(context)[-(self.max_length - budget) :]
            jobs.append({"prompt": prompt, "until": until, "budget": budget, "new": []})
        active = list(range(len(jobs)))
        while active:
            items = [([*jobs[i]["prompt"], *jobs[i]["new"], 0], 1) for i in active]
            for i, (_, best) in zip(active, self.scorer.score(items)):
                jobs[i]["new"].append(int(best[-1]))
            active = [i for i in active if not self._done(jobs[i])]
        return [
            postprocess_generated_text(self.tok_decode(job["new"]), job["until"], None)
            for job in jobs
        ]

    def _done(self, job: dict) -> bool:
        if len(job["new"]) >= job["budget"] or job["new"][-1] == self.eot_token_id:
            return True
        text = self.tok_decode(job["new"])
        return any(stop and stop in text for stop in job["until"])
