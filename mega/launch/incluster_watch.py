"""The hang watcher where no driver runs: beside node 0's agent, in a pod the cluster keeps alive.

On Kubernetes the cluster's controllers (JobSet, the Job controller) restart pods; no process of
ours holds the nodes to stop a hung attempt. This watcher reads the heartbeats of the current
attempt (mega.stability.detect.Watcher: hang detection and localisation as under the driver) and
ends a hung attempt through the heartbeat channel (mega.stability.heartbeat_redis): it writes the stop
order of the attempt, which every rank's heartbeat thread reads within ``stability.heartbeat_s``
and obeys by exiting with ``heartbeat_redis.RESTART_EXIT_CODE``; the pod entry (mega.launch.pod) exits
with that code, which the workload's failure policy answers with a restart of every pod. The next
pods start as the next attempt (``heartbeat_redis.generation_key``) and restore ``latest``.

The culprit's node (its Kubernetes node name, published by its pod entry) is added to the run's
evicted set: ``evicted_hosts`` names it for the next placement (``launcher.kubernetes.avoid_hosts``,
a node anti-affinity). Nothing here is Kubernetes-specific: tests run it on ``local-nodes``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from mega.stability import heartbeat_redis
from mega.stability.detect import Watcher

ORDER_TTL_S = 7 * 86400


def node_name_key(prefix: str, node: int) -> str:
    return f"{prefix}:nodename:{node}"


def evicted_key(prefix: str) -> str:
    return f"{prefix}:evicted"


def generation(client, prefix: str) -> int:
    """The attempt pods starting now belong to (0 before any stop order)."""
    value = client.get(heartbeat_redis.generation_key(prefix))
    return int(value) if value else 0


def evicted_hosts(client, prefix: str) -> list[str]:
    """Nodes the watcher took out of the run: the next pods' anti-affinity."""
    return sorted(v.decode() if isinstance(v, bytes) else v for v in client.smembers(evicted_key(prefix)))


class InClusterWatch:
    """Follows the run's current attempt; ``poll()`` returns the stop order it issued, or None."""

    def __init__(self, cfg, hb_env: dict[str, str], log: Callable[[str], None] = print):
        self.cfg, self.hb_env, self.log = cfg, hb_env, log
        self.client, self.prefix = heartbeat_redis.client_from_env(hb_env)
        if self.client is None:
            raise ValueError(f"no heartbeat channel: ${heartbeat_redis.URL_ENV} is not set")
        self.attempt = generation(self.client, self.prefix)
        self.watcher = Watcher(cfg, hb_env, self.attempt, log)

    def poll(self) -> dict | None:
        w = self.watcher
        verdict = w.poll()
        if not verdict and w.last_progress is not None and not any(b.get("closed") for b in w.beats.values()):
            # under a driver, its stall check owns the cap (stability.hang_timeout_s); here nobody else does
            stalled = time.time() - w.last_progress
            if stalled > self.cfg.stability.hang_timeout_s and not any(i.kind == "hang" for i in w.incidents):
                verdict = w._declare_hang(time.time(), stalled, self.cfg.stability.hang_timeout_s)
        return self.stop(verdict) if verdict else None

    def stop(self, reason: str) -> dict:
        """Tell every rank of the attempt to exit with the restart code; name the culprit's node."""
        hang = next((i for i in reversed(self.watcher.incidents) if i.kind == "hang"), None)
        culprit = (hang.culprit or {}) if hang else {}
        evict = []
        if culprit.get("node") is not None:
            name = self.client.get(node_name_key(self.prefix, culprit["node"]))
            evict = [name.decode() if isinstance(name, bytes) else name] if name else []
        order = {
            "attempt": self.attempt,
            "reason": reason,
            "exit_code": heartbeat_redis.RESTART_EXIT_CODE,
            "culprit": culprit,
            "evict": evict,
            "time": time.time(),
        }
        pipe = self.client.pipeline(transaction=True)
        pipe.set(heartbeat_redis.stop_key(self.prefix, self.attempt), json.dumps(order), ex=ORDER_TTL_S)
        pipe.set(heartbeat_redis.generation_key(self.prefix), self.attempt + 1)
        if evict:
            pipe.sadd(evicted_key(self.prefix), *evict)
        pipe.execute()
        if hang is not None:
            hang.write(self.cfg.train.run_dir)
        self.log(
            f"attempt {self.attempt}: told every rank to exit with {heartbeat_redis.RESTART_EXIT_CODE}"
            + (f"; node {evict[0]} is evicted from the next placement" if evict else "")
        )
        return order


def watch_in_thread(
    cfg, hb_env: dict[str, str], log: Callable[[str], None] = print, poll_s: float = 0.5
) -> tuple[threading.Thread, threading.Event]:
    """Run the watcher in a daemon thread until the returned event is set (or it stopped an attempt)."""
    done = threading.Event()

    def loop() -> None:
        try:
            watch = InClusterWatch(cfg, hb_env, log)
            while not done.wait(poll_s):
                if watch.poll() is not None:
                    return
        except Exception as err:
            log(f"in-cluster watcher stopped: {type(err).__name__}: {err}")

    thread = threading.Thread(target=loop, name="mega-incluster-watch", daemon=True)
    thread.start()
    return thread, done
