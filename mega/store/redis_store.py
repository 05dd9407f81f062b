"""``RedisStore``: a ``torch.distributed.Store`` backed by a Redis server (through redis-py).

Drop-in for TCPStore in ``dist.init_process_group(backend, store=RedisStore(...), rank=r,
world_size=n)`` and for everything built on the default store (``new_group``, megatron-core's
``initialize_model_parallel``), with TCPStore's semantics: ``get``/``wait``/``multi_get`` block
until the keys exist or the store timeout passes (then ``DistStoreError``, as TCPStore), ``add``
keeps a decimal string, ``compare_set`` with an empty expected value creates a missing key, ...

Layout of one job attempt, all under ``mega:<job_id>:<attempt>:`` (see docs/bootstrap.md):

* ``kv``       hash: every store key is a field (O(1) ``num_keys``, one TTL for the namespace)
* ``waiters``  set: keys some client is blocked on while they do not exist yet
* ``sig:<key>`` stream (MAXLEN 1): written when a waited-for key is created; waiters block in
  ``XREAD BLOCK`` on it, which wakes *every* blocked reader at once (no polling, no herd of
  re-polls, one Redis connection per blocked thread)
* ``q:<key>``  list: ``queue_push``/``queue_pop`` (``BLPOP`` wakes exactly one consumer)

Every write runs as one Lua script (atomic) that also refreshes the namespace TTL, so a dead
attempt's keys expire ``ttl_s`` after its last write instead of leaking; ``drop_namespace()``
removes them at once. A restarted job uses a new attempt number and never sees a dead attempt's keys.

A Python object behind a C++ store handle must outlive the handle (pybind trampoline), so every
RedisStore stays referenced by this module until ``close()``: ``init_process_group(store=
RedisStore(...))`` with a temporary is safe.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

import redis
import torch.distributed as dist
from redis.backoff import NoBackoff
from redis.retry import Retry

from mega import rank_env
from mega.store.redis_server import parse_redis_url, redact_url

__all__ = [
    "RedisStore",
    "RedisStoreError",
    "RedisUnreachableError",
    "RedisAuthError",
    "drop_attempts",
    "parse_redis_url",
    "redact_url",
]

T = TypeVar("T")

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_TIMEOUT = timedelta(seconds=300)  # TCPStore's default
DEFAULT_TTL_S = 24 * 3600
BLOCK_SLICE_MS = 20_000  # one XREAD/BLPOP blocks at most this long, then the loop re-checks
SOCKET_TIMEOUT_S = 45.0  # > BLOCK_SLICE_MS: a read that waits longer means a dead or stuck server
_JOB_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class RedisStoreError(dist.DistStoreError):
    """A Redis-side failure that is not a timeout (bad data, permissions)."""


class RedisUnreachableError(dist.DistNetworkError):
    """The Redis server cannot be reached; the message names host:port (never credentials)."""


class RedisAuthError(dist.DistStoreError):
    """Redis refused the credentials (or needs some); the message never contains the password."""


# ---------------------------------------------------------------------------------------------
# Lua: every mutation is one atomic script. KEYS[1] = kv hash, KEYS[2] = waiters set;
# ARGV[1] = TTL seconds, ARGV[2] = signal stream prefix, ARGV[3..] = operation arguments.

_LUA_COMMON = """
-- f was just created with value v: wake its waiters (XREAD on the stream), handing them v
local function signal(f, v)
  if redis.call('SREM', KEYS[2], f) == 1 then
    local s = ARGV[2] .. f
    redis.call('XADD', s, 'MAXLEN', '1', '*', 'v', v)
    redis.call('EXPIRE', s, ARGV[1])
  end
end
local function touch() redis.call('EXPIRE', KEYS[1], ARGV[1]) end
"""

_LUA_SET = (
    _LUA_COMMON
    + """
for i = 3, #ARGV, 2 do
  if redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then signal(ARGV[i], ARGV[i + 1]) end
end
touch()
return 1
"""
)

# HINCRBY's reply becomes a Lua double; return the stored decimal string to keep all 64 bits
_LUA_ADD = (
    _LUA_COMMON
    + """
