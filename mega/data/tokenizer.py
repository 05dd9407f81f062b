"""Byte-level BPE tokenizer trained on the corpus with HF ``tokenizers``.

Byte-level: any text round-trips exactly (no unknown tokens), and training on the same documents
with the same settings gives the same merges, hence the same ids. ``<|endoftext|>`` (id 0) ends
every document in the token stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mega.data.corpus import DataError

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
MIN_FREQUENCY = 2
MIN_VOCAB_SIZE = 257  # the 256 byte tokens and EOS


def settings(vocab_size: int) -> dict:
    """Everything that decides the trained tokenizer besides the documents (part of the cache key).
    The library version is included because its training algorithm decides the merges."""
    return {"kind": "byte_level_bpe", "vocab_size": vocab_size, "min_frequency": MIN_FREQUENCY,
            "special_tokens": [EOS_TOKEN], "tokenizers": tokenizers.__version__}


def train_tokenizer(documents: Sequence[str], vocab_size: int) -> Tokenizer:
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{MIN_VOCAB_SIZE} (256 bytes + {EOS_TOKEN})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a prepared dataset: ``path`` is its index.json, its directory or the file."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    elif path.name != TOKENIZER_FILE:
        path = path.parent / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{path}: no tokenizer file; run prepare_dataset first")
    return Tokenizer.from_file(str(path))


def eos_id(tokenizer: Tokenizer) -> int:
    return tokenizer.token_to_id(EOS_TOKEN)
