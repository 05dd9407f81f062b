"""A run's per-rank timelines read back: per rank and step numbers, stragglers, heat-map data.

``load(run_dir)`` reads ``<run_dir>/obs/attempt-*/rank-*.jsonl``. A step replayed after a restart
is taken from the latest attempt that recorded it (as ``metrics.jsonl`` does).

Straggler score of a rank: over the steps, the median of its compute time divided by the median
compute time of the ranks doing the same work in that step (same pipeline stage: the same layers,
the same microbatch count). 1.0 is typical; a rank 30 % slower than its peers scores 1.3. Compute
time is forward, backward and optimizer time not blocked in communication (mega.obs.timeline),
so a rank waiting on a slow peer does not look slow itself.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from mega.obs import timeline

OBS_DIR = "obs"
_RANK_FILE = re.compile(r"rank-(\d+)\.jsonl$")
_ATTEMPT_DIR = re.compile(r"attempt-(\d+)$")


@dataclass
class RunTimeline:
    """Every rank's header (identity, clock offset) and step records, by rank then step."""

    run_dir: Path
    headers: dict[int, dict] = field(default_factory=dict)
    steps: dict[int, dict[int, dict]] = field(default_factory=dict)  # rank -> step -> record
    accounting: dict[int, dict] = field(default_factory=dict)  # rank -> its last attempt's accounting
    arrivals: dict[tuple, dict] = field(default_factory=dict, repr=False)  # (kind, group, step) -> launches

    @property
    def ranks(self) -> list[int]:
        return sorted(self.headers)

    def step_numbers(self) -> list[int]:
        return sorted({s for per_rank in self.steps.values() for s in per_rank})

    def ordered_ranks(self) -> list[int]:
        """Ranks laid out by their parallel coordinates: pipeline stage, then DP, then TP."""
        return sorted(
            self.ranks,
            key=lambda r: (
                self.headers[r].get("pp", 0),
                self.headers[r].get("dp", 0),
                self.headers[r].get("tp", 0),
                r,
            ),
        )

    def offset(self, rank: int, step: int | None = None) -> int:
        """ns to add to a rank's timestamps to put them on rank 0's clock (its record's attempt)."""
        if step is not None and "_offset" in self.steps.get(rank, {}).get(step, {}):
            return self.steps[rank][step]["_offset"]
        return self.headers[rank].get("clock_offset_ns", 0)


def load(run_dir: str | Path, steps: tuple[int, int] | None = None) -> RunTimeline:
    """Read the run's span files (``steps``: an inclusive 1-based range, to read less)."""
    run_dir = Path(run_dir)
    tl = RunTimeline(run_dir)
    attempts = sorted(
        (int(m.group(1)), d)
        for d in (run_dir / OBS_DIR).glob("attempt-*")
        if (m := _ATTEMPT_DIR.search(d.name))
    )
    if not attempts:
        raise FileNotFoundError(f"no span files under {run_dir / OBS_DIR} (was obs.enabled off?)")
    for attempt, directory in attempts:  # later attempts overwrite replayed steps
        for path in sorted(directory.glob("rank-*.jsonl")):
            rank = int(_RANK_FILE.search(path.name).group(1))
            header = None
            with open(path) as f:
                for line in f:
                    if not line.strip():
                        continue
                    try:
                        item = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # the last line of a rank killed while its flush thread wrote
                    if "header" in item:
                        header = item["header"]
                        tl.headers[rank] = header
                    elif "accounting" in item:
                        tl.accounting[rank] = item["accounting"]
                    elif "step" in item:
                        if steps is not None and not steps[0] <= item["step"] <= steps[1]:
                            continue
                        item["_offset"] = (header or {}).get("clock_offset_ns", 0)
                        item["_attempt"] = attempt
                        tl.steps.setdefault(rank, {})[item["step"]] = item
    return tl


def _summary(record: dict) -> dict:
    return record.get("summary") or {}


def table(tl: RunTimeline, key: str = "compute_s") -> dict[int, dict[int, float]]:
    """``key`` of every (rank, step) summary: rank -> step -> value."""
    return {r: {s: _summary(rec).get(key) for s, rec in tl.steps.get(r, {}).items()} for r in tl.ranks}


def work_groups(tl: RunTimeline) -> dict[tuple, list[int]]:
    """Ranks that do the same work: the same pipeline stage (its layers and microbatches)."""
    groups: dict[tuple, list[int]] = {}
    for r in tl.ranks:
        groups.setdefault(("pp", tl.headers[r].get("pp", 0)), []).append(r)
    return groups


