"""Data blends: several sources with weights (``data.blend``); prepared by
``mega.data.prepare.prepare_blend``.

Sampling: the global walk position ``p`` (step ``s`` takes ``[s*G, (s+1)*G)``, cut rank-major
across DP ranks as for one source) maps to a source and to that source's k-th sample, as a pure
function of ``p``. The weights are realised exactly over every period of ``PERIOD`` positions:
source j gets ``counts[j]`` of them (the weights rounded to 1/PERIOD, at least 1), spread evenly
(its k-th position in the period is the one nearest ``(k + 1/2) * PERIOD / counts[j]``), so any
window of n positions holds ``n * counts[j] / PERIOD`` of source j give or take 2.
"""

from __future__ import annotations

import numpy as np

from mega.data.corpus import DataError

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
