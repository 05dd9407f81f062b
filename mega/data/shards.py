"""The token cache: ``prepare_dataset`` turns a corpus into Arrow shards plus an index.json.

Layout of ``<cache_dir>/<content_hash[:16]>/``::

    index.json        {version, content_hash, vocab_size, eos_id, tokenizer, shards, num_tokens, ...}
    tokenizer.json    the byte-level BPE the ids come from
    train-00000.arrow Arrow IPC files, one record batch, column ``tokens`` (uint16, or uint32 for
    val-00000.arrow   vocabularies over 65536 ids): documents each followed by <|endoftext|>

The directory is built under a temporary name and renamed into place, so a directory with the
final name is always complete; its name is the content hash, so the same inputs hit the cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from mega.config import DataConfig
from mega.data import tokenizer as bpe
from mega.data.corpus import DataError, load_documents, publish_dir

# Part of the content hash: bump it whenever the same inputs would give different files (shard
# layout, split rule, tokenizer recipe), so old caches are not mistaken for new ones.
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
SPLITS = ("train", "val")
ENCODE_BATCH_CHARS = 1 << 20  # text per encode_batch call: enough documents to keep every core busy


def prepare_dataset(data: DataConfig, vocab_size: int, progress: bool = True) -> Path:
    """Read the corpus, train the tokenizer, tokenize, write shards; return the index.json path.
    A second call with the same documents and settings only reads and hashes the corpus."""
    if data.tokenizer != "bpe":
        raise DataError(f"data.tokenizer {data.tokenizer!r}: the only tokenizer is 'bpe'")
    if data.shard_tokens < 1 or not 0 <= data.val_fraction < 1:
        raise DataError(f"data.shard_tokens={data.shard_tokens} must be >= 1 and "
                        f"data.val_fraction={data.val_fraction} in [0, 1)")
    cache_dir = Path(data.cache_dir).expanduser().resolve()
    documents = load_documents(data.source, data.text_field, cache_dir, progress)
    doc_digests = [hashlib.sha256(doc.encode("utf-8")).digest() for doc in documents]
    settings = {"version": FORMAT_VERSION, "tokenizer": bpe.settings(vocab_size),
                "val_fraction": data.val_fraction, "shard_tokens": data.shard_tokens}
    digest = content_hash(doc_digests, settings)
    final = cache_dir / digest[:16]
    if (final / INDEX_FILE).is_file():
        return final / INDEX_FILE
    if final.exists():  # a finished cache always has its index; this one was tampered with
        shutil.rmtree(final)

    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".tmp-{digest[:16]}-") as tmp:
        out_dir = Path(tmp) / "dataset"
        out_dir.mkdir()
        splits = split_documents(doc_digests, [len(doc) for doc in documents], data.val_fraction)
        index = _build(out_dir, documents, splits, vocab_size, data.shard_tokens, progress)
        index.update(content_hash=digest, settings=settings)
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))
        publish_dir(out_dir, final)
    return final / INDEX_FILE


def content_hash(doc_digests: Sequence[bytes], settings: dict) -> str:
    """sha256 over the settings (format version, tokenizer, split, shard size) and every
    document's bytes, in order."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for doc_digest in doc_digests:
        h.update(doc_digest)
    return h.hexdigest()


def split_documents(doc_digests: Sequence[bytes], doc_sizes: Sequence[int],
                    val_fraction: float) -> list[str]:
    """Assign each document to "train" or "val". Val takes documents in the order of their content
    digests (stable, independent of file order) until it holds val_fraction of the text: at least
    one document when val_fraction > 0, never all of them."""
    n = len(doc_digests)
    splits = ["train"] * n
    if val_fraction <= 0 or n < 2:
        return splits
    target, val_size = val_fraction * sum(doc_sizes), 0
    for i in sorted(range(n), key=lambda i: (doc_digests[i], i))[: n - 1]:
        splits[i] = "val"
        val_size += doc_sizes[i]
        if val_size >= target:
            break
    return splits


