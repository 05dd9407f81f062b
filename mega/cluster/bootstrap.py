"""Bring up and verify the rendezvous store, and time process-group initialization.

MegaScale (NSDI'24, section 3.5) found job start-up dominated by the rendezvous store and by
building the many communicator groups of 3D parallelism; both are measured here before training:

* ``verify_store(cfg)``: start the store (TCPStore, or RedisStore on ``store.redis_url`` / a local
  redis-server), connect a client, time set/get/add/wait round trips.
* ``time_process_groups(cfg)`` (started by mega/launch/node_jobs.py): a job on every node (``python -m mega.cluster.bootstrap``, one
  torchrun agent per node) over the config's world that times ``init_process_group`` (over
  ``store.kind``) and megatron-core's model-parallel groups (built the ``cluster.group_init``
  way, mega/cluster/parallel_groups.py) and reports the slowest rank, overall and per node:
  {"pg_init_s", "model_parallel_init_s", "world_size", "store", "group_init", "nodes", "ranks",
  "phases", "job_s"}, with start-up broken down by phase (``PHASES``: process start, imports, import
  skew, the default group, and group creation's store, connection, megatron and barrier parts).

How a job's ranks reach the store is mega/cluster/rendezvous.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mega.cluster.rendezvous import (
    dump_store_traffic,
    init_process_group,
    redis_server_url,
)

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from mega.config import MegaConfig

STORE_OPS = 50  # round trips per operation kind: enough for a stable median on loopback


class StoreNotAvailable(NotImplementedError):
    """The configured rendezvous store kind is not built yet."""


# ---------------------------------------------------------------------------------------------
# Rendezvous store


def start_tcp_store(host: str, port: int = 0, timeout_s: float = 300.0) -> TCPStore:
    """A torch TCPStore server on host:port (0 = a free port; the bound one is ``store.port``)."""
    from torch.distributed import TCPStore

    # wait_for_workers=False: the server must not block until clients of a job have joined
    return TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def connect_tcp_store(host: str, port: int, timeout_s: float = 300.0) -> TCPStore:
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def verify_store(cfg: MegaConfig) -> dict[str, Any]:
    """Start the configured store, check it with real operations and time their round trips.

    Returns {"store", "host", "port", "ok", "ops", "roundtrip_ms" (median over all ops),
    "set_ms", "get_ms", "add_ms", "wait_ms" (medians), "connect_ms"}.
    """
    c = cfg.cluster
    if cfg.store.kind == "redis":
        return _verify_redis_store(cfg)
    if cfg.store.kind != "tcp":
        raise ValueError(f"store.kind: unknown store {cfg.store.kind!r}")

    server = start_tcp_store(c.master_addr, c.master_port, timeout_s=c.pg_timeout_s)
    start = time.perf_counter()
    client = connect_tcp_store(c.master_addr, server.port, timeout_s=c.pg_timeout_s)
    connect_ms = (time.perf_counter() - start) * 1e3
    try:
        timings = _time_store_ops(server, client)
    finally:
        del client, server  # closes the sockets; the port is free again
    return _store_report("tcp", c.master_addr, connect_ms, timings)


def _verify_redis_store(cfg: MegaConfig) -> dict[str, Any]:
    """verify_store for store.kind=redis: store.redis_url, else a local redis-server.

    Two RedisStore clients in a throwaway namespace play the tcp branch's server and client; the
    namespace is dropped afterwards and a local server stopped. The host/port reported are the
    Redis server's (never its credentials).
    """

    from mega.store import RedisStore

    c = cfg.cluster
    job_id = f"verify-store-{uuid.uuid4().hex[:12]}"
    timeout = timedelta(seconds=c.pg_timeout_s)
    # exits in reverse: the stores close before a local server stops
    with redis_server_url(cfg) as url, contextlib.ExitStack() as open_stores:
        start = time.perf_counter()
        client = RedisStore(url, job_id=job_id, timeout=timeout, ttl_s=600)
        connect_ms = (time.perf_counter() - start) * 1e3
        open_stores.callback(client.close)
        peer = RedisStore(url, job_id=job_id, timeout=timeout, ttl_s=600)
        open_stores.callback(peer.close)
        timings = _time_store_ops(peer, client)
        client.drop_namespace()
    return _store_report("redis", client.host, connect_ms, timings)


def _store_report(store: str, host: str, connect_ms: float, timings: dict[str, Any]) -> dict[str, Any]:
    """verify_store's result from ``_time_store_ops``'s timings: medians per op and over all."""
    result: dict[str, Any] = {
        "store": store,
        "host": host,
        "port": timings.pop("port"),
        "ok": True,
        "ops": STORE_OPS,
        "connect_ms": round(connect_ms, 3),
    }
    all_ms = [ms for op_ms in timings.values() for ms in op_ms]
    result["roundtrip_ms"] = round(statistics.median(all_ms), 4)
    result.update({f"{op}_ms": round(statistics.median(ms), 4) for op, ms in timings.items()})
    return result


def _time_store_ops(server: TCPStore, client: TCPStore) -> dict[str, Any]:
    """set/get/add from the client, and wait on keys the server sets from another thread."""

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    times: dict[str, Any] = {"set": [], "get": [], "add": [], "wait": [], "port": server.port}
    for i in range(STORE_OPS):
        value = f"value-{i}".encode()
        times["set"].append(timed(lambda: client.set(f"k{i}", value)))
        got: list[bytes] = []
        times["get"].append(timed(lambda: got.append(client.get(f"k{i}"))))
        _expect(got[0] == value, f"get k{i} returned {got[0]!r}, set {value!r}")
        times["add"].append(timed(lambda: client.add("counter", 1)))
    _expect(server.add("counter", 0) == STORE_OPS, "add counter lost increments")

    # wait: the rendezvous primitive; another party publishes the key while the client waits
    for i in range(STORE_OPS):
        setter = threading.Timer(0.0, server.set, args=(f"w{i}", b"1"))
        start = time.perf_counter()
        setter.start()
        client.wait([f"w{i}"], timedelta(seconds=10))
        times["wait"].append((time.perf_counter() - start) * 1e3)
        setter.join()
    return times


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(f"rendezvous store check failed: {message}")


# ---------------------------------------------------------------------------------------------
# Process-group initialization timing (torchrun job)

LAUNCH_TIME_ENV = "MEGA_BOOTSTRAP_LAUNCH_TIME"  # time.time() when the launcher started torchrun
# Start-up phases of one rank, in the order they happen (seconds; docs/bootstrap.md#where-start-up-goes):
PHASES = (
    "spawn_s",  # launcher starts torchrun -> this rank's process exists (torchrun's start, agent, fork+exec)
    "import_s",  # process start -> torch, megatron-core and mega imported (interpreter start included)
    "import_skew_s",  # waiting at the ready line for the slowest rank's imports
    "pg_init_s",  # init_process_group + a world barrier (the default group's gloo full mesh)
    "mp_store_s",  # initialize_model_parallel: inside store operations (incl. waiting for peers' keys)
    "mp_connect_s",  # ... in torch's new_group outside the store: gloo pair connections, torch bookkeeping
    "mp_megatron_s",  # ... outside new_group: megatron's rank lists and module state
    "mp_barrier_s",  # ... the world barrier after it (the slowest rank's groups)
)


def _rank_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mega.cluster.bootstrap", description="time process-group init"
    )
    p.add_argument("--config", required=True, help="config.json (mega.config.save)")
    p.add_argument("--out", required=True, help="result.json written by rank 0")
    args = p.parse_args(argv)

    # Everything the measurement needs is imported before the clock starts: megatron-core alone
    # takes seconds per process, and imported lazily inside initialize_model_parallel it would be
    # counted as group creation (19-27 s for 8 ranks on 2 cores; the groups take ~0.2 s).
    import psutil
    import torch
    import torch.distributed as dist

    from mega import optional_packages

    optional_packages.quiet_megatron(cuda=torch.cuda.is_available())  # before megatron-core's import
    from megatron.core import parallel_state  # noqa: F401 - imported here, outside the timing

    from mega.cluster import parallel_groups  # noqa: F401
    from mega.config import load

    imported = time.time()
    cfg = load(args.config)
    row = _time_rank_init(cfg)
    started = psutil.Process().create_time()
    launched = float(os.environ.get(LAUNCH_TIME_ENV, "nan"))
    row.update(spawn_s=started - launched if math.isfinite(launched) else None, import_s=imported - started)

    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        slowest = max(rows, key=lambda r: r["model_parallel_init_s"])
        nodes = sorted({r["node"] for r in rows})
        result = {
            "pg_init_s": max(r["pg_init_s"] for r in rows),
            "model_parallel_init_s": max(r["model_parallel_init_s"] for r in rows),
            "world_size": len(rows),
            "store": cfg.store.kind,
            "group_init": cfg.cluster.group_init,
            "ranks": rows,
            "nodes": [
                {
                    "node": k,
                    "address": next(r["address"] for r in rows if r["node"] == k),
                    "pg_init_s": max(r["pg_init_s"] for r in rows if r["node"] == k),
                    "model_parallel_init_s": max(r["model_parallel_init_s"] for r in rows if r["node"] == k),
                }
                for k in nodes
            ],
            # the rank that took longest to create its groups, phase by phase (they add up)
            "phases": {k: slowest.get(k) for k in PHASES},
            "phases_max": {
                k: max((r[k] for r in rows if r.get(k) is not None), default=None) for k in PHASES
            },
            "written_at": time.time(),
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
    _destroy_groups()
    return 0


def _time_rank_init(cfg: MegaConfig) -> dict[str, Any]:
    """Time this rank's init_process_group and initialize_model_parallel, phase by phase (imports
    excluded: the caller imported everything). Every store operation goes through a
    ``RecordingStore``, whose ``busy_s`` is the store's part."""
    import torch
    import torch.distributed as dist

    from mega.cluster import node, parallel_groups
    from mega.cluster.backend_flags import backend_flags

    c, p = cfg.cluster, cfg.parallelism
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if c.device == "cuda":
        torch.cuda.set_device(local_rank)
    # megatron-core builds its groups with plain dist.new_group, which works on gloo: no CPU
    # adaptation of megatron-core is needed for this measurement.
    timeout = timedelta(seconds=c.pg_timeout_s)
    import_skew_s = _wait_for_all_ranks(timeout)

    start = time.perf_counter()
    recorder = init_process_group(cfg, record=True)
    dist.barrier()  # init returns before the slowest peer has joined; the barrier includes it
    pg_init_s = time.perf_counter() - start
    pg_store_s, pg_ops = recorder.busy_s, len(recorder.ops)

    with _timed_new_groups(recorder) as in_new_group:
        start = time.perf_counter()
        parallel_groups.initialize_model_parallel(
            c.group_init,
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_size,
            distributed_timeout_minutes=max(1, math.ceil(c.pg_timeout_s / 60)),
            create_gloo_process_groups=backend_flags(cfg).create_gloo_process_groups,
        )  # as mega.train does
        created = time.perf_counter()
    dist.barrier()
    done = time.perf_counter()
    dump_store_traffic(cfg, recorder, "bootstrap")
    mp_store_s = recorder.busy_s - pg_store_s  # in new_group, and light's one barrier outside it
    return {
        "rank": dist.get_rank(),
        "node": node.node_rank(),
        "address": node.address(),
        "pg_init_s": pg_init_s,
        "model_parallel_init_s": done - start,
        "import_skew_s": import_skew_s,
        "pg_store_s": pg_store_s,
        "pg_store_ops": pg_ops,
        "mp_store_s": mp_store_s,
        "mp_store_ops": len(recorder.ops) - pg_ops,
        "mp_connect_s": in_new_group["s"] - in_new_group["store_s"],
        "mp_megatron_s": created - start - in_new_group["s"] - (mp_store_s - in_new_group["store_s"]),
        "mp_barrier_s": done - created,
        "new_group_calls": in_new_group["calls"],
    }


