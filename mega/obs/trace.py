"""``python -m mega.trace RUN_DIR [--steps a:b] [--out PATH]``: one Chrome trace of every rank.

Merges the ranks' span files (mega.obs.recorder) into one trace-event JSON that Perfetto
(ui.perfetto.dev) and chrome://tracing open: a process per rank, named
``node k / rank r (tp a, pp b, dp c)`` and ordered by pipeline stage, DP and TP rank, with

* ``main thread``: the training thread's spans, nested (step > forward-backward > forward /
  backward > collectives and waits; optimizer, data, checkpoint, gc);
* ``in flight tp|pp|dp|other``: asynchronous operations from their post to the end of their wait
  (pipeline sends and receives, DDP bucket reductions, async TP all-reduces);
* flow arrows from a pipeline send's post to the end of the matching receive's wait;
* counters per step: exposed communication per kind and compute time (ms).

Every rank's timestamps are moved to rank 0's clock (the offsets estimated at start); time 0 is
the earliest step start in the trace.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from mega.obs import analysis, timeline

MAIN_TID = 0
TRACKS = {kind: i + 1 for i, kind in enumerate(timeline.COMM_KINDS)}


def _steps_arg(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    first, _, last = text.partition(":")
    try:
        lo = int(first) if first else 1
        hi = int(last) if last else 10**12
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps takes a:b (1-based, inclusive), got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: need 1 <= a <= b")
    return lo, hi


def build(tl: analysis.RunTimeline) -> dict:
    """The Chrome trace (a dict with ``traceEvents``) of everything ``tl`` holds."""
    meta, events = [], []
    starts = [rec["t0"] + rec["_offset"] for per in tl.steps.values() for rec in per.values()]
    if not starts:
        raise ValueError(f"no steps recorded under {tl.run_dir}")
    origin = min(starts)
    sends = _send_posts(tl, origin)
    flow_ids = itertools.count(1)
    for index, rank in enumerate(tl.ordered_ranks()):
        meta += _rank_metadata(rank, index, tl.headers[rank].get("label", f"rank {rank}"))
        for step, rec in sorted(tl.steps.get(rank, {}).items()):
            events += _step_events(rec, step, rank, origin, sends, flow_ids)
    # by time, parents before their children at equal start (longer first), so viewers nest them
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "run_dir": str(tl.run_dir),
            "ranks": len(tl.ranks),
            "steps": tl.step_numbers(),
            "clock": "rank 0's perf_counter; other nodes aligned by store round trips",
        },
    }


def _send_posts(tl: analysis.RunTimeline, origin: int) -> dict:
    """(attempt, sender, receiver, seq) -> the trace time of the send's post."""
    sends = {}
    for rank in tl.ranks:
        for rec in tl.steps.get(rank, {}).values():
            for op, peer, seq, post, *_ in rec["p2p"]:
                if op == "send":
                    sends[(rec["_attempt"], rank, peer, seq)] = _us(post + rec["_offset"], origin)
    return sends


def _rank_metadata(rank: int, index: int, label: str) -> list[dict]:
    """A rank's process (name, place in the list) and its threads: the main one and one per
    in-flight kind."""
    return [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": index}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": MAIN_TID, "args": {"name": "main thread"}},
        *(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": f"in flight {kind}"}}
            for kind, tid in TRACKS.items()
        ),
    ]


