"""Free ports for servers started a moment later: ``python -m mega.ports [N]`` prints N of them.

A port probed with ``bind(0)`` comes from the kernel's ephemeral range, the same range every
outgoing connection and every other ``bind(0)`` draws from; on a busy machine (a test suite in two
workers, a node running eight ranks' gloo connections) it is often taken again between the probe
and the server's own bind, and a rendezvous store or a restarted server fails with EADDRINUSE.
Ports chosen here lie *below* that range, where only servers that name their port listen, and at
a random place in it, so two choosers at the same moment rarely meet.

Standard library only, importing nothing of mega: a Slurm batch script runs it on the first node
of an allocation (mega/launch/slurm.py embeds this file's source in the script).
"""

from __future__ import annotations

import random
import secrets
import socket
import sys
from pathlib import Path

LOWEST = 10_000  # below: well-known and registered services' ports


def ephemeral_range() -> range:
    """The kernel's ephemeral (``bind(0)`` and outgoing) port range."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_ports(n: int = 1, host: str = "") -> list[int]:
    """``n`` distinct ports that bind on ``host`` now, outside the ephemeral range."""
    ephemeral = ephemeral_range()
    candidates = [p for p in range(LOWEST, 65_536) if p not in ephemeral]
    rng = random.Random(secrets.randbits(64))
    socks: list[socket.socket] = []
    try:
        for port in rng.sample(candidates, min(len(candidates), 50 * n)):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)  # held open together so the n ports are distinct
        if len(socks) < n:
            raise RuntimeError(
                f"no {n} free ports outside the ephemeral range {ephemeral.start}-{ephemeral.stop - 1}"
            )
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


if __name__ == "__main__":
    print(*free_ports(int(sys.argv[1]) if len(sys.argv) > 1 else 1))
