"""Every second of a run's wall clock attributed to exactly one category (docs/goodput.md).

The marks (mega/goodput/marks.py) become intervals with a priority: the flow's tasks, then the
driver's attempts, then each attempt's reference rank (its lowest rank with a file) and its steps,
then what happens inside them (data wait, checkpoint stalls, validation, warm-up). A sweep gives
each instant to the highest-priority interval covering it; an instant nobody covers, or only a
fallback interval, is ``unattributed`` and the ledger says which part (``unattributed_parts``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from mega import faults
from mega.goodput.marks import DIR
from mega.storage.save_log import read_save_log

CATEGORIES = (
    "productive",
    "lost_work",
    "queue_wait",
    "startup",
    "group_creation",
    "restore",
    "warmup",
    "checkpoint_stall",
    "validation",
    "fault_detection",
    "teardown",
    "selfcheck",
    "data_wait",
    "idle",
    "reporting",
    "unattributed",
)
FLOW_TASKS = {
    "prepare-data": "data_wait",
    "node-selfcheck": "selfcheck",
    "verify-store": "selfcheck",
    "time-process-groups": "group_creation",
    "report": "reporting",
    "observability": "reporting",
}
GOODPUT_FILE = "goodput.json"


@dataclass(frozen=True)
class Interval:
    t0: float
    t1: float
    category: str
    prio: int
    note: str = ""


def _read(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a torn last line of a killed writer
    return rows


def read_marks(run_dir: str | Path) -> dict:
    """Flow, driver and rank marks, and the injected faults, of a run directory."""
    run_dir = Path(run_dir)
    ranks: dict[int, dict[int, list[dict]]] = {}
    for f in sorted((run_dir / DIR).glob("attempt-*/rank-*.jsonl")):
        a, r = int(f.parent.name.split("-")[1]), int(f.stem.split("-")[1])
        ranks.setdefault(a, {})[r] = _read(f)
    return {
        "flow": _read(run_dir / DIR / "flow.jsonl"),
        "driver": _read(run_dir / DIR / "driver.jsonl"),
        "ranks": ranks,
        "faults": faults.recorded(run_dir),
    }


def _attempts(driver: list[dict]) -> list[dict]:
    """One row per attempt: launch, stopped (every process gone), verdict, ok, reason."""
    out: dict[int, dict] = {}
    for e in driver:
        if e["event"] == "launch":
            out[e["attempt"]] = {"attempt": e["attempt"], "launch": e["t"]}
        elif e["event"] == "stopped" and e["attempt"] in out:
            out[e["attempt"]].update(
                stopped=e["t"],
                verdict=e["t"] - e.get("stop_s", 0.0),
                ok=e.get("ok", False),
                reason=e.get("reason", ""),
            )
    return [out[a] for a in sorted(out)]


def _surviving(marks: dict, attempts: list[dict], durable_step: int) -> dict[int, int]:
    """Step -> the attempt whose run of it survives: the latest attempt that ran it. A run that
    ended failed (its last attempt stopped, not ok) keeps only the steps up to its last durable
    checkpoint: a resume starts there and runs every later step again."""
    latest: dict[int, int] = {}
    for a, by_rank in marks["ranks"].items():
        for rows in by_rank.values():
            for r in rows:
                if r["event"] == "step":
                    latest[r["step"]] = max(latest.get(r["step"], -1), a)
    if attempts and attempts[-1].get("ok") is False:
        latest = {step: a for step, a in latest.items() if step <= durable_step}
    return latest


def _durable_step(run_dir: Path) -> int:
    """The step of the run's last committed checkpoint (rank 0's save log), 0 when none."""
    return max((r["step"] for r in read_save_log(run_dir) if r["event"] == "committed"), default=0)


def _flow_intervals(flow: list[dict], driver: list[dict]) -> list[Interval]:
    start = next((e["t"] for e in flow if e["event"] == "start"), None)
    end = next((e["t"] for e in reversed(flow) if e["event"] == "end"), None)
    out = []
    if start is not None and end is not None:
        out.append(Interval(start, end, "idle", 1, "flow: between tasks"))
    entered = next((e.get("t_entered", e["t"]) for e in driver if e["event"] == "start"), None)
    ended = next((e["t"] for e in reversed(driver) if e["event"] == "end"), None)
    tasks = sorted((e for e in flow if e["event"] == "task"), key=lambda e: e["t0"] - e["t1"])
    for e in tasks:  # longest first: a task that ran inside another's time (overlapped) wins there
        if e["name"] == "train":
            out.append(Interval(e["t0"], e["t1"], "unattributed", 1, "train task: no driver record"))
            if entered is not None and entered > e["t0"]:
                out.append(Interval(e["t0"], entered, "queue_wait", 2, "train task: before the launcher"))
            if ended is not None and e["t0"] < ended < e["t1"]:
                out.append(Interval(ended, e["t1"], "teardown", 2, "train task: after the launcher"))
        else:
            out.append(Interval(e["t0"], e["t1"], FLOW_TASKS.get(e["name"], "idle"), 2, e["name"]))
    return out


def _driver_intervals(driver: list[dict], attempts: list[dict]) -> list[Interval]:
    out = []
    starts = [e for e in driver if e["event"] == "start"]
    ends = [e["t"] for e in driver if e["event"] == "end"]
    for s in starts:
        t0 = s.get("t_entered", s["t"])
        t1 = min((t for t in ends if t >= t0), default=max((e.get("t", t0) for e in driver), default=t0))
        out.append(Interval(t0, t1, "unattributed", 1, "driver: between its records"))
        first = min((a["launch"] for a in attempts if a["launch"] >= t0), default=t1)
        out.append(Interval(t0, first, "queue_wait", 2, "launcher: stores, Redis, nodes"))
    for i, a in enumerate(attempts):
        nxt = (
            attempts[i + 1]["launch"]
            if i + 1 < len(attempts)
            else min((t for t in ends if t >= a["launch"]), default=a.get("stopped", a["launch"]))
        )
        stopped = a.get("stopped", nxt)
        out.append(
            Interval(a["launch"], stopped, "unattributed", 2, f"attempt {a['attempt']}: no rank records")
        )
        if "verdict" in a:
            out.append(Interval(a["verdict"], stopped, "teardown", 3, "verdict -> every process gone"))
        out.append(Interval(stopped, nxt, "teardown", 2, "driver: after the attempt"))
    for e in driver:
        if e["event"] == "diagnose":
            out.append(Interval(e["t"] - e["seconds"], e["t"], "selfcheck", 3, "diagnosis"))
        elif e["event"] == "backoff":
            out.append(Interval(e["t"], e["t"] + e["seconds"], "idle", 3, "restart backoff"))
    return out


def _reference_rank(by_rank: dict[int, list[dict]]) -> list[dict]:
    """The lowest rank whose file has steps (else the lowest with any record)."""
    with_steps = [r for r, rows in sorted(by_rank.items()) if any(x["event"] == "step" for x in rows)]
    return by_rank[with_steps[0] if with_steps else min(by_rank)]


def _restored_from(marks: dict, a: dict) -> str | None:
    """Where the attempt's ranks restored from (their restore mark): memory-own, memory-peer,
    durable; None for a fresh start or no record."""
    by_rank = marks["ranks"].get(a["attempt"], {})
    rows = _reference_rank(by_rank) if by_rank else []
    return next((x.get("source") for x in rows if x["event"] == "restore"), None)


def _median_step_s(marks: dict) -> float:
    rest = []
    for by_rank in marks["ranks"].values():
        steps = [x for x in _reference_rank(by_rank) if x["event"] == "step"] if by_rank else []
        rest += [x["t1"] - x["t0"] for x in steps[1:] if not x["skipped"]]
    return statistics.median(rest) if rest else 0.0


def _rank_intervals(
    a: dict, rows: list[dict], survivors: dict[int, int], fault_t: float | None, median_s: float
) -> tuple[list[Interval], list[int]]:
    """The attempt's timeline from its reference rank; returns the intervals and its lost steps."""
    n, out, lost = a["attempt"], [], []
    header = next((x for x in rows if x["event"] == "header"), {})
    steps = [x for x in rows if x["event"] == "step"]
    phases = [x for x in rows if x["event"] not in ("header", "step")]
    born = header.get("agent_created_t") or header.get("created_t") or a["launch"]
    if born > a["launch"]:
        out.append(Interval(a["launch"], born, "queue_wait", 3, f"attempt {n}: launch -> agent"))
    ends = [x.get("t1", 0.0) for x in rows if x["event"] != "header"] + [header.get("main_t") or 0.0]
    last = max(ends) if ends else born
    loop_start = steps[0]["t0"] if steps else last
    out.append(
        Interval(
            min(born, a["launch"]) if born < a["launch"] else born,
            loop_start,
            "startup",
            3,
            f"attempt {n}: start-up",
        )
    )
    for p in phases:
        cat = {
            "checkpoint": "checkpoint_stall",
            "validation": "validation",
            "restore": "restore",
            "group_creation": "group_creation",
            "close": "teardown",
        }.get(p["event"], "unattributed")
        out.append(
            Interval(p["t0"], p["t1"], cat, 5 if cat != "teardown" else 4, f"attempt {n}: {p['event']}")
        )
    for i, x in enumerate(steps):
        survives = survivors.get(x["step"]) == n and not x["skipped"]
        if not survives:
            lost.append(x["step"])
        cat = "productive" if survives else "lost_work"
        t1 = steps[i + 1]["t0"] if i + 1 < len(steps) else x["t1"]
        out.append(Interval(x["t0"], t1, cat, 4, f"attempt {n}: step {x['step']}"))
        if survives and i == 0 and median_s and x["t1"] - x["t0"] > median_s:  # a discarded step is all lost
            out.append(Interval(x["t0"], x["t1"] - median_s, "warmup", 6, f"attempt {n}: first step"))
        elif survives and x.get("data_s"):
            out.append(Interval(x["t0"], x["t0"] + x["data_s"], "data_wait", 6, f"attempt {n}: data"))
    if steps:  # after the loop: the tail of the last step until the close, or a fault
        out.append(
            Interval(
                steps[-1]["t1"],
                last,
                "productive"
                if survivors.get(steps[-1]["step"]) == n and not steps[-1]["skipped"]
                else "lost_work",
                4,
                f"attempt {n}: after the last step",
            )
        )
    if a.get("ok"):
        out.append(Interval(last, a.get("verdict", last), "teardown", 4, f"attempt {n}: ranks exit"))
    elif "verdict" in a:
        hit = max(last, fault_t) if fault_t is not None else last
        if fault_t is not None and fault_t > last:  # a step in flight, or start-up not yet done
            out.append(
                Interval(
                    last,
                    fault_t,
                    "lost_work" if steps else "startup",
                    4,
                    f"attempt {n}: {'step in flight' if steps else 'start-up'} at the fault",
                )
            )
        out.append(Interval(hit, a["verdict"], "fault_detection", 4, f"attempt {n}: fault -> verdict"))
    return out, lost


