"""TokenDataset: fixed-length samples over memory-mapped shards, and the microbatch each
data-parallel rank consumes at each step.

Sample ``i`` is the non-overlapping window ``[i*(L+1), (i+1)*(L+1))`` of the split's concatenated
token stream (L = seq_length). Training walks a seeded permutation of all samples, a new one each
epoch; step ``s`` consumes positions ``[s*G, (s+1)*G)`` of that walk (G = global batch size), cut
rank-major into the ranks' microbatches. A blend (several sources, mega.data.blend) maps each walk
position to a source and to the next sample of that source's own walk. Everything is a pure
function of (seed, step, layout), so a resumed run sees the same data and any DP degree with the
same global batch sees the same samples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mega.data.corpus import DataError
from mega.data.shards import read_index, read_shard


class TokenStream:
    """One split of one prepared source: its shards, memory-mapped, as one token sequence."""

    def __init__(self, index_path: Path, index: dict, split: str):
        self.shards = []
        for entry in index["shards"]:
            if entry["split"] != split:
                continue
            path = Path(entry["path"]) if entry.get("external") else index_path.parent / entry["path"]
            if entry.get("external") and path.stat().st_size != entry["bytes"]:
                raise DataError(
                    f"{path}: {path.stat().st_size} bytes, {index_path} was prepared from "
                    f"{entry['bytes']}; it changed: prepare the dataset again"
                )
            tokens = read_shard(path, index.get("dtype"))
            if "token_range" in entry:
                tokens = tokens[entry["token_range"][0] : entry["token_range"][1]]
            if len(tokens) != entry["num_tokens"]:
                raise DataError(
                    f"{path}: {len(tokens)} tokens, the index says {entry['num_tokens']}; "
                    "delete the directory and prepare again"
                )
            self.shards.append(tokens)
        # starts[k] = position of shard k's first token in the split's stream
        self.starts = np.cumsum([0] + [len(t) for t in self.shards])
        self.num_tokens = int(self.starts[-1])

    def window(self, begin: int, end: int) -> np.ndarray:
        first = int(np.searchsorted(self.starts, begin, side="right")) - 1
        pieces = []
        for k in range(first, len(self.shards)):  # a window may straddle shard boundaries
            lo, hi = max(begin - self.starts[k], 0), min(end - self.starts[k], len(self.shards[k]))
            if lo >= hi:
                break
            pieces.append(self.shards[k][lo:hi])
        return np.concatenate(pieces).astype(np.int64)


class TokenDataset:
    def __init__(self, index_path: str | Path, seq_length: int, seed: int, split: str = "train"):
        self.index_path = Path(index_path)
        index = read_index(self.index_path)
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.seq_length, self.seed, self.split = seq_length, seed, split
        if index.get("kind") == "blend":
            parts = [(self.index_path.parent / s["index"], s["weight"]) for s in index["sources"]]
        else:
            parts = [(self.index_path, 1.0)]
        self.streams, self.source_samples = [], []
        for path, _ in parts:
            sub = index if path == self.index_path else read_index(path)
            stream = TokenStream(path, sub, split)
            samples = stream.num_tokens // (seq_length + 1)
            if samples == 0:
                raise DataError(
                    f"{path}: split {split!r} has {stream.num_tokens} tokens, fewer than one sample "
                    f"of seq_length+1={seq_length + 1}; use more text or a larger data.val_fraction"
                )
            self.streams.append(stream)
            self.source_samples.append(samples)
        self.vocab_size: int = index["vocab_size"]
        self.eos_id: int | None = index["eos_id"]
        self.num_tokens = sum(s.num_tokens for s in self.streams)
        self.num_samples = sum(self.source_samples)
        if len(parts) > 1:
            from mega.data.blend import BlendSchedule

            self.blend: BlendSchedule | None = BlendSchedule([w for _, w in parts])
        else:
            self.blend = None
        self._permutations: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int, source: int = 0) -> np.ndarray:
        """Sample ``i`` of ``source``: seq_length+1 consecutive token ids (int64)."""
        if not 0 <= i < self.source_samples[source]:
            raise IndexError(f"sample {i} out of range [0, {self.source_samples[source]})")
        begin = i * (self.seq_length + 1)
        return self.streams[source].window(begin, begin + self.seq_length + 1)

    def permutation(self, epoch: int, source: int = 0) -> np.ndarray:
        """The order in which epoch ``epoch`` visits a source's samples (seeded by seed and epoch)."""
        key = (source, epoch)
        if key not in self._permutations:
            if len(self._permutations) >= 2 * len(self.streams):  # a global batch spans at most two epochs
                self._permutations.pop(next(iter(self._permutations)))
            rng = np.random.default_rng(
                [self.seed, epoch] if self.blend is None else [self.seed, epoch, source + 1]
            )
            self._permutations[key] = rng.permutation(self.source_samples[source])
        return self._permutations[key]

    def positions(
        self,
        step: int,
        microbatch: int,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        num_microbatches: int,
    ) -> np.ndarray:
        """Walk positions of one microbatch: step s takes [s*G, (s+1)*G), rank-major."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if not 0 <= microbatch < num_microbatches:
            raise ValueError(f"microbatch {microbatch} is not in [0, num_microbatches={num_microbatches})")
        per_rank = micro_batch_size * num_microbatches
        first = step * per_rank * dp_size + dp_rank * per_rank + microbatch * micro_batch_size
        return np.arange(first, first + micro_batch_size)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample index in that source) of each walk position."""
        if self.blend is None:
            sources, draws = np.zeros(len(positions), dtype=np.int64), np.asarray(positions)
        else:
            sources, draws = self.blend.locate(positions)
        ids = np.empty(len(positions), dtype=np.int64)
        for n, (j, k) in enumerate(zip(sources, draws)):
            epoch, offset = divmod(int(k), self.source_samples[j])
            ids[n] = self.permutation(epoch, int(j))[offset]
        return sources, ids

    def sample_ids(
        self,
        step: int,
        microbatch: int,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        num_microbatches: int,
    ) -> np.ndarray:
        """The sample indices of one microbatch (within their sources; see ``locate``)."""
        return self.locate(
            self.positions(step, microbatch, dp_rank, dp_size, micro_batch_size, num_microbatches)
        )[1]

    def microbatch_samples(
        self,
        step: int,
        microbatch: int,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        num_microbatches: int,
    ) -> np.ndarray:
        """The microbatch's samples, [micro_batch_size, seq_length+1] int64 (no torch needed)."""
        sources, ids = self.locate(
            self.positions(step, microbatch, dp_rank, dp_size, micro_batch_size, num_microbatches)
        )
        return np.stack([self.sample(int(i), int(j)) for j, i in zip(sources, ids)])

    def microbatch(
        self,
        step: int,
        microbatch: int,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        num_microbatches: int,
    ) -> dict:
        """Microbatch ``microbatch`` of data-parallel rank ``dp_rank`` at training step ``step``.

        The step's global batch is positions [step*G, (step+1)*G) of the walk,
        G = micro_batch_size*num_microbatches*dp_size; rank r takes the r-th contiguous 1/dp_size of
        it and microbatch m the m-th micro_batch_size of that. Keys: tokens, labels (tokens shifted
        by one), loss_mask (ones, float32), position_ids; all [micro_batch_size, seq_length].
        """
        return as_batch(
            self.microbatch_samples(step, microbatch, dp_rank, dp_size, micro_batch_size, num_microbatches)
        )

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.index_path)!r}, split={self.split!r}, seq_length={self.seq_length}, "
            f"num_samples={self.num_samples}, sources={len(self.streams)}, vocab_size={self.vocab_size})"
        )


def as_batch(samples) -> dict:
    """The model's inputs from [b, L+1] samples (numpy or torch): tokens, labels, loss_mask, position_ids."""
    import torch

    samples = torch.as_tensor(samples)
    tokens, labels = samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.ones(tokens.shape, dtype=torch.float32),
        "position_ids": torch.arange(tokens.shape[1], dtype=torch.int64).repeat(tokens.shape[0], 1),
    }
