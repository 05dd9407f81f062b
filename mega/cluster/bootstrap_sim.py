"""Replay the rendezvous-store traffic of N ranks' process-group creation against a real server.

Real gloo processes stop at a few dozen ranks on a small machine; the store traffic of bringing
up megatron-core's groups does not need the ranks, only what each of them reads, writes and
waits on. This module generates that traffic, rank by rank, and replays it against a real
``redis-server`` (through the same Lua scripts and ``XREAD`` waits as ``mega.store.RedisStore``)
or a real torch ``TCPStore`` server (its C++ libuv daemon, in a subprocess), with one client
connection per simulated rank, as in a real job.

What is modelled (torch 2.13, megatron-core 0.16.1; the gloo part is checked against recordings
of real ranks, ``tests/test_bootstrap_sim.py``):

* **The groups**: megatron-core's own ``initialize_model_parallel`` is run with
  ``torch.distributed.new_group`` replaced by a recorder (``megatron_groups``): the exact list and
  order of ``new_group`` calls (ranks, gloo or default backend) of the layout, no hand-written copy.
* **init_process_group** (default group "0", on the store as given) and every ``new_group``:
  torch names the i-th group ``str(i)`` and gives it ``PrefixStore("<name>/", default store)``;
  the default store is ``PrefixStore("0/", store)``. ``light`` (``mega.cluster.parallel_groups``) keeps
  those names (torch's own hashed names would differ between members, see that module).
* **Backend rendezvous of the members**: gloo (recorded): ``set(<p>cpu//0/<group rank>)``, then
  for every member ``j``: ``wait(<p>cpu//0/<j>)`` and ``get(<p>cpu//0/<j>)`` -- a full mesh,
  quadratic in the group size. NCCL (not recorded: no GPU here; from ProcessGroupNCCL's unique-id
  broadcast): group rank 0 ``set(<p>cuda//0)``, every other member ``get``s it. torch creates NCCL
  communicators lazily (at the first collective); the exchange is counted at creation.
* **Store-based barrier** after each group (``TORCH_DIST_INIT_BARRIER=1``: torch < 2.1's default,
  the setting MegaScale measured; torch >= 2.1 skips it unless the variable is set):
  ``add(k, 1)``, ``n = add(k, 0)``, the rank that sees ``n == size`` ``set(k:last_worker)``,
  then ``wait(k:last_worker)``; ``k = store_based_barrier_key:<name>``. Without local
  synchronization every rank of the world runs it for every group (members or not) on the default
  store; with it, only the members, on the group's store.

Strategies: ``default`` is megatron's pattern (every rank calls ``new_group`` for every group,
world-wide barrier each time); ``light`` is ``mega.cluster.parallel_groups``' members-only creation with
``use_local_synchronization=True``: no barrier per group, one world barrier once every group
exists (``add`` + ``wait`` per rank on ``mega_groups_ready:1``, one ``set`` of its ``:done`` key by
the rank completing the count). With the barrier off both issue the same operations. ``plan_counts`` gives the operations
per kind without running anything; ``run_in_memory`` executes the programs against a dict (small
N, per-rank counts); ``simulate`` replays them against a server and times it.

Client side: one asyncio ``Protocol`` per simulated rank, driving that rank's program (a
generator) from the reply callbacks -- no task or thread per rank. Each rank's operations are
issued one after another, each waiting for its reply as the real client does (TCPStore's ``set``
has no reply; its ``get`` is ``WAIT`` then ``GET``, as in the C++ client); blocking waits block on
the server (TCPStore ``WAIT``; Redis ``XREAD BLOCK`` on the key's signal stream), never by polling.
The clock starts when every rank is connected (connection set-up is reported apart) and stops when
the last rank has finished.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import lru_cache
from typing import Any

from mega import procstat
from mega.cluster.parallel_groups import READY_BARRIER_PREFIX

__all__ = [
    "STRATEGIES",
    "STORES",
    "Layout",
    "megatron_groups",
    "rank_program",
    "plan_counts",
    "run_in_memory",
    "simulate",
    "TCPStoreServer",
    "record_real_ranks",
]

STRATEGIES = ("default", "light")
STORES = ("tcpstore", "redis")
BARRIER_PREFIX = "store_based_barrier_key"  # torch.distributed.distributed_c10d.STORE_BASED_BARRIER_PREFIX
DEFAULT_PG = "0"

Op = tuple  # ("set", key) | ("get", key) | ("add", key, delta) | ("wait", key)


@dataclass(frozen=True)
class Layout:
    """world = tp x pp x dp ranks; ``backend`` of megatron's main groups ("nccl" for a GPU job,
    "gloo" as on this CPU); ``gloo_groups``: megatron's gloo copies of the DP groups
    (``create_gloo_process_groups``); ``barrier``: TORCH_DIST_INIT_BARRIER=1."""

    world: int
    tp: int = 1
    pp: int = 1
    backend: str = "nccl"
    gloo_groups: bool = False
    barrier: bool = True

    def __post_init__(self):
        if self.world % (self.tp * self.pp):
            raise ValueError(f"world={self.world} is not divisible by tp*pp={self.tp * self.pp}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {self.backend!r}")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


# ---------------------------------------------------------------------------------------------
# The groups: megatron-core's own initialize_model_parallel, with new_group recorded


@lru_cache(maxsize=16)
def megatron_groups(
    world: int, tp: int, pp: int, gloo_groups: bool
) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """Every ``new_group`` call of megatron's ``initialize_model_parallel``, in order:
    ``(ranks, is_gloo)`` (``is_gloo``: backend="gloo"; otherwise the default backend)."""
    from unittest import mock

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    calls: list[tuple[tuple[int, ...], bool]] = []

    def new_group(
        ranks=None,
        timeout=None,
        backend=None,
        pg_options=None,
        use_local_synchronization=False,
        group_desc=None,
        **_,
    ):
        calls.append((tuple(sorted(ranks)), backend == "gloo"))
        return object()

    if dist.is_initialized():
        raise RuntimeError("megatron_groups must run where no process group is initialized")
    with (
        mock.patch.object(dist, "new_group", new_group),
        mock.patch.object(dist, "get_world_size", lambda *a, **k: world),
        mock.patch.object(dist, "get_rank", lambda *a, **k: 0),
        mock.patch.object(dist, "is_initialized", lambda: True),
    ):
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                create_gloo_process_groups=gloo_groups,
            )
        finally:
            ps.destroy_model_parallel()
    return tuple(calls)


@dataclass(frozen=True)
class _Membership:
    index: int  # position in megatron's call order
    ranks: tuple[int, ...]
    group_rank: int
    gloo: bool


def _memberships(layout: Layout) -> list[list[_Membership]]:
    return _memberships_cached(layout)


@lru_cache(maxsize=4)
def _memberships_cached(layout: Layout) -> list[list[_Membership]]:
    groups = megatron_groups(layout.world, layout.tp, layout.pp, layout.gloo_groups)
    out: list[list[_Membership]] = [[] for _ in range(layout.world)]
    for i, (ranks, is_gloo) in enumerate(groups):
        for j, r in enumerate(ranks):
            out[r].append(_Membership(i, ranks, j, is_gloo or layout.backend == "gloo"))
    return out


# ---------------------------------------------------------------------------------------------
# One rank's program: the store operations torch issues, as a generator (replies are sent in)


def _rendezvous(prefix: str, gloo: bool, group_rank: int, size: int) -> Generator[Op, Any, None]:
    if gloo:  # ProcessGroupGloo: publish this rank's address, read every member's (full mesh)
        device = prefix + "cpu//0/"
        yield ("set", device + str(group_rank))
        for j in range(size):
            yield ("wait", device + str(j))
            yield ("get", device + str(j))
    else:  # ProcessGroupNCCL: rank 0 publishes the unique id, the others read it
        key = prefix + "cuda//0"
        yield ("set", key) if group_rank == 0 else ("get", key)


def _barrier(store_prefix: str, name: str, size: int) -> Generator[Op, Any, None]:
    key = f"{store_prefix}{BARRIER_PREFIX}:{name}"
    yield ("add", key, 1)
    arrived = yield ("add", key, 0)
    if arrived == size:
        yield ("set", key + ":last_worker")
    yield ("wait", key + ":last_worker")


def rank_program(
    strategy: str, layout: Layout, rank: int, memberships: list[list[_Membership]] | None = None
) -> Generator[Op, Any, None]:
    """The store operations of ``rank``: init_process_group, then megatron's groups."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    memberships = memberships if memberships is not None else _memberships(layout)
    world = layout.world
    root = DEFAULT_PG + "//"  # PrefixStore("0/", store): the default group's store
    yield from _rendezvous(root, layout.backend == "gloo", rank, world)
    if layout.barrier:
        yield from _barrier("", DEFAULT_PG, world)  # init_process_group's, on the store as given
    mine = memberships[rank]
    if strategy == "default":
        groups = megatron_groups(layout.world, layout.tp, layout.pp, layout.gloo_groups)
        k = 0
        for i in range(len(groups)):
            name = str(i + 1)
            if k < len(mine) and mine[k].index == i:
                m = mine[k]
                k += 1
                yield from _rendezvous(f"{root}{name}//", m.gloo, m.group_rank, len(m.ranks))
            if layout.barrier:
                yield from _barrier(root, name, world)
    else:  # mega.cluster.parallel_groups "light": members only, each group under default's name
        for m in mine:
            name = str(m.index + 1)
            yield from _rendezvous(f"{root}{name}//", m.gloo, m.group_rank, len(m.ranks))
        if layout.barrier:  # no barrier per group; one over the world once all exist
            yield from _ready_barrier(root, world)