def sweep(intervals: list[Interval], t0: float, t1: float) -> tuple[dict, dict, list[tuple], dict]:
    """Seconds per category and per unattributed part over [t0, t1], the merged timeline
    ``(start, end, category)`` and the lost work per attempt; each instant goes to the
    highest-priority interval covering it (the later one among equals)."""
    cuts = sorted({t0, t1, *(x for i in intervals for x in (i.t0, i.t1) if t0 < x < t1)})
    ranked = sorted(enumerate(intervals), key=lambda e: (e[1].prio, e[0]))
    totals = {c: 0.0 for c in CATEGORIES}
    parts: dict[str, float] = {}
    timeline: list[tuple] = []
    lost: dict[int, float] = {}
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        best = None
        for _, iv in ranked:
            if iv.t0 <= mid < iv.t1:
                best = iv
        cat = best.category if best else "unattributed"
        totals[cat] += b - a
        if cat == "lost_work" and best.note.startswith("attempt "):
            n = int(best.note.split(":")[0].split()[1])
            lost[n] = lost.get(n, 0.0) + b - a
        if cat == "unattributed":
            key = best.note if best else "no record covers it"
            parts[key] = parts.get(key, 0.0) + b - a
        if timeline and timeline[-1][2] == cat and timeline[-1][1] == a:
            timeline[-1] = (timeline[-1][0], b, cat)
        else:
            timeline.append((a, b, cat))
    return totals, parts, timeline, lost


