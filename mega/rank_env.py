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
# A module whose ``watch(pid, env)`` each warm client runs for the process it forked (the heartbeat
# environment names mega.stability.liveness): mega.warm stays below the packages that plug in here.
CLIENT_HOOK_ENV = "MEGA_CLIENT_HOOK"
PEAK_FLOPS_ENV = "MEGA_PEAK_FLOPS"  # "<FLOP/s>@<world size>": the previous attempt's measured CPU peak


def attempt() -> int:
    """This process's attempt number (0 outside a launched job)."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))


def peak_flops(world_size: int) -> float | None:
    """The CPU peak the previous attempt of this run measured at ``world_size`` ranks (the driver
    hands it on); None when there is none, or it was measured at another size."""
    value, _, world = os.environ.get(PEAK_FLOPS_ENV, "").partition("@")
    try:
        return float(value) if world and int(world) == world_size else None
    except ValueError:
        return None


def peak_flops_env(peak: float | None, world_size: int | None) -> dict[str, str]:
    """The environment that hands ``peak`` (measured at ``world_size`` ranks) to the next attempt."""
    return {PEAK_FLOPS_ENV: f"{peak!r}@{world_size}"} if peak and world_size else {}
