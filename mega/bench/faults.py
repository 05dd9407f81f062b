"""``python -m mega.bench faults``: every fault the driver handles, injected into a real run, timed
end to end (docs/benchmarks.md#faults-fault-drills-detection-and-recovery-timed).

Each drill trains ``model=tiny`` through the driver (``run_training``: torchrun ranks, checkpoints
every 2 steps so that a relaunch has a ``latest``), injects one fault and records, in its run
directory's ``drill.json``, the driver's log lines with their wall-clock times, what the harness did
and when (SIGSTOP/SIGCONT), and each attempt's outcome. A row is computed from that directory
alone (``ROWS[name](run_dir)``), so a kept run (``--out``) can be re-read.

Rows (``detect_s``: fault -> the driver's verdict; ``recover_s``: verdict -> the first step logged
by the relaunched attempt; ``steps_lost``: steps the failed attempt logged after the checkpoint the
relaunch restored):

* ``rank-kill``: 2 local nodes x 4 ranks (DP 8); rank 1 SIGKILLs itself at step 3
  (``fault.kill_rank``, written to ``faults.jsonl``). Detected: the driver's failure line; culprit
  named: attempt 0's ``failed_nodes`` is exactly the killed rank's node.
* ``rank-hang``: the same layout; the harness SIGSTOPs rank 1 once step 3 is logged
  (``stop_rank_when``). Rank 0 burns 0.2 s more per forward (steps of ~0.8 s) so that the stop
  lands mid-run, never after the last step. Detected: a hang incident; culprit named: its rank and node are the stopped
  one; ``within_target``: detect_s <= 2 x heartbeat_s + the incident's threshold_s.
* ``straggler``: DP 2, rank 1 computes 0.1 s more per forward from the start
  (``fault.slow_rank``). Detected: a straggler incident naming rank 1; recovered: one attempt, every
  step (recover_s 0: nothing to recover); detect_s from the start of the first step.
* ``nan``: PP 2; every rank's loss turns NaN at step 4 of attempt 0 (``fault.nan_at_step``, a
  poisoned weight). Detected: the driver's rollback line; culprit named: the skipped step is the
  poisoned one; recovered: the run finished, that step logged as skipped, every other loss finite.
* ``bad-node``: 2 local nodes x 4 ranks with one spare node; node 1's ranks are SIGKILLed at step 2 and
  node 1 fails its self-check (``fault.bad_node``). Detected: the driver's failure line naming node 1;
  culprit named: node 1 and only node 1 evicted; recovered: finished at full size on the spare.
* ``redis-outage``: DP 2 with a heartbeat Redis the harness owns (``store.redis_url``), SIGSTOPped
  for 10 s once step 2 is logged, then SIGCONTed (rank 1 burns 0.25 s per forward, steps of ~1 s, so the
  run outlasts the outage). Detected: a ``store`` incident (reported); detect_s: stop -> the driver's "store
  outage" line (else the incident's detected_at); recovered: heartbeats resumed
  (``evidence.resumed``), one attempt, every step, nothing evicted; recover_s: detection -> the
  incident (every rank beat again).

Warm against cold (rank-kill, rank-hang, bad-node): every drill runs on warm processes (the
default: agents and ranks are forks of each node's zygote, mega/warm); these three run a second
time with ``launcher.warm_processes=false`` (under ``<out>/cold/``), and their row gains
``recover_s_cold`` (the cold run's ``recover_s``) and ``warm_target_met``: ``recover_s`` <= 5 s
and <= a quarter of ``recover_s_cold``. Their layout is 2 local nodes x 4 ranks (DP 8).

Besides the rows: ``heartbeat_overhead`` = max over ranks of the heartbeat thread's CPU time over
its wall time (``heartbeats-attempt0.json``, written by the driver's watcher) in a clean DP 2 run
with the default ``stability.heartbeat_s``; ``heartbeat_overhead_on_off`` = (median step time with
stability on - off) / off, the same run with ``stability.enabled=false``, in the order on, off, off,
on (for information: on a shared 2-core machine it is mostly noise). Every figure is measured on this
machine's processes and clocks; timings on a shared machine are noisy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mega.bench import common
from mega.faults import recorded

STEPS = 6
KILL_RANK, KILL_STEP = 1, 3
HANG_RANK, HANG_STEP, HANG_HEARTBEAT_S, HANG_THRESHOLD_S = 1, 3, 1.0, 6.0
SLOW_RANK, SLOW_S, STRAGGLER_STEPS = 1, 0.1, 8
NAN_STEP = 4
BAD_NODE, BAD_NODE_STEP = 1, 2
OUTAGE_AT_STEP, OUTAGE_S, OUTAGE_STEPS = 2, 10.0, 16
OVERHEAD_STEPS, OVERHEAD_WARMUP = 60, 2
OVERHEAD_ORDER = ("on", "off", "off", "on")
ROW_KEYS = ("fault", "detected", "detect_s", "culprit_named", "recovered", "recover_s", "steps_lost")
DRILL_FILE = "drill.json"  # <run_dir>/drill.json: the harness's record of one drill

# Every drill: tiny model, no evaluation, checkpoints every 2 steps (sync: a relaunch has a
# `latest` at a known step), no backoff between attempts.
BASE = [
    "model=tiny",
    "train.tensorboard=false",
    "train.eval_batches=0",
    "optimizer.warmup_steps=1",
    "restart.backoff_s=0",
    "checkpoint.async_save=false",
    "checkpoint.interval=2",
]
WARM_VS_COLD = ("rank-kill", "rank-hang", "bad-node")  # run warm, then cold: recover_s_cold
TWO_BY_FOUR = [
    "parallelism=dp2",
    "parallelism.dp=8",
    "launcher=local-nodes",
    "cluster.nodes=2",
    "cluster.procs_per_node=4",
]
COLD = ["launcher.warm_processes=false", "checkpoint.memory_interval=0"]  # the durable, cold path
WARM_RECOVER_S, WARM_COLD_RATIO = 5.0, 0.25  # warm recovery: at most 5 s and a quarter of cold


# ---------------------------------------------------------------------------------------------
# Striking a running job from outside (shared with tests/test_stability.py)


def stop_process_when(
    run_dir: str | Path,
    at_step: int,
    pid_of: Callable[[], int | None],
    done: dict,
    pause_s: float | None = None,
    deadline_s: float = 240,
) -> None:
    """In a thread: once attempt 0 logged ``at_step`` and ``pid_of()`` names a process, SIGSTOP it
    (frozen: no step, no heartbeat, no exit, no answer) and record ``pid``, ``time``, ``step`` in
    ``done``; with ``pause_s``, SIGCONT it that much later (``resumed``: the time), else it stays
    stopped until someone kills it."""
    from mega.metrics import read_metrics

    end = time.monotonic() + deadline_s
    while time.monotonic() < end and "pid" not in done:
        try:
            steps = [m["step"] for m in read_metrics(run_dir) if m.get("attempt") == 0]
        except (OSError, ValueError):  # a line being written
            steps = []
        pid = pid_of() if steps and max(steps) >= at_step else None
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
            done.update(pid=pid, time=time.time(), step=max(steps))
            if pause_s is not None:
                try:
                    time.sleep(pause_s)
                finally:
                    os.kill(pid, signal.SIGCONT)
                    done["resumed"] = time.time()
            return
        time.sleep(0.1)


def stop_rank_when(run_dir: str | Path, rank: int, at_step: int, done: dict, deadline_s: float = 240) -> None:
    """``stop_process_when`` for one training rank of attempt 0 (its pid and node from the ranks'
    process records, mega.cluster.node.record_process); ``done`` also gets ``rank`` and ``node``."""
    from mega.cluster.node import read_processes

    def pid_of() -> int | None:
        procs = {p["rank"]: p for p in read_processes(run_dir, 0)}
        if rank not in procs:
            return None
        done.update(rank=rank, node=procs[rank]["node"])
        return procs[rank]["pid"]

    stop_process_when(run_dir, at_step, pid_of, done, deadline_s=deadline_s)


# ---------------------------------------------------------------------------------------------
# Running a drill and reading it back


def run_drill(
    name: str,
    overrides: list[str],
    base: Path,
    extra: list[str],
    steps: int = STEPS,
    strike: Callable[[Path, dict], None] | None = None,
    events: dict | None = None,
) -> Path:
    """Train one drill's run in ``base/name`` through the driver, ``strike(run_dir, events)`` in a
    thread beside it; write ``drill.json`` and return the run dir. ``extra``: the user's overrides
    (e.g. data.cache_dir), before the drill's own. A failed run is recorded (``error``), never raised."""
    from mega.config import compose
    from mega.launch import TrainingFailed, run_training

    run_dir = base / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a kept --out from before: start clean
    cfg = compose(
        [
            *BASE,
            *extra,
            f"train.steps={steps}",
            f"train.run_dir={run_dir}",
            f"checkpoint.dir={run_dir}/checkpoints",
            *overrides,
        ]
    )
    index = common.prepare_data(cfg)
    lines: list[list] = []
    events = {} if events is None else events

    def log(message: str) -> None:
        lines.append([time.time(), message])
        common.log(f"  {name}: {message}")

    thread = threading.Thread(target=strike, args=(run_dir, events), daemon=True) if strike else None
    record: dict = {"fault": name, "overrides": overrides, "steps": steps, "started": time.time()}
    if thread:
        thread.start()
    try:
        result = run_training(cfg, index, log=log)
        record.update(
            attempts=result.attempts, final_step=result.final_step, history=result.history, error=None
        )
    except TrainingFailed as e:
        record.update(attempts=None, final_step=None, history=[], error=str(e))
    finally:
        if thread:
            thread.join(timeout=OUTAGE_S + 5)
    record.update(log=lines, events=events, ended=time.time())
    (run_dir / DRILL_FILE).write_text(json.dumps(record, indent=1, default=str))
    return run_dir


