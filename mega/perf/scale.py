"""The losses of scale that are not one collective's bytes over a link: the step of N ranks in
lock-step is the slowest rank's, and a collective over many nodes pays per-hop latency.

* ``expected_max_normal(n)``: E[max of n independent standard normals]. If each of n ranks takes
  ``T (1 + sigma Z_i)`` for a step (Z_i standard normal: clocks, thermals, OS noise, a slower
  link), the synchronised step takes ``T (1 + sigma E[max Z_i])``: the loss grows like
  ``sigma sqrt(2 ln n)``, with the number of ranks and not with the work per rank.
* ``tree_all_reduce_s``: NCCL's double binary tree, ``2 log2(n)`` latency hops instead of the ring's
  ``2 (n - 1)``; the planner takes the faster of ring and tree for all-reduces, as NCCL's tuner does.
"""

from __future__ import annotations

import math
from functools import lru_cache


@lru_cache(maxsize=4096)
def expected_max_normal(n: int) -> float:
    """E[max(Z_1..Z_n)], Z_i iid N(0, 1): the integral of x n phi(x) Phi(x)^(n-1) (Simpson's rule
    over [-10, 10], 4000 intervals; exact for n = 1 and 2: 0 and 1/sqrt(pi))."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return 0.0
    lo, hi, k = -10.0, 10.0, 4000
    step = (hi - lo) / k
    total = 0.0
    for i in range(k + 1):
        x = lo + i * step
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        f = x * n * pdf * cdf ** (n - 1)
        total += f * (1 if i in (0, k) else 4 if i % 2 else 2)
    return total * step / 3


def straggler_s(compute_s: float, sigma: float, ranks: int) -> float:
    """Seconds the slowest of ``ranks`` adds to a step of ``compute_s`` (relative spread ``sigma``)."""
    return compute_s * sigma * expected_max_normal(max(1, ranks))


def tree_all_reduce_s(nbytes: float, n: int, bytes_per_s: float, latency_s: float) -> float:
    """All-reduce over a double binary tree: each half of the data goes up one tree and down the
    other, 2 log2(n) latency hops, every byte crossing each rank's link about twice."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * latency_s + 2 * nbytes / bytes_per_s


def interleaved_bubble_fraction(pp: int, vpp: int, microbatches: int) -> float:
    """Idle fraction of the interleaved 1F1B schedule relative to its busy time: (pp - 1) / (vpp m)
    (Narayanan et al. SC'21, section 2.2.2)."""
    return (pp - 1) / (vpp * microbatches)
