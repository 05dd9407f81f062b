"""Names of the environment variables a launcher hands every rank, read by several packages.

One constant per name, here at the bottom of the package order so any module may read them
(mega.cluster.rendezvous, the launch backends and the ranks' own modules). Names one module alone
reads and writes stay next to that module's code.
"""

from __future__ import annotations

import os

ATTEMPT_ENV = "MEGA_ATTEMPT"  # the attempt's number over the run's life: logs, store keys, fault drills
REDIS_PASSWORD_ENV = "MEGA_REDIS_PASSWORD"  # RedisStore's fallback when the URL has no password
AGENT_PID_ENV = "MEGA_AGENT_PID"  # the torchrun agent's pid where the rank is not its child (warm forks)


def attempt() -> int:
    """This process's attempt number (0 outside a launched job)."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))
