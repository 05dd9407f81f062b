"""RedisStore against a real redis-server, held to TCPStore's behaviour.

The behavioural tests run unchanged against torch's TCPStore and mega's RedisStore (the ``kind``
parameter); the rest is Redis-only: namespacing and TTL, failure messages (unreachable server,
wrong password), the C++ trampoline path, and real gloo process groups plus megatron-core's
``initialize_model_parallel`` over the store.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import socket
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

from mega.config import ConfigError, from_dict
from mega.store import RedisAuthError, RedisServer, RedisStore, RedisUnreachableError, find_redis_server
from mega.store.redis_server import RedisServerError, parse_redis_url, redact_url

SHORT = timedelta(milliseconds=300)


@pytest.fixture(scope="module")
def redis_server():
    try:
        find_redis_server()
    except RedisServerError as err:
        pytest.fail(f"{err} (infra/install.sh installs it)")
    with RedisServer() as server:
        yield server


class Stores:
    """Clients of one fresh store: ``a`` (for TCP: the server side), ``b``, and ``new()`` for more."""

    def __init__(self, kind: str, redis_server: RedisServer | None):
        self.kind = kind
        self._made: list = []
        self._timers: list[threading.Timer] = []
        if kind == "tcp":
            self._server = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
            )
            self.a = self._server
        else:
            self._url, self._job = redis_server.url, f"test-{uuid.uuid4().hex[:10]}"
            self.a = self.new()
        self.b = self.new()

    def new(self, timeout: timedelta = timedelta(seconds=10)):
        if self.kind == "tcp":
            store = dist.TCPStore("127.0.0.1", self._server.port, is_master=False, timeout=timeout)
        else:
            store = RedisStore(self._url, job_id=self._job, timeout=timeout, ttl_s=600)
        self._made.append(store)
        return store

    def later(self, seconds: float, call, *args) -> None:
        """``call(*args)`` from another client's thread after ``seconds``; joined before the
        clients close, so a late reply never meets a closed connection."""
        timer = threading.Timer(seconds, call, args=args)
        self._timers.append(timer)
        timer.start()

    def close(self):
        for timer in self._timers:
            timer.join(timeout=30)
        for store in self._made:
            if isinstance(store, RedisStore):
                store.drop_namespace()
                store.close()


@pytest.fixture(params=["tcp", "redis"])
def stores(request):
    server = request.getfixturevalue("redis_server") if request.param == "redis" else None
    s = Stores(request.param, server)
    yield s
    s.close()


# ---------------------------------------------------------------------------------------------
# The same behaviour from both stores


def test_set_get(stores):
    a, b = stores.a, stores.b
    a.set("k", b"v1")
    assert b.get("k") == b"v1"
    b.set("k", "v2")  # str values are stored as UTF-8
    assert b.get("k") == b"v2"  # (TCPStore does not acknowledge a set: read back on b first)
    assert a.get("k") == b"v2"
    a.set("bin", b"\x00\xff\x00")
    assert b.get("bin") == b"\x00\xff\x00"
    a.set("", b"empty key")
    assert b.get("") == b"empty key"


def test_get_times_out_with_the_same_error(stores):
    b = stores.new(timeout=SHORT)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        b.get("never-set")
    assert 0.25 < time.monotonic() - start < 5
    b.set_timeout(timedelta(milliseconds=100))
    assert b.timeout == timedelta(milliseconds=100)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        b.get("never-set")
    assert time.monotonic() - start < 3


def test_blocking_get_is_released_by_a_set_from_another_thread(stores):
    waiters = [stores.new() for _ in range(6)]  # several clients block on one key: all wake
    got: dict[int, bytes] = {}

    def wait(i, store):
        got[i] = store.get("late")

    threads = [threading.Thread(target=wait, args=(i, s)) for i, s in enumerate(waiters)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert not got  # still blocked
    start = time.monotonic()
    stores.a.set("late", b"here")
    for t in threads:
        t.join(timeout=10)
    assert got == {i: b"here" for i in range(len(waiters))}
    assert time.monotonic() - start < 3


def test_add_is_atomic_under_concurrency(stores):
    n_threads, n_adds = 6, 40
    clients = [stores.new() for _ in range(n_threads)]
    returned: list[int] = []
    lock = threading.Lock()

    def work(store):
        mine = [store.add("counter", 1) for _ in range(n_adds)]
        with lock:
            returned.extend(mine)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    total = n_threads * n_adds
    assert sorted(returned) == list(range(1, total + 1))  # every increment seen exactly once
    assert stores.b.get("counter") == str(total).encode()  # a decimal string, like TCPStore
    assert stores.a.add("counter", -total) == 0
    assert stores.a.add("neg", -5) == -5 and stores.b.get("neg") == b"-5"
    assert stores.a.add("big", 2**62) == 2**62  # all 64 bits survive


def test_compare_set(stores):
    a, b = stores.a, stores.b
    assert a.compare_set("cs", "", "first") == b"first"  # missing + empty expected: created
    assert b.get("cs") == b"first"
    assert b.compare_set("cs", "", "second") == b"first"  # present, expected differs: unchanged
    assert b.compare_set("cs", "first", "second") == b"second"  # present, expected matches
    assert a.compare_set("cs", "wrong", "third") == b"second"
    assert a.get("cs") == b"second"
    assert a.compare_set("missing", "x", "y") == b"x"  # missing + non-empty expected: expected back
    assert not a.check(["missing"])


def test_wait_and_check(stores):
    a, b = stores.a, stores.b
    assert b.check([]) and not b.check(["w1"])
    a.set("w1", b"1")
    a.num_keys()  # a round trip on a's connection: TCPStore does not acknowledge set
    assert b.check(["w1"]) and not b.check(["w1", "w2"])
    b.wait(["w1"], timedelta(seconds=1))  # present: returns at once
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        b.wait(["w1", "w2"], SHORT)
    assert 0.25 < time.monotonic() - start < 5

    stores.later(0.1, a.set, "w2", b"2")
    stores.later(0.2, a.add, "w3", 1)  # created by add: wakes waiters too
    b.wait(["w1", "w2", "w3"], timedelta(seconds=10))
    assert b.check(["w1", "w2", "w3"])


def test_delete_key_and_num_keys(stores):
    a, b = stores.a, stores.b
    base = a.num_keys()
    a.set("d1", b"1")
    a.add("d2", 1)
    b.append("d3", b"x")
    assert b.num_keys() == base + 3
    assert b.delete_key("d1") is True
    assert b.delete_key("d1") is False
    assert a.num_keys() == base + 2
    assert not a.check(["d1"])
    with pytest.raises(dist.DistStoreError):
        a.wait(["d1"], timedelta(milliseconds=100))  # deleted keys block again
    stores.later(0.1, b.set, "d1", b"again")
    assert a.get("d1") == b"again"


def test_multi_get_multi_set(stores):
    a, b = stores.a, stores.b
    a.multi_set(["m1", "m2", "m3"], [b"1", "2", b"\x003"])
    assert b.multi_get(["m1", "m2", "m3"]) == [b"1", b"2", b"\x003"]
    assert b.multi_get([]) == []
    with pytest.raises(dist.DistStoreError, match="timeout"):
        stores.new(timeout=SHORT).multi_get(["m1", "m-missing"])
    stores.later(0.1, a.set, "m4", b"4")
    assert b.multi_get(["m4", "m1"]) == [b"4", b"1"]  # blocks until every key exists


def test_append(stores):
    a, b = stores.a, stores.b
    a.append("log", b"ab")  # creates
    a.append("log", "cd")  # (one client: TCPStore does not order appends across connections)
    a.append("log", b"\x00")
    assert a.get("log") == b"abcd\x00" and b.get("log") == b"abcd\x00"
    assert a.has_extended_api() and b.has_extended_api()


def test_queues(stores):
    a, b = stores.a, stores.b
    assert a.queue_len("q") == 0
    a.queue_push("q", b"one")
    a.queue_push("q", "two")
    assert a.queue_len("q") == 2 and b.queue_len("q") == 2
    assert b.queue_pop("q") == b"one"
    assert b.queue_pop("q", block=False) == b"two"
    with pytest.raises(dist.QueueEmptyError):
        b.queue_pop("q", block=False)
    stores.later(0.1, a.queue_push, "q", b"three")
    assert b.queue_pop("q") == b"three"  # blocks until a push
    short = stores.new(timeout=SHORT)
    with pytest.raises(dist.DistStoreError, match="timeout"):
        short.queue_pop("q")


def test_prefix_store_goes_through_the_cpp_interface(stores):
    """PrefixStore (what process groups wrap stores in) calls the store from C++."""
    p, q = dist.PrefixStore("pg0", stores.a), dist.PrefixStore("pg0", stores.b)
    p.set("addr", b"10.0.0.1:1234")
    assert q.get("addr") == b"10.0.0.1:1234"
    assert stores.b.get("pg0/addr") == b"10.0.0.1:1234"
    assert q.add("n", 2) == 2 and p.add("n", 3) == 5
    assert p.compare_set("c", "", "x") == b"x"
    assert q.check(["addr", "n"]) and not q.check(["addr", "nope"])
    stores.later(0.1, p.set, "later", b"1")
    q.wait(["later"], timedelta(seconds=10))
    base = q.num_keys()
    assert q.delete_key("later") and q.num_keys() == base - 1
    p.multi_set(["m1", "m2"], [b"1", b"2"])
    assert q.multi_get(["m1", "m2"]) == [b"1", b"2"]
    p.append("ap", b"x")
    p.append("ap", b"y")
    assert p.get("ap") == b"xy" and q.get("ap") == b"xy"
    q.barrier("b0", 1)  # torch's Store.barrier, built on add/wait


# ---------------------------------------------------------------------------------------------
# Redis only


def _store(server: RedisServer, job: str, attempt: int = 0, **kwargs) -> RedisStore:
    kwargs.setdefault("timeout", timedelta(seconds=10))
    return RedisStore(server.url, job_id=job, attempt=attempt, **kwargs)


def test_job_attempts_are_isolated(redis_server):
    job = f"iso-{uuid.uuid4().hex[:8]}"
    first, second = _store(redis_server, job, 0), _store(redis_server, job, 1)
    other_job = _store(redis_server, job + "-b", 0)
    try:
        first.set("rank0/addr", b"old")
        first.add("joined", 4)
        assert second.num_keys() == 0 and not second.check(["rank0/addr"])
        assert other_job.num_keys() == 0
        with pytest.raises(dist.DistStoreError):
            second.wait(["rank0/addr"], timedelta(milliseconds=100))
        second.set("rank0/addr", b"new")
        assert first.get("rank0/addr") == b"old" and second.get("rank0/addr") == b"new"
        assert second.add("joined", 1) == 1
        assert first.prefix == f"mega:{job}:0:" and second.prefix == f"mega:{job}:1:"

        # a restart drops the dead attempt's keys instead of waiting for their TTL
        from mega.store import drop_attempts

        assert drop_attempts(second, [0, 1]) >= 1
        assert first.num_keys() == 0 and second.get("rank0/addr") == b"new"
    finally:
        for s in (first, second, other_job):
            s.drop_namespace()
            s.close()


def test_namespace_expires_after_its_ttl(redis_server):
    store = _store(redis_server, f"ttl-{uuid.uuid4().hex[:8]}", ttl_s=1)
    try:
        store.set("k", b"v")
        assert 0 < store.ttl() <= 1
        deadline = time.monotonic() + 5
        while store.num_keys() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.num_keys() == 0 and not store.check(["k"])
    finally:
        store.close()


def test_store_survives_as_a_temporary(redis_server):
    """init_process_group(store=RedisStore(...)) keeps only a C++ handle: the object must live on."""
    job = f"tmp-{uuid.uuid4().hex[:8]}"
    prefixed = dist.PrefixStore("default_pg", _store(redis_server, job))
    gc.collect()
    prefixed.set("k", b"v")
    assert prefixed.get("k") == b"v" and prefixed.num_keys() == 1
    clone = _store(redis_server, job).clone()
    assert clone.get("default_pg/k") == b"v"


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_redis_fails_fast_naming_the_address():
    port = _unused_port()
    start = time.monotonic()
    with pytest.raises(RedisUnreachableError, match=f"127.0.0.1:{port}") as err:
        RedisStore(f"redis://:hunter2@127.0.0.1:{port}/0", job_id="x", connect_timeout_s=1.0)
    assert time.monotonic() - start < 3
    assert isinstance(err.value, dist.DistNetworkError)  # what TCPStore raises when it cannot connect
    assert "hunter2" not in str(err.value)


def test_password_protected_server(tmp_path):
    try:
        find_redis_server()
    except RedisServerError as err:
        pytest.fail(f"{err} (infra/install.sh installs it)")
    secret = f"pw-{uuid.uuid4().hex}"
    with RedisServer(password=secret) as server:
        assert secret not in repr(server) and secret in server.url
        store = RedisStore(server.url, job_id="auth")  # the URL's password
        store.set("k", b"v")
        assert secret not in repr(store)
        store.drop_namespace()
        store.close()
        host_url = f"redis://{server.address}/0"
        ok = RedisStore(host_url, job_id="auth", password=secret)  # password given apart from the URL
        ok.close()

        wrong = f"redis://:not-{secret}@{server.address}/0"
        start = time.monotonic()
        with pytest.raises(RedisAuthError, match=server.address) as err:
            RedisStore(wrong, job_id="auth")
        assert time.monotonic() - start < 3
        assert secret not in str(err.value) and "with a password" in str(err.value)
        assert isinstance(err.value, dist.DistStoreError)
        with pytest.raises(RedisAuthError, match="without a password"):
            RedisStore(host_url, job_id="auth")

        # an ACL user limited to mega's keys (least privilege) runs every store operation
        admin = RedisStore(server.url, job_id="admin")
        admin._r.acl_setuser(
            "ranks",
            enabled=True,
            passwords=[f"+acl-{secret}"],
            keys=["mega:*"],
            commands=["+@all", "-@dangerous"],
        )
        admin.close()
        limited = RedisStore(
            f"redis://ranks@{server.address}/0",
            job_id="acl",
            password=f"acl-{secret}",
            timeout=timedelta(seconds=5),
        )
        setter = threading.Timer(0.1, limited.clone().set, args=("k", b"v"))
        setter.start()
        assert limited.get("k") == b"v" and limited.add("n", 2) == 2 and limited.num_keys() == 2
        setter.join(timeout=30)  # its reply read before the server stops
        assert limited.drop_namespace() > 0
        limited.close()
        with pytest.raises(RedisAuthError, match="user 'ranks' with a password") as err:
            RedisStore(f"redis://ranks:wrong-{secret}@{server.address}/0", job_id="acl")
        assert secret not in str(err.value)


def test_redis_urls_never_show_passwords():
    assert redact_url("redis://user:p4ss@h:6380/2") == "redis://user:***@h:6380/2"
    assert redact_url("rediss://h:6380") == "rediss://h:6380"
    fields = parse_redis_url("rediss://user:p%40ss@10.0.0.5:6380/3")
    assert fields == {
        "host": "10.0.0.5",
        "port": 6380,
        "db": 3,
        "username": "user",
        "password": "p@ss",
        "ssl": True,
    }
    assert parse_redis_url("redis://h")["port"] == 6379
    with pytest.raises(ValueError, match="scheme") as err:
        parse_redis_url("http://u:p4ss@h:1/0")
    assert "p4ss" not in str(err.value)


@pytest.mark.parametrize(
    "store, fragment",
    [
        ({"redis_url": "http://h:1"}, "scheme must be"),
        ({"redis_url": "redis://:s3cret@h:99999/0"}, "Port out of range"),
        ({"redis_url": "redis://h:6379/zero"}, "database must be a number"),
        (
            {"kind": "redis", "start_local_redis": False},
            "set store.redis_url or store.start_local_redis",
        ),
    ],
)
def test_redis_store_settings_are_validated(store, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        from_dict({"store": store})
    assert err.value.key == "store.redis_url" and "s3cret" not in str(err.value)


def test_redis_store_settings_accept_a_url():
    cfg = from_dict({"store": {"kind": "redis", "redis_url": "redis://:s3cret@10.0.0.1:6380/1"}})
    assert cfg.store.redis_url.endswith("@10.0.0.1:6380/1") and cfg.store.start_local_redis
    assert "s3cret" not in repr(cfg.store) and "s3cret" not in repr(cfg)


def test_redis_server_stops_cleanly():
    try:
        find_redis_server()
    except RedisServerError as err:
        pytest.fail(f"{err} (infra/install.sh installs it)")
    server = RedisServer().start()
    port, workdir = server.port, server._dir
    assert server.running and workdir.exists()
    server.stop()
    assert not server.running and not workdir.exists()
    with pytest.raises(RedisUnreachableError):
        RedisStore(f"redis://127.0.0.1:{port}/0", job_id="gone", connect_timeout_s=0.3)


# ---------------------------------------------------------------------------------------------
# Real process groups over the store


def _rank_main(rank: int, world: int, url: str, job: str, results) -> None:
    """One rank: gloo world over RedisStore, an all_reduce, megatron tp=2 x pp=2 groups."""
    try:
        import torch
        from megatron.core import parallel_state as ps

        store = RedisStore(url, job_id=job, attempt=0, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            distributed_timeout_minutes=1,
            create_gloo_process_groups=True,
        )
        tp = torch.tensor([float(rank)])
        dist.all_reduce(tp, group=ps.get_tensor_model_parallel_group())
        row = {
            "rank": rank,
            "world_sum": x.item(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_size": ps.get_data_parallel_world_size(),
            "tp_sum": tp.item(),
            "store_keys": store.num_keys(),
        }
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        results.put(row)
    except BaseException as err:  # report, do not hang the parent
        results.put({"rank": rank, "error": f"{type(err).__name__}: {err}"})
        raise


@pytest.mark.slow  # 4 ranks; megatron-core is imported once (forkserver): ~15 s on a shared CPU
def test_gloo_world_and_megatron_groups_over_redis_store(redis_server):
    world, job = 4, f"pg-{uuid.uuid4().hex[:8]}"
    # forkserver with preloaded modules: torch and megatron-core are imported once, not per rank
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megatron.core.parallel_state", "mega.store.redis_store"])
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, redis_server.url, job, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    rows = []
    try:
        for _ in range(world):
            rows.append(results.get(timeout=150))
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    rows.sort(key=lambda r: r["rank"])
    assert all(r["world_sum"] == 1 + 2 + 3 + 4 for r in rows)
    # megatron's default order tp-cp-ep-dp-pp: tp groups {0,1} and {2,3}, pp groups {0,2} and {1,3}
    assert [(r["tp_rank"], r["pp_rank"], r["dp_size"]) for r in rows] == [
        (0, 0, 1),
        (1, 0, 1),
        (0, 1, 1),
        (1, 1, 1),
    ]
    assert [r["tp_sum"] for r in rows] == [1.0, 1.0, 5.0, 5.0]
    assert all(r["store_keys"] > 0 for r in rows)
    assert all(p.exitcode == 0 for p in procs)
    leftover = RedisStore(redis_server.url, job_id=job)
    try:
        assert leftover.num_keys() > 0 and 0 < leftover.ttl() <= 24 * 3600  # expires, never leaks
    finally:
        leftover.drop_namespace()
        leftover.close()
