"""Data blends: several sources with weights (``data.blend``).

Preparation: one tokenizer for all sources (``data.tokenizer_file``, or a BPE trained on a sample
drawn from the text sources in proportion to their weights), each source prepared as on its own,
and ``<cache_dir>/blend-<hash16>.json`` naming their indexes and weights.

Sampling: the global walk position ``p`` (step ``s`` takes ``[s*G, (s+1)*G)``, cut rank-major
across DP ranks as for one source) maps to a source and to that source's k-th sample, as a pure
function of ``p``. The weights are realised exactly over every period of ``PERIOD`` positions:
source j gets ``counts[j]`` of them (the weights rounded to 1/PERIOD, at least 1), spread evenly
(its k-th position in the period is the one nearest ``(k + 1/2) * PERIOD / counts[j]``), so any
window of n positions holds ``n * counts[j] / PERIOD`` of source j give or take 2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from mega.config import DataConfig
from mega.data import tokenizer as bpe
from mega.data.corpus import DataError, open_corpus
from mega.data.shards import FORMAT_VERSION, write_json

PERIOD = 1 << 16


class BlendSchedule:
    def __init__(self, weights: list[float], period: int = PERIOD):
        w = np.asarray(weights, dtype=np.float64)
        if len(w) == 0 or np.any(w <= 0):
            raise DataError(f"blend weights must be positive, got {list(weights)}")
        self.period = period
        self.counts = _apportion(w / w.sum(), period)
        times = np.concatenate([(np.arange(c) + 0.5) * period / c for c in self.counts])
        owner = np.repeat(np.arange(len(w)), self.counts)
        order = np.lexsort((owner, times))  # by ideal time, ties by source
        self.source = owner[order].astype(np.int64)
        self.rank = np.concatenate([np.arange(c) for c in self.counts])[order].astype(np.int64)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, k): position p is the k-th sample drawn from that source."""
        period, offset = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        source = self.source[offset]
        return source, period * self.counts[source] + self.rank[offset]


def _apportion(shares: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total``, proportional to ``shares`` (largest remainders), each >= 1."""
    raw = shares * total
    counts = np.maximum(np.floor(raw).astype(np.int64), 1)
    while counts.sum() < total:
        counts[np.argmax(raw - counts)] += 1
    while counts.sum() > total:
        counts[np.argmax(np.where(counts > 1, counts - raw, -np.inf))] -= 1
    return counts


def prepare_blend(data: DataConfig, vocab_size: int, cache_dir: Path, progress: bool) -> Path:
    from mega.data.indexed import is_megatron_prefix
    from mega.data.prepare import _digest, prepare_source, sample_documents

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