def _ready_barrier(store_prefix: str, size: int) -> Generator[Op, Any, None]:
    """mega.cluster.parallel_groups.world_barrier after light creation (the first group is named "1")."""
    key = f"{store_prefix}{READY_BARRIER_PREFIX}:1"
    arrived = yield ("add", key, 1)
    if arrived == size:
        yield ("set", key + ":done")
    yield ("wait", key + ":done")


def _rendezvous_counts(gloo: bool, group_rank: int, size: int) -> Counter:
    if gloo:
        return Counter(set=1, wait=size, get=size)
    return Counter(set=1) if group_rank == 0 else Counter(get=1)


def plan_counts(strategy: str, layout: Layout) -> dict[str, int]:
    """Store operations per kind over all ranks, without generating them (one ``set`` per
    barrier: the last rank to arrive writes ``last_worker``)."""
    world = layout.world
    groups = megatron_groups(layout.world, layout.tp, layout.pp, layout.gloo_groups)
    total = Counter()
    for r in range(world):
        total += _rendezvous_counts(layout.backend == "gloo", r, world)
    barrier = Counter(add=2, wait=1)
    barriers = Counter()  # (size -> how many barriers of that size)
    if layout.barrier:
        barriers[world] += 1
    for ranks, is_gloo in groups:
        gloo = is_gloo or layout.backend == "gloo"
        for j in range(len(ranks)):
            total += _rendezvous_counts(gloo, j, len(ranks))
        if layout.barrier and strategy == "default":
            barriers[world] += 1
    for size, n in barriers.items():
        for kind, c in barrier.items():
            total[kind] += c * size * n
        total["set"] += n
    if layout.barrier and strategy == "light":  # the one ready barrier: add + wait, one set
        total.update(add=world, wait=world, set=1)
    return {k: v for k, v in sorted(total.items()) if v}