@contextlib.contextmanager
def _timed_new_groups(recorder):
    """Time megatron-core's calls into torch's new_group (``parallel_state.create_group``, which
    ``light`` routes its member ranks' calls through too): {"s": seconds, "store_s": the part of
    them inside ``recorder``'s store operations, "calls": count}."""
    from megatron.core import parallel_state

    timing = {"s": 0.0, "store_s": 0.0, "calls": 0}
    original = parallel_state.create_group

    def create_group(*args, **kwargs):
        start, store_before = time.perf_counter(), recorder.busy_s
        try:
            return original(*args, **kwargs)
        finally:
            timing["s"] += time.perf_counter() - start
            timing["store_s"] += recorder.busy_s - store_before
            timing["calls"] += 1

    parallel_state.create_group = create_group
    try:
        yield timing
    finally:
        parallel_state.create_group = original


def _wait_for_all_ranks(timeout: timedelta) -> float | None:
    """Line the ranks up on torchrun's agent store, so the timing excludes import skew; returns how
    long this rank waited for the others (None when not under torchrun's agent store).

    Without this, the first rank to finish its imports (~5 s per process for megatron-core alone,
    several times that when 8 processes share 2 cores) would count the slowest rank's imports as
    process-group init.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # not under torchrun's agent store: nothing to line up on before init
    from torch.distributed import TCPStore

    start = time.perf_counter()
    world = int(os.environ["WORLD_SIZE"])
    store = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    store.add("mega/bootstrap/ready", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add("mega/bootstrap/ready", 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all {world} ranks started within {timeout}")
        time.sleep(0.005)
    return time.perf_counter() - start


def _destroy_groups() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_rank_main())
