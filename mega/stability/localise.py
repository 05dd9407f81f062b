"""Which rank holds a hung job up: a pure function of the ranks' identities and latest heartbeats.

Two kinds of evidence, in this order:

* **silence**: a rank whose heartbeat stopped (none within ``silent_after_s``) is stopped, frozen
  or gone: its heartbeat thread cannot run. Its peers keep beating from inside the collective they
  wait in. Several silent ranks on one node point at the node.
* **sequence numbers**: every rank publishes, per process group, how many collectives it has
  entered. In a hang the members that reached a collective wait for those that did not; the ones
  behind are culprits or victims (a rank waiting in a TP collective falls behind its DP peers that
  reached the next DP collective). The culprit is behind in some group and ahead of nobody in any
  of its groups: it never reached a collective at all.

The verdict names the rank, its node, its (tp, pp, dp) coordinates, the group it holds up (the
one its peers are furthest ahead in) and by how many collectives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Culprit:
    rank: int
    node: int | None
    host: str | None
    coords: dict  # {"tp": i, "pp": j, "dp": k}
    reason: str  # "silent" | "behind"
    group: str | None  # the group it holds up (tp, pp, dp, world), None when no sequence evidence
    group_ranks: list[int] = field(default_factory=list)
    behind: int | None = None  # collectives its peers in `group` are ahead of it
    silent_ranks: list[int] = field(default_factory=list)
    silent_nodes: list[int] = field(default_factory=list)  # nodes every rank of which is silent

    def describe(self) -> str:
        c = self.coords
        where = f"rank {self.rank} (node {self.node}, tp {c.get('tp')}, pp {c.get('pp')}, dp {c.get('dp')})"
        what = "stopped sending heartbeats" if self.reason == "silent" else "never reached a collective"
        group = (
            (
                f"; holds up its {self.group} group {self.group_ranks}"
                + (f", {self.behind} collective(s) behind" if self.behind is not None else "")
            )
            if self.group
            else ""
        )
        return f"{where} {what}{group}"

    def to_dict(self) -> dict:
        return asdict(self)


def _lags(rank: int, ident: dict, beats: dict[int, dict]) -> dict[str, int]:
    """Per group of ``rank``: how far the furthest peer is ahead of it (groups with known numbers)."""
    mine = (beats.get(rank) or {}).get("seq") or {}
    out = {}
    for name, members in (ident.get("groups") or {}).items():
        if mine.get(name) is None or len(members) < 2:
            continue
        peers = [(beats.get(p) or {}).get("seq", {}).get(name) for p in members if p != rank]
        peers = [s for s in peers if s is not None]
        if peers:
            out[name] = max(peers) - mine[name]
    return out


def _worst(lags: dict[str, int]) -> tuple[str | None, int | None]:
    """The group a rank holds up most (ties: the smallest group kind first, tp before dp)."""
    order = {"tp": 0, "pp": 1, "dp": 2, "dp_cp": 3, "dp_opt": 4, "dp_gloo": 5, "embd": 6, "mp": 7, "world": 8}
    if not lags:
        return None, None
    name = max(lags, key=lambda n: (lags[n], -order.get(n, 9)))
    return name, lags[name]


def localise(
    identities: dict[int, dict], beats: dict[int, dict | None], now: float, silent_after_s: float
) -> Culprit | None:
    """The culprit of a hang, or None when every rank beats and no group has one behind.

    ``identities``: rank -> what the rank published at start (node, host, tp/pp/dp, groups: name ->
    member ranks). ``beats``: rank -> its latest heartbeat seen (``time``, ``seq``: group name ->
    collectives entered), None or absent when none was ever seen. A rank is silent when its latest
    heartbeat is older than ``silent_after_s`` at ``now`` (or there is none).
    """
    ranks = sorted(identities)
    silent = [r for r in ranks if not beats.get(r) or now - beats[r].get("time", 0) > silent_after_s]
    by_node: dict = {}
    for r in ranks:
        by_node.setdefault(identities[r].get("node"), []).append(r)
    silent_nodes = sorted(n for n, rs in by_node.items() if n is not None and all(r in silent for r in rs))

    def culprit(rank: int, reason: str) -> Culprit:
        ident = identities[rank]
        group, behind = _worst(_lags(rank, ident, beats))
        return Culprit(
            rank,
            ident.get("node"),
            ident.get("host"),
            {k: ident.get(k) for k in ("tp", "pp", "dp")},
            reason,
            group,
            list((ident.get("groups") or {}).get(group, [])) if group else [],
            behind,
            silent,
            silent_nodes,
        )

    if silent:
        # the silent rank its peers are furthest ahead of (it stopped first), then the lowest rank
        lags = {r: _worst(_lags(r, identities[r], beats))[1] for r in silent}
        first = max(silent, key=lambda r: (lags[r] if lags[r] is not None else -1, -r))
        return culprit(first, "silent")
    behind = {r: lags for r in ranks if (lags := _lags(r, identities[r], beats)) and max(lags.values()) > 0}
    # a rank ahead of some peer has reached a collective and waits in it: a victim, not the cause
    roots = [r for r in behind if all(_not_ahead(r, identities[r], beats))]
    if not roots:
        return None
    return culprit(max(roots, key=lambda r: (max(behind[r].values()), -r)), "behind")


def _not_ahead(rank: int, ident: dict, beats: dict[int, dict]):
    """For each group of ``rank``: True when no peer has entered fewer collectives than it."""
    mine = (beats.get(rank) or {}).get("seq") or {}
    for name, members in (ident.get("groups") or {}).items():
        if mine.get(name) is None:
            continue
        peers = [(beats.get(p) or {}).get("seq", {}).get(name) for p in members if p != rank]
        yield all(s is None or s >= mine[name] for s in peers)
