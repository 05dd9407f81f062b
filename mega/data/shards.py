"""Token shards: writing a split's token stream as it fills, and reading shards back.

A split's stream (its documents in corpus order, each followed by the end-of-document token) is cut
into shards of exactly ``shard_tokens`` tokens (the last one shorter), each written in one or both
formats:

    train-00000.arrow         Arrow IPC file, one record batch, column ``tokens``
    train-00000.bin/.idx      megatron-core IndexedDataset (written by its IndexedDatasetBuilder;
                              one sequence per document piece in the shard)

Every file is written under a temporary name and renamed into place, so a shard with its final
name is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa

from mega.data.corpus import DataError

FORMATS = ("arrow", "megatron")
INDEX_FILE = "index.json"
# Part of the cache key: bump it whenever the same inputs would give different files (shard
# layout, split rule, tokenizer recipe), so old caches are not mistaken for new ones.
FORMAT_VERSION = 2


class SplitWriter:
    """Appends documents of one split and writes a shard each time ``shard_tokens`` are pending.

    The pending tail (fewer than ``shard_tokens`` tokens) and the document boundaries in it are its
    whole state: ``state()``/``restore`` let a killed preparation go on where it was.
    """

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: type, formats: tuple[str, ...]):
        self.out_dir, self.split, self.shard_tokens, self.dtype, self.formats = (
            out_dir,
            split,
            shard_tokens,
            dtype,
            formats,
        )
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.ends: list[int] = []  # document ends inside the pending tokens (offsets)
        self.num_tokens = 0  # tokens in finished shards
        self.num_documents = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray, ends_document: bool = True) -> int:
        """Append a document's tokens (or a piece of one); returns how many shards it finished."""
        if len(tokens):
            self.pending.append(tokens)
            self.pending_tokens += len(tokens)
        if ends_document:
            self.ends.append(self.pending_tokens)
            self.num_documents += 1
        written = 0
        while self.pending_tokens >= self.shard_tokens:
            self._flush(self.shard_tokens)
            written += 1
        return written

    def close(self) -> list[dict]:
        if self.pending_tokens:
            self._flush(self.pending_tokens)
        return self.shards

    def tail(self) -> tuple[np.ndarray, np.ndarray]:
        """The pending tokens and the document ends in them."""
        tokens = np.concatenate(self.pending) if self.pending else np.empty(0, self.dtype)
        self.pending = [tokens] if len(tokens) else []
        return tokens, np.asarray(self.ends, dtype=np.int64)

    def restore(self, shards: list[dict], num_documents: int, tokens: np.ndarray, ends: np.ndarray) -> None:
        self.shards = list(shards)
        self.num_tokens = sum(s["num_tokens"] for s in shards)
        self.num_documents = num_documents
        self.pending = [tokens.astype(self.dtype)] if len(tokens) else []
        self.pending_tokens = len(tokens)
        self.ends = [int(e) for e in ends]

    def _flush(self, count: int) -> None:
        tokens = self.pending[0] if len(self.pending) == 1 else np.concatenate(self.pending)
        self.pending = [tokens[count:]] if len(tokens) > count else []  # a view: no copy
        self.pending_tokens = len(tokens) - count
        shard, cuts = tokens[:count], [e for e in self.ends if 0 < e < count]
        self.ends = [e - count for e in self.ends if e > count]
        stem = f"{self.split}-{len(self.shards):05d}"
        entry = {"split": self.split, "num_tokens": count}
        if "arrow" in self.formats:
            entry.update(path=f"{stem}.arrow", sha256=write_arrow(self.out_dir / f"{stem}.arrow", shard))
        if "megatron" in self.formats:
            # one sequence (= one megatron document) per document piece in this shard
            lengths = np.diff([0, *cuts, count]).tolist()
            entry["megatron"] = write_megatron(self.out_dir, stem, shard, lengths)
            entry.setdefault("path", f"{stem}.bin")
        self.shards.append(entry)
        self.num_tokens += count


def _publish(tmp: Path, final: Path) -> str:
    with open(tmp, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    os.replace(tmp, final)
    return digest


def write_arrow(path: Path, tokens: np.ndarray) -> str:
    batch = pa.record_batch([pa.array(tokens)], names=["tokens"])
    tmp = path.with_name(f".{path.name}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return _publish(tmp, path)


def import_megatron_datasets():
    """megatron-core's indexed_dataset module. Importing megatron.core takes seconds (torch and
    more): ``preload_megatron`` starts it in the background while the workers tokenize."""
    with _import_lock, warnings.catch_warnings():  # it warns about GPU libraries files do not need
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def preload_megatron() -> None:
    threading.Thread(target=import_megatron_datasets, name="import-megatron", daemon=True).start()


_import_lock = threading.Lock()


def write_megatron(out_dir: Path, stem: str, tokens: np.ndarray, lengths: list[int]) -> dict:
    """``<stem>.bin/.idx`` through megatron-core's own IndexedDatasetBuilder."""
    IndexedDatasetBuilder = import_megatron_datasets().IndexedDatasetBuilder

    tmp_bin, tmp_idx = out_dir / f".{stem}.bin.tmp", out_dir / f".{stem}.idx.tmp"
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=tokens.dtype.type)
    offset = 0
    for length in lengths:
        builder.add_document(tokens[offset : offset + length], [length])
        offset += length
    builder.finalize(str(tmp_idx))
    return {
        "prefix": stem,
        "bin_sha256": _publish(tmp_bin, out_dir / f"{stem}.bin"),
        "idx_sha256": _publish(tmp_idx, out_dir / f"{stem}.idx"),
    }


def read_shard(path: Path, dtype: str | None = None) -> np.ndarray:
    """A shard's tokens as a read-only numpy view of the memory-mapped file (no copy): an Arrow
    IPC file, or a megatron ``.bin`` (flat tokens of ``dtype``)."""
    try:
        if path.suffix == ".bin":
            return np.memmap(path, dtype=np.dtype(dtype or "uint16"), mode="r")
        batch = pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0)
        return batch.column("tokens").to_numpy(zero_copy_only=True)
    except (pa.ArrowException, OSError, KeyError, ValueError) as err:
        raise DataError(
            f"{path}: not a readable token shard ({err}); delete its directory and run prepare_dataset again"
        ) from None


def read_index(index_path: str | Path) -> dict:
    path = Path(index_path)
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a readable dataset index ({err}); run prepare_dataset") from None
    if index.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: dataset format version {index.get('version')}, this mega reads "
            f"{FORMAT_VERSION}; run prepare_dataset again"
        )
    return index


def write_json(path: Path, obj: dict) -> None:
    """Write a small JSON file atomically (temporary name, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
