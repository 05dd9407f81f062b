"""Clock offsets between ranks, estimated at start from round trips through the rendezvous store.

Every rank timestamps with ``time.perf_counter_ns`` (CLOCK_MONOTONIC): one clock per machine, but
unrelated between machines. A *clock domain* is the ranks that share a clock, i.e. a node
(torchrun's ``GROUP_RANK``). Rank 0's clock is the reference. The first rank of every other domain
does ``rounds`` NTP-style round trips with rank 0 over the store::

    leader: t0 = now(); set(ping i); get(pong i) -> rank 0's time r; t1 = now()
    offset = r - (t0 + t1) / 2,  uncertainty <= (t1 - t0) / 2

and keeps the round trip with the smallest RTT. The other ranks of the domain read their leader's
offset (same clock). ``aligned = local + offset``. Ranks of rank 0's domain have offset 0 exactly.

A rank given an injected skew (``fault.clock_skew_rank``, a drill) is a domain of its own, so the
estimate has something to find even on one machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "mega-obs-clock"


@dataclass(frozen=True)
class ClockEstimate:
    offset_ns: int  # add to a local timestamp to get rank 0's clock
    error_ns: int  # half the best round trip (0 in rank 0's domain)
    domain: str
    rounds: int

    def as_dict(self) -> dict:
        return {
            "clock_offset_ns": self.offset_ns,
            "clock_error_ns": self.error_ns,
            "clock_domain": self.domain,
            "clock_rounds": self.rounds,
        }


def leaders(domains: list[str]) -> dict[str, int]:
    """First rank of every clock domain (``domains[r]`` is rank r's domain)."""
    out: dict[str, int] = {}
    for rank, domain in enumerate(domains):
        out.setdefault(domain, rank)
    return out


def serve(store, domains: list[str], rounds: int, clock: Callable[[], int] = time.perf_counter_ns) -> None:
    """Rank 0: answer every other domain leader's pings with rank 0's time, leader by leader."""
    for domain, leader in leaders(domains).items():
        if domain == domains[0]:
            continue
        for i in range(rounds):
            store.get(f"{PREFIX}/ping/{leader}/{i}")  # blocks until the leader pings
            store.set(f"{PREFIX}/pong/{leader}/{i}", str(clock()))


def probe(store, rank: int, rounds: int, clock: Callable[[], int] = time.perf_counter_ns) -> tuple[int, int]:
    """A domain leader: ``rounds`` round trips with rank 0; (offset, error) of the best one."""
    best = None
    for i in range(rounds):
        t0 = clock()
        store.set(f"{PREFIX}/ping/{rank}/{i}", "1")
        ref = int(store.get(f"{PREFIX}/pong/{rank}/{i}"))
        t1 = clock()
        rtt = t1 - t0
        if best is None or rtt < best[0]:
            best = (rtt, ref - (t0 + t1) // 2)
    return best[1], best[0] // 2


def estimate(
    store, rank: int, domains: list[str], rounds: int = 8, clock: Callable[[], int] = time.perf_counter_ns
) -> ClockEstimate:
    """This rank's offset to rank 0's clock. Every rank calls it once, at the same point."""
    domain = domains[rank]
    if domain == domains[0]:
        if rank == 0:
            serve(store, domains, rounds, clock)
        return ClockEstimate(0, 0, domain, 0)
    leader = leaders(domains)[domain]
    if rank == leader:
        offset, error = probe(store, rank, rounds, clock)
        store.set(f"{PREFIX}/offset/{domain}", f"{offset},{error}")
    else:
        offset, error = (int(x) for x in store.get(f"{PREFIX}/offset/{domain}").decode().split(","))
    return ClockEstimate(offset, error, domain, rounds)
