"""Where a relaunch's seconds go: each attempt after a failed one, from the driver's verdict to the
first step the new attempt finished, cut into its steps (docs/recovery.md).

Each boundary is the latest rank's mark (the slowest rank holds up everyone at the next
collective), so the steps add up to ``total_s``:

* ``stop``: verdict -> every process of the failed attempt gone (the driver's ``stopped`` mark);
* ``driver``: between attempts (store keys, incidents, a self-check, the backoff) -> ``launch``;
* ``agents_to_ranks``: ``launch`` -> the last rank process created (agents start, rendezvous,
  ranks forked or started);
* ``rank_imports``: process created -> ``main()`` (a cold process's imports; a fork's nothing);
* ``setup``: ``main()`` -> process group creation begins (config, megatron patches);
* ``groups``: process groups and megatron's parallel state;
* ``build``: model, optimizer, data -> the restore begins;
* ``restore``: the checkpoint (in-memory copy or durable ``latest``) loaded;
* ``first_step``: restore done -> the first step of the attempt finished.
"""

from __future__ import annotations

from mega.goodput.ledger import _attempts, read_marks

STEPS = (
    "stop",
    "driver",
    "agents_to_ranks",
    "rank_imports",
    "setup",
    "groups",
    "build",
    "restore",
    "first_step",
)


def _latest(rows_by_rank: dict[int, list[dict]], pick) -> float | None:
    """The latest over ranks of ``pick(rows)`` (a time or None); None when any rank lacks it."""
    times = [pick(rows) for rows in rows_by_rank.values()]
    return None if not times or any(t is None for t in times) else max(times)


def _event(name: str, key: str):
    return lambda rows: next((r[key] for r in rows if r["event"] == name), None)


def _header(key: str):
    return lambda rows: next((r.get(key) for r in rows if r["event"] == "header"), None)


def relaunch(marks: dict, attempt: dict, failed: dict) -> dict | None:
    """The steps of ``attempt`` (a relaunch after ``failed``), or None when a mark is missing
    (the attempt died before its first step)."""
    ranks = marks["ranks"].get(attempt["attempt"], {})
    if "verdict" not in failed or not ranks:
        return None
    bounds = [
        failed["verdict"],
        failed["stopped"],
        attempt["launch"],
        _latest(ranks, _header("created_t")),
        _latest(ranks, _header("main_t")),
        _latest(ranks, _event("group_creation", "t0")),
        _latest(ranks, _event("group_creation", "t1")),
        _latest(ranks, _event("restore", "t0")),
        _latest(ranks, _event("restore", "t1")),
        _latest(ranks, _event("step", "t1")),
    ]
    if any(b is None for b in bounds):
        return None
    steps = {name: round(b1 - b0, 3) for name, b0, b1 in zip(STEPS, bounds, bounds[1:])}
    return {
        "attempt": attempt["attempt"],
        "after": failed.get("reason", ""),
        "steps_s": steps,
        "total_s": round(bounds[-1] - bounds[0], 3),
    }


def recoveries(run_dir) -> list[dict]:
    """Every relaunch of the run after a failed attempt, its steps in seconds."""
    marks = read_marks(run_dir)
    attempts = _attempts(marks["driver"])
    out = []
    for failed, attempt in zip(attempts, attempts[1:]):
        if failed.get("ok") is False and (row := relaunch(marks, attempt, failed)) is not None:
            out.append(row)
    return out
