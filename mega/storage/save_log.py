"""The run's record of its saves: ``<run_dir>/checkpoints.jsonl``, one line per save, commit to the
store and failed save, appended by rank 0's checkpointer (mega/checkpoint/save.py). The goodput
ledger reads which step is durable from it; benchmarks read the saves' costs."""

from __future__ import annotations

import json
from pathlib import Path

SAVE_LOG = "checkpoints.jsonl"


def read_save_log(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / SAVE_LOG
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