# ---------------------------------------------------------------------------------------------
# In-memory execution (small N): per-rank counts, and a check that every program terminates


def run_in_memory(
    strategy: str, layout: Layout, ops: list[list[tuple[str, str]]] | None = None
) -> list[Counter]:
    """Run every rank's program against a dict, round-robin; blocked ranks wait for their key.
    Returns the operations per kind of each rank; ``ops`` (a list) receives each rank's
    ``(kind, key)`` sequence."""
    memberships = _memberships(layout)
    programs = [rank_program(strategy, layout, r, memberships) for r in range(layout.world)]
    counts = [Counter() for _ in programs]
    seqs: list[list[tuple[str, str]]] = [[] for _ in programs]
    kv: dict[str, int] = {}
    pending: list[tuple[int, Any]] = [(r, None) for r in range(layout.world)]
    blocked: dict[str, list[int]] = {}
    while pending:
        nxt: list[tuple[int, Any]] = []
        for r, reply in pending:
            prog = programs[r]
            while True:
                try:
                    op = prog.send(reply)
                except StopIteration:
                    break
                kind, key = op[0], op[1]
                counts[r][kind] += 1
                if ops is not None:
                    seqs[r].append((kind, key))
                if kind == "set":
                    kv.setdefault(key, 1)
                    nxt.extend((w, None) for w in blocked.pop(key, []))
                    reply = None
                elif kind == "add":
                    created = key not in kv
                    kv[key] = kv.get(key, 0) + op[2]
                    if created:
                        nxt.extend((w, None) for w in blocked.pop(key, []))
                    reply = kv[key]
                elif key in kv:
                    reply = kv[key]
                else:
                    blocked.setdefault(key, []).append(r)
                    break
        pending = nxt
    if blocked:
        raise RuntimeError(f"{strategy}: ranks blocked forever on {list(blocked)[:3]}")
    if ops is not None:
        ops[:] = seqs
    return counts


