"""What the benchmarks share: compose a run's config, prepare its data, train it with the real
launcher (torchrun ranks, the configured layout, no checkpoints), summarise the step metrics."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from pathlib import Path

from mega import config as mega_config
from mega.config import MegaConfig

# A benchmark run writes no checkpoints, never restarts and logs no TensorBoard events.
RUN_OVERRIDES = ("checkpoint.interval=0", "restart.max_restarts=0", "train.tensorboard=false")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def compose_run(overrides: list[str], steps: int, run_dir: str | Path) -> MegaConfig:
    """The config of one benchmark run: ``overrides`` (later ones win), then the run's own keys."""
    return mega_config.compose(
        [*overrides, f"train.steps={steps}", f"train.run_dir={run_dir}", *RUN_OVERRIDES]
    )


def prepare_data(cfg: MegaConfig) -> Path:
    from mega.data import prepare_dataset

    return prepare_dataset(cfg.data, cfg.model.vocab_size, progress=False)


def train(cfg: MegaConfig, index: Path):
    """Run the training job to ``train.steps``; returns the launcher's ``TrainingResult``."""
    from mega.launch import run_training

    return run_training(cfg, index, log=log)


def steady(metrics: list[dict], warmup: int) -> list[dict]:
    """The steps after the first ``warmup`` ones (all of them when none are left)."""
    return [row for row in metrics if row["step"] > warmup] or metrics


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def tokens_per_step(cfg: MegaConfig) -> int:
    return cfg.parallelism.global_batch_size * cfg.model.seq_length


def device_name(cfg: MegaConfig) -> str:
    import torch

    if cfg.cluster.device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()}"
