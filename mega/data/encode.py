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


# glibc serves a request above M_MMAP_THRESHOLD with its own mmap, returned to the system when
# freed; below it, from the heap. By default the threshold rises to the largest block freed (up to
# 32 MB), so after the first 4 MB unit is freed every unit, token array and shard buffer comes from
# the heap, whose free holes fragment: the preparation's peak memory then grows with the corpus
# (+50 MB in the main process from 25 to 300 MB here) although what it holds is bounded. A fixed
# threshold keeps big buffers on mmap (flat peak; measured in docs/data.md).
MMAP_THRESHOLD = 256 << 10
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>


def fixed_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold (and trim threshold) for this process; False where there is no
    glibc ``mallopt`` (musl, macOS): nothing changes there."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, MMAP_THRESHOLD)
        )
    except (OSError, AttributeError):
        return False


def init_worker(parent: int, tokenizer_path: str, text_field: str, eos: int, dtype: str) -> None:
    die_with_parent(parent)
    fixed_mmap_threshold()
    # One process per core: the tokenizer's own thread pool would only oversubscribe them.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    from mega.data.tokenizer import Encoder

    _state.update(
        encoder=Encoder(Tokenizer.from_file(tokenizer_path)),
        text_field=text_field,
        eos=eos,
        dtype=np.dtype(dtype),
    )


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
