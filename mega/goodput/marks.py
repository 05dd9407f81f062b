"""Timestamps of a run's phases, appended as JSON lines under ``<run_dir>/goodput/``.

* ``flow.jsonl``: the flow's start and end and each pre/post-training task (``FlowMarks``).
* ``driver.jsonl``: the driver's start, each attempt's launch, the failure verdict, every process
  gone, diagnosis, backoff, the driver's end (``driver_mark``).
* ``attempt-<a>/rank-<r>.jsonl``: a rank's start-up phases, each step, checkpoint stalls,
  validations, the loop's end (``RankMarks``).

Every time is ``time.time()`` plus the writer's offset to the one clock (mega/goodput/clock.py);
the first line of a file of marks says which clock and its error. Writing never raises into
training: a mark that cannot be written is lost, and the ledger names the time it leaves uncovered.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from mega import procstat
from mega.goodput import clock

DIR = "goodput"
_DRIVER_CLOCK: dict | None = None


def _append(path: Path, row: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError:
        pass


def driver_clock(env: dict[str, str] | None = None) -> dict:
    """The driver's offset to the one clock (measured at the run's start; kept for its marks)."""
    global _DRIVER_CLOCK
    _DRIVER_CLOCK = clock.from_env(env or {})
    return _DRIVER_CLOCK


def driver_mark(run_dir: str | Path, event: str, env: dict[str, str] | None = None, **fields) -> None:
    """One driver event (``start``, ``launch``, ``verdict``, ``stopped``, ``diagnose``, ``backoff``,
    ``end``) at now on the one clock."""
    c = driver_clock(env) if env else (_DRIVER_CLOCK or {"offset_s": 0.0, "clock": "host"})
    _append(
        Path(run_dir) / DIR / "driver.jsonl",
        {"event": event, "t": time.time() + c["offset_s"], "clock": c["clock"], **fields},
    )


class FlowMarks:
    """The flow's side: ``start()``, then ``with marks.task("node-selfcheck"): ...``, ``end()``.
    Flow marks use the host clock (the flow runs where the driver does)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / DIR / "flow.jsonl"

    def start(self) -> None:
        self.path.unlink(missing_ok=True)  # one flow run per run directory's ledger
        _append(self.path, {"event": "start", "t": time.time()})

    @contextlib.contextmanager
    def task(self, name: str):
        t0 = time.time()
        try:
            yield
        finally:
            _append(self.path, {"event": "task", "name": name, "t0": t0, "t1": time.time()})

    def end(self) -> None:
        _append(self.path, {"event": "end", "t": time.time()})


class RankMarks:
    """A rank's marks. ``main_t`` is when the rank's ``main()`` began (its imports done)."""

    def __init__(self, run_dir: str | Path, attempt: int, rank: int, main_t: float):
        self.path = Path(run_dir) / DIR / f"attempt-{attempt}" / f"rank-{rank}.jsonl"
        self.path.unlink(missing_ok=True)
        self.clock = clock.from_env()
        header = {
            "event": "header",
            "rank": rank,
            "attempt": attempt,
            "pid": os.getpid(),
            **self.clock,
            **_process_starts(),
        }
        header["main_t"] = main_t
        self._write(header, shift=("created_t", "agent_created_t", "main_t"))

    def now(self) -> float:
        return time.time()

    def _write(self, row: dict, shift: tuple[str, ...] = ("t", "t0", "t1")) -> None:
        off = self.clock["offset_s"]
        _append(self.path, {k: (v + off if k in shift and v is not None else v) for k, v in row.items()})

    def phase(self, name: str, t0: float, t1: float | None = None, **fields) -> None:
        """A start-up or loop phase (``group_creation``, ``restore``, ``checkpoint``, ...) from t0 to t1 (now)."""
        self._write({"event": name, "t0": t0, "t1": self.now() if t1 is None else t1, **fields})

    @contextlib.contextmanager
    def span(self, name: str, **fields):
        t0 = self.now()
        try:
            yield
        finally:
            self.phase(name, t0, **fields)

    def step(
        self, step: int, t0: float, t1: float, skipped: bool, data_s: float | None, samples: dict | None
    ) -> None:
        """A finished step (1-based ``step``), its data wait, and the samples this rank consumed."""
        self._write(
            {
                "event": "step",
                "step": step,
                "t0": t0,
                "t1": t1,
                "skipped": skipped,
                "data_s": data_s,
                **({"samples": samples} if samples else {}),
            }
        )


def _process_starts() -> dict:
    """When this process and its parent (the torchrun agent) were created, on the host clock:
    ``/proc/<pid>/stat``'s start time (clock ticks since boot) against CLOCK_BOOTTIME now."""
    try:
        now, since_boot = time.time(), time.clock_gettime(time.CLOCK_BOOTTIME)
        from mega.cluster.node import agent_pid

        mine, agent = procstat.read(os.getpid()), procstat.read(agent_pid())
    except (OSError, ValueError, AttributeError):
        mine = agent = None
    if mine is None or agent is None:  # not Linux: the ledger counts from the launch
        return {"created_t": None, "agent_created_t": None}
    return {
        "created_t": now - (since_boot - mine.start_s),
        "agent_created_t": now - (since_boot - agent.start_s),
    }