# ---------------------------------------------------------------------------------------------
# Servers


def _serve_tcpstore(port_out, stop) -> None:
    from torch.distributed import TCPStore

    server = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        use_libuv=True,
        timeout=timedelta(seconds=3600),
    )
    port_out.put(server.port)
    stop.wait()


class TCPStoreServer:
    """torch's TCPStore server (the C++ libuv daemon) in a forked child process, so that its
    sockets do not count against this process's file-descriptor limit nor share its GIL."""

    def __init__(self):
        import multiprocessing as mp

        self._ctx = mp.get_context("fork")  # torch is imported already: no second import
        self.proc = None
        self.port = 0

    def start(self) -> TCPStoreServer:
        port_out = self._ctx.Queue()
        self._stop = self._ctx.Event()
        self.proc = self._ctx.Process(target=_serve_tcpstore, args=(port_out, self._stop), daemon=True)
        self.proc.start()
        try:
            self.port = int(port_out.get(timeout=60))
        except Exception:
            self.stop()
            raise RuntimeError("TCPStore server did not start") from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self._stop.set()
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ---------------------------------------------------------------------------------------------
# Clients: one protocol object per simulated rank, driven by reply callbacks


class _Rank(asyncio.Protocol):
    def __init__(self, program: Iterator[Op], on_done: Callable[[_Rank, BaseException | None], None]):
        self.program = program
        self.on_done = on_done
        self.ops = 0
        self.kinds: Counter = Counter()
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.expect: Callable[[], Any] | None = None  # parses one reply from buf, or returns _MORE
        self.finished = False
        self.ready: asyncio.Future | None = None  # done once the client is connected as a real one is

    def connection_made(self, transport):
        self.transport = transport
        self.ready = asyncio.get_running_loop().create_future()
        self.ready.set_result(None)

    def connection_lost(self, exc):
        if not self.finished:
            self._finish(exc or ConnectionError("store connection closed"))

    def start(self) -> None:
        self._advance(None)

    def _finish(self, err: BaseException | None) -> None:
        if self.ready is not None and not self.ready.done():  # lost before it was connected
            self.ready.set_exception(err or ConnectionError("store connection closed while connecting"))
            return
        if not self.finished:
            self.finished = True
            self.on_done(self, err)

    def _advance(self, reply: Any) -> None:
        try:
            while True:
                try:
                    op = self.program.send(reply)
                except StopIteration:
                    self._finish(None)
                    return
                self.ops += 1
                self.kinds[op[0]] += 1
                if self.issue(op):  # a reply is awaited
                    return
                reply = None
        except BaseException as err:
            self._finish(err)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            while self.expect is not None:
                value = self.expect()
                if value is _MORE:
                    return
                self.expect = None
                self.on_reply(value)
        except BaseException as err:
            self._finish(err)

    def on_reply(self, value: Any) -> None:
        self._advance(value)

    def issue(self, op: Op) -> bool:
        raise NotImplementedError


_MORE = object()


