"""Whether a rank's process runs at all, as its node sees it: the second witness of a silent rank.

A rank's heartbeat stops both when its process does not run (stopped by SIGSTOP, a debugger or a
frozen cgroup; blocked in the kernel; dead) and when only its heartbeat thread is starved (the
training thread holds the GIL in a long C call of the set-up, on a loaded host). Once training
steps, the watcher tells them apart by the steps; before the first step it cannot, so a silent
rank was a hang only after ``stability.min_hang_s``. A process that used no CPU at all for two
heartbeat intervals is not starved: it is not running.

The witness is the warm client (mega/warm/client.py): torchrun's stand-in for the rank, on the
same node, idle while it waits for the rank to exit. Every ``stability.heartbeat_s`` its thread
reads the rank's ``/proc/<pid>/stat`` and writes ``{time, pid, state, cpu_s, still_s}``
(``still_s``: how long the process's CPU time has not moved) to ``heartbeat_redis.proc_key``,
bounded as every heartbeat write (heartbeat_redis.TIMEOUT_S, dropped on failure). Without warm
processes there is no witness and the ``min_hang_s`` rule stands.
"""

from __future__ import annotations

import json
import threading
import time

from mega import procstat, rank_env
from mega.stability import heartbeat_redis

STILL_BEATS = 2  # heartbeat intervals without any CPU that make a silent process "not running"


def not_running(report: dict | None, now: float, heartbeat_s: float) -> bool:
    """A fresh report (written within ``STILL_BEATS`` intervals) of a process that used no CPU for
    ``STILL_BEATS`` intervals, or is stopped or dead."""
    if not report or now - report.get("time", float("-inf")) > STILL_BEATS * heartbeat_s:
        return False
    return (
        report.get("state") in ("T", "t", "Z", "X") or report.get("still_s", 0) >= STILL_BEATS * heartbeat_s
    )


class Reporter:
    """The thread that writes one rank's process state every ``interval_s`` until it exits."""

    def __init__(self, env: dict[str, str], key: str, pid: int, interval_s: float):
        self.env, self.key, self.pid, self.interval_s = env, key, pid, interval_s
        self.ttl_s = max(2, int(round(10 * interval_s)))  # a dead run's keys go by themselves
        self._thread = threading.Thread(target=self._run, name="mega-liveness", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def _run(self) -> None:
        import redis  # here, not in the client's main thread: it relays signals meanwhile

        client, _ = heartbeat_redis.client_from_env(self.env)
        last_cpu, still_since = None, time.time()
        while True:  # until the rank is gone; a daemon thread, it ends with the client too
            stat = procstat.read(self.pid)
            if stat is None:
                return
            now, cpu_s = time.time(), stat.cpu_s
            if cpu_s != last_cpu:
                last_cpu, still_since = cpu_s, now
            record = {"time": now, "pid": self.pid, "state": stat.state, "cpu_s": cpu_s}
            record["still_s"] = round(now - still_since, 3)
            try:
                client.set(self.key, json.dumps(record), ex=self.ttl_s)
            except (redis.RedisError, OSError):
                pass  # dropped, as a heartbeat: the next one is tried on time
            time.sleep(self.interval_s)


def watch(pid: int, env: dict[str, str]) -> None:
    """The warm client's hook (``rank_env.CLIENT_HOOK_ENV``, set by ``heartbeat_redis.heartbeat_env``):
    report ``pid``'s state while it runs, if it is a rank of a run with heartbeats."""
    if reporter := reporter_from_env(pid, env):
        reporter.start()


def reporter_from_env(pid: int, env: dict[str, str]) -> Reporter | None:
    """The reporter of a torchrun worker (``RANK`` and ``LOCAL_RANK`` set) whose run has heartbeats;
    None for anything else (the agent itself, a run without heartbeats)."""
    if "LOCAL_RANK" not in env or "RANK" not in env:
        return None
    if not env.get(heartbeat_redis.URL_ENV):
        return None
    attempt = int(env.get(rank_env.ATTEMPT_ENV, "0"))
    key = heartbeat_redis.proc_key(env[heartbeat_redis.PREFIX_ENV], attempt, int(env["RANK"]))
    return Reporter(env, key, pid, float(env.get(heartbeat_redis.INTERVAL_ENV, "1")))
