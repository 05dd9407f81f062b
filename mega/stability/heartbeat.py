"""The rank side: a daemon thread that writes this rank's heartbeat to Redis every
``stability.heartbeat_s``.

A heartbeat is one small JSON value (``SET key value EX ttl``): the last finished step, its loss,
grad norm, step and compute time, tokens/s, the phase the rank is in now (mega.obs's recorder: a
watcher thread may read it), RSS and device memory, and the sequence number of every process group
it belongs to (torch's per-group collective counter, ``ProcessGroup._get_sequence_number_for_group``:
it counts the collectives this rank has entered, on gloo and NCCL alike), and the CPU time of the
training thread (``train_cpu_s``: rising while it computes, flat while it waits or sleeps). A rank
stuck in compute stops counting while its peers enter the next collective; a stopped rank stops
beating. The driver's watcher
(mega.stability.detect) reads both. The thread also writes the rank's identity: rank, node,
host, TP/PP/DP coordinates and the ranks of each of its groups, first thing and again after any
dropped write (the Redis may have come back empty).

Redis never stops training: only the thread talks to it, every call is bounded by
heartbeat_redis.TIMEOUT_S; a failed write is dropped and counted (``dropped``), and the next one is tried
on time. ``close`` has the thread send one last beat (bounded the same way), so the driver's
heartbeat summary counts every beat.
"""

from __future__ import annotations

import json
import os
import threading
import time

from mega import rank_env
from mega.stability import heartbeat_redis


def _groups():
    """name -> process group, from megatron's parallel_state (after initialize_model_parallel):
    every group training's collectives run on (DDP reduces over the DP x CP group, the distributed
    optimizer over its instance group, the grad norm over the model-parallel group), each once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    getters = {
        "tp": lambda: ps.get_tensor_model_parallel_group(),
        "pp": lambda: ps.get_pipeline_model_parallel_group(),
        "dp": lambda: ps.get_data_parallel_group(),
        "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        "dp_opt": lambda: ps.get_intra_distributed_optimizer_instance_group(check_initialized=False),
        "dp_gloo": lambda: ps.get_data_parallel_group_gloo(with_context_parallel=True),
        "embd": lambda: ps.get_embedding_group(check_initialized=False),
        "mp": lambda: ps.get_model_parallel_group(check_initialized=False),
        "world": lambda: dist.group.WORLD,
    }
    groups: dict = {}
    for name, get in getters.items():
        try:
            g = get()
            member = dist.get_rank() in dist.get_process_group_ranks(g)
        except (AssertionError, AttributeError, RuntimeError, TypeError, ValueError):  # not in this layout
            continue
        if member and all(g is not h for h in groups.values()):
            groups[name] = g
    return groups


def _seq(group) -> int | None:
    try:
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):  # a torch without the counter: localisation by silence only
        return None


def _cuda_device() -> int | None:
    """The CUDA device this rank trains on, read on the main thread (a new thread's current
    device is 0); None on CPU, and nothing is initialised here."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def _device_mb(device: int | None) -> float | None:
    if device is None:
        return None
    import torch

    return torch.cuda.memory_allocated(device) / 2**20


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


