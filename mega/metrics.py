"""Per-step metrics of a training run: ``metrics.jsonl`` (the record the flow reads), TensorBoard,
and one console line per step. Only the logging rank (last pipeline stage, TP 0, DP 0) writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console

from mega.obs import ROW_KEYS as OBS_ROW_KEYS

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.console = Console(stderr=True, highlight=False)
        self._file = None
        self._tb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / METRICS_FILE, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()  # the launcher watches this file for progress
        if self._tb is not None:
            for key in (
                "loss",
                "grad_norm",
                "lr",
                "tokens_per_s",
                "mfu",
                "step_s",
                "val_loss",
                *OBS_ROW_KEYS,
            ):
                value = row.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    group = "obs" if key in OBS_ROW_KEYS else "train"  # compute, exposed comm (mega.obs)
                    self._tb.add_scalar(f"{group}/{key}", value, row["step"])
        self.console.print(
            f"step {row['step']:>6} | loss {row['loss']:.5f} | grad norm {row['grad_norm']:.4f} | "
            f"lr {row['lr']:.2e} | {row['tokens_per_s']:,.0f} tok/s | MFU {100 * row['mfu']:.2f}% | "
            f"{row['step_s'] * 1000:.0f} ms"
            + (f" | val loss {row['val_loss']:.5f}" if "val_loss" in row else "")
        )

    def event(self, message: str) -> None:
        if self.enabled:
            self.console.print(f"[mega] {message}")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Rows of ``metrics.jsonl``, one per step: after a restart a step repeats and the last wins."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]
