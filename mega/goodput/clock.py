"""The ledger's one clock: the heartbeat Redis server's ``TIME``.

The driver starts that Redis on its own host (or every process is given the same external one),
and every process that writes goodput marks (the driver, each rank) measures its offset to the
server's clock once, NTP-style: ``offset = server - (t0 + t1) / 2`` from the round trip with the
smallest RTT, error <= RTT / 2. Marks are ``time.time() + offset``. Without a Redis (stability
off) marks are the host's own ``time.time()``, which is one clock on one machine and NTP's
accuracy across machines; the mark files say which (``clock``).
"""

from __future__ import annotations

import time


def offset_to_redis(client, rounds: int = 5) -> tuple[float, float]:
    """(offset_s, error_s) of this host's ``time.time()`` to the Redis server's clock."""
    best = None
    for _ in range(rounds):
        t0 = time.time()
        sec, usec = client.time()
        t1 = time.time()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, sec + usec / 1e6 - (t0 + t1) / 2)
    return best[1], best[0] / 2


def from_env(env: dict[str, str] | None = None) -> dict:
    """This process's clock for marks: ``{"offset_s", "error_s", "clock"}``; never raises (a Redis
    that does not answer leaves the host clock, said so)."""
    from mega.stability import heartbeat_redis

    client, _ = heartbeat_redis.client_from_env(env)
    if client is None:
        return {"offset_s": 0.0, "error_s": None, "clock": "host"}
    try:
        offset, error = offset_to_redis(client)
    except Exception as e:
        return {"offset_s": 0.0, "error_s": None, "clock": f"host (redis: {type(e).__name__})"}
    return {"offset_s": offset, "error_s": error, "clock": "redis"}