class Heartbeat:
    """One rank's heartbeat thread. ``step_done`` after each step; ``close`` at the end."""

    def __init__(
        self,
        client,
        prefix: str,
        attempt: int,
        identity: dict,
        groups: dict,
        interval_s: float,
        device: int | None = None,
    ):
        self.client = client
        self.rank = identity["rank"]
        self.key = heartbeat_redis.beat_key(prefix, attempt, self.rank)
        self.id_key = heartbeat_redis.id_key(prefix, attempt, self.rank)
        self.stop_key = heartbeat_redis.stop_key(prefix, attempt)
        self.identity = identity
        self.groups = groups
        self.interval_s = interval_s
        self.device = device  # CUDA device index, None on CPU
        self.ttl_s = max(2, int(round(10 * interval_s)))  # a dead run's keys go by themselves
        self.last: dict = {}  # replaced, never mutated: the thread reads it without a lock
        self.sent = self.dropped = 0
        self.cpu_ns = 0  # this thread's CPU time (heartbeat overhead)
        self.started = time.time()  # when the thread started: its wall time is the overhead's denominator
        self._t0 = time.monotonic()
        self._train_clock: int | None = None  # the training thread's CPU clock, set by start()
        self._id_pending = True  # the identity is (re)written by the thread until a write goes through
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mega-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Starts the thread; never touches Redis itself (a Redis down at start costs nothing).
        Called from the training thread: its CPU clock is the one each beat reads."""
        self.started, self._t0 = time.time(), time.monotonic()
        self._train_clock = time.pthread_getcpuclockid(threading.get_ident())
        self._thread.start()
        return self

    def step_done(self, step: int, result: dict, step_s: float, tokens: int | None = None) -> None:
        """After each step: its result, wall time and (``tokens``) the tokens it trained on."""
        from mega import obs

        self.last = {
            "step": step,
            "loss": result.get("loss"),
            "grad_norm": result.get("grad_norm"),
            "step_s": step_s,
            "compute_s": obs.current().last_step.get("compute_s"),
            "tokens_per_s": tokens / step_s if tokens and step_s > 0 else None,
        }

    def record(self) -> dict:
        from mega import obs

        snap = obs.current().snapshot()
        return {
            "rank": self.rank,
            "time": time.time(),
            **self.last,
            "phase": snap.get("phase"),
            "phase_s": snap.get("phase_s"),
            "doing": snap.get("doing"),
            "rss_mb": _rss_mb(),
            "device_mb": _device_mb(self.device),
            "seq": {name: _seq(g) for name, g in self.groups.items()},
            "sent": self.sent,
            "dropped": self.dropped,
            "cpu_s": self.cpu_ns * 1e-9,
            "train_cpu_s": self._train_cpu_s(),
            "started": self.started,
            "up_s": time.monotonic() - self._t0,
            "closed": self._stop.is_set(),
        }  # the training loop is over: silence from now on is no hang

    def _train_cpu_s(self) -> float | None:
        if self._train_clock is None:
            return None
        try:
            return time.clock_gettime(self._train_clock)
        except OSError:  # the training thread is gone (the process is exiting)
            return None

    def beat(self) -> bool:
        """One heartbeat (and the identity while it is owed); False when Redis did not take it."""
        c0 = time.thread_time_ns()
        try:
            if self._id_pending:  # one timeout per tick at most: no identity, no beat this time
                self._id_pending = not self._send(self.id_key, self.identity, ex=7 * 86400)
            ok = not self._id_pending and self._send(self.key, self.record(), ex=self.ttl_s, stop=True)
            if ok:
                self.sent += 1
            else:
                self.dropped += 1
                self._id_pending = True  # a Redis back from an outage may have lost it
            return ok
        finally:
            self.cpu_ns += time.thread_time_ns() - c0

    def _send(self, key: str, value: dict, ex: int, stop: bool = False) -> bool:
        """SET the value; with ``stop``, in the same round trip, read the watcher's stop order
        (heartbeat_redis.stop_key) and obey it: the process exits with its code at once, even while the
        main thread is stuck in a collective (the heartbeat thread still runs then)."""
        import redis

        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(key, json.dumps(value, default=float), ex=ex)
            if stop:
                pipe.get(self.stop_key)
            replies = pipe.execute()
        except (redis.RedisError, OSError):
            return False
        if stop and replies[1]:
            order = json.loads(replies[1])
            print(
                f"rank {self.rank}: the watcher ends this attempt ({order.get('reason')}); "
                f"exiting with {order['exit_code']}",
                flush=True,
            )
            os._exit(int(order["exit_code"]))
        return True

    def _run(self) -> None:
        self.beat()  # identity and a first beat now, not one interval later
        while not self._stop.wait(self.interval_s):
            self.beat()
        self.beat()  # the last one: the driver's summary sees every beat up to the end

    def close(self) -> None:
        """Stops the thread after its last beat. Bounded: a beat in flight and the last one each
        take at most two socket timeouts (connect, reply)."""
        self._stop.set()
        self._thread.join(timeout=6 * heartbeat_redis.TIMEOUT_S + 1)
        self.client.close()


def start(cfg) -> Heartbeat | None:
    """This rank's heartbeat thread, started; None when the driver gave no heartbeat Redis
    (stability.enabled=false, or a rank started by hand)."""
    import torch.distributed as dist

    from mega.obs.session import rank_identity

    client, prefix = heartbeat_redis.client_from_env()
    if client is None or not cfg.stability.enabled:
        return None
    groups = _groups()
    identity = {**rank_identity(), "groups": {n: dist.get_process_group_ranks(g) for n, g in groups.items()}}
    attempt = rank_env.attempt()
    return Heartbeat(
        client, prefix, attempt, identity, groups, cfg.stability.heartbeat_s, device=_cuda_device()
    ).start()
