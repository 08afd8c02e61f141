"""Tokenizers for ``plait prepare``: bytes (no setup), byte-level BPE trained here with HF
``tokenizers``, a ``tokenizer.json`` the user gives, or a model directory's own (``data.
tokenizer=<model dir>``: its ``tokenizer.json``, each document ended by the model's end-of-text
token from its ``tokenizer_config.json`` / ``config.json``). Nothing is downloaded.

A tokenizer's *identity* is ``bytes-v1`` or the SHA-256 of its JSON serialisation; two shard
directories can be blended only when their identities match, and a prepare resumes only with the
tokenizer it started with.

``encode_documents`` takes documents and pieces of documents (``(text, first, last)``: a large
plain file is cut into pieces, see :mod:`plait.plugins.data.cutting`): a HF tokenizer's special
tokens (its post-processor's BOS / EOS) go around each whole document, and ``eot`` after it, so
the pieces of a document give exactly the ids of the document encoded whole. Truncation and
padding saved in a ``tokenizer.json`` are switched off: a prepare keeps every token.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np

Document = tuple[Union[str, bytes], bool, bool]  # text, holds its start, holds its end
CUT_PROBE = (b"A line of text.\n", b"The next line.\n")  # a cut every splitting tokenizer makes

BYTES = "bytes"
BPE = "bpe"
EOT = "<|endoftext|>"  # GPT-2's document separator, added to every BPE plait trains


class ByteTokenizer:
    """Token id = byte value (vocab 256), exactly what ``data=stdlib|text`` train on."""

    name = BYTES
    identity = "bytes-v1"
    vocab_size = 256
    eot: Optional[int] = None  # all 256 ids are bytes; documents are separated by the index
    json: Optional[str] = None

    can_cut = True

    def encode_batch(self, docs: list[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(doc, dtype=np.uint8) for doc in docs]

    def encode_documents(self, docs: list[Document]) -> list[np.ndarray]:
        return [
            np.frombuffer(text.encode() if isinstance(text, str) else text, dtype=np.uint8)
            for text, _, _ in docs
        ]

    def cut_is_exact(self, left: bytes, right: bytes) -> bool:
        return True

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HF ``tokenizers`` tokenizer; documents are UTF-8 text (invalid bytes become U+FFFD)."""

    def __init__(self, tokenizer, name: str, eot: Optional[int] = None):
        self.tokenizer = tokenizer
        self.name = name
        self.json = tokenizer.to_str()
        self.identity = "sha256:" + hashlib.sha256(self.json.encode()).hexdigest()
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot = tokenizer.token_to_id(EOT) if eot is None else eot
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.affixes = special_affixes(tokenizer)
        self.can_cut = self.affixes is not None and self.cut_is_exact(*CUT_PROBE)

    @classmethod
    def from_json(cls, json: str, name: str, eot: Optional[int] = None) -> HFTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(json), name, eot)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def encode_batch(self, docs: list[bytes]) -> list[np.ndarray]:
        texts = [doc.decode("utf-8", errors="replace") for doc in docs]
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(texts)]

    def encode_documents(self, docs: list[Document]) -> list[np.ndarray]:
        """Ids of each document or piece, in batch (``encode_batch_fast``: no offsets)."""
        texts = [
            t if isinstance(t, str) else t.decode("utf-8", errors="replace") for t, _, _ in docs
        ]
        if self.affixes is None:  # the library adds special tokens; documents come whole
            assert all(first and last for _, first, last in docs), "a piece of a document"
            encoded = self.tokenizer.encode_batch_fast(texts)
            prefix, suffix = [], []
        else:
            encoded = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            prefix, suffix = self.affixes
        tail = [] if self.eot is None else [self.eot]
        return [
            np.array(
                (prefix if first else []) + e.ids + (suffix + tail if last else []), dtype=np.int64
            )
            for e, (_, first, last) in zip(encoded, docs)
        ]

    def cut_is_exact(self, left: bytes, right: bytes) -> bool:
        """Whether the text ``left + right`` encodes as ``left`` and ``right`` apart."""
        texts = [t.decode("utf-8", errors="replace") for t in (left + right, left, right)]
        whole, a, b = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return whole.ids == a.ids + b.ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def special_affixes(tokenizer) -> Optional[tuple[list[int], list[int]]]:
    """The ids the post-processor puts before and after a single sequence (a template's BOS /
    EOS), when it does only that (checked on two probes); None otherwise."""
    found = None
    for probe in ("plait", "a b\nc"):
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe).ids
        at = next(
            (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain),
            None,
        )
        if at is None or found not in (None, (full[:at], full[at + len(plain) :])):
            return None
        found = (full[:at], full[at + len(plain) :])
    return found


def train_bpe(docs: Iterable[Union[str, bytes]], vocab_size: int) -> HFTokenizer:
    """Byte-level BPE (GPT-2's scheme) trained on ``docs``: every byte is in the initial
    alphabet, so any text round-trips exactly; ``<|endoftext|>`` is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (doc if isinstance(doc, str) else doc.decode("utf-8", errors="replace") for doc in docs)
    tokenizer.train_from_iterator(texts, trainer)
    return HFTokenizer(tokenizer, BPE)


def load_tokenizer_file(
    path: str | Path, name: str = "file", eot: Optional[int] = None
) -> HFTokenizer:
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_file(str(path)), name, eot)


MODEL = "model"
TOKENIZER_JSON = "tokenizer.json"


def model_eot(directory: Path, tokenizer) -> Optional[int]:
    """A model directory's end-of-text id: ``tokenizer_config.json``'s ``eos_token``, else
    ``config.json``'s ``eos_token_id`` (the first of a list), else ``<|endoftext|>``."""
    import json

    config = directory / "tokenizer_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return tokenizer.token_to_id(eos)
    model_config = directory / "config.json"
    if model_config.exists():
        eos = json.loads(model_config.read_text()).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int):
            return eos
    return tokenizer.token_to_id(EOT)


def load_model_tokenizer(directory: str | Path) -> HFTokenizer:
    """The tokenizer of a model directory (``tokenizer.json``), ending documents with its
    end-of-text token."""
    from tokenizers import Tokenizer

    directory = Path(directory).expanduser()
    tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_JSON))
    return HFTokenizer(tokenizer, MODEL, model_eot(directory, tokenizer))


def from_spec(name: str, json: Optional[str], eot: Optional[int] = None):
    """Rebuild a tokenizer in a worker process from its name, JSON and end-of-text id."""
    return ByteTokenizer() if name == BYTES else HFTokenizer.from_json(json, name, eot)