class _TCPStoreRank(_Rank):
    """The wire protocol of torch's C++ TCPStore client (``TCPStore.cpp``): a query byte, strings as
    a uint64 length + bytes, native byte order; keys carry the client's "/" prefix."""

    VALIDATE, SET, GET, ADD, WAIT, PING = 0, 1, 3, 4, 6, 13
    MAGIC = 0x3C85F7CE
    _then_get: bytes | None = None  # a get's key while its WAIT is in flight

    def connection_made(self, transport):
        # As TCPStore's constructor: validate, then a ping round trip; the rank counts as
        # connected once the server echoed it. (Without the ping, a burst of connections whose
        # first request is already a store operation stalled torch's libuv server here for ~5 s
        # per 64 connections: an artifact the real client never sees.)
        self.transport = transport
        self.ready = asyncio.get_running_loop().create_future()
        self._nonce = os.getpid() & 0xFFFFFFFF
        transport.write(
            struct.pack("<BI", self.VALIDATE, self.MAGIC) + struct.pack("<BI", self.PING, self._nonce)
        )
        self.expect = self._fixed(4, "<I")

    @staticmethod
    def _str(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    def _fixed(self, n: int, fmt: str):
        def parse():
            if len(self.buf) < n:
                return _MORE
            value = struct.unpack(fmt, self.buf[:n])[0]
            del self.buf[:n]
            return value

        return parse

    def _bytes(self):
        if len(self.buf) < 8:
            return _MORE
        n = struct.unpack("<Q", self.buf[:8])[0]
        if len(self.buf) < 8 + n:
            return _MORE
        value = bytes(self.buf[8 : 8 + n])
        del self.buf[: 8 + n]
        return value

    def issue(self, op: Op) -> bool:
        kind, key = op[0], ("/" + op[1]).encode()
        w = self.transport.write
        if kind == "set":
            w(bytes([self.SET]) + self._str(key) + self._str(b"1"))
            return False  # TCPStore acknowledges no set
        if kind == "add":
            w(bytes([self.ADD]) + self._str(key) + struct.pack("<q", op[2]))
            self.expect = self._fixed(8, "<q")
            return True
        if kind in ("wait", "get"):
            w(bytes([self.WAIT]) + struct.pack("<Q", 1) + self._str(key))
            self.expect = self._fixed(1, "<B")
            self._then_get = key if kind == "get" else None
            return True
        raise ValueError(f"unsupported op {kind}")

    def on_reply(self, value: Any) -> None:
        if not self.ready.done():  # the ping's echo
            if value != self._nonce:
                raise RuntimeError(f"TCPStore ping returned {value}, sent {self._nonce}")
            self.ready.set_result(None)
            return
        key = self._then_get
        if key is not None:  # the C++ client's get: WAIT, then GET once the key exists
            self._then_get = None
            self.transport.write(bytes([self.GET]) + self._str(key))
            self.expect = self._bytes
            return
        self._advance(value)


def _resp(*args: bytes | str | int) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


class RespError(RuntimeError):
    pass


def _resp_reader():
    """A RESP2 reply parser per connection: hiredis' C one, what redis-py uses. The replay's client
    CPU is the simulator's own cost, not the store's: on a cluster every rank parses its replies
    on its own CPU."""
    import hiredis

    return hiredis.Reader()


class _RedisRank(_Rank):
    """RedisStore's commands for each op (mega/store/redis_store.py): the same Lua scripts, the
    ``HGET`` fast path of ``get``, and ``XREAD BLOCK`` on the signal stream of a missing key."""

    def __init__(self, program, on_done, ns: _RedisNamespace):
        super().__init__(program, on_done)
        self.ns = ns
        self.state: tuple | None = None
        self.reader = _resp_reader()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (value := self.reader.gets()) is not False:
                if isinstance(value, Exception):
                    raise RespError(str(value))
                self.on_reply(value)
        except BaseException as err:
            self._finish(err)

    def _send(self, *args) -> None:
        self.transport.write(_resp(*args))

    def _script(self, name: str, *args) -> None:
        ns = self.ns
        self._send("EVALSHA", ns.sha[name], 2, ns.kv, ns.waiters, ns.ttl, ns.sig, *args)

    def issue(self, op: Op) -> bool:
        kind, key = op[0], op[1]
        if kind == "set":
            self.state = ("done",)
            self._script("set", key, b"1")
        elif kind == "add":
            self.state = ("add",)
            self._script("add", key, op[2])
        elif kind == "get":
            self.state = ("hget", key)
            self._send("HGET", self.ns.kv, key)
        elif kind == "wait":
            self.state = ("read", key, "0")
            self._script("read", "0", key)
        else:
            raise ValueError(f"unsupported op {kind}")
        return True

    def on_reply(self, value: Any) -> None:
        state = self.state
        step = state[0]
        if step == "done":
            return self._advance(None)
        if step == "add":
            return self._advance(int(value))
        if step == "hget":
            if value is not None:
                return self._advance(value)
            self.state = ("read", state[1], "1")
            return self._script("read", "1", state[1])
        if step == "read":
            key, flag = state[1], state[2]
            if value[0] == 1:
                return self._advance(value[1] if flag == "1" else None)
            self.state = ("xread", key, flag)
            # value = [0, key, last id]: block on the key's signal stream from that id
            return self._send("XREAD", "COUNT", 1, "BLOCK", 20_000, "STREAMS", self.ns.sig + key, value[2])
        if step == "xread":
            key, flag = state[1], state[2]
            if value:  # get: the signal carries the value; wait: the key now exists (as RedisStore)
                return self._advance(b"1" if flag == "1" else None)
            self.state = ("read", key, flag)
            return self._script("read", flag, key)
        raise AssertionError(step)


@dataclass
class _RedisNamespace:
    prefix: str
    sha: dict
    ttl: int = 3600

    @property
    def kv(self) -> str:
        return self.prefix + "kv"

    @property
    def waiters(self) -> str:
        return self.prefix + "waiters"

    @property
    def sig(self) -> str:
        return self.prefix + "sig:"


def _redis_namespace(url: str, job: str) -> _RedisNamespace:
    import redis

    from mega.store import redis_store as rs

    client = redis.Redis.from_url(url)
    try:
        sha = {
            name: client.script_load(src)
            for name, src in [("set", rs._LUA_SET), ("add", rs._LUA_ADD), ("read", rs._LUA_READ_OR_REGISTER)]
        }
    finally:
        client.close()
    return _RedisNamespace(
        prefix=f"mega:{job}:0:", sha={k: v.encode() if isinstance(v, str) else v for k, v in sha.items()}
    )


# ---------------------------------------------------------------------------------------------
# Replay


@dataclass
class SimResult:
    strategy: str
    store: str
    ranks: int
    completed: bool
    seconds: float | None
    store_ops: int  # planned operations (what the ranks issue when they all finish)
    ops_done: int  # issued (more ``set``s than planned when ranks reach a barrier at the same time)
    ops_by_kind: dict
    connect_s: float
    client_cpu_s: float  # CPU time of the client processes during the replay
    server_cpu_s: float | None  # CPU time of the server process during the replay
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _replay(
    strategy: str,
    store: str,
    layout: Layout,
    ranks: range,
    memberships,
    host: str,
    port: int,
    ns: _RedisNamespace | None,
    start_barrier,
    deadline_s: float,
) -> dict[str, Any]:
    """Connect ``ranks``, wait for every worker at ``start_barrier``, run them; timestamps are
    ``time.monotonic()`` (one clock for all worker processes)."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    left = [len(ranks)]
    errors: list[str] = []

    def on_done(rank: _Rank, err: BaseException | None) -> None:
        if err is not None and not errors:
            errors.append(f"{type(err).__name__}: {err}")
        left[0] -= 1
        if (left[0] == 0 or err is not None) and not finished.done():
            finished.set_result(time.monotonic())

    def factory(r: int):
        program = rank_program(strategy, layout, r, memberships)
        if store == "tcpstore":
            return lambda: _TCPStoreRank(program, on_done)
        return lambda: _RedisRank(program, on_done, ns)

    t0 = time.monotonic()
    sem = asyncio.Semaphore(128)  # a burst of thousands of SYNs would overflow the listen backlog

    async def connect(r: int) -> _Rank:
        async with sem:
            _, proto = await loop.create_connection(factory(r), host, port)
            await proto.ready
            return proto

    protos = await asyncio.gather(*(connect(r) for r in ranks))
    connect_s = time.monotonic() - t0
    await loop.run_in_executor(None, start_barrier.wait)
    start = time.monotonic()
    cpu0 = time.process_time()
    for proto in protos:
        proto.start()
    end = None
    try:
        end = await asyncio.wait_for(asyncio.shield(finished), timeout=max(0.1, deadline_s))
    except TimeoutError:
        pass
    cpu_s = time.process_time() - cpu0
    completed = end is not None and not errors and left[0] == 0
    ops_done = sum(p.ops for p in protos)
    kinds = sum((p.kinds for p in protos), Counter())
    for proto in protos:
        proto.finished = True
        if proto.transport is not None:
            proto.transport.abort()
    await asyncio.sleep(0)
    return {
        "completed": completed,
        "start": start,
        "end": end if completed else None,
        "ops_done": ops_done,
        "ops_by_kind": dict(kinds),
        "connect_s": connect_s,
        "client_cpu_s": cpu_s,
        "error": errors[0] if errors else None,
    }


def _run_loop(coro):
    """uvloop's event loop (libuv): like the reply parser, the loop's CPU per callback is the
    simulator's cost, which real ranks spread over their hosts."""
    import uvloop

    return uvloop.run(coro)


def _worker(strategy, store, layout, ranks, host, port, ns, start_barrier, max_seconds, out) -> None:
    try:
        memberships = _memberships(layout)  # cached in the parent before the fork
        out.put(
            _run_loop(
                _replay(
                    strategy, store, layout, ranks, memberships, host, port, ns, start_barrier, max_seconds
                )
            )
        )
    except BaseException as err:
        out.put(_failed_report(f"{type(err).__name__}: {err}"))
        try:
            start_barrier.abort()
        except Exception:
            pass


def simulate(
    strategy: str,
    store: str,
    layout: Layout,
    *,
    max_seconds: float = 60.0,
    workers: int = 2,
    redis_url: str | None = None,
    tcp_port: int | None = None,
) -> SimResult:
    """Replay ``strategy`` for ``layout`` against a server: ``store="redis"`` needs ``redis_url``
    (a fresh namespace is used), ``"tcpstore"`` starts a TCPStore server unless ``tcp_port`` names
    one. The ranks are split over ``workers`` forked client processes (one event loop each) that
    start together. Past ``max_seconds`` the point is ``completed=False, seconds=None``."""
    import multiprocessing as mp

    from redis.exceptions import RedisError

    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    planned = sum(plan_counts(strategy, layout).values())
    _memberships_cached(layout)  # computed once, inherited by the forked workers
    host, port, ns, server = _server(strategy, store, layout, redis_url, tcp_port)
    workers = max(1, min(workers, layout.world))
    ctx = mp.get_context("fork")  # the workers inherit the plan; nothing is imported again
    start_barrier = ctx.Barrier(workers)
    out = ctx.Queue()
    bounds = [layout.world * i // workers for i in range(workers + 1)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                strategy,
                store,
                layout,
                range(bounds[i], bounds[i + 1]),
                host,
                port,
                ns,
                start_barrier,
                max_seconds,
                out,
            ),
            daemon=True,
        )
        for i in range(workers)
    ]
    cpu_before = _server_cpu(redis_url, server)
    try:
        for proc in procs:
            proc.start()
        rows = _collect(procs, out, max_seconds)
        cpu_after = _server_cpu(redis_url, server)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        if server is not None:
            server.stop()
        if ns is not None:
            try:
                _drop_namespace(redis_url, ns)
            except RedisError:  # a server still busy with a timed-out replay; the keys carry a TTL
                pass
    cpu_s = None if cpu_before is None or cpu_after is None else round(cpu_after - cpu_before, 3)
    return _result(strategy, store, layout.world, planned, rows, cpu_s, max_seconds)