local new = redis.call('HEXISTS', KEYS[1], ARGV[3]) == 0
redis.call('HINCRBY', KEYS[1], ARGV[3], ARGV[4])
local v = redis.call('HGET', KEYS[1], ARGV[3])
if new then signal(ARGV[3], v) end
touch()
return v
"""
)

# TCPStore: missing key -> create only when expected is empty (else return expected);
# present key -> replace when equal to expected; always return the value now stored (or expected)
_LUA_COMPARE_SET = (
    _LUA_COMMON
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[3])
if not cur then
  if ARGV[4] == '' then
    redis.call('HSET', KEYS[1], ARGV[3], ARGV[5]); signal(ARGV[3], ARGV[5]); touch()
    return ARGV[5]
  end
  return ARGV[4]
end
if cur == ARGV[4] then
  redis.call('HSET', KEYS[1], ARGV[3], ARGV[5]); touch()
  return ARGV[5]
end
return cur
"""
)

_LUA_APPEND = (
    _LUA_COMMON
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[3])
if cur then
  redis.call('HSET', KEYS[1], ARGV[3], cur .. ARGV[4])
else
  redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]); signal(ARGV[3], ARGV[4])
end
touch()
return 1
"""
)

# The read side of every blocking call (get, multi_get, wait), one atomic script: when all keys
# exist, return {1, values...} (values only when ARGV[3] == '1'); otherwise join the waiters set
# for each missing key and return {0, key, last signal id, ...}. Because the existence check and
# the registration are atomic, a key created after this script always signals, and XREAD from
# the returned id cannot miss it.
_LUA_READ_OR_REGISTER = """
local vals, missing = {1}, {}
for i = 4, #ARGV do
  if ARGV[3] == '1' then
    local v = redis.call('HGET', KEYS[1], ARGV[i])
    if v then vals[#vals + 1] = v else missing[#missing + 1] = ARGV[i] end
  elseif redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    missing[#missing + 1] = ARGV[i]
  end
end
if #missing == 0 then return vals end
local out = {0}
for _, f in ipairs(missing) do
  redis.call('SADD', KEYS[2], f)
  local last = redis.call('XREVRANGE', ARGV[2] .. f, '+', '-', 'COUNT', 1)
  out[#out + 1] = f
  if #last > 0 then out[#out + 1] = last[1][1] else out[#out + 1] = '0-0' end
end
redis.call('EXPIRE', KEYS[2], ARGV[1])
return out
"""

_LUA_CHECK = """
for i = 3, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then return 0 end
end
return 1
"""

_LUA_QUEUE_PUSH = """
redis.call('RPUSH', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


# ---------------------------------------------------------------------------------------------


_LIVE: set[RedisStore] = set()  # see the module docstring: pybind trampoline lifetime
_LIVE_LOCK = threading.Lock()


class RedisStore(dist.Store):
    """A c10d store in one Redis namespace ``mega:<job_id>:<attempt>:``.

    Args:
        url: redis://[user[:password]@]host:port/db; rediss:// for TLS.
        job_id: names the job ([A-Za-z0-9._-], e.g. a flow-run id); attempt: the restart attempt.
        timeout: how long get/wait/multi_get/queue_pop block (``set_timeout`` changes it).
        ttl_s: the namespace expires this long after its last write.
        connect_timeout_s: construction fails (``RedisUnreachableError``) after this long.
        username/password: override the URL's; password falls back to $MEGA_REDIS_PASSWORD.
        ssl_*: passed to redis-py (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_cert_reqs``...).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        job_id: str = "default",
        attempt: int = 0,
        timeout: timedelta = DEFAULT_TIMEOUT,
        ttl_s: int = DEFAULT_TTL_S,
        connect_timeout_s: float = 2.0,
        username: str | None = None,
        password: str | None = None,
        **ssl_kwargs: Any,
    ):
        super().__init__()
        if not _JOB_ID.match(job_id):
            raise ValueError(f"job_id must match {_JOB_ID.pattern}, got {job_id!r}")
        if not (isinstance(attempt, int) and attempt >= 0):
            raise ValueError(f"attempt must be an integer >= 0, got {attempt!r}")
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {ttl_s}")
        unknown = [k for k in ssl_kwargs if not k.startswith("ssl_")]
        if unknown:
            raise TypeError(f"RedisStore: unexpected arguments {unknown}")
        fields = parse_redis_url(url)
        if username is not None:
            fields["username"] = username
        if password is not None:
            fields["password"] = password
        elif fields["password"] is None and os.environ.get(rank_env.REDIS_PASSWORD_ENV):
            fields["password"] = os.environ[rank_env.REDIS_PASSWORD_ENV]

        self._url = url
        self._fields = fields
        self._ssl_kwargs = ssl_kwargs
        self._job_id, self._attempt = job_id, attempt
        self._ttl_s = int(ttl_s)
        self._connect_timeout_s = connect_timeout_s
        self.prefix = f"mega:{job_id}:{attempt}:"
        self._kv = self.prefix + "kv"
        self._waiters = self.prefix + "waiters"
        self._sig = self.prefix + "sig:"
        self._q = self.prefix + "q:"
        self.set_timeout(timeout)

        # retries: none inside redis-py (a retried HINCRBY could count twice); idempotent
        # operations retry in _call instead
        self._r = redis.Redis(
            host=fields["host"],
            port=fields["port"],
            db=fields["db"],
            username=fields["username"],
            password=fields["password"],
            ssl=fields["ssl"],
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_keepalive=True,
            retry=Retry(NoBackoff(), 0),
            client_name=f"mega-store:{job_id}:{attempt}",
            **ssl_kwargs,
        )
        self._scripts = {
            name: self._r.register_script(src)
            for name, src in [
                ("set", _LUA_SET),
                ("add", _LUA_ADD),
                ("compare_set", _LUA_COMPARE_SET),
                ("append", _LUA_APPEND),
                ("read", _LUA_READ_OR_REGISTER),
                ("check", _LUA_CHECK),
                ("queue_push", _LUA_QUEUE_PUSH),
            ]
        }
        self._connect()
        with _LIVE_LOCK:
            _LIVE.add(self)

    # -- identity ----------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._fields["host"]

    @property
    def port(self) -> int:
        return self._fields["port"]

    @property
    def address(self) -> str:
        """host:port/db, safe to log."""
        return f"{self.host}:{self.port}/{self._fields['db']}"

    @property
    def job_id(self) -> str:
        return self._job_id

    @property
    def attempt(self) -> int:
        return self._attempt

    def __repr__(self) -> str:
        scheme = "rediss" if self._fields["ssl"] else "redis"
        return f"RedisStore({scheme}://{self.address}, namespace={self.prefix!r})"

    # -- connection and error mapping -------------------------------------------------------

    def _connect(self) -> None:
        """PING until it answers or connect_timeout_s passes: fast, named failures."""
        deadline = time.monotonic() + self._connect_timeout_s
        while True:
            try:
                self._r.ping()
                return
            except redis.AuthenticationError as err:
                self._r.close()
                raise self._auth_error(err) from None
            except (redis.ConnectionError, redis.TimeoutError) as err:
                if time.monotonic() + 0.1 > deadline:
                    self._r.close()
                    raise RedisUnreachableError(
                        f"cannot reach Redis at {self.address} within {self._connect_timeout_s:g} s: "
                        f"{type(err).__name__}: {self._scrub(err)}"
                    ) from None
                time.sleep(0.1)
            except redis.ResponseError as err:
                self._r.close()
                if "NOAUTH" in str(err) or "WRONGPASS" in str(err):
                    raise self._auth_error(err) from None
                raise RedisStoreError(f"Redis at {self.address}: {self._scrub(err)}") from None

    def _auth_error(self, err: Exception) -> RedisAuthError:
        who = f"user {self._fields['username']!r}" if self._fields["username"] else "the default user"
        how = "with a password" if self._fields["password"] else "without a password"
        return RedisAuthError(
            f"Redis at {self.address} refused {who} {how}: {self._scrub(err)} "
            "(check store.redis_url or $MEGA_REDIS_PASSWORD)"
        )

    def _scrub(self, err: Exception) -> str:
        text = str(err)
        secret = self._fields.get("password")
        return text.replace(secret, "***") if secret else text

    def _call(self, what: str, fn: Callable[[], T], idempotent: bool = True) -> T:
        """Run one Redis operation; map its errors onto torch's store exceptions."""
        attempts = 3 if idempotent else 1
        for i in range(attempts):
            try:
                return fn()
            except redis.AuthenticationError as err:
                raise self._auth_error(err) from None
            except (redis.ConnectionError, redis.TimeoutError) as err:
                if i + 1 < attempts:
                    time.sleep(0.05 * 4**i)
                    continue
                raise RedisUnreachableError(
                    f"Redis at {self.address} failed during {what}: {type(err).__name__}: {self._scrub(err)}"
                ) from None
            except redis.ResponseError as err:
                if "NOAUTH" in str(err) or "WRONGPASS" in str(err):
                    raise self._auth_error(err) from None
                raise RedisStoreError(f"Redis at {self.address}: {what} failed: {self._scrub(err)}") from None
        raise AssertionError("unreachable")

    def _script(self, name: str, args: list, keys: list[str] | None = None, idempotent: bool = True) -> Any:
        script = self._scripts[name]
        keys = keys if keys is not None else [self._kv, self._waiters]
        return self._call(name, lambda: script(keys=keys, args=[self._ttl_s, self._sig, *args]), idempotent)

    # -- the c10d Store interface -----------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._script("set", [key, _b(value)])

    def get(self, key: str) -> bytes:
        value = self._call("get", lambda: self._r.hget(self._kv, key))  # fast path: a plain HGET
        return value if value is not None else self._read([key], values=True)[0]

    def add(self, key: str, value: int) -> int:
        return int(self._script("add", [key, int(value)], idempotent=False))

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        return self._script("compare_set", [key, _b(expected_value), _b(desired_value)], idempotent=False)

    def append(self, key: str, value: bytes | str) -> None:
        self._script("append", [key, _b(value)], idempotent=False)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        if keys:
            self._script("set", [x for kv in zip(keys, values) for x in (kv[0], _b(kv[1]))])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        keys = list(keys)
        if not keys:
            return []
        values = self._call("multi_get", lambda: self._r.hmget(self._kv, keys))
        return values if all(v is not None for v in values) else self._read(keys, values=True)

    def check(self, keys: list[str]) -> bool:
        keys = list(keys)
        if not keys:
            return True
        return bool(self._script("check", keys, keys=[self._kv]))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", lambda: self._r.hdel(self._kv, key)))

    def num_keys(self) -> int:
        return int(self._call("num_keys", lambda: self._r.hlen(self._kv)))

    # the C++ trampoline looks these two up by their C++ names
    getNumKeys = num_keys
    deleteKey = delete_key

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self._call("list_keys", lambda: self._r.hkeys(self._kv))]

    def has_extended_api(self) -> bool:
        return True  # append, multi_get, multi_set: gloo's rendezvous uses them to save round trips

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; DistStoreError after ``timeout`` (default: the store's)."""
        keys = list(keys)
        if keys:
            self._read(keys, values=False, timeout=timeout)

    def _read(self, keys: list[str], values: bool, timeout: timedelta | None = None) -> list[bytes]:
        """Values of ``keys`` once all exist (``values=False``: just wait for them).

        One round trip when they exist. Otherwise the script registers this client as a waiter
        and the thread blocks in ``XREAD BLOCK`` on the missing keys' signal streams -- no Redis
        traffic while waiting -- until a writer creates one of them, then reads again.
        """
        timeout = self.timeout if timeout is None else timeout
        limit_ms = timeout / timedelta(milliseconds=1)
        deadline = time.monotonic() + limit_ms / 1e3 if limit_ms > 0 else None  # 0 = no timeout (c10d)
        flag = "1" if values else "0"
        while True:
            reply = self._script("read", [flag, *keys])
            if reply[0] == 1:
                return reply[1:]
            pending = reply[1:]
            streams = {self._sig + pending[i].decode(): pending[i + 1] for i in range(0, len(pending), 2)}
            block_ms = BLOCK_SLICE_MS
            if deadline is not None:
                left_ms = (deadline - time.monotonic()) * 1e3
                if left_ms <= 0:
                    missing = [pending[i].decode() for i in range(0, len(pending), 2)]
                    raise dist.DistStoreError(
                        f"wait timeout after {int(limit_ms)}ms, keys: {', '.join(missing)} "
                        f"(Redis {self.address}, namespace {self.prefix})"
                    )
                block_ms = max(1, min(BLOCK_SLICE_MS, int(left_ms) + 1))
            woke = self._call("wait", lambda: self._r.xread(streams, count=1, block=block_ms))
            if woke and len(pending) == 2 and not values:
                # the one missing key was created while we waited: `wait` is satisfied (as
                # TCPStore's, which returns once the key has been set), no re-read
                return []
            if values and len(keys) == 1 and woke:
                # the signal carries the value the key was created with: a valid result of this
                # get (created while it waited), one round trip less per released waiter
                value = _signal_value(woke)
                if value is not None:
                    return [value]

    # queues: Python callers only (torch 2.13's trampoline does not forward queue ops from C++)

    def queue_push(self, key: str, value: bytes | str) -> None:
        self._script("queue_push", [_b(value)], keys=[self._q + key], idempotent=False)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        if not block:
            value = self._call("queue_pop", lambda: self._r.lpop(self._q + key), idempotent=False)
            if value is None:
                raise dist.QueueEmptyError("queue is empty")
            return value
        limit_ms = self.timeout / timedelta(milliseconds=1)
        deadline = time.monotonic() + limit_ms / 1e3 if limit_ms > 0 else None
        while True:
            block_s = BLOCK_SLICE_MS / 1e3
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(
                        f"wait timeout after {int(limit_ms)}ms, keys: {key} "
                        f"(Redis {self.address}, namespace {self.prefix})"
                    )
                block_s = min(block_s, max(left, 0.001))
            got = self._call(
                "queue_pop", lambda: self._r.blpop([self._q + key], timeout=block_s), idempotent=False
            )
            if got is not None:
                return got[1]

    def queue_len(self, key: str) -> int:
        return int(self._call("queue_len", lambda: self._r.llen(self._q + key)))

    def clone(self) -> RedisStore:
        """A new connection to the same namespace (process groups clone stores, e.g. on shrink)."""
        return RedisStore(
            self._url,
            job_id=self._job_id,
            attempt=self._attempt,
            timeout=self.timeout,
            ttl_s=self._ttl_s,
            connect_timeout_s=self._connect_timeout_s,
            username=self._fields["username"],
            password=self._fields["password"],
            **self._ssl_kwargs,
        )

    # -- beyond c10d --------------------------------------------------------------------------

    def touch(self) -> None:
        """Restart the namespace TTL (writes do this already; for a long quiet job)."""

        def run():
            with self._r.pipeline(transaction=False) as pipe:
                pipe.expire(self._kv, self._ttl_s)
                pipe.expire(self._waiters, self._ttl_s)
                pipe.execute()

        self._call("touch", run)

    def ttl(self) -> int:
        """Seconds until the namespace expires (-2: it holds no keys)."""
        return int(self._call("ttl", lambda: self._r.ttl(self._kv)))

    def drop_namespace(self) -> int:
        """Delete every key of this job attempt now; returns how many Redis keys went."""

        def run() -> int:
            names = [self._kv, self._waiters]
            pattern = _glob_escape(self.prefix) + "*"
            names += [
                k
                for k in self._r.scan_iter(match=pattern, count=1000)
                if k not in (self._kv.encode(), self._waiters.encode())
            ]
            return int(self._r.unlink(*names)) if names else 0

        return self._call("drop_namespace", run)

    def ping_ms(self) -> float:
        start = time.perf_counter()
        self._call("ping", self._r.ping)
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        """Disconnect; the store must not be in use by a process group any more."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        self._r.close()

    def __reduce__(self):
        raise TypeError("RedisStore is not picklable: pass url/job_id/attempt and build one per process")


def _signal_value(reply: Any) -> bytes | None:
    """The 'v' field of the newest entry in an XREAD reply (RESP2 list or RESP3 dict form)."""
    try:
        entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
        if entries and isinstance(entries[0], list) and entries and not isinstance(entries[0][0], bytes):
            entries = entries[0]  # RESP3 nests one more level
        return entries[-1][1].get(b"v")
    except (AttributeError, IndexError, KeyError, StopIteration, TypeError):
        return None


def _b(value: bytes | str | bytearray | memoryview) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def drop_attempts(store: RedisStore, attempts: Iterable[int]) -> int:
    """Delete the namespaces of other attempts of ``store``'s job (e.g. all before a restart)."""
    removed = 0
    for attempt in attempts:
        if attempt == store.attempt:
            continue
        other = RedisStore(
            store._url,
            job_id=store.job_id,
            attempt=attempt,
            ttl_s=store._ttl_s,
            connect_timeout_s=store._connect_timeout_s,
            username=store._fields["username"],
            password=store._fields["password"],
            **store._ssl_kwargs,
        )
        try:
            removed += other.drop_namespace()
        finally:
            other.close()
    return removed
