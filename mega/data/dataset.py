"""TokenDataset: fixed-length samples over memory-mapped shards, and the microbatch each
data-parallel rank consumes at each step.

Sample ``i`` is the non-overlapping window ``[i*(L+1), (i+1)*(L+1))`` of the split's concatenated
token stream (L = seq_length). Training walks a seeded permutation of all samples, a new one each
epoch; step ``s`` consumes positions ``[s*G, (s+1)*G)`` of that walk (G = global batch size), cut
rank-major into the ranks' microbatches. Everything is a pure function of (seed, step, layout), so
a resumed run sees the same data and any DP degree with the same global batch sees the same samples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mega.data.corpus import DataError
from mega.data.shards import read_index, read_shard


class TokenDataset:
    def __init__(self, index_path: str | Path, seq_length: int, seed: int, split: str = "train"):
        self.index_path = Path(index_path)
        index = read_index(self.index_path)
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.seq_length, self.seed, self.split = seq_length, seed, split
        self.vocab_size: int = index["vocab_size"]
        self.eos_id: int = index["eos_id"]
        self.tokenizer_path = self.index_path.parent / index["tokenizer"]

        self._shards = []
        for entry in index["shards"]:
            if entry["split"] != split:
                continue
            tokens = read_shard(self.index_path.parent / entry["path"])
            if len(tokens) != entry["num_tokens"]:
                raise DataError(f"{self.index_path.parent / entry['path']}: {len(tokens)} tokens, the "
                                f"index says {entry['num_tokens']}; delete the directory and prepare again")
            self._shards.append(tokens)
        # _starts[k] = position of shard k's first token in the split's stream
        self._starts = np.cumsum([0] + [len(t) for t in self._shards])
        self.num_tokens = int(self._starts[-1])
        self.num_samples = self.num_tokens // (seq_length + 1)
        if self.num_samples == 0:
            raise DataError(f"{self.index_path}: split {split!r} has {self.num_tokens} tokens, fewer than "
                            f"one sample of seq_length+1={seq_length + 1}; use more text or a larger "
                            "data.val_fraction")
        self._permutations: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> np.ndarray:
        """Sample ``i``: seq_length+1 consecutive token ids (int64)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        begin = i * (self.seq_length + 1)
        end = begin + self.seq_length + 1
        first = int(np.searchsorted(self._starts, begin, side="right")) - 1
        pieces = []
        for k in range(first, len(self._shards)):  # a window may straddle shard boundaries
            lo, hi = max(begin - self._starts[k], 0), min(end - self._starts[k], len(self._shards[k]))
            if lo >= hi:
                break
            pieces.append(self._shards[k][lo:hi])
        return np.concatenate(pieces).astype(np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the samples (seeded by seed and epoch)."""
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a global batch spans at most two epochs' worth
                self._permutations.pop(next(iter(self._permutations)))
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.num_samples)
        return self._permutations[epoch]

    def sample_ids(self, step: int, microbatch: int, dp_rank: int, dp_size: int,
                   micro_batch_size: int, num_microbatches: int) -> np.ndarray:
        """The sample indices of one microbatch (see ``microbatch``)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if not 0 <= microbatch < num_microbatches:
            raise ValueError(f"microbatch {microbatch} is not in [0, num_microbatches={num_microbatches})")
        per_rank = micro_batch_size * num_microbatches
        first = step * per_rank * dp_size + dp_rank * per_rank + microbatch * micro_batch_size
        positions = np.arange(first, first + micro_batch_size)
        epochs, offsets = np.divmod(positions, self.num_samples)
        return np.array([self.permutation(int(e))[o] for e, o in zip(epochs, offsets)], dtype=np.int64)

    def microbatch(self, step: int, microbatch: int, dp_rank: int, dp_size: int,
                   micro_batch_size: int, num_microbatches: int) -> dict[str, torch.Tensor]:
        """Microbatch ``microbatch`` of data-parallel rank ``dp_rank`` at training step ``step``.

        The step's global batch is positions [step*G, (step+1)*G) of the per-epoch permutations,
        G = micro_batch_size*num_microbatches*dp_size; rank r takes the r-th contiguous 1/dp_size of
        it and microbatch m the m-th micro_batch_size of that. Keys: tokens, labels (tokens shifted
        by one), loss_mask (ones, float32), position_ids; all [micro_batch_size, seq_length].
        """
        ids = self.sample_ids(step, microbatch, dp_rank, dp_size, micro_batch_size, num_microbatches)
        samples = torch.from_numpy(np.stack([self.sample(int(i)) for i in ids]))
        tokens, labels = samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": torch.ones(tokens.shape, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64).repeat(len(ids), 1),
        }

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.index_path)!r}, split={self.split!r}, seq_length={self.seq_length}, "
                f"num_samples={self.num_samples}, vocab_size={self.vocab_size})")