def _server(strategy: str, store: str, layout: Layout, redis_url: str | None, tcp_port: int | None):
    """(host, port, redis namespace or None, the TCPStore server started here or None)."""
    from mega.store.redis_server import parse_redis_url

    ns = None
    server = None
    if store == "redis":
        if redis_url is None:
            raise ValueError("store=redis needs redis_url")
        fields = parse_redis_url(redis_url)
        host, port = fields["host"], fields["port"]
        ns = _redis_namespace(redis_url, f"sim-{strategy}-{layout.world}-{os.getpid()}-{time.monotonic_ns()}")
    else:
        host = "127.0.0.1"
        if tcp_port is None:
            server = TCPStoreServer().start()
            tcp_port = server.port
        port = tcp_port
    return host, port, ns, server


def _collect(procs: list, out, max_seconds: float) -> list[dict]:
    """Every worker's report; a worker silent past the deadline counts as not completed."""
    rows = []
    deadline = time.monotonic() + max_seconds + 300  # connecting thousands of clients comes first
    for _ in procs:
        try:
            rows.append(out.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:  # a worker still connecting or replaying: the point did not complete
            rows.append(_failed_report(f"no report within {max_seconds + 300:g} s"))
    return rows


def _failed_report(error: str) -> dict:
    """A worker's report of a point it did not complete."""
    return {
        "completed": False,
        "error": error,
        "ops_done": 0,
        "ops_by_kind": {},
        "start": None,
        "end": None,
        "connect_s": 0.0,
        "client_cpu_s": 0.0,
    }


def _result(
    strategy: str, store: str, world: int, planned: int, rows: list[dict], server_cpu_s, max_seconds: float
) -> SimResult:
    """The point's result from the workers' reports: timed from the first start to the last end."""
    errors = [r["error"] for r in rows if r.get("error")]
    completed = all(r["completed"] for r in rows)
    seconds = None
    if completed:
        seconds = max(r["end"] for r in rows) - min(r["start"] for r in rows)
        completed = seconds <= max_seconds
    kinds = sum((Counter(r["ops_by_kind"]) for r in rows), Counter())
    return SimResult(
        strategy,
        store,
        world,
        completed,
        round(seconds, 4) if completed else None,
        planned,
        sum(r["ops_done"] for r in rows),
        dict(sorted(kinds.items())),
        round(max(r["connect_s"] for r in rows), 3),
        round(sum(r["client_cpu_s"] for r in rows), 3),
        server_cpu_s,
        errors[0] if errors else None,
    )


def _server_cpu(redis_url: str | None, server: TCPStoreServer | None) -> float | None:
    """CPU seconds the server process has used so far (Redis: INFO cpu; TCPStore: /proc); None when
    the server does not answer (a Redis still busy with a replay that ran out of time)."""
    from redis.exceptions import RedisError

    try:
        if server is not None and server.proc is not None:
            stat = procstat.read(server.proc.pid)
            return None if stat is None else stat.cpu_s
        if redis_url is not None:
            import redis

            client = redis.Redis.from_url(redis_url)
            try:
                info = client.info("cpu")
            finally:
                client.close()
            return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    except (OSError, ValueError, KeyError, IndexError, RedisError):
        return None
    return None


def _drop_namespace(url: str, ns: _RedisNamespace) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        names = list(client.scan_iter(match=ns.prefix + "*", count=10_000))
        for i in range(0, len(names), 10_000):
            client.unlink(*names[i : i + 10_000])
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------
# Real ranks with a RecordingStore (the simulator's reference)


def _record_rank(
    rank: int,
    world: int,
    port: int,
    tp: int,
    pp: int,
    strategies: tuple[str, ...],
    gloo_groups: bool,
    barrier: bool,
    results,
) -> None:
    try:
        # set here, not in the parent: a forkserver child has the environment the forkserver
        # started with (maybe long before, by another caller), not the parent's current one
        os.environ["TORCH_DIST_INIT_BARRIER"] = "1" if barrier else "0"
        import torch.distributed as dist
        from megatron.core import parallel_state
        from torch.distributed import PrefixStore, TCPStore

        from mega.cluster import parallel_groups
        from mega.store.recording import RecordingStore

        timeout = timedelta(seconds=60)
        tcp = TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        rows = {}
        for strategy in strategies:  # one world per strategy, each in its own key space
            store = RecordingStore(PrefixStore(f"record-{strategy}", tcp), rank=rank)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
            parallel_groups.initialize_model_parallel(
                strategy,
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                create_gloo_process_groups=gloo_groups,
            )
            rows[strategy] = store.to_dict()
            dist.barrier()  # gloo, not the store: nobody tears down while a peer still connects
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        results.put({"rank": rank, "recordings": rows})
    except BaseException as err:  # report, never hang the parent
        results.put({"rank": rank, "error": f"{type(err).__name__}: {err}"})
        raise


def record_real_ranks(
    strategies: tuple[str, ...],
    world: int,
    tp: int,
    pp: int,
    *,
    gloo_groups: bool = True,
    barrier: bool = True,
    timeout_s: float = 150.0,
) -> dict[str, dict[int, dict[str, Any]]]:
    """Run ``world`` real gloo ranks (processes; forkserver with torch and megatron-core preloaded)
    that create megatron's groups with each of ``strategies`` in turn (``mega.cluster.parallel_groups``)
    over a TCPStore wrapped in ``RecordingStore``. Returns ``{strategy: {rank: {"rank", "counts",
    "ops"}}}``. ``barrier`` sets TORCH_DIST_INIT_BARRIER in the ranks."""
    import multiprocessing as mp

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "megatron.core.parallel_state", "mega.cluster.parallel_groups", "mega.store.recording"]
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_record_rank,
            args=(r, world, server.port, tp, pp, tuple(strategies), gloo_groups, barrier, results),
            daemon=True,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        rows = [results.get(timeout=timeout_s) for _ in range(world)]
    finally:
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        del server
    errors = [r for r in rows if "error" in r]
    if errors:
        raise RuntimeError(f"real ranks failed: {errors}")
    return {s: {row["rank"]: row["recordings"][s] for row in rows} for s in strategies}


if __name__ == "__main__":  # python -m mega.cluster.bootstrap_sim STRATEGY STORE N [TP PP]: one replay, JSON
    strategy, store, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tp, pp = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (8, 8)
    lay = Layout(n, tp, pp)
    if store == "redis":
        from mega.store import RedisServer

        with RedisServer(maxclients=max(10_000, n + 100)) as srv:
            res = simulate(strategy, store, lay, redis_url=srv.url)
    else:
        res = simulate(strategy, store, lay)
    print(json.dumps(res.as_dict()))