class Drill:
    """A drill's run directory as the row functions read it."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.d = json.loads((self.run_dir / DRILL_FILE).read_text())
        self.history: list[dict] = self.d.get("history") or []
        self.events: dict = self.d.get("events") or {}

    def row(self) -> dict:
        row = dict.fromkeys(ROW_KEYS)
        row.update(fault=self.d["fault"], detected=False, culprit_named=False, recovered=False)
        if self.d.get("error"):
            row["error"] = self.d["error"]
        return row

    @property
    def finished(self) -> bool:
        return not self.d.get("error") and self.d.get("final_step") == self.d["steps"]

    def metrics(self) -> list[dict]:
        """Every row of metrics.jsonl as written (a step repeated by a relaunch appears twice)."""
        path = self.run_dir / "metrics.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
        return [r for r in rows if "step" in r]

    def first_step_after(self, attempt: int) -> float | None:
        """When the first step of a later attempt was logged."""
        times = [r["time"] for r in self.metrics() if r.get("attempt", 0) > attempt]
        return min(times) if times else None

    def faults(self, kind: str) -> list[dict]:
        return [r for r in recorded(self.run_dir) if r["kind"] == kind]

    def incidents(self, kind: str) -> list[dict]:
        from mega.stability.incident import read_incidents

        return [i for i in read_incidents(self.run_dir) if i["kind"] == kind]

    def logged(self, *words: str) -> float | None:
        """When the driver first logged a line holding every one of ``words``."""
        return next((t for t, line in self.d.get("log", []) if all(w in line for w in words)), None)

    def record(self):
        from mega.launch.runs import RunRecordError, read_record

        try:
            return read_record(self.run_dir)
        except RunRecordError:
            return None

    def steps_lost(self) -> int | None:
        """Steps attempt 0 logged after the checkpoint attempt 1 restored (0 with one attempt)."""
        if len(self.history) < 2:
            return 0 if self.history else None
        first, second = self.history[0], self.history[1]
        restored = int(second["restored"].split("_")[-1]) if second.get("restored") else 0
        return max(0, first["final_step"] - restored)


def _since(t: float | None, t0: float | None) -> float | None:
    return round(t - t0, 3) if t is not None and t0 is not None else None


# ---------------------------------------------------------------------------------------------
# The drills: how each run is made, and its row


def run_rank_kill(base: Path, extra: list[str]) -> Path:
    return run_drill(
        "rank-kill",
        [*TWO_BY_FOUR, f"fault.kill_rank={KILL_RANK}", f"fault.kill_at_step={KILL_STEP}"],
        base,
        extra,
    )


def row_rank_kill(run_dir: Path) -> dict:
    d = Drill(run_dir)
    row = d.row()
    killed = d.faults("kill")
    seen = d.logged("attempt 0:", "stopping every node")
    if not d.history or not killed:
        return row
    first = d.history[0]
    row.update(
        detected=seen is not None and not first["code"] == 0,
        detect_s=_since(seen, killed[0]["time"]),
        culprit_named=first["failed_nodes"] == [killed[0]["node"]] and killed[0]["rank"] == KILL_RANK,
        recovered=d.finished and d.d["attempts"] == 2,
        recover_s=_since(d.first_step_after(0), seen),
        steps_lost=d.steps_lost(),
        failed_nodes=first["failed_nodes"],
    )
    return row


def run_rank_hang(base: Path, extra: list[str]) -> Path:
    return run_drill(
        "rank-hang",
        [
            *TWO_BY_FOUR,
            "fault.slow_rank=0",
            "fault.slow_s=0.2",
            f"stability.heartbeat_s={HANG_HEARTBEAT_S}",
            f"stability.min_hang_s={HANG_THRESHOLD_S}",
            "stability.progress_factor=5",
            "stability.straggler_beats=100",
            "stability.hang_timeout_s=120",
            "checkpoint.upload_timeout_s=10",
        ],
        base,
        extra,
        strike=lambda run_dir, done: stop_rank_when(run_dir, HANG_RANK, HANG_STEP, done),
    )


def row_rank_hang(run_dir: Path) -> dict:
    d = Drill(run_dir)
    row = d.row()
    stopped, hangs = d.events, d.incidents("hang")
    row.update(heartbeat_s=HANG_HEARTBEAT_S)
    if "time" not in stopped:
        row["error"] = row.get("error") or "the rank was never stopped"
        return row
    if not hangs:
        return row
    inc = hangs[0]
    c = inc.get("culprit") or {}
    threshold = inc["evidence"].get("threshold_s")
    detect = _since(inc["detected_at"], stopped["time"])
    row.update(
        detected=True,
        detect_s=detect,
        culprit_named=(c.get("rank"), c.get("node")) == (stopped["rank"], stopped["node"]),
        culprit=c.get("rank"),
        coords=c.get("coords"),
        threshold_s=threshold,
        within_target=detect is not None
        and threshold is not None
        and detect <= 2 * HANG_HEARTBEAT_S + threshold,
        recovered=d.finished and d.d["attempts"] == 2 and d.history[0]["reason"].startswith("hung"),
        recover_s=_since(d.first_step_after(0), inc["detected_at"]),
        steps_lost=d.steps_lost(),
    )
    return row


def run_straggler(base: Path, extra: list[str]) -> Path:
    return run_drill(
        "straggler",
        [
            "parallelism=dp2",
            f"fault.slow_rank={SLOW_RANK}",
            f"fault.slow_s={SLOW_S}",
            "stability.heartbeat_s=0.25",
            "stability.min_hang_s=30",
            "stability.straggler_beats=2",
        ],
        base,
        extra,
        steps=STRAGGLER_STEPS,
    )


def row_straggler(run_dir: Path) -> dict:
    d = Drill(run_dir)
    row = d.row()
    rows = d.metrics()
    slow = [i for i in d.incidents("straggler") if (i.get("culprit") or {}).get("rank") == SLOW_RANK]
    named = d.incidents("straggler")
    # slow from its first forward on: the fault begins with the first step
    began = min((r["time"] - r["step_s"] for r in rows), default=None)
    row.update(
        detected=bool(slow),
        culprit_named=bool(slow) and len(named) == 1,
        recovered=d.finished and d.d["attempts"] == 1,
        recover_s=0.0,
        steps_lost=d.steps_lost(),
    )
    if slow:
        row.update(detect_s=_since(slow[0]["detected_at"], began), ratios=slow[0]["evidence"].get("ratios"))
    return row


def run_nan(base: Path, extra: list[str]) -> Path:
    return run_drill("nan", ["parallelism=pp2", f"fault.nan_at_step={NAN_STEP}"], base, extra)


def row_nan(run_dir: Path) -> dict:
    d = Drill(run_dir)
    row = d.row()
    record = d.record()
    skips = record.skipped_steps if record else []
    poisoned = d.faults("nan")
    seen = d.logged("rolling back")
    if not skips or not poisoned:
        return row
    rows = [r for r in d.metrics() if r.get("attempt", 0) > 0]
    skipped = [r for r in rows if r["step"] == NAN_STEP and r.get("data_skipped")]
    row.update(
        detected=seen is not None,
        detect_s=_since(seen, poisoned[0]["time"]),
        culprit_named=skips[0]["step"] == NAN_STEP,
        recovered=d.finished
        and bool(skipped)
        and all(math.isfinite(r["loss"]) for r in rows if not r.get("data_skipped")),
        recover_s=_since(d.first_step_after(0), seen),
        steps_lost=d.steps_lost(),
    )
    return row


def run_bad_node(base: Path, extra: list[str]) -> Path:
    return run_drill(
        "bad-node",
        [
            *TWO_BY_FOUR,
            "restart.spare_nodes=1",
            f"fault.kill_node={BAD_NODE}",
            f"fault.kill_at_step={BAD_NODE_STEP}",
            f"fault.bad_node={BAD_NODE}",
        ],
        base,
        extra,
    )


def row_bad_node(run_dir: Path) -> dict:
    d = Drill(run_dir)
    row = d.row()
    killed = d.faults("kill")
    seen = d.logged("attempt 0:", "stopping every node")
    if not d.history:
        return row
    first = d.history[0]
    record = d.record()
    evicted = [e["node"] for e in record.evicted_nodes] if record else []
    row.update(
        detected=first["failed_nodes"] == [BAD_NODE] and seen is not None,
        detect_s=_since(seen, killed[0]["time"]) if killed else None,
        culprit_named=first.get("evicted") == [BAD_NODE] and evicted == [BAD_NODE],
        # at full size: two nodes again, the spare in the evicted node's place
        recovered=d.finished
        and len(d.history) == 2
        and record is not None
        and len((record.membership or {}).get("nodes", [])) == 2
        and BAD_NODE not in record.membership["nodes"],
        recover_s=_since(d.first_step_after(0), seen),
        steps_lost=d.steps_lost(),
    )
    return row


def run_redis_outage(base: Path, extra: list[str]) -> Path:
    from mega.store import RedisServer

    with RedisServer() as server:
        events = {"store": server.address}
        return run_drill(
            "redis-outage",
            [
                "parallelism=dp2",
                f"store.redis_url={server.url}",
                f"fault.slow_rank={SLOW_RANK}",
                "fault.slow_s=0.25",
                "stability.heartbeat_s=0.5",
                "stability.min_hang_s=8",
                "stability.progress_factor=4",
                f"stability.straggler_beats={OUTAGE_STEPS + 1}",
            ],
            base,
            extra,
            steps=OUTAGE_STEPS,
            events=events,
            strike=lambda run_dir, done: stop_process_when(
                run_dir, OUTAGE_AT_STEP, lambda: server.pid, done, pause_s=OUTAGE_S
            ),
        )


def row_redis_outage(run_dir: Path) -> dict:
    d = Drill(run_dir)
    row = d.row()
    paused = d.events
    if "time" not in paused:
        row["error"] = row.get("error") or "Redis was never stopped"
        return row
    stores = d.incidents("store")
    record = d.record()
    row.update(outage_s=_since(paused.get("resumed"), paused["time"]), steps_lost=d.steps_lost())
    if not stores:
        row["note"] = "no store incident: the driver's watcher recorded no heartbeat Redis outage"
        return row
    inc = stores[0]
    e = inc.get("evidence") or {}
    seen = d.logged("store outage") or inc["detected_at"]
    last = max((r["time"] for r in d.metrics()), default=0)
    row.update(
        detected=True,
        detect_s=_since(seen, paused["time"]),
        culprit_named=str(paused.get("store", "")) in json.dumps(inc.get("culprit")),
        recovered=bool(e.get("resumed"))
        and d.finished
        and d.d["attempts"] == 1
        and record is not None
        and record.evicted_nodes == [],
        recover_s=_since(inc["detected_at"], seen),
        reported_s=_since(inc["detected_at"], paused["time"]),
        watcher_outage_s=e.get("outage_s"),
        ranks_resumed=e.get("ranks_resumed"),
        dropped=e.get("dropped"),
        mid_run=last > paused.get("resumed", math.inf),
    )
    return row


DRILLS: dict[str, tuple[Callable[[Path, list[str]], Path], Callable[[Path], dict]]] = {
    "rank-kill": (run_rank_kill, row_rank_kill),
    "rank-hang": (run_rank_hang, row_rank_hang),
    "straggler": (run_straggler, row_straggler),
    "nan": (run_nan, row_nan),
    "bad-node": (run_bad_node, row_bad_node),
    "redis-outage": (run_redis_outage, row_redis_outage),
}
OVERHEAD = "overhead"  # --only name of the heartbeat overhead runs


# ---------------------------------------------------------------------------------------------
# Heartbeat overhead


def run_overhead(base: Path, extra: list[str]) -> dict[str, list[Path]]:
    """The same clean DP 2 run with stability on (default heartbeat_s) and off, back to back in
    the order on, off, off, on: a drift of the shared machine's load over the four hits both."""
    over = ["parallelism=dp2", "checkpoint.interval=0"]
    runs: dict[str, list[Path]] = {"on": [], "off": []}
    for i, mode in enumerate(OVERHEAD_ORDER):
        runs[mode].append(
            run_drill(
                f"overhead-{mode}-{i}",
                [*over, f"stability.enabled={mode == 'on'}"],
                base,
                extra,
                steps=OVERHEAD_STEPS,
            )
        )
    return runs


