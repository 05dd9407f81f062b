"""The data pipeline: corpus -> tokenizer -> token shards -> deterministic microbatches.

    index = prepare_dataset(cfg.data, cfg.model.vocab_size)       # streaming, parallel, resumable
    ds = TokenDataset(index, cfg.model.seq_length, cfg.train.seed)
    batch = ds.microbatch(step, m, dp_rank, dp_size, mbs, num_microbatches)

See docs/data.md. Names are imported on first use, so the tokenizer workers and the node loader
(processes of their own) do not pay for torch or the config schema.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DataError": "mega.data.corpus",
    "TokenDataset": "mega.data.dataset",
    "load_tokenizer": "mega.data.tokenizer",
    "prepare_dataset": "mega.data.prepare",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mega.data' has no attribute {name!r}")
