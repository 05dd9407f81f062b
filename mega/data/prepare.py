"""``prepare_dataset``: corpus -> tokenizer -> token shards + index.json, streaming and resumable.

    <cache_dir>/<key[:16]>/index.json     the dataset (key: settings + the source's file listing)
    <cache_dir>/.tmp-<key[:16]>/          a preparation in progress: tokenizer, finished shards,
                                          journal.json (where to go on) and the pending tails
    <cache_dir>/blend-<hash[:16]>.json    data.blend: the sources' indexes and weights

The corpus is read once, in bounded work units, by this process; ``data.workers`` processes
tokenize them; shards are written as they fill. After a shard is finished the journal records the
read position, the writers' pending tails and the running content hash, so a killed preparation
goes on from there. The dataset directory is renamed into place only when its index.json is
written: a directory with the final name is always complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from mega import faults
from mega.config import DataConfig
from mega.data import tokenizer as bpe
from mega.data.corpus import DataError, open_corpus, read_units, unit_documents
from mega.data.progress import Progress, say, tokenizing
from mega.data.shards import FORMAT_VERSION, INDEX_FILE, SplitWriter, preload_megatron, write_json

SPLITS = ("train", "val")
JOURNAL = "journal.json"
COMMIT_EVERY_S = 5.0  # journal commits at most this often (and only after a shard is finished)
LOCK_STALL_S = 600.0  # a preparation holding the lock whose files do not change for this long is stuck
RESULT_TIMEOUT_S = 900.0  # one unit (a few MB) taking longer than this means a stuck worker


# Set while the tokenizer workers run ("PID:PATH"): the file a worker of process PID writes if it
# finds itself calling prepare_dataset (see _stop_if_script_rerun).
RERUN_MARK_ENV = "MEGA_DATA_WORKER_RERUN_MARK"


def prepare_dataset(data: DataConfig, vocab_size: int, progress: Progress = True) -> Path:
    """Prepare ``data.source`` (or every source of ``data.blend``); return the index path. A second
    call with the same files and settings returns at once. From a script, call it under
    ``if __name__ == "__main__":`` (the tokenizer workers are spawned processes, which run the
    script's top level again)."""
    _stop_if_script_rerun()
    if data.tokenizer != "bpe":
        raise DataError(f"data.tokenizer {data.tokenizer!r}: the only tokenizer is 'bpe'")
    if data.shard_tokens < 1 or not 0 <= data.val_fraction < 1:
        raise DataError(
            f"data.shard_tokens={data.shard_tokens} must be >= 1 and "
            f"data.val_fraction={data.val_fraction} in [0, 1)"
        )
    cache_dir = Path(data.cache_dir).expanduser().resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    if data.blend:
        return prepare_blend(data, vocab_size, cache_dir, progress)
    return prepare_source(data, data.source, data.text_field, vocab_size, cache_dir, progress)


def _stop_if_script_rerun() -> None:
    """A tokenizer worker calling prepare_dataset is running the caller's script again as it starts
    (multiprocessing's spawn imports the parent's ``__main__``): the call is at the script's top
    level. Say so to the parent (the mark file) and exit before doing any work twice."""
    parent, _, mark = os.environ.get(RERUN_MARK_ENV, "").partition(":")
    if mark and int(parent) != os.getpid():  # a process the preparing one started
        Path(mark).touch()
        raise SystemExit(3)


def _script_rerun_error() -> DataError:
    script = getattr(sys.modules["__main__"], "__file__", None) or "the caller's __main__"
    return DataError(
        f"prepare_dataset was called again by its own tokenizer workers: they are spawned "
        f"processes, which run {script} again as they start, and its call to prepare_dataset "
        f'is at the top level. Put that call under `if __name__ == "__main__":`.'
    )


def formats_of(data: DataConfig) -> tuple[str, ...]:
    return ("arrow", "megatron") if data.format == "both" else (data.format,)


def prepare_source(
    data: DataConfig,
    source: str,
    text_field: str,
    vocab_size: int,
    cache_dir: Path,
    progress: Progress,
    tokenizer_file: str | None = None,
) -> Path:
    from mega.data.indexed import is_megatron_prefix, prepare_megatron_source

    tokenizer_file = tokenizer_file or data.tokenizer_file
    if is_megatron_prefix(source):
        return prepare_megatron_source(data, source, cache_dir, tokenizer_file)
    corpus = open_corpus(source, text_field, cache_dir, data.s3_endpoint_url, progress)
    pretrained = (
        bpe.load_pretrained(tokenizer_file, data.max_run_chars, data.eos_token) if tokenizer_file else None
    )
    tokenizer_settings = (
        {
            "kind": "pretrained",
            "sha256": hashlib.sha256(pretrained.to_str().encode()).hexdigest(),
            "eos_token": data.eos_token,
        }
        if pretrained
        else bpe.settings(vocab_size, data.max_run_chars, data.tokenizer_sample_mb)
    )
    settings = {
        "version": FORMAT_VERSION,
        "tokenizer": tokenizer_settings,
        "val_fraction": data.val_fraction,
        "shard_tokens": data.shard_tokens,
        "formats": list(formats_of(data)),
    }
    key = _digest(
        {"settings": settings, "source": source, "text_field": text_field, "files": corpus.listing()}
    )
    final = cache_dir / key[:16]
    if (final / INDEX_FILE).is_file():
        return final / INDEX_FILE
    with _locked(cache_dir, key[:16], progress):
        if (final / INDEX_FILE).is_file():  # prepared by whoever held the lock before us
            return final / INDEX_FILE
        if final.exists():  # a finished dataset always has its index; this one was tampered with
            shutil.rmtree(final)
        work = cache_dir / f".tmp-{key[:16]}"
        work.mkdir(exist_ok=True)
        tokenizer = _tokenizer(work, corpus, pretrained, data, vocab_size, progress)
        index = _stream(work, corpus, tokenizer, data, settings, key, vocab_size, progress)
        write_json(work / INDEX_FILE, index)  # the commit record: written last
        for stale in work.glob("pending-*"):
            stale.unlink()
        (work / JOURNAL).unlink(missing_ok=True)
        os.rename(work, final)
    return final / INDEX_FILE


def prepare_blend(data: DataConfig, vocab_size: int, cache_dir: Path, progress: Progress) -> Path:
    """Prepare every source of ``data.blend`` with one tokenizer (``data.tokenizer_file``, or a BPE
    trained on a sample drawn from the text sources in proportion to their weights), each as on its
    own; return ``<cache_dir>/blend-<hash16>.json``, which names their indexes and weights."""
    from mega.data.indexed import is_megatron_prefix

    sources = list(data.blend)
    tokenizer_file = data.tokenizer_file
    text = [s for s in sources if not is_megatron_prefix(s.source)]
    if text and not tokenizer_file:
        corpora = [
            open_corpus(s.source, s.text_field, cache_dir, data.s3_endpoint_url, progress) for s in text
        ]
        key = _digest(
            {
                "tokenizer": bpe.settings(vocab_size, data.max_run_chars, data.tokenizer_sample_mb),
                "val_fraction": data.val_fraction,
                "sources": [[s.source, s.weight, s.text_field, c.listing()] for s, c in zip(text, corpora)],
            }
        )
        path = cache_dir / f"tokenizer-{key[:16]}.json"
        if not path.is_file():
            docs = sample_documents(
                corpora, [s.weight for s in text], data.tokenizer_sample_mb << 20, data.val_fraction
            )
            tokenizer = bpe.train_tokenizer(docs, vocab_size, data.max_run_chars)
            tmp = path.with_name(f".{path.name}.tmp")
            tokenizer.save(str(tmp))
            tmp.replace(path)
        tokenizer_file = str(path)
    indexes = [
        prepare_source(data, s.source, s.text_field, vocab_size, cache_dir, progress, tokenizer_file)
        for s in sources
    ]
    entries = [
        {"source": s.source, "weight": s.weight, "index": str(p.relative_to(cache_dir))}
        for s, p in zip(sources, indexes)
    ]
    metas = [json.loads(p.read_text()) for p in indexes]
    blend = {
        "version": FORMAT_VERSION,
        "kind": "blend",
        "sources": entries,
        "vocab_size": max(m["vocab_size"] for m in metas),
        "eos_id": next((m["eos_id"] for m in metas if m.get("eos_id") is not None), None),
        "tokenizer": str(Path(tokenizer_file).resolve()) if tokenizer_file else None,
    }
    name = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / f"blend-{name}.json"
    write_json(path, blend)
    return path


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def is_val(digest: bytes, val_fraction: float) -> bool:
    """The split rule: a document is in val when its sha256, read as a fraction of 2**64, is
    below data.val_fraction (decided per document, whatever the corpus order or size)."""
    return int.from_bytes(digest[:8], "big") < val_fraction * 2.0**64


# ---------------------------------------------------------------------------------------------
# The tokenizer: pretrained, or trained on a bounded sample spread over the corpus


def _tokenizer(work: Path, corpus, pretrained, data: DataConfig, vocab_size: int, progress: Progress):
    from tokenizers import Tokenizer

    path = work / bpe.TOKENIZER_FILE
    if path.is_file():  # a resumed preparation: the tokenizer is part of what it finished
        return Tokenizer.from_file(str(path))
    if pretrained is None:
        say(progress, f"training the tokenizer on up to {data.tokenizer_sample_mb} MB of {corpus.source}")
        pretrained = bpe.train_tokenizer(
            sample_documents([corpus], [1.0], data.tokenizer_sample_mb << 20, data.val_fraction),
            vocab_size,
            data.max_run_chars,
        )
    tmp = work / f".{bpe.TOKENIZER_FILE}.tmp"
    pretrained.save(str(tmp))
    os.replace(tmp, path)
    return pretrained


def sample_documents(corpora: list, weights: list[float], budget: int, val_fraction: float):
    """Train documents for the tokenizer: ``budget`` bytes split over the corpora by weight and
    over each corpus's files by size, each file read from its start (all of it when it fits)."""
    total_weight = sum(weights)
    for corpus, weight in zip(corpora, weights):
        share = budget * weight / total_weight
        limits = (
            None
            if corpus.total_bytes <= share
            else [max(1, int(share * f.size / max(corpus.total_bytes, 1))) for f in corpus.files]
        )
        for unit in read_units(corpus, limit_bytes=limits):
            for doc in unit_documents(unit, corpus.text_field):
                digest = unit.digest or hashlib.sha256(doc.encode("utf-8")).digest()
                if not is_val(digest, val_fraction):
                    yield doc


# ---------------------------------------------------------------------------------------------
# Streaming: read units, tokenize them in the workers, write shards, commit the journal


class _Written:
    """What the stream has written: the split writers, the journal's state (read position, hash
    chain of document digests, commits) and counts; it commits the journal."""

    def __init__(self, work: Path, key: str, settings: dict, writers: dict, val_fraction: float):
        self.work, self.key, self.writers, self.val_fraction = work, key, writers, val_fraction
        journal = _load_journal(work, key, writers)
        self.state = journal or {
            "position": [0, 0, 1],
            "chain": hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest(),
            "generation": 0,
            "commits": 0,
        }
        self.resumed_at = self.state["position"] if journal else None
        self.chain = bytes.fromhex(self.state["chain"])
        self.counts = {"bytes": 0, "tokens": 0, "documents": 0}
        self.last_commit, self.finished_since_commit = time.monotonic(), 0
        self.eager = faults.data_commit_eager()  # a drill counts commits: one per finished shard

    def consume(self, unit, encoded) -> None:
        """A unit's encoded documents into their splits' shards, in read order."""
        offset = 0
        for n, digest, ends in zip(encoded.lengths, encoded.digests, encoded.ends):
            digest = digest or unit.digest
            split = "val" if digest is not None and is_val(digest, self.val_fraction) else "train"
            self.finished_since_commit += self.writers[split].add(
                encoded.tokens[offset : offset + n], ends_document=ends
            )
            offset += n
            if ends:
                self.chain = hashlib.sha256(self.chain + digest).digest()
        counts = self.counts
        counts["bytes"] += len(unit.payload) if isinstance(unit.payload, bytes) else unit.payload.nbytes
        counts["tokens"] += len(encoded.tokens)
        counts["documents"] += sum(encoded.ends)
        self.state["position"] = [
            unit.file,
            unit.end,
            unit.line + (unit.payload.count(b"\n") if unit.kind == "jsonl" else 0),
        ]

    def maybe_commit(self) -> None:
        """Commit the journal when a shard finished since the last commit, at most every
        COMMIT_EVERY_S."""
        if self.finished_since_commit and (
            self.eager or time.monotonic() - self.last_commit >= COMMIT_EVERY_S
        ):
            self.commit()

    def commit(self) -> None:
        state = self.state
        state["chain"] = self.chain.hex()
        state["generation"] += 1
        state["commits"] += 1
        _write_journal(self.work, self.key, state, self.writers)
        self.last_commit, self.finished_since_commit = time.monotonic(), 0
        faults.after_data_commit(state["commits"])


def _stream(
    work: Path,
    corpus,
    tokenizer,
    data: DataConfig,
    settings: dict,
    key: str,
    vocab_size: int,
    progress: Progress,
) -> dict:
    from mega.data.encode import fixed_mmap_threshold

    fixed_mmap_threshold()  # this process holds units and shard buffers too (see encode.py)

    eos = bpe.eos_id(tokenizer, data.eos_token)
    dtype = bpe.token_dtype(tokenizer.get_vocab_size())
    writers = {s: SplitWriter(work, s, data.shard_tokens, dtype, tuple(settings["formats"])) for s in SPLITS}
    if "megatron" in settings["formats"]:
        preload_megatron()
    written = _Written(work, key, settings, writers, data.val_fraction)
    workers = data.workers or len(os.sched_getaffinity(0))
    started = time.monotonic()
    worker_args = (os.getpid(), str(work / bpe.TOKENIZER_FILE), corpus.text_field, eos, np.dtype(dtype).name)
    _encode_all(work, corpus, written, workers, worker_args, progress, started)

    shards = [entry for s in SPLITS for entry in writers[s].close()]
    if not any(w.num_documents for w in writers.values()):
        raise DataError(
            f"empty corpus: {corpus.source} has no non-empty documents "
            f"(read {len(corpus.files)} file(s): {', '.join(f.rel for f in corpus.files[:5])})"
        )
    seconds = time.monotonic() - started
    return {
        "version": FORMAT_VERSION,
        "content_hash": written.chain.hex(),
        "key": key,
        "vocab_size": tokenizer.get_vocab_size(),
        "requested_vocab_size": vocab_size,
        "eos_id": eos,
        "tokenizer": bpe.TOKENIZER_FILE,
        "dtype": np.dtype(dtype).name,
        "shards": shards,
        "num_tokens": {s: writers[s].num_tokens for s in SPLITS},
        "num_documents": {s: writers[s].num_documents for s in SPLITS},
        "settings": settings,
        "source": {
            "source": corpus.source,
            "text_field": corpus.text_field,
            "files": len(corpus.files),
            "bytes": corpus.total_bytes,
        },
        "prepared": {
            "seconds": round(seconds, 3),
            "workers": workers,
            "resumed_at": written.resumed_at,
            "tokens_read_now": written.counts["tokens"],
        },
    }


def _encode_all(
    work: Path,
    corpus,
    written: _Written,
    workers: int,
    worker_args: tuple,
    progress: Progress,
    started: float,
) -> None:
    """Read the corpus's units from the journal's position, encode them in ``workers`` spawned
    tokenizer processes (bounded read-ahead) and hand each result to ``written`` in read order."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    from multiprocessing import get_context

    from mega.data.encode import encode_unit, init_worker

    rerun_mark = work / "worker-rerun-script"
    rerun_mark.unlink(missing_ok=True)
    with (
        tokenizing(progress, corpus) as show,
        _environ(RERUN_MARK_ENV, f"{os.getpid()}:{rerun_mark}"),
        ProcessPoolExecutor(
            workers, mp_context=get_context("spawn"), initializer=init_worker, initargs=worker_args
        ) as pool,
    ):
        inflight: deque = deque()
        file, offset, line = written.state["position"]

        def worker_died(unit) -> DataError:
            if rerun_mark.exists():
                return _script_rerun_error()
            return DataError(
                f"a tokenizer worker died (killed, or out of memory?) while encoding "
                f"{unit.label} at offset {unit.start}"
            )

        def drain_one() -> None:
            unit, future = inflight.popleft()
            try:
                written.consume(unit, future.result(timeout=RESULT_TIMEOUT_S))
            except BrokenProcessPool:
                raise worker_died(unit) from None
            except TimeoutError:
                raise DataError(
                    f"a tokenizer worker took over {RESULT_TIMEOUT_S:.0f}s on {unit.label} "
                    f"at offset {unit.start}"
                ) from None
            show(unit, written.counts, time.monotonic() - started)
            written.maybe_commit()

        for unit in read_units(corpus, file, offset, line):
            try:
                inflight.append((unit, pool.submit(encode_unit, unit)))
            except BrokenProcessPool:
                raise worker_died(unit) from None
            if len(inflight) > 2 * workers + 1:  # bounded read-ahead: memory stays flat
                drain_one()
        while inflight:
            drain_one()


def _write_journal(work: Path, key: str, state: dict, writers: dict) -> None:
    gen = state["generation"]
    tails = {}
    for split, writer in writers.items():
        tokens, ends = writer.tail()
        name = f"pending-{split}-{gen}.npz"
        tmp = work / f".{name}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, tokens=tokens, ends=ends)
        os.replace(tmp, work / name)
        tails[split] = {"pending": name, "shards": writer.shards, "num_documents": writer.num_documents}
    write_json(work / JOURNAL, {**state, "key": key, "writers": tails})
    for old in work.glob("pending-*.npz"):
        if not old.name.endswith(f"-{gen}.npz"):
            old.unlink(missing_ok=True)


def _load_journal(work: Path, key: str, writers: dict) -> dict | None:
    path = work / JOURNAL
    if not path.is_file():
        return None
    try:
        journal = json.loads(path.read_text())
        if journal.get("key") != key:
            return None
        for split, writer in writers.items():
            entry = journal["writers"][split]
            with np.load(work / entry["pending"]) as tail:
                writer.restore(entry["shards"], entry["num_documents"], tail["tokens"], tail["ends"])
        return journal
    except (OSError, ValueError, KeyError) as err:  # a damaged journal: start over
        print(f"prepare: {path} is unusable ({err}); starting this preparation over", file=sys.stderr)
        for writer in writers.values():
            writer.restore([], 0, np.empty(0, writer.dtype), np.empty(0, np.int64))
        return None


@contextlib.contextmanager
def _locked(cache_dir: Path, name: str, progress: Progress):
    """One preparer per dataset: others wait while its files change, and take over (resuming its
    journal) when it dies; one whose files stop changing for LOCK_STALL_S is reported as stuck."""
    locks = cache_dir / ".locks"
    locks.mkdir(exist_ok=True)
    with open(locks / name, "a+") as f:
        waited_since, last_change, told = time.monotonic(), None, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                work = cache_dir / f".tmp-{name}"
                change = max((p.stat().st_mtime for p in work.iterdir()), default=0) if work.is_dir() else 0
                if change != last_change:
                    last_change, waited_since = change, time.monotonic()
                elif time.monotonic() - waited_since > LOCK_STALL_S:
                    raise DataError(
                        f"another preparation of this dataset ({work}) has made no progress for "
                        f"{LOCK_STALL_S:.0f}s; stop it (or delete {locks / name}) and retry"
                    ) from None
                if not told:
                    say(progress, f"prepare: waiting for another process preparing {work}")
                    told = True
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _environ(name: str, value: str):
    """``name=value`` in this process's environment (so in the processes it starts) for the block."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