def relative_compute(tl: RunTimeline) -> dict[int, dict[int, float]]:
    """Compute time of each (rank, step) over the median of its work group in that step."""
    compute = table(tl, "compute_s")
    out: dict[int, dict[int, float]] = {r: {} for r in tl.ranks}
    for members in work_groups(tl).values():
        for step in tl.step_numbers():
            values = {r: compute[r].get(step) for r in members if compute[r].get(step) is not None}
            if not values:
                continue
            median = statistics.median(values.values())
            for r, v in values.items():
                out[r][step] = v / median if median > 0 else 1.0
    return out


def straggler_scores(tl: RunTimeline, skip_first: bool = True) -> dict[int, float]:
    """Per rank: the median over steps of its relative compute time (the first step, warm-up,
    left out when there are others)."""
    rel = relative_compute(tl)
    scores = {}
    for r, by_step in rel.items():
        steps = sorted(by_step)
        if skip_first and len(steps) > 1:
            steps = steps[1:]
        scores[r] = statistics.median(by_step[s] for s in steps) if steps else float("nan")
    return scores


def heatmap_data(tl: RunTimeline) -> dict:
    """What the heat map draws: ranks (ordered by pp, dp, tp) x steps of compute seconds and of
    compute relative to the work group, with labels and the straggler scores."""
    ranks = tl.ordered_ranks()
    steps = tl.step_numbers()
    compute, rel = table(tl, "compute_s"), relative_compute(tl)
    scores = straggler_scores(tl)
    return {
        "ranks": ranks,
        "labels": [_coord_label(tl.headers[r]) for r in ranks],
        "stages": [tl.headers[r].get("pp", 0) for r in ranks],
        "steps": steps,
        "compute_s": [[compute[r].get(s) for s in steps] for r in ranks],
        "relative": [[rel[r].get(s) for s in steps] for r in ranks],
        "scores": [scores[r] for r in ranks],
        "top_straggler": max(scores, key=lambda r: scores[r]) if scores else None,
    }


def _coord_label(h: dict) -> str:
    return f"pp{h.get('pp', 0)} dp{h.get('dp', 0)} tp{h.get('tp', 0)} · r{h.get('rank')} n{h.get('node', 0)}"


def exposed_per_step(tl: RunTimeline, from_arrival: bool = False) -> list[dict]:
    """Per step, per communication kind: the exposed seconds, max and mean over ranks. With
    ``from_arrival`` also ``exposed_{dp,tp}_from_arrival_{max,mean}_s``: the same without the waits
    on a late peer (``exposed_intervals``)."""
    out = []
    for step in tl.step_numbers():
        row: dict = {"step": step}
        for kind in ("tp", "pp", "dp", "other"):
            values = [
                v
                for r in tl.ranks
                if (v := _summary(tl.steps.get(r, {}).get(step, {})).get(f"exposed_{kind}_s")) is not None
            ]
            row[f"exposed_{kind}_max_s"] = max(values) if values else None
            row[f"exposed_{kind}_mean_s"] = statistics.fmean(values) if values else None
        for kind in ("tp", "dp") if from_arrival else ():
            values = [
                exposed_by_op(tl, r, kind, [step], from_arrival=True).get("total", 0.0)
                for r in tl.ranks
                if step in tl.steps.get(r, {})
            ]
            row[f"exposed_{kind}_from_arrival_max_s"] = max(values) if values else None
            row[f"exposed_{kind}_from_arrival_mean_s"] = statistics.fmean(values) if values else None
        out.append(row)
    return out


_BUCKET_SUFFIX = re.compile(r" bucket \d+( start| wait)?$")
# how a launch and the wait on it name the same operation: "X bucket 3 start" / "X bucket 3 wait"
# (DP buckets), "launch X" / "wait X" (asynchronous collectives), "ring start" / "ring wait"
_LAUNCH_WAIT = re.compile(r"^(launch|wait) | (start|wait)$")
# the ranks a collective of each kind runs over: same coordinates but the kind's own
_GROUP_OF = {"dp": ("tp", "pp"), "tp": ("pp", "dp")}


def group_peers(tl: RunTimeline, rank: int, kind: str) -> list[int]:
    """The other ranks of ``rank``'s ``kind`` (dp or tp) group, from the headers' coordinates."""
    h = tl.headers[rank]
    same = _GROUP_OF[kind]
    return [r for r in tl.ranks if r != rank and all(tl.headers[r].get(k, 0) == h.get(k, 0) for k in same)]


def _keyed(record: dict, kind: str):
    """``record``'s spans of ``kind`` in time order, each with its operation's key and whether it
    is a launch rather than the wait on one. The key: the name without ``launch``/``start``/
    ``wait``, whether the operation is asynchronous (a launch not blocked, and the wait on it) or
    synchronous (one blocked span, launch and wait at once), and which occurrence of that it is in
    the step; every rank runs the same operations in the same order, so keys match across ranks."""
    seen: dict[tuple, int] = {}
    for name, cat, t0, t1, _depth, blocked, _args in sorted(record.get("spans", []), key=lambda x: x[2]):
        if cat != kind:
            continue
        is_wait = name.startswith("wait ") or name.endswith(" wait")
        op = (_LAUNCH_WAIT.sub("", name), is_wait or not blocked, is_wait)
        n = seen.get(op, 0)
        seen[op] = n + 1
        yield name, t0, t1, blocked, (*op[:2], n), not is_wait


