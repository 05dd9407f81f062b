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
        self.console.print(step_line(row))

    def event(self, message: str) -> None:
        if self.enabled:
            self.console.print(f"[mega] {message}")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()


def step_line(row: dict, steps: int | None = None) -> str:
    """One step's row as a line: the logging rank's console, each step; the driver's log (with
    ``steps``, the run's target), every ``train.log_interval`` steps."""
    step = f"{row['step']:>6}" if steps is None else f"{row['step']}/{steps}"
    return (
        f"step {step} | loss {row['loss']:.5f} | grad norm {row['grad_norm']:.4f} | "
        f"lr {row['lr']:.2e} | {row['tokens_per_s']:,.0f} tok/s | MFU {100 * row['mfu']:.2f}% | "
        f"{row['step_s'] * 1000:.0f} ms" + (f" | val loss {row['val_loss']:.5f}" if "val_loss" in row else "")
    )


class ProgressLog:
    """The driver's view of an attempt's training: ``poll()`` reads the rows the logging rank
    appended to ``metrics.jsonl`` since the last poll (from the attempt's start: an earlier
    attempt's rows are not this one's) and logs ``step_line`` for every ``every``-th step and the
    last, with the time left at the wall-clock pace of this attempt's steps so far (saves and
    evaluations included; from one row, its step time). ``every`` 0: no lines."""

    def __init__(self, run_dir: str | Path, every: int, steps: int, log):
        self.path, self.every, self.steps, self.log = Path(run_dir) / METRICS_FILE, every, steps, log
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.partial = b""  # a line the rank had not finished writing at the last poll
        self.first: dict | None = None  # this attempt's first row: the pace's origin

    def poll(self) -> None:
        if self.every <= 0 or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            try:
                row = json.loads(line)
                first = self.first = self.first or row
                if row["step"] % self.every and row["step"] < self.steps:
                    continue
                done = row["step"] - first["step"]
                pace = (row["time"] - first["time"]) / done if done > 0 else row["step_s"]
                left = max(0, self.steps - row["step"]) * pace
                self.log(step_line(row, self.steps) + (f" | {left:.0f} s left" if left else ""))
            except (ValueError, KeyError, TypeError):  # a torn or foreign line: the record is the rank's
                continue


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