def _build(out_dir: Path, documents: list[str], splits: list[str], vocab_size: int,
           shard_tokens: int, progress: bool) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task("training tokenizer", total=None)
        train_docs = [doc for doc, split in zip(documents, splits) if split == "train"]
        tokenizer = bpe.train_tokenizer(train_docs, vocab_size)
        tokenizer.save(str(out_dir / bpe.TOKENIZER_FILE))
        bar.update(task, description="tokenizing documents", total=len(documents), completed=0)

        eos = bpe.eos_id(tokenizer)
        dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.uint32
        writers = {split: ShardWriter(out_dir, split, shard_tokens, dtype) for split in SPLITS}
        for start, batch in _batches(documents):
            for i, encoding in enumerate(tokenizer.encode_batch(batch), start):
                writers[splits[i]].add(encoding.ids, eos)
            bar.advance(task, len(batch))
        shards = [entry for split in SPLITS for entry in writers[split].close()]

    return {
        "version": FORMAT_VERSION,
        "vocab_size": tokenizer.get_vocab_size(),
        "requested_vocab_size": vocab_size,
        "eos_id": eos,
        "tokenizer": bpe.TOKENIZER_FILE,
        "dtype": np.dtype(dtype).name,
        "shards": shards,
        "num_tokens": {split: writers[split].num_tokens for split in SPLITS},
        "num_documents": {split: splits.count(split) for split in SPLITS},
    }


def _batches(documents: list[str]) -> Iterator[tuple[int, list[str]]]:
    start, size = 0, 0
    for i, doc in enumerate(documents):
        size += len(doc)
        if size >= ENCODE_BATCH_CHARS or i == len(documents) - 1:
            yield start, documents[start:i + 1]
            start, size = i + 1, 0


class ShardWriter:
    """Appends token ids of one split and cuts them into shards of exactly ``shard_tokens``
    (the last one shorter)."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: type):
        self.out_dir, self.split, self.shard_tokens, self.dtype = out_dir, split, shard_tokens, dtype
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.num_tokens = 0
        self.shards: list[dict] = []

    def add(self, ids: list[int], eos: int) -> None:
        tokens = np.empty(len(ids) + 1, dtype=self.dtype)
        tokens[:-1] = ids
        tokens[-1] = eos
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        while self.pending_tokens >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> list[dict]:
        if self.pending_tokens:
            self._flush(self.pending_tokens)
        return self.shards

    def _flush(self, count: int) -> None:
        tokens = self.pending[0] if len(self.pending) == 1 else np.concatenate(self.pending)
        self.pending = [tokens[count:]]  # a view: cutting a long document into shards copies nothing
        self.pending_tokens = len(tokens) - count
        name = f"{self.split}-{len(self.shards):05d}.arrow"
        self.shards.append(write_shard(self.out_dir / name, tokens[:count]) | {"split": self.split})
        self.num_tokens += count


def write_shard(path: Path, tokens: np.ndarray) -> dict:
    batch = pa.record_batch([pa.array(tokens)], names=["tokens"])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    with open(path, "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    return {"path": path.name, "num_tokens": len(tokens), "sha256": sha256}


def read_shard(path: Path) -> np.ndarray:
    """The shard's tokens as a read-only numpy view of the memory-mapped file (no copy)."""
    try:
        batch = pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0)
        return batch.column("tokens").to_numpy(zero_copy_only=True)
    except (pa.ArrowException, OSError, KeyError) as err:
        raise DataError(f"{path}: not a readable token shard ({err}); delete its directory and "
                        "run prepare_dataset again") from None


def read_index(index_path: str | Path) -> dict:
    path = Path(index_path)
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a readable dataset index ({err}); run prepare_dataset") from None
    if index.get("version") != FORMAT_VERSION:
        raise DataError(f"{path}: dataset format version {index.get('version')}, this mega reads "
                        f"{FORMAT_VERSION}; run prepare_dataset again")
    return index