def overhead(runs: dict[str, list[Path]]) -> dict:
    """heartbeat_overhead: max over the "on" runs' ranks of the heartbeat thread's cpu_s / wall_s
    (the watcher's heartbeats-attempt0.json); heartbeat_overhead_on_off: the relative difference of
    the median step time after the warm-up, every on run's steps against every off run's."""
    out: dict = {"heartbeat_overhead": None, "heartbeat_overhead_on_off": None}
    ranks, ratios = {}, []
    for i, run_dir in enumerate(runs["on"]):
        summary = Path(run_dir) / "heartbeats-attempt0.json"
        if summary.exists():
            s = json.loads(summary.read_text())
            ranks[f"on-{i}"] = {"heartbeat_s": s.get("heartbeat_s"), "ranks": s["ranks"]}
            ratios += [r["cpu_s"] / r["wall_s"] for r in s["ranks"].values() if r.get("wall_s")]
    if ratios:
        out["heartbeat_overhead"] = round(max(ratios), 6)
        out["heartbeat_overhead_detail"] = {"runs": ranks, "target": 0.005, "target_met": max(ratios) < 0.005}
    else:
        out["note"] = (
            "heartbeat_overhead: no heartbeats-attempt0.json (the driver's watcher writes it as "
            "an attempt with heartbeats ends)"
        )
    steps = {}
    for mode, dirs in runs.items():
        drills = [Drill(d) for d in dirs]
        times = [r["step_s"] for d in drills for r in d.metrics() if r["step"] > OVERHEAD_WARMUP]
        steps[mode] = statistics.median(times) if times and all(d.finished for d in drills) else None
    if steps["on"] and steps["off"]:
        out["heartbeat_overhead_on_off"] = round((steps["on"] - steps["off"]) / steps["off"], 4)
    out["step_s_on_off"] = [steps["on"], steps["off"]]
    return out