def _attempts_rank_intervals(marks: dict, attempts: list[dict], survivors, median_s: float):
    """The ranks' intervals of every attempt and the steps each attempt lost."""
    intervals, lost_steps = [], []
    for a in attempts:
        by_rank = marks["ranks"].get(a["attempt"], {})
        if not by_rank:
            continue
        faults = [
            f["time"]
            for f in marks["faults"]  # the last fault before the verdict ended the attempt
            if f.get("attempt") == a["attempt"] and f["time"] <= a.get("verdict", f["time"])
        ]
        ivs, lost = _rank_intervals(
            a, _reference_rank(by_rank), survivors, max(faults) if faults else None, median_s
        )
        intervals += ivs
        lost_steps += [{"attempt": a["attempt"], "step": s} for s in lost]
    return intervals, lost_steps


def build(run_dir: str | Path) -> dict:
    """The ledger of a run directory (all its attempts); raises only when there is nothing to read."""
    run_dir = Path(run_dir)
    marks = read_marks(run_dir)
    if not marks["driver"] and not marks["flow"]:
        raise FileNotFoundError(
            f"{run_dir}/{DIR}: no driver or flow marks (was the run launched by mega.launch?)"
        )
    attempts = _attempts(marks["driver"])
    survivors = _surviving(marks, attempts, _durable_step(run_dir))
    median_s = _median_step_s(marks)
    intervals = _flow_intervals(marks["flow"], marks["driver"]) + _driver_intervals(marks["driver"], attempts)
    everyone = {r for by_rank in marks["ranks"].values() for r in by_rank}
    missing_ranks = {
        a["attempt"]: sorted(everyone - set(marks["ranks"].get(a["attempt"], {})))
        for a in attempts
        if everyone - set(marks["ranks"].get(a["attempt"], {}))
    }
    rank_ivs, lost_steps = _attempts_rank_intervals(marks, attempts, survivors, median_s)
    intervals += rank_ivs
    times = [t for i in intervals for t in (i.t0, i.t1)]
    flow_start = next((e["t"] for e in marks["flow"] if e["event"] == "start"), None)
    flow_end = next((e["t"] for e in reversed(marks["flow"]) if e["event"] == "end"), None)
    t0 = flow_start if flow_start is not None else min(times)
    t1 = flow_end if flow_end is not None else max(times)
    totals, parts, timeline, lost_by_attempt = sweep(intervals, t0, t1)
    wall = t1 - t0
    from mega.goodput.samples import sample_ledger

    step_rows = [
        {**r, "attempt": a}
        for a, by_rank in marks["ranks"].items()
        for rows in by_rank.values()
        for r in rows
        if r["event"] == "step"
    ]
    target = max((r["step"] for r in step_rows), default=0)
    return {
        "run_dir": str(run_dir),
        "start": t0,
        "end": t1,
        "wall_s": wall,
        "ettr": totals["productive"] / wall if wall > 0 else 0.0,
        "ledger_s": totals,
        "unattributed_s": totals["unattributed"],
        "unattributed_fraction": totals["unattributed"] / wall if wall > 0 else 0.0,
        "unattributed_parts": parts,
        "attempts": [
            {**{k: a.get(k) for k in ("attempt", "ok", "reason")}, "restored_from": _restored_from(marks, a)}
            for a in attempts
        ],
        "lost_steps": lost_steps,
        "lost_s_by_attempt": lost_by_attempt,
        "missing_rank_files": missing_ranks,
        "clock": sorted(
            {e.get("clock", "host") for e in marks["driver"]}
            | {
                r.get("clock", "host")
                for by_rank in marks["ranks"].values()
                for rows in by_rank.values()
                for r in rows[:1]
            }
        ),
        "faults": [
            {"kind": f["kind"], "attempt": f.get("attempt"), "step": f.get("step"), "at": f["time"]}
            for f in marks["faults"]
        ],
        "samples": sample_ledger(step_rows, target),
        "timeline": [[round(a - t0, 4), round(b - t0, 4), c] for a, b, c in timeline],
    }


def write(run_dir: str | Path) -> dict:
    """Build the ledger and write ``<run_dir>/goodput.json``."""
    led = build(run_dir)
    (Path(run_dir) / GOODPUT_FILE).write_text(json.dumps(led, indent=1))
    return led
