"""megatron-core ``IndexedDataset`` prefixes (``<prefix>.bin`` + ``<prefix>.idx``) as a source.

Megatron users bring their preprocessed data unchanged: ``data.source=/path/to/my-corpus_text_document``
(the prefix, or either file). Nothing is copied: the index.json written here points at the
``.bin`` and says which token range is train and which is val. The split is by document, like
Megatron's own ``--split``: the last ``data.val_fraction`` of the documents are val.
The ``.idx`` is read with megatron-core's own ``IndexedDataset``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from mega.config import DataConfig
from mega.data.corpus import DataError
from mega.data.shards import FORMAT_VERSION, INDEX_FILE, import_megatron_datasets, write_json


def megatron_prefix(source: str) -> Path | None:
    """The prefix ``source`` names (``prefix``, ``prefix.bin`` or ``prefix.idx``), or None."""
    if source.startswith("s3://"):
        return None
    path = Path(source).expanduser()
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if prefix.with_name(prefix.name + ".idx").is_file() or path.suffix in (".bin", ".idx"):
        return prefix.resolve()
    return None


def is_megatron_prefix(source: str) -> bool:
    return megatron_prefix(source) is not None


def prepare_megatron_source(
    data: DataConfig, source: str, cache_dir: Path, tokenizer_file: str | None
) -> Path:
    prefix = megatron_prefix(source)
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    for path in (bin_path, idx_path):
        if not path.is_file():
            raise DataError(f"data.source {source!r}: megatron prefix {prefix} has no {path.name}")
    stat = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in (bin_path, idx_path)}
    tokenizer_sha = hashlib.sha256(Path(tokenizer_file).read_bytes()).hexdigest() if tokenizer_file else None
    key = hashlib.sha256(
        json.dumps(
            {
                "version": FORMAT_VERSION,
                "megatron": str(prefix),
                "files": stat,
                "val_fraction": data.val_fraction,
                "tokenizer": tokenizer_sha,
                "eos_token": data.eos_token,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    final = cache_dir / key[:16]
    if (final / INDEX_FILE).is_file():
        return final / INDEX_FILE

    dtype, starts, doc_index = _sequences(prefix, bin_path, idx_path)
    num_docs = len(doc_index) - 1
    if num_docs < 1 or starts[-1] == 0:
        raise DataError(f"{prefix}: no documents")
    val_docs = 0
    if data.val_fraction > 0 and num_docs >= 2:
        val_docs = min(max(1, round(num_docs * data.val_fraction)), num_docs - 1)
    split_token = int(starts[doc_index[num_docs - val_docs]])
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    vocab_size, eos = _vocabulary(tokens, tokenizer_file, data.eos_token)
    shards = _shards(bin_path, split_token, int(starts[-1]), val_docs > 0)
    index = {
        "version": FORMAT_VERSION,
        "kind": "megatron",
        "key": key,
        "content_hash": None,
        "vocab_size": vocab_size,
        "requested_vocab_size": None,
        "eos_id": eos,
        "tokenizer": str(Path(tokenizer_file).resolve()) if tokenizer_file else None,
        "dtype": dtype.name,
        "shards": shards,
        "num_tokens": {"train": split_token, "val": int(starts[-1]) - split_token},
        "num_documents": {"train": num_docs - val_docs, "val": val_docs},
        "settings": {"val_fraction": data.val_fraction},
        "source": {"source": str(prefix)},
    }
    final.mkdir(parents=True, exist_ok=True)
    write_json(final / INDEX_FILE, index)
    return final / INDEX_FILE


def _sequences(prefix: Path, bin_path: Path, idx_path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, token offset of each sequence and of the end, document indices) of a megatron
    IndexedDataset whose .bin holds the .idx's sequences back to back, in order."""
    IndexedDataset = import_megatron_datasets().IndexedDataset

    try:
        dataset = IndexedDataset(str(prefix), mmap=True)
    except (AssertionError, OSError, ValueError) as err:
        raise DataError(f"{idx_path}: not a readable megatron IndexedDataset ({err})") from None
    dtype = np.dtype(dataset.index.dtype)
    lengths = dataset.sequence_lengths.astype(np.int64)
    pointers = dataset.index.sequence_pointers.astype(np.int64)
    doc_index = dataset.document_indices.astype(np.int64)
    # token offset of each sequence; the .bin must hold the sequences back to back, in order
    starts = np.concatenate([[0], np.cumsum(lengths)])
    if (
        not np.array_equal(pointers, starts[:-1] * dtype.itemsize)
        or starts[-1] * dtype.itemsize != bin_path.stat().st_size
    ):
        raise DataError(
            f"{prefix}: the .bin does not hold the .idx's sequences back to back "
            "(rewrite it with IndexedDatasetBuilder)"
        )
    return dtype, starts, doc_index


def _shards(bin_path: Path, split_token: int, total: int, with_val: bool) -> list[dict]:
    """The train shard (tokens before ``split_token``) and the val shard (the rest): ranges of the
    megatron .bin itself, which stays where it is."""
    shards = [
        {
            "split": "train",
            "path": str(bin_path),
            "external": True,
            "token_range": [0, split_token],
            "num_tokens": split_token,
            "bytes": bin_path.stat().st_size,
        }
    ]
    if with_val:
        shards.append(
            {
                "split": "val",
                "path": str(bin_path),
                "external": True,
                "token_range": [split_token, total],
                "num_tokens": total - split_token,
                "bytes": bin_path.stat().st_size,
            }
        )
    return shards


def _vocabulary(tokens: np.ndarray, tokenizer_file: str | None, eos_token: str) -> tuple[int, int | None]:
    """(vocab size, EOS id): the tokenizer's when given, else the largest id in the data + 1."""
    if tokenizer_file:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        return tokenizer.get_vocab_size(), tokenizer.token_to_id(eos_token)
    largest = 0
    for lo in range(0, len(tokens), 1 << 26):  # bounded memory: 64M tokens at a time
        largest = max(largest, int(tokens[lo : lo + (1 << 26)].max()))
    return largest + 1, None
