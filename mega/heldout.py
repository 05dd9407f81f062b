"""Validation loss on the held-out split: forward only, through megatron-core's pipeline schedule.

The data pipeline keeps whole documents out of training (``data.val_fraction``, the ``val``
split, docs/data.md). ``validation_loss`` runs ``train.eval_batches`` global batches of it
through the same schedule as training with ``forward_only=True`` (every TP/PP/DP layout, no
gradients, dropout off) and returns the mean token loss over them, averaged over DP like the
training loss. The sequences are a fixed set: the first ``eval_batches x global batch`` positions
of one seeded permutation of the split (``HELD_OUT_SEED``, not ``train.seed``), so runs with other
seeds, other layouts, and other global batches covering the same number of sequences evaluate the
same text. Past the end of the split the positions wrap around (sequences repeat).

``train.eval_interval``: after every that many steps and after the last one (0: after the last one
only); the value goes into that step's metrics row as ``val_loss`` (mega/train.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

HELD_OUT_SEED = 0  # the order of the held-out sequences, whatever train.seed is


def held_out_dataset(cfg, data_index: str | Path):
    """The held-out split as a ``TokenDataset``; None when evaluation is off (train.eval_batches=0)."""
    if cfg.train.eval_batches == 0:
        return None
    from mega.data.dataset import TokenDataset

    return TokenDataset(data_index, seq_length=cfg.model.seq_length, seed=HELD_OUT_SEED, split="val")


def check_held_out(cfg, data_index: str | Path) -> None:
    """Before launch: with evaluation on, the prepared data must hold at least one held-out
    sequence (a small corpus may have no val document at all: the split is per document).
    Raises ConfigError naming data.val_fraction; otherwise every rank would fail the same way."""
    from mega.config import ConfigError
    from mega.data.corpus import DataError

    try:
        held_out_dataset(cfg, data_index)
    except DataError as err:
        raise ConfigError(
            "data.val_fraction",
            f"{err}; train.eval_batches={cfg.train.eval_batches} needs a "
            "held-out split: raise data.val_fraction, or set train.eval_batches=0",
        ) from err


def due(cfg, step: int) -> bool:
    """Whether to evaluate after ``step`` (1-based: the number of steps done)."""
    t = cfg.train
    if t.eval_batches == 0:
        return False
    return step == t.steps or (t.eval_interval > 0 and step % t.eval_interval == 0)


def _microbatches(trainer, dataset, batch: int) -> list[dict]:
    """This rank's microbatches of held-out global batch ``batch`` (read here: the node loader,
    data.loader=node, serves the training split only)."""
    from megatron.core import parallel_state as ps

    p = trainer.cfg.parallelism
    layout = (
        ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(),
        p.micro_batch_size,
        p.num_microbatches,
    )
    return [
        {k: v.to(trainer.device) for k, v in dataset.microbatch(batch, m, *layout).items()}
        for m in range(p.num_microbatches)
    ]


def validation_loss(trainer, dataset, forward_step: Callable) -> float:
    """Mean loss over ``train.eval_batches`` held-out global batches, forward only; the value on
    the last pipeline stage (NaN on the others, as the training loss). ``forward_step`` is the
    training loop's own."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg, p = trainer.cfg, trainer.cfg.parallelism
    chunks = trainer.model
    losses = []
    for chunk in chunks:
        chunk.eval()  # no dropout: evaluation draws nothing from the RNG, training resumes bit-exact
    try:
        with torch.no_grad():
            for batch in range(cfg.train.eval_batches):
                data = _microbatches(trainer, dataset, batch)
                losses += get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=[iter(data) for _ in chunks] if len(chunks) > 1 else iter(data),
                    model=chunks if len(chunks) > 1 else chunks[0],
                    num_microbatches=p.num_microbatches,
                    seq_length=cfg.model.seq_length,
                    micro_batch_size=p.micro_batch_size,
                    forward_only=True,
                )
    finally:
        for chunk in chunks:
            chunk.train()
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return math.nan
    mean = torch.stack([x["lm loss"] for x in losses]).mean().reshape(1)
    torch.distributed.all_reduce(mean, group=ps.get_data_parallel_group())
    return mean.item() / ps.get_data_parallel_world_size()
