"""The data pipeline: corpus -> byte-level BPE -> Arrow token shards -> deterministic microbatches.

    index = prepare_dataset(cfg.data, cfg.model.vocab_size)       # cached by content hash
    ds = TokenDataset(index, cfg.model.seq_length, cfg.train.seed)
    batch = ds.microbatch(step, m, dp_rank, dp_size, mbs, num_microbatches)

See docs/data.md.
"""

from mega.data.corpus import DataError
from mega.data.dataset import TokenDataset
from mega.data.shards import prepare_dataset
from mega.data.tokenizer import load_tokenizer

__all__ = ["DataError", "TokenDataset", "load_tokenizer", "prepare_dataset"]