def _step_events(rec: dict, step: int, rank: int, origin: int, sends: dict, flow_ids) -> list[dict]:
    """One step of one rank: the step, its spans, its p2p and other in-flight operations, its
    counters."""
    off = rec["_offset"]

    def us(t: int) -> float:
        return _us(t + off, origin)

    summary = rec.get("summary") or {}
    rounded = {k: round(v, 6) if isinstance(v, float) else v for k, v in summary.items()}
    events = [_complete(f"step {step}", "step", us(rec["t0"]), us(rec["t1"]), rank, MAIN_TID, rounded)]
    for name, cat, t0, t1, _depth, blocked, args in rec["spans"]:
        a = dict(args) if isinstance(args, dict) else {}
        if blocked:
            a["blocked"] = True
        events.append(_complete(name, cat, us(t0), us(t1), rank, MAIN_TID, a))
    for i, (op, peer, seq, post, _w0, w1, nbytes) in enumerate(rec["p2p"]):
        end = us(w1) if w1 is not None else us(rec["t1"])
        name = f"{op} {'->' if op == 'send' else '<-'} {peer}"
        pp_id = f"{rank}.{step}.p{i}"
        events += _async(name, "pp", us(post), end, rank, TRACKS["pp"], pp_id, {"seq": seq, "bytes": nbytes})
        if op == "recv" and w1 is not None:
            src = sends.get((rec["_attempt"], peer, rank, seq))
            if src is not None:
                events += _flow_arrow(next(flow_ids), peer, src, rank, end)
    for i, (kind, name, post, _w0, w1) in enumerate(rec["async"]):
        if w1 is not None:
            track = TRACKS.get(kind, TRACKS["other"])
            events += _async(name, kind, us(post), us(w1), rank, track, f"{rank}.{step}.a{i}", {})
    if summary:
        events += _counters(summary, rank, us(rec["t1"]))
    return events


def _flow_arrow(flow: int, sender: int, sent: float, receiver: int, received: float) -> list[dict]:
    """An arrow from a send's post to the end of the receive that matched it."""
    return [
        {"ph": "s", "name": "p2p", "cat": "p2p", "id": flow, "pid": sender, "tid": MAIN_TID, "ts": sent},
        {
            "ph": "f",
            "bp": "e",
            "name": "p2p",
            "cat": "p2p",
            "id": flow,
            "pid": receiver,
            "tid": MAIN_TID,
            "ts": received,
        },
    ]


def _counters(summary: dict, rank: int, ts: float) -> list[dict]:
    """The step's exposed communication by kind and its compute, as counter tracks."""
    exposed = {k: round(1e3 * summary[f"exposed_{k}_s"], 3) for k in timeline.COMM_KINDS}
    return [
        {
            "ph": "C",
            "name": "exposed communication (ms)",
            "pid": rank,
            "tid": MAIN_TID,
            "ts": ts,
            "args": exposed,
        },
        {
            "ph": "C",
            "name": "compute (ms)",
            "pid": rank,
            "tid": MAIN_TID,
            "ts": ts,
            "args": {"compute": round(1e3 * summary["compute_s"], 3)},
        },
    ]


def _us(ns: int, origin: int) -> float:
    return round((ns - origin) / 1000, 3)


def _complete(name, cat, ts, end, pid, tid, args) -> dict:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "ts": ts,
        "dur": round(max(0.0, end - ts), 3),
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _async(name, cat, ts, end, pid, tid, ident, args) -> list[dict]:
    return [
        {"ph": "b", "name": name, "cat": cat, "id": ident, "ts": ts, "pid": pid, "tid": tid, "args": args},
        {"ph": "e", "name": name, "cat": cat, "id": ident, "ts": max(ts, end), "pid": pid, "tid": tid},
    ]


def write(run_dir: str | Path, steps: tuple[int, int] | None = None, out: str | Path | None = None) -> Path:
    """Merge ``run_dir``'s span files into one trace JSON; returns its path (default
    ``<run_dir>/trace.json``, or ``trace-steps-a-b.json`` for a range)."""
    tl = analysis.load(run_dir, steps)
    trace = build(tl)
    if out is None:
        name = (
            "trace.json"
            if steps is None
            else f"trace-steps-{steps[0]}-{min(steps[1], max(tl.step_numbers()))}.json"
        )
        out = Path(run_dir) / name
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace, separators=(",", ":")))
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mega.trace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="a training run's directory (train.run_dir)")
    parser.add_argument(
        "--steps", type=_steps_arg, default=None, help="a:b, 1-based and inclusive (a: or :b too)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the trace goes (default: under RUN_DIR)"
    )
    return parser


def check_args(argv: list[str]) -> None:
    """Parse ``argv`` as ``main`` does, reading no run (a bad flag or --steps range exits)."""
    _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        path = write(args.run_dir, args.steps, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"mega.trace: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
