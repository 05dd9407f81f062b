"""The tokenizer workers of the preparation: a work unit of raw input in, token ids out.

Runs in processes of its own (``spawn``), so it imports only what encoding needs (no torch).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import sys
from dataclasses import dataclass

import numpy as np

from mega.data.corpus import Unit, unit_documents


@dataclass
class Encoded:
    """A unit's documents: their tokens back to back (each whole document followed by EOS), how
    many tokens each has, its sha256 (None for a piece of a text document read in several units)
    and whether it ends its document."""

    tokens: np.ndarray
    lengths: list[int]
    digests: list[bytes | None]
    ends: list[bool]
    chars: int


_state: dict = {}


def die_with_parent(parent: int) -> None:
    """Exit when the process that started this one dies, even by SIGKILL (Linux prctl): a killed
    preparation or training rank leaves no orphans behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the prctl took effect
        sys.exit(1)


def init_worker(parent: int, tokenizer_path: str, text_field: str, eos: int, dtype: str) -> None:
    die_with_parent(parent)
    # One process per core: the tokenizer's own thread pool would only oversubscribe them.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    from mega.data.tokenizer import Encoder

    _state.update(encoder=Encoder(Tokenizer.from_file(tokenizer_path)), text_field=text_field, eos=eos,
                  dtype=np.dtype(dtype))


def encode_unit(unit: Unit) -> Encoded:
    return encode_documents(unit, _state["encoder"], _state["text_field"], _state["eos"], _state["dtype"])


def encode_documents(unit: Unit, encoder, text_field: str, eos: int, dtype: np.dtype) -> Encoded:
    documents = unit_documents(unit, text_field)
    piece = unit.kind == "txt" and not (unit.doc_start and unit.doc_end)
    tokens, lengths = encoder.encode_flat(documents, eos if not piece or unit.doc_end else None)
    if piece:
        digests, ends = [None] * len(documents), [unit.doc_end] * len(documents)
    else:
        digests = [hashlib.sha256(doc.encode("utf-8")).digest() for doc in documents]
        ends = [True] * len(documents)
    return Encoded(tokens.astype(dtype), lengths, digests, ends, sum(map(len, documents)))