# ---------------------------------------------------------------------------------------------
# The bench


def _line(row: dict, took: float) -> str:
    def s(x):
        return "-" if x is None else f"{x:.2f} s"

    return (
        f"faults: {row['fault']}: detected {row['detected']} in {s(row['detect_s'])}, culprit named "
        f"{row['culprit_named']}, recovered {row['recovered']} in {s(row['recover_s'])}, steps lost "
        f"{row['steps_lost']} ({took:.0f} s)" + (f"; error: {row['error']}" if row.get("error") else "")
    )


def _drill_row(name: str, base: Path, extra: list[str]) -> dict:
    from mega.goodput.recovery import recoveries

    run, row_of = DRILLS[name]
    try:
        run_dir = run(base, extra)
        return {**row_of(run_dir), "recover_steps": recoveries(run_dir)}  # where recover_s went
    except Exception as e:
        return {
            **dict.fromkeys(ROW_KEYS),
            "fault": name,
            "detected": False,
            "culprit_named": False,
            "recovered": False,
            "error": f"{type(e).__name__}: {e}",
        }


def warm_vs_cold(warm: dict, cold: dict) -> dict:
    """``recover_s_cold`` and whether warm recovery met its target (None when either is missing)."""
    w, c = warm.get("recover_s"), cold.get("recover_s")
    met = (
        None
        if w is None or c is None or not (warm["recovered"] and cold["recovered"])
        else (w <= WARM_RECOVER_S and w <= WARM_COLD_RATIO * c)
    )
    return {
        "recover_s_cold": c,
        "warm_target_met": met,
        **({"cold_error": cold["error"]} if cold.get("error") else {}),
    }


