"""Prefect task: tokenize the corpus into cached shards (mega.data.prepare_dataset)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mega.config import DataConfig
from mega.data import prepare_dataset


# The corpus may come from the package registry: a flaky download deserves another try.
# prepare_dataset caches by content hash itself, so Prefect-level caching would add nothing.
@task(name="prepare-data", retries=2, retry_delay_seconds=[5, 30], cache_policy=NO_CACHE)
def prepare_data(data: DataConfig, vocab_size: int) -> Path:
    logger = get_run_logger()
    index_path = prepare_dataset(data, vocab_size, progress=logger.info)  # notes, and a line every 30 s
    logger.info("dataset ready: %s", index_path)
    return index_path
