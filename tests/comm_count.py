"""Count the communication a piece of code issues, by wrapping torch.distributed's collectives and
p2p calls (for tests that claim a layer issues fewer or other collectives)."""

from __future__ import annotations

import contextlib
from collections import Counter

DIST_CALLS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_all_gather_base",
    "_reduce_scatter_base",
    "broadcast",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


@contextlib.contextmanager
def counting_communication():
    """Yield a Counter of calls by kind: each torch.distributed function by its name, and
    megatron's all-gather and reduce-scatter (bound at import in two of its modules, so the
    torch.distributed names do not see them) as "all_gather" and "reduce_scatter"."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers, mappings

    counts = Counter()
    targets = [(dist, name, name) for name in DIST_CALLS] + [
        (module, name, kind)
        for module in (mappings, layers)
        for name, kind in [
            ("dist_reduce_scatter_func", "reduce_scatter"),
            ("dist_all_gather_func", "all_gather"),
        ]
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in targets]

    def counting(kind, fn):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    for (module, name, kind), (_, _, fn) in zip(targets, originals):
        setattr(module, name, counting(kind, fn))
    try:
        yield counts
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