def _last_launches(tl: RunTimeline, rank: int, kind: str, step: int) -> dict[tuple, int]:
    """Per operation key of the step: when the last rank of ``rank``'s group (itself included:
    its own launch precedes its own wait) launched it, on rank 0's clock; keys some member did not
    record are left out. Computed once per group and step (the report asks for every member)."""
    group = tuple(sorted([rank, *group_peers(tl, rank, kind)]))
    if (kind, group, step) in tl.arrivals:
        return tl.arrivals[(kind, group, step)]
    latest: dict[tuple, int] = {}
    counted: dict[tuple, int] = {}
    records = [tl.steps.get(member, {}).get(step) for member in group]
    if None in records:  # a member did not record the step: nothing to correct with
        records = []
    for member, record in zip(group, records):
        shift = tl.offset(member, step)  # the member's clock -> rank 0's
        for _name, t0, _t1, _blocked, key, launch in _keyed(record, kind):
            if launch:
                latest[key] = max(latest.get(key, t0 + shift), t0 + shift)
                counted[key] = counted.get(key, 0) + 1
    out = tl.arrivals[(kind, group, step)] = {k: t for k, t in latest.items() if counted[k] == len(group)}
    return out


def exposed_intervals(
    tl: RunTimeline, rank: int, kind: str, step: int, from_arrival: bool = False
) -> dict[str, list[timeline.Interval]]:
    """``rank``'s blocked intervals of ``kind`` in ``step`` by operation (bucket numbers dropped).

    ``from_arrival``: each one counts only from when the last peer of the group had launched the
    same operation (its same occurrence in the step, clocks aligned): until then the rank waits on
    a peer that is still computing, which is that peer's compute (a straggler), not communication:
    the correction mega.obs.timeline makes for pipeline p2p, here for DP and TP collectives and
    the TP ring's steps (a ring step's wait from the last peer's post of the same step: at TP=2
    exactly the peer it exchanges with; at larger TP the latest of the group, a little later than
    the two neighbours the step needs)."""
    record = tl.steps.get(rank, {}).get(step)
    if record is None:
        return {}
    arrivals = _last_launches(tl, rank, kind, step) if from_arrival else {}
    own = tl.offset(rank, step) if arrivals else 0  # rank 0's clock -> this rank's: subtract
    groups: dict[str, list[timeline.Interval]] = {}
    for name, t0, t1, blocked, key, _launch in _keyed(record, kind):
        if blocked:
            start = max(t0, arrivals[key] - own) if key in arrivals else t0
            groups.setdefault(_BUCKET_SUFFIX.sub("", name), []).append((start, max(start, t1)))
    return groups


def exposed_by_op(
    tl: RunTimeline, rank: int, kind: str, steps: list[int], from_arrival: bool = False
) -> dict[str, float]:
    """``rank``'s exposed communication of ``kind`` split by what it waited for: the blocked spans
    of that kind grouped by name (a DP bucket's number and start/wait dropped: ``all_gather
    params``, ``reduce_scatter grads``), each group's union per step, the median over ``steps``
    (a step without that operation counts 0), and ``total`` (the union of all of them: the step
    summary's ``exposed_<kind>_s``, or with ``from_arrival`` that less the waits on late peers; see
    ``exposed_intervals``). Pipeline p2p waits appear raw here; their corrected exposure is the
    step summary's ``exposed_pp_s``."""
    per_step: dict[str, list[float]] = {}
    present = [s for s in steps if s in tl.steps.get(rank, {})]
    for i, step in enumerate(present):
        groups = exposed_intervals(tl, rank, kind, step, from_arrival)
        everything = [iv for intervals in groups.values() for iv in intervals]
        for op, intervals in [*groups.items(), ("total", everything)]:
            per_step.setdefault(op, [0.0] * len(present))[i] = timeline.total(intervals) * timeline.NS
    return {op: round(statistics.median(v), 6) for op, v in sorted(per_step.items())}


def overhead(tl: RunTimeline) -> dict:
    """The recorder's counted cost over all ranks: sum of costs over sum of wall times."""
    acc = list(tl.accounting.values())
    total = sum(a["total_ns"] for a in acc)
    wall = sum(a["wall_ns"] for a in acc)
    return {
        "overhead": total / wall if wall else None,
        "ranks": len(acc),
        "total_s": total * 1e-9,
        "wall_s": wall * 1e-9,
        "max_rank_overhead": max((a["overhead"] for a in acc), default=None),
    }
