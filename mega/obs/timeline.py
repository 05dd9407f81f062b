"""What one rank's step was made of: interval arithmetic over its recorded spans.

Pure functions over plain tuples (no torch, no clocks), shared by the rank (the step summary that
goes into ``metrics.jsonl``) and by the offline analysis (trace, heat map, stragglers).

A span is ``(name, cat, t0_ns, t1_ns, depth, blocked, args)``; ``cat`` is a phase (``step``,
``data``, ``forward``, ``backward``, ``optimizer``, ``checkpoint``, ``gc``, ``schedule``) or a
communication kind (``tp``, ``pp``, ``dp``, ``other``). ``blocked`` marks the training thread
sitting in a synchronous collective or in a ``wait()`` on an asynchronous one.

A point-to-point record is ``(op, peer, seq, post_ns, wait_t0_ns, wait_t1_ns, nbytes)``: this
rank's ``seq``-th ``op`` (``"send"``/``"recv"``) with global rank ``peer``, posted at ``post_ns``
and waited on from ``wait_t0_ns`` to ``wait_t1_ns`` (``None`` until waited on).

Exposed communication of a kind = the union of its blocked intervals. For pipeline p2p, a wait
counts only from when the transfer could start, i.e. once both ends had posted their operation
(the peer's post time brought to this rank's clock by the aligned clocks): a receive waiting on a
peer that is still computing is the peer's compute, not communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

COMM_KINDS = ("tp", "pp", "dp", "other")
COMPUTE_PHASES = ("forward", "backward", "optimizer")
PHASES = ("data", "forward", "backward", "optimizer", "checkpoint", "gc")
NS = 1e-9

Interval = tuple[int, int]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time as ``intervals`` (empty ones dropped)."""
    merged: list[list[int]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1][1] = b
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def total(intervals: Iterable[Interval]) -> int:
    """Length of the union of ``intervals``."""
    return sum(b - a for a, b in union(intervals))


def intersect(xs: Sequence[Interval], ys: Sequence[Interval]) -> list[Interval]:
    """Intersection of two unions (both sorted and disjoint, as ``union`` returns them)."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def post_key(op: str, me: int, peer: int, seq: int) -> tuple:
    """How a rank names its own p2p operation for its peers: (op, sender, receiver, seq)."""
    sender, receiver = (me, peer) if op == "send" else (peer, me)
    return (op, sender, receiver, seq)


def peer_key(op: str, me: int, peer: int, seq: int) -> tuple:
    """``post_key`` of the other end of this rank's operation: our send pairs with the peer's
    receive of the same (sender, receiver, seq), our receive with the peer's send."""
    return post_key("recv" if op == "send" else "send", peer, me, seq)


def p2p_exposed(record: Sequence, peer_post_ns: int | None) -> Interval | None:
    """The exposed part of one p2p wait: from when both ends had posted (or the wait began, if
    later) to the end of the wait. ``peer_post_ns`` is the other end's post time on this rank's
    clock; unknown (no match) books the whole wait."""
    post, w0, w1 = record[3], record[4], record[5]
    if w0 is None or w1 is None:
        return None
    ready = post if peer_post_ns is None else max(post, peer_post_ns)
    start = max(w0, ready)
    return (start, w1) if w1 > start else None


def summarize(
    spans: Sequence[Sequence],
    p2p: Sequence[Sequence],
    step_t0: int,
    step_t1: int,
    peer_posts: dict | None = None,
    rank: int | None = None,
) -> dict:
    """One rank's step in seconds.

    ``peer_posts`` maps ``post_key`` of peers' operations to their post time on this rank's
    clock (None: no correction, every p2p wait counts whole). Returns ``step_s``, ``compute_s``
    (forward/backward/optimizer time not blocked in communication), ``exposed_<kind>_s`` per
    communication kind, ``pp_wait_s`` (raw p2p waits, peers' compute included), the phases'
    times (``data_s``, ``optimizer_s``, ``checkpoint_s``, ``gc_s``) and ``p2p_ops``.
    """
    blocked: dict[str, list[Interval]] = {k: [] for k in COMM_KINDS}
    phases: dict[str, list[Interval]] = {k: [] for k in PHASES}
    raw_blocked: list[Interval] = []
    for _name, cat, t0, t1, _depth, is_blocked, args in spans:
        if cat in phases:
            phases[cat].append((t0, t1))
        elif is_blocked and cat in blocked:
            raw_blocked.append((t0, t1))
            if not (cat == "pp" and isinstance(args, dict) and "p2p" in args):
                blocked[cat].append((t0, t1))  # p2p waits are booked below, corrected
    for rec in p2p:
        if rec[4] is None:
            continue
        raw_blocked.append((rec[4], rec[5]))
        peer_post = None if peer_posts is None else peer_posts.get(peer_key(rec[0], rank, rec[1], rec[2]))
        exposed = p2p_exposed(rec, peer_post)
        if exposed is not None:
            blocked["pp"].append(exposed)
    comm = union(raw_blocked)
    compute = union(phases["forward"] + phases["backward"] + phases["optimizer"])
    compute_ns = total(compute) - sum(b - a for a, b in intersect(compute, comm))
    return {
        "step_s": (step_t1 - step_t0) * NS,
        "compute_s": compute_ns * NS,
        **{f"exposed_{k}_s": total(v) * NS for k, v in blocked.items()},
        "pp_wait_s": total((r[4], r[5]) for r in p2p if r[4] is not None) * NS,
        **{f"{k}_s": total(phases[k]) * NS for k in ("data", "optimizer", "checkpoint", "gc")},
        "p2p_ops": len(p2p),
    }