def bench_faults(
    only: list[str] | None = None, out: str | Path | None = None, overrides: list[str] | None = None
) -> dict:
    """Run the named drills (all by default; ``overhead`` for the heartbeat overhead runs), one
    after another, each in its own run dir under ``out`` (default: a temporary dir, removed)."""
    names = only or [*DRILLS, OVERHEAD]
    unknown = [n for n in names if n not in DRILLS and n != OVERHEAD]
    if unknown:
        from mega.config import ConfigError

        raise ConfigError("--only", f"unknown drill(s) {unknown}; known: {', '.join([*DRILLS, OVERHEAD])}")
    with tempfile.TemporaryDirectory(prefix="mega-bench-faults-") as tmp:
        base = Path(out) if out else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        rows = []
        for name in [n for n in DRILLS if n in names]:
            run, row_of = DRILLS[name]
            t0 = time.monotonic()
            common.log(f"faults: {name} ...")
            row = _drill_row(name, base, list(overrides or []))
            common.log(_line(row, time.monotonic() - t0))
            if name in WARM_VS_COLD:
                t0 = time.monotonic()
                common.log(f"faults: {name} on cold processes ...")
                cold = _drill_row(name, base / "cold", [*(overrides or []), *COLD])
                common.log(_line(cold, time.monotonic() - t0))
                row.update(warm_vs_cold(row, cold))
            rows.append(row)
        result: dict = {"faults": rows, "heartbeat_overhead": None, "heartbeat_overhead_on_off": None}
        if OVERHEAD in names:
            common.log("faults: heartbeat overhead (stability on, then off) ...")
            result.update(overhead(run_overhead(base, list(overrides or []))))
            common.log(
                f"faults: heartbeat overhead {result['heartbeat_overhead']}, on/off step time "
                f"{result['heartbeat_overhead_on_off']}"
            )
        else:
            result["note"] = "heartbeat overhead not measured (--only without overhead)"
        result["targets_met"] = (
            all(r["detected"] and r["recovered"] for r in rows)
            and all(r.get("within_target", True) and r.get("warm_target_met", True) for r in rows)
            and (result["heartbeat_overhead"] or 1.0) < 0.005
        )
        if out:
            result["out"] = str(base)
    return result
