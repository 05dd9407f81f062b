"""Heartbeats, hang localisation and incidents (mega/stability, docs/stability.md)."""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time

import pytest
from helpers import tiny_config

from mega.bench.faults import stop_process_when
from mega.metrics import read_metrics
from mega.stability import heartbeat_redis
from mega.stability.detect import Watcher, hang_threshold_s, stragglers
from mega.stability.heartbeat import Heartbeat
from mega.stability.incident import Incident, read_incidents
from mega.stability.localise import localise

NOW = 1000.0


def grid(tp=2, pp=2, dp=2, per_node=4) -> dict[int, dict]:
    """Identities of a TP x PP x DP job in megatron's rank order (tp fastest, then dp, then pp)."""
    ids = {}
    for r in range(tp * pp * dp):
        t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
        ids[r] = {
            "rank": r,
            "node": r // per_node,
            "host": f"h{r // per_node}",
            "tp": t,
            "pp": p,
            "dp": d,
            "groups": {
                "tp": [p * tp * dp + d * tp + i for i in range(tp)],
                "dp": [p * tp * dp + j * tp + t for j in range(dp)],
                "pp": [k * tp * dp + d * tp + t for k in range(pp)],
                "world": list(range(tp * pp * dp)),
            },
        }
    return ids


def beats(ids, seq: dict[int, dict] | None = None, age: dict[int, float] | None = None) -> dict[int, dict]:
    """Everyone beat 0.5 s ago having entered 10 collectives per group, unless told otherwise."""
    seq, age = seq or {}, age or {}
    return {
        r: {
            "rank": r,
            "time": NOW - age.get(r, 0.5),
            "step": 3,
            "seq": {g: seq.get(r, {}).get(g, 10) for g in ("tp", "pp", "dp", "world")},
        }
        for r in ids
    }


def test_all_beating_and_level_is_no_culprit():
    ids = grid()
    assert localise(ids, beats(ids), NOW, silent_after_s=3.0) is None


def test_silent_rank_in_a_tp_group_is_named_with_its_coordinates():
    ids = grid()
    # rank 5 stopped 20 s ago after 10 TP collectives; its TP peer (rank 4) entered the 11th and waits
    b = beats(ids, seq={4: {"tp": 11}}, age={5: 20.0})
    c = localise(ids, b, NOW, silent_after_s=3.0)
    assert c is not None and c.rank == 5 and c.reason == "silent"
    assert (c.node, c.host, c.coords) == (1, "h1", {"tp": 1, "pp": 1, "dp": 0})
    assert (c.group, c.group_ranks, c.behind) == ("tp", [4, 5], 1)
    assert c.silent_ranks == [5] and c.silent_nodes == []
    assert "rank 5 (node 1, tp 1, pp 1, dp 0)" in c.describe()


def test_never_seen_rank_is_silent_and_a_whole_silent_node_is_named():
    ids = grid()
    b = beats(ids, age={4: 30.0, 5: 30.0, 6: 30.0})
    del b[7]  # rank 7 never beat
    c = localise(ids, b, NOW, silent_after_s=3.0)
    assert c is not None and c.reason == "silent" and c.rank in (4, 5, 6, 7)
    assert c.silent_ranks == [4, 5, 6, 7] and c.silent_nodes == [1]


def test_rank_behind_in_a_dp_group_is_the_culprit_not_its_waiting_peers():
    ids = grid()
    # rank 2 (tp 0, pp 0, dp 1) never reached the DP all-reduce its DP peer rank 0 waits in; its TP
    # peer rank 3 waits for it in a TP collective, and so falls behind rank 1 in their DP group.
    b = beats(ids, seq={0: {"dp": 11, "world": 10}, 3: {"tp": 11}, 1: {"dp": 11}})
    c = localise(ids, b, NOW, silent_after_s=3.0)
    assert c is not None and c.reason == "behind" and c.rank == 2
    assert c.coords == {"tp": 0, "pp": 0, "dp": 1}
    # it holds up both by one collective; the tie goes to the TP group (the tighter coupling)
    assert (c.group, c.group_ranks, c.behind) == ("tp", [2, 3], 1)
    assert c.silent_ranks == []


def test_hang_threshold_is_k_times_the_median_step_within_bounds():
    assert hang_threshold_s([1.0, 2.0, 100.0], 10, 5, 600) == 20.0
    assert hang_threshold_s([0.1], 10, 5, 600) == 5  # at least min_hang_s
    assert hang_threshold_s([100.0], 10, 5, 600) == 600  # stability.hang_timeout_s stays the bound
    assert hang_threshold_s([], 10, 5, 600) == 5


def test_a_save_waiting_for_a_silent_s3_store_is_given_its_whole_bound_before_a_hang():
    """A blocking save waits for an S3 store that accepts connections and never answers up to
    ``store_wait_bound_s`` (upload_timeout_s and the request under way then): while a rank is in
    its ``checkpoint`` phase the hang threshold allows all of it, not upload_timeout_s alone."""
    from mega.config import compose

    over = ["model=tiny", "parallelism=tp2-pp2-dp2", "checkpoint.storage_uri=s3://bucket/run"]
    cfg = compose([*over, "stability.min_hang_s=60", "stability.hang_timeout_s=600"])
    w = Watcher(cfg, {}, attempt=0, log=lambda s: None)
    w.beats = {0: {"phase": "train"}, 1: {"phase": "train"}}
    assert w.threshold_s() == 60
    w.beats[1]["phase"] = "checkpoint"
    assert cfg.checkpoint.store_wait_bound_s() > cfg.checkpoint.upload_timeout_s
    assert w.threshold_s() == 60 + cfg.checkpoint.store_wait_bound_s()


def test_straggler_needs_every_one_of_the_last_steps_slow():
    rows = {s: {0: 1.0, 1: 1.1, 2: 0.9, 3: 3.0} for s in range(1, 5)}
    assert list(stragglers(rows, factor=1.5, beats=3)) == [3]
    rows[4][3] = 1.2  # the latest step was normal: not (yet) a straggler
    assert stragglers(rows, factor=1.5, beats=3) == {}
    assert stragglers({1: {0: 1.0, 1: 5.0}}, factor=1.5, beats=3) == {}  # too few steps seen
    # the last pipeline stage (output layer, loss) computes more than the first: compared within
    # its stage it is no straggler; rank 2 is, against its stage peer rank 0
    rows = {s: {0: 1.0, 1: 2.0, 2: 1.8, 3: 2.1} for s in range(1, 4)}
    assert list(stragglers(rows, factor=1.5, beats=3, stage={0: 0, 1: 1, 2: 0, 3: 1})) == [2]


def _cfg(**stability):
    from mega.config import compose

    over = [f"stability.{k}={v}" for k, v in stability.items()]
    return compose(["model=tiny", "parallelism=tp2-pp2-dp2", *over])


def test_watcher_declares_a_hang_and_names_the_silent_rank(redis_url, tmp_path):
    """Real Redis, heartbeats written as the ranks would, the clock driven by the test."""
    import redis

    cfg = _cfg(heartbeat_s=1, min_hang_s=8, progress_factor=10)
    env = {heartbeat_redis.URL_ENV: redis_url, heartbeat_redis.PREFIX_ENV: "mega:hb:test1"}
    r = redis.Redis.from_url(redis_url)
    ids = grid()
    for rank, ident in ids.items():
        r.set(heartbeat_redis.id_key("mega:hb:test1", 0, rank), json.dumps(ident))
    clock = [NOW]
    w = Watcher(cfg, env, attempt=0, log=lambda s: None, clock=lambda: clock[0])

    def publish(step, skip=()):
        for rank in ids:
            if rank not in skip:
                rec = {
                    "rank": rank,
                    "time": clock[0],
                    "step": step,
                    "step_s": 0.2,
                    "compute_s": 0.1,
                    "seq": {"tp": 10 * step + (rank == 4), "pp": 10 * step, "dp": 10 * step, "world": step},
                }
                r.set(heartbeat_redis.beat_key("mega:hb:test1", 0, rank), json.dumps(rec))

    for step in range(1, 4):  # three steps, one per second
        publish(step)
        assert w.poll() is None
        clock[0] += 1.0
    for _ in range(3):  # every rank beats at step 3 for 3 s: slow, not hung (step rule: 8 s)
        publish(3)
        assert w.poll() is None
        clock[0] += 1.0
    # rank 5 stops; the others beat on: a hang once it has been silent for silent_after_s (3 s),
    # sooner than the step rule's 8 s
    silent_at = clock[0] - 1.0
    for _ in range(6):
        publish(3, skip={5})
        if reason := w.poll():
            break
        clock[0] += 1.0
    assert reason is not None and "rank 5 (node 1, tp 1, pp 1, dp 0)" in reason
    assert clock[0] - silent_at == pytest.approx(w.silent_after_s + 1)
    [inc] = w.incidents
    assert inc.kind == "hang" and inc.culprit["rank"] == 5 and inc.culprit["group"] == "tp"
    assert inc.evidence["threshold_s"] == w.silent_after_s == 3 and inc.evidence["last_step"] == 3


def test_before_the_first_step_a_stopped_rank_is_a_hang_and_a_slow_restore_is_not(redis_url):
    """The ranks beat from group creation on, through the restore (no step yet): every rank
    beating is no hang however long it takes; one silent amid beating peers is, after min_hang_s
    (a gap of silent_after_s is not, this early); one that never beat is too."""
    import redis

    cfg = _cfg(heartbeat_s=1, min_hang_s=8, progress_factor=10)
    r = redis.Redis.from_url(redis_url)
    ids = grid()

    def watcher(prefix):
        for rank, ident in ids.items():
            r.set(heartbeat_redis.id_key(prefix, 0, rank), json.dumps(ident))
        env = {heartbeat_redis.URL_ENV: redis_url, heartbeat_redis.PREFIX_ENV: prefix}
        return Watcher(cfg, env, attempt=0, log=lambda s: None, clock=lambda: clock[0])

    def publish(prefix, skip=()):
        for rank in ids:
            if rank not in skip:
                rec = {"rank": rank, "time": clock[0], "phase": "restore", "seq": {}}
                r.set(heartbeat_redis.beat_key(prefix, 0, rank), json.dumps(rec))

    clock = [NOW]
    w = watcher("mega:hb:startup1")
    for _ in range(30):  # a restore of 30 s, every rank beating: slow, not hung
        publish("mega:hb:startup1")
        assert w.poll() is None
        clock[0] += 1.0
    silent_at = clock[0] - 1.0
    for _ in range(12):  # rank 5 stopped (SIGSTOP) mid-restore
        publish("mega:hb:startup1", skip={5})
        if reason := w.poll():
            break
        clock[0] += 1.0
    assert reason is not None and "before the first step" in reason and "rank 5 (node 1" in reason
    assert w.silent_after_s < cfg.stability.min_hang_s
    assert clock[0] - silent_at == pytest.approx(cfg.stability.min_hang_s + 1)

    clock = [NOW]
    w = watcher("mega:hb:startup2")
    first = clock[0]
    for _ in range(20):  # rank 3 stopped before its first beat
        publish("mega:hb:startup2", skip={3})
        if reason := w.poll():
            break
        clock[0] += 1.0
    assert reason is not None and "rank(s) 3 never beat" in reason, reason
    assert clock[0] - first == pytest.approx(cfg.stability.min_hang_s + 1)
    [inc] = w.incidents
    assert inc.kind == "hang" and inc.evidence["never_beat"] == [3] and inc.evidence["last_step"] is None


def test_before_the_first_step_a_silent_rank_its_node_sees_not_running_is_a_hang_at_silent_after_s(
    redis_url,
):
    """The node's witness (mega.stability.liveness: the warm client's reports of its rank's
    process) tells a rank that does not run from one whose heartbeat thread is starved: the first
    is declared after silent_after_s, the second only after min_hang_s, as without a witness."""
    import redis

    cfg = _cfg(heartbeat_s=1, min_hang_s=12, progress_factor=10)
    r = redis.Redis.from_url(redis_url)
    ids = grid()

    def run(prefix: str, proc) -> tuple[float, Watcher]:
        """Every rank beats for 5 s, then rank 5 goes silent; its node reports ``proc(seconds since
        its last beat)``. Returns the seconds since rank 5's last beat at the verdict."""
        for rank, ident in ids.items():
            r.set(heartbeat_redis.id_key(prefix, 0, rank), json.dumps(ident))
        env = {heartbeat_redis.URL_ENV: redis_url, heartbeat_redis.PREFIX_ENV: prefix}
        w = Watcher(cfg, env, attempt=0, log=lambda s: None, clock=lambda: clock[0])
        clock, silent_at = [NOW], NOW + 5
        while clock[0] < NOW + 40:
            for rank in ids:
                if rank != 5 or clock[0] <= silent_at:
                    rec = {"rank": rank, "time": clock[0], "phase": "restore", "seq": {}}
                    r.set(heartbeat_redis.beat_key(prefix, 0, rank), json.dumps(rec))
            report = {"time": clock[0], "pid": 4242, **proc(max(0.0, clock[0] - silent_at))}
            r.set(heartbeat_redis.proc_key(prefix, 0, 5), json.dumps(report))
            if w.poll():
                return clock[0] - silent_at, w
            clock[0] += 1.0
        raise AssertionError("no verdict")

    stopped_after, w = run("mega:hb:live1", lambda quiet: {"state": "T", "still_s": quiet})
    assert stopped_after == w.silent_after_s + 1 < cfg.stability.min_hang_s
    [inc] = w.incidents
    assert "rank 5 (node 1" in inc.summary and inc.evidence["processes"][5]["state"] == "T"
    # silent, but its process computes (CPU time moving: still_s stays 0): starved, not stopped
    starved_after, _ = run("mega:hb:live2", lambda quiet: {"state": "R", "still_s": 0.0})
    assert starved_after == cfg.stability.min_hang_s + 1
    # a sleeping process that used no CPU for two beats is not running either (blocked, deadlocked)
    asleep_after, _ = run("mega:hb:live3", lambda quiet: {"state": "S", "still_s": quiet})
    assert asleep_after == w.silent_after_s + 1


def test_heartbeat_survives_a_redis_outage_and_resumes(tmp_path):
    """The heartbeat's Redis goes away: writes are dropped within the socket timeout, never raise;
    when it is back (same port), they go through again."""
    import redis

    from mega.store import RedisServer

    server = RedisServer().start()
    port = server.port
    ident = {"rank": 3, "node": 0, "groups": {}}
    hb = Heartbeat(heartbeat_redis.client(server.url), "mega:hb:test2", 0, ident, {}, interval_s=0.1)
    try:
        assert hb.beat() and hb.sent == 1
        server.stop()
        t0 = time.monotonic()
        assert not hb.beat() and not hb.beat()
        assert time.monotonic() - t0 < 4 * heartbeat_redis.TIMEOUT_S + 1 and hb.dropped == 2
        server = RedisServer(port=port).start()  # back, and empty
        assert hb.beat()
        back = redis.Redis.from_url(server.url)
        value = json.loads(back.get("mega:hb:test2:0:hb:3"))
        assert value["rank"] == 3 and value["dropped"] == 2 and value["sent"] == 1
        assert value["up_s"] > 0 and value["device_mb"] is None  # CPU: no device memory
        # the identity written before the outage was lost with the server: written again
        assert json.loads(back.get("mega:hb:test2:0:id:3")) == ident
    finally:
        hb.client.close()
        server.stop()


def test_heartbeat_thread_never_blocks_on_a_redis_down_at_start():
    """No Redis at start, only a port that takes connections and never answers: start() returns
    before any Redis call could (each waits out heartbeat_redis.TIMEOUT_S), the thread writes the
    identity once Redis is there, and close() sends a last beat within its bound."""
    import socket

    import redis

    from mega.store import RedisServer

    silent = socket.create_server(("127.0.0.1", 0))  # the kernel completes connections; no reply
    port = silent.getsockname()[1]
    ident = {"rank": 1, "node": 0, "groups": {}}
    hb = Heartbeat(
        heartbeat_redis.client(f"redis://127.0.0.1:{port}/0"), "mega:hb:test4", 0, ident, {}, interval_s=0.1
    )
    t0 = time.monotonic()
    hb.start()
    assert time.monotonic() - t0 < heartbeat_redis.TIMEOUT_S
    # the thread's first write meets the silent port (a loaded machine may start the thread late)
    end = time.monotonic() + 10
    while hb.dropped == 0 and time.monotonic() < end:
        time.sleep(0.05)
    assert hb.dropped > 0, "the heartbeat thread never tried the silent port"
    silent.close()
    server = RedisServer(port=port).start()
    try:
        r = redis.Redis.from_url(server.url)
        end = time.monotonic() + 10
        while r.get("mega:hb:test4:0:id:1") is None and time.monotonic() < end:
            time.sleep(0.05)
        assert json.loads(r.get("mega:hb:test4:0:id:1")) == ident
        hb.step_done(7, {"loss": 2.0}, 0.5, tokens=1000)
        t0 = time.monotonic()
        hb.close()  # the last beat carries step 7
        assert time.monotonic() - t0 < 6 * heartbeat_redis.TIMEOUT_S + 1
        last = json.loads(r.get("mega:hb:test4:0:hb:1"))
        assert last["step"] == 7 and last["tokens_per_s"] == 2000 and last["dropped"] > 0 and last["closed"]
    finally:
        server.stop()


def _store_outage_watcher(url: str, prefix: str, clock: list, logs: list):
    """A TP2xPP2xDP2 watcher on the fake clock and a function writing every rank's heartbeat."""
    import redis

    cfg = _cfg(heartbeat_s=1, min_hang_s=5, progress_factor=10)
    w = Watcher(
        cfg,
        {heartbeat_redis.URL_ENV: url, heartbeat_redis.PREFIX_ENV: prefix},
        attempt=0,
        log=logs.append,
        clock=lambda: clock[0],
    )

    def publish(step, dropped=0, closed=False, ranks=None):
        r = redis.Redis.from_url(url)
        for rank, ident in grid().items():
            if ranks is not None and rank not in ranks:
                continue
            r.set(heartbeat_redis.id_key(prefix, 0, rank), json.dumps(ident))
            rec = {
                "rank": rank,
                "time": clock[0],
                "step": step,
                "step_s": 0.2,
                "compute_s": 0.1,
                "seq": {"world": step},
                "sent": 10 * step,
                "dropped": dropped + rank,
                "cpu_s": 0.01,
                "up_s": 5.0,
                "closed": closed,
            }
            r.set(heartbeat_redis.beat_key(prefix, 0, rank), json.dumps(rec))
        r.close()

    return w, publish


def test_watcher_reports_a_store_outage_once_heartbeats_resume(tmp_path):
    """Real Redis stopped for 12 s (fake clock) and started again, empty, on the same port: one
    store incident once every rank beat again; no hang from the stale heartbeats meanwhile."""
    from mega.store import RedisServer

    server = RedisServer().start()
    port = server.port
    clock, logs = [NOW], []
    w, publish = _store_outage_watcher(server.url, "mega:hb:test5", clock, logs)
    try:
        for step in range(1, 4):
            publish(step)
            assert w.poll() is None
            clock[0] += 1.0
        server.stop()
        for _ in range(12):  # Redis gone for 12 s: far past min_hang_s (5 s) without a step seen
            assert w.poll() is None
            clock[0] += 1.0
        assert w.outage is not None and w.outage["started"] == NOW + 3
        assert any("store outage" in m for m in logs)
        server = RedisServer(port=port).start()  # back, empty: the keys were lost
        assert w.poll() is None and w.outage is not None  # answering, but no rank has beaten again
        assert w.incidents == []  # and the stale heartbeats (12 s old) declared no hang
        clock[0] += 1.0
        publish(9, dropped=12)  # every rank beats again, after training on without Redis
        assert w.poll() is None
        [inc] = w.incidents
        assert inc.kind == "store" and inc.action == "reported" and inc.culprit == {"store": server.url}
        e = inc.evidence
        assert e["outage_s"] == 12.0 and e["resumed"] and e["ranks_resumed"] == list(range(8))
        assert e["read_errors"] == 12 and e["dropped"] == {r: 12 + r for r in range(8)}
        assert w.outage is None and any("answers again" in m for m in logs)
        for _ in range(6):  # hang detection is back: no step for 6 s more is a hang again
            clock[0] += 1.0
            publish(9)
            reason = w.poll()
        assert reason is not None and reason.startswith("hung") and w.incidents[-1].kind == "hang"
    finally:
        w.client.close()
        server.stop()


@contextlib.contextmanager
def _redis_back_after_outage(prefix: str, down_s: int):
    """A watcher that saw step 1, then its Redis down for ``down_s`` polls (1 s each, the last at
    the clock's value on entry) and started again, empty, on the same port: (watcher, publish, clock)."""
    from mega.store import RedisServer

    server = RedisServer().start()
    clock: list = [NOW]
    w, publish = _store_outage_watcher(server.url, prefix, clock, [])
    try:
        publish(1)
        assert w.poll() is None
        server.stop()
        for _ in range(down_s):
            clock[0] += 1.0
            assert w.poll() is None
        assert w.outage is not None and w.outage["failed"] == clock[0]
        server = RedisServer(port=server.port).start()
        yield w, publish, clock
    finally:
        w.client.close()
        server.stop()


def test_after_an_outage_a_late_rank_is_waited_for_and_a_quiet_one_named():
    """Redis back after an outage: a rank whose first beat comes 4 s later (past silent_after_s:
    it had to wait for its next tick and reconnect on a loaded node) still counts as resumed; one
    quiet for longer than resume_after_s is named not resumed, and the incident says how long each
    rank took to beat again."""
    with _redis_back_after_outage("mega:hb:test-late", down_s=4) as (w, publish, clock):
        clock[0] += 1.0
        answered = clock[0]
        assert w.poll() is None and w.outage["answered"] == answered
        on_time = [0, 1, 2, 3, 4, 7]
        for _ in range(3):
            clock[0] += 1.0
            publish(2, ranks=on_time)
            assert w.poll() is None
        clock[0] += 1.0  # answered + 4 s > silent_after_s (3 s): rank 6 beats only now
        assert clock[0] - answered > w.silent_after_s
        publish(2, ranks=[*on_time, 6])
        assert w.poll() is None and w.outage is not None and w.incidents == []
        reason = None
        while reason is None and clock[0] - answered < 10:  # rank 5 never again
            clock[0] += 1.0
            publish(2, ranks=[*on_time, 6])
            reason = w.poll()
    # the outage ends past resume_after_s and hang detection, back, names the quiet rank
    assert clock[0] - answered == math.ceil(w.resume_after_s)
    assert [i.kind for i in w.incidents] == ["store", "hang"] and reason.startswith("hung")
    inc, hang = w.incidents
    assert hang.culprit["rank"] == 5 and "stopped sending heartbeats" in hang.summary
    e = inc.evidence
    assert e["resumed"] is False and e["ranks_not_resumed"] == [5], e
    assert e["ranks_resumed"] == [0, 1, 2, 3, 4, 6, 7]
    assert e["resumed_after_s"] == {**dict.fromkeys(on_time, 1.0), 6: 4.0}
    assert "no heartbeat since from rank(s) [5]" in inc.summary


def test_a_beat_counts_as_resumed_by_its_stamp_after_the_last_failed_read():
    """A write sent to a stopped Redis lands when it resumes with its stale stamp: no proof the
    rank is alive. A beat stamped after the watcher's last failed read is, even when it got
    through before the watcher's first good read (the rank's last beat before it exited)."""
    with _redis_back_after_outage("mega:hb:test-stamp", down_s=3) as (w, publish, clock):
        clock[0] -= 0.5  # lands now, stamped before the last failed read
        publish(2)
        clock[0] += 1.0
        assert w.poll() is None and w.outage is not None and w.outage["answered"] == clock[0]
        clock[0] -= 0.25  # stamped after the last failed read, read with the next good read
        publish(3, closed=True)
        clock[0] += 0.75
        assert w.poll() is None and w.outage is None
    [inc] = w.incidents
    e = inc.evidence
    assert e["resumed"] is True and e["ranks_resumed"] == list(range(8))
    assert e["resumed_after_s"] == dict.fromkeys(range(8), -0.25)
    assert "the last at -0.2 s from it answering" in inc.summary, inc.summary


def test_no_hang_once_a_rank_closed_its_heartbeat(redis_url):
    """After the last step the ranks save, close and exit: no more steps, and no hang either once
    a rank's last beat says its training loop is over."""
    clock, logs = [NOW], []
    w, publish = _store_outage_watcher(redis_url, "mega:hb:test7", clock, logs)
    for step in range(1, 4):
        publish(step)
        assert w.poll() is None
        clock[0] += 1.0
    publish(3, closed=True)
    for _ in range(10):  # twice min_hang_s without a step
        clock[0] += 1.0
        assert w.poll() is None
    assert w.incidents == []


@pytest.mark.parametrize("device_mb", [None, 512.0])
def test_a_rank_still_computing_is_slow_not_hung(redis_url, device_mb):
    """Every rank beats at step 3 long past the step rule (min_hang_s 5 s). On CPU, rank 2's
    training thread keeps using CPU (a slow step on a loaded machine) while its peers wait in a
    collective (flat): no hang, however long; once its CPU time is flat too (deadlocked), a hang
    min_hang_s after it was last seen computing. On a GPU (device_mb) a synchronisation may spin
    the CPU while the device is stuck: CPU time proves nothing and the step rule holds."""
    import redis

    prefix = f"mega:hb:test-busy-{device_mb}"
    r = redis.Redis.from_url(redis_url)
    ids = grid()
    for rank, ident in ids.items():
        r.set(heartbeat_redis.id_key(prefix, 0, rank), json.dumps(ident))
    clock, cpu = [NOW], dict.fromkeys(ids, 1.0)
    env = {heartbeat_redis.URL_ENV: redis_url, heartbeat_redis.PREFIX_ENV: prefix}
    w = Watcher(
        _cfg(heartbeat_s=1, min_hang_s=5, progress_factor=10), env, 0, lambda s: None, lambda: clock[0]
    )

    def publish(step, computing=()):
        for rank in ids:
            cpu[rank] += 0.02 if rank in computing else 0.0001  # 2% of a core: load 100 on 2 cores
            rec = {"rank": rank, "time": clock[0], "step": step, "step_s": 0.2, "compute_s": 0.1}
            rec.update(seq={"world": step}, train_cpu_s=cpu[rank], device_mb=device_mb)
            r.set(heartbeat_redis.beat_key(prefix, 0, rank), json.dumps(rec))

    def run(seconds, computing=()):
        for _ in range(seconds):
            publish(3, computing)
            if reason := w.poll():
                return reason
            clock[0] += 1.0

    for step in range(1, 4):
        publish(step)
        assert w.poll() is None
        clock[0] += 1.0
    stepped = clock[0] - 1.0
    if device_mb is not None:
        assert run(20, computing={2}).startswith("hung") and clock[0] - stepped == 6
        return
    assert run(20, computing={2}) is None and w.incidents == []  # 20 s: four times min_hang_s
    computed = clock[0] - 1.0
    assert run(10).startswith("hung") and clock[0] - computed == 6
    [inc] = w.incidents
    assert inc.evidence["stalled_s"] == clock[0] - stepped and inc.evidence["computed_s_ago"] == 6
    w.client.close()


def test_store_outage_open_at_close_is_recorded_unresumed_with_the_summary(tmp_path):
    """Redis still down when the attempt ends: the store incident says not resumed; the heartbeat
    summary file holds the last beats the watcher saw."""
    from mega.launch.runs import RunRecord, RunTracker, read_record
    from mega.store import RedisServer

    server = RedisServer().start()
    clock, logs = [NOW], []
    w, publish = _store_outage_watcher(server.url, "mega:hb:test6", clock, logs)
    publish(2)
    assert w.poll() is None
    server.stop()
    for _ in range(4):
        clock[0] += 1.0
        assert w.poll() is None
    record = RunRecord(
        run_dir=str(tmp_path),
        state="training",
        config="",
        data_index="",
        target_steps=4,
        cwd=".",
        pid=0,
        host="h",
        heartbeat=NOW,
        started=NOW,
    )
    w.close(RunTracker(record), 2, "failed: ranks exited", lambda: None)
    [inc] = read_incidents(tmp_path)
    assert inc["kind"] == "store" and inc["evidence"]["resumed"] is False
    # from the first failed read (NOW + 1) to the close (NOW + 4)
    assert inc["evidence"]["answering"] is False and inc["evidence"]["outage_s"] == 3.0
    assert "heartbeat Redis" in (tmp_path / "incidents" / "000-attempt0-store.md").read_text()
    assert [b["kind"] for b in read_record(tmp_path).incidents] == ["store"]
    summary = json.loads((tmp_path / "heartbeats-attempt0.json").read_text())
    assert summary["attempt"] == 0 and summary["heartbeat_s"] == 1.0
    assert summary["ranks"]["3"] == {"sent": 20, "dropped": 3, "cpu_s": 0.01, "wall_s": 5.0}


def test_incident_is_written_as_json_and_markdown(tmp_path):
    inc = Incident(
        "hang",
        0,
        NOW,
        "no step",
        {
            "rank": 5,
            "node": 1,
            "host": "h1",
            "coords": {"tp": 1, "pp": 1, "dp": 0},
            "group": "tp",
            "group_ranks": [4, 5],
            "behind": 1,
            "reason": "silent",
        },
        {"stalled_s": 9.0},
        "relaunch from latest",
        steps_lost=1,
    )
    path = inc.write(tmp_path)
    assert path.name == "000-attempt0-hang.json"
    [back] = read_incidents(tmp_path)
    assert back["culprit"]["rank"] == 5 and back["steps_lost"] == 1
    md = path.with_suffix(".md").read_text()
    assert "rank 5 on node 1 (h1)" in md and "tp 1, pp 1, dp 0" in md
    assert inc.brief(path)["file"] == "incidents/000-attempt0-hang.json"


# ---------------------------------------------------------------------------------------------
# The drill: real ranks, real Redis, real torchrun


@pytest.mark.slow
def test_sigstopped_rank_is_named_and_the_run_relaunches_from_latest(tmp_path, data_index, data_cache):
    """SIGSTOP one rank of a TP2 x DP2 run: the watcher sees no step for min_hang_s, names that rank
    with its node and coordinates, the driver relaunches from `latest`, the run ends. (Four ranks;
    the watcher tests above localise over all three groups of TP2 x PP2 x DP2.)"""
    from mega.bench.faults import stop_rank_when
    from mega.config import compose
    from mega.launch import run_training
    from mega.launch.runs import read_record

    victim = 3  # tp 1, dp 1 in megatron's order
    cfg = compose(
        [
            "model=tiny",
            "parallelism=tp2",
            "parallelism.dp=2",
            "parallelism.name=tp2-dp2",
            "train.steps=4",
            f"train.run_dir={tmp_path}",
            f"data.cache_dir={data_cache}",
            "train.tensorboard=false",
            "optimizer.warmup_steps=1",
            "restart.backoff_s=0",
            "checkpoint.async_save=false",
            "checkpoint.interval=2",
            # a synchronous save blocks the step, and the watcher allows it upload_timeout_s
            # more: on a loaded machine a save's planning alone took 10 s
            "stability.hang_timeout_s=120",
            "checkpoint.upload_timeout_s=30",
            "stability.heartbeat_s=1",
            "stability.min_hang_s=10",
            "stability.progress_factor=5",
        ]
    )
    assert cfg.parallelism.world_size == 4
    stopped: dict = {}
    thread = threading.Thread(target=stop_rank_when, args=(tmp_path, victim, 3, stopped), daemon=True)
    thread.start()
    messages: list[str] = []
    result = run_training(cfg, data_index, log=messages.append)
    thread.join(timeout=5)
    assert stopped, ("the rank was never stopped", messages)
    assert result.final_step == 4 and result.attempts == 2, messages
    assert result.history[0]["reason"].startswith("hung: "), result.history
    assert result.restored is not None  # attempt 1 resumed from a checkpoint, not from scratch

    [inc] = read_incidents(tmp_path)
    c = inc["culprit"]
    assert inc["kind"] == "hang" and inc["action"] == "relaunch from latest"
    assert (c["rank"], c["node"], c["reason"]) == (victim, stopped["node"], "silent")
    assert c["coords"] == {"tp": 1, "pp": 0, "dp": 1}
    assert c["silent_ranks"] == [victim]
    # detected within the threshold plus a few heartbeats of the last step's end
    assert inc["detected_at"] - stopped["time"] < inc["evidence"]["threshold_s"] + 10
    assert inc["steps_lost"] is not None and inc["steps_lost"] >= 0
    assert (tmp_path / "incidents" / "000-attempt0-hang.md").exists()
    [brief] = read_record(tmp_path).incidents
    assert brief["culprit_rank"] == victim and brief["coords"] == c["coords"]


STEPS = 14
PAUSE_S = 10.0


@pytest.fixture(scope="module")
def slow_rank_and_store_outage(tmp_path_factory, data_index, data_cache):
    """One DP2 run checked two ways: rank 1 computes fault.slow_s more in every forward (a
    straggler; and steps of ~1 s, so that the outage falls mid-run), and the heartbeat Redis
    (owned by the test, given as store.redis_url) is SIGSTOPped for PAUSE_S after step 2."""
    from mega.launch import run_training
    from mega.store import RedisServer

    run_dir = tmp_path_factory.mktemp("slow-rank-store-outage")
    with RedisServer() as server:
        # A hang from stale heartbeats would be declared 8 s (min_hang_s) after the last step
        # seen: within the outage, were hang detection not suspended.
        cfg = tiny_config(
            run_dir,
            data_cache,
            [
                "parallelism=dp2",
                "checkpoint.interval=0",
                f"store.redis_url={server.url}",
                "fault.slow_rank=1",
                "fault.slow_s=0.25",
                "stability.heartbeat_s=0.5",
                "stability.min_hang_s=8",
                "stability.progress_factor=4",
                "stability.straggler_beats=2",
            ],
            steps=STEPS,
        )
        paused: dict = {}
        thread = threading.Thread(
            target=stop_process_when,
            args=(run_dir, 2, lambda: server.pid, paused),
            kwargs={"pause_s": PAUSE_S},
            daemon=True,
        )
        thread.start()
        messages: list[str] = []
        try:
            result = run_training(cfg, data_index, log=messages.append)
        finally:
            thread.join(timeout=15)
        url = server.url
    assert "resumed" in paused, ("Redis was never paused", messages)
    incidents = read_incidents(run_dir)
    return {
        "cfg": cfg,
        "result": result,
        "run_dir": run_dir,
        "paused": paused,
        "messages": messages,
        "url": url,
        "incidents": incidents,
    }


@pytest.mark.slow
def test_slow_rank_is_reported_as_a_straggler_without_a_restart(slow_rank_and_store_outage):
    """fault.slow_rank computes fault.slow_s more in every forward: named as a straggler from its
    heartbeats' compute time, and the run goes on in one attempt."""
    from mega.launch.runs import read_record

    run = slow_rank_and_store_outage
    assert run["result"].attempts == 1 and run["result"].final_step == STEPS
    # the straggler and the store outage (below), once each; no hang, no rank exit
    assert sorted(i["kind"] for i in run["incidents"]) == ["store", "straggler"], run["incidents"]
    [inc] = [i for i in run["incidents"] if i["kind"] == "straggler"]
    assert inc["action"] == "reported"
    assert inc["culprit"]["rank"] == 1 and inc["culprit"]["coords"] == {"tp": 0, "pp": 0, "dp": 1}
    assert min(inc["evidence"]["ratios"]) > run["cfg"].stability.straggler_factor, inc["evidence"]
    print(inc["summary"])
    assert sorted(b["kind"] for b in read_record(run["run_dir"]).incidents) == ["store", "straggler"]


@pytest.mark.slow
def test_heartbeat_redis_stopped_for_10s_is_a_store_incident_and_training_goes_on(slow_rank_and_store_outage):
    """The heartbeat Redis SIGSTOPped for 10 s mid-run: one attempt, every step done, one store
    incident (outage ~10 s, heartbeats resumed from both ranks), no hang, nobody evicted; the
    ranks counted dropped beats."""
    from mega.launch.runs import read_record

    run = slow_rank_and_store_outage
    run_dir, paused, messages, result = run["run_dir"], run["paused"], run["messages"], run["result"]
    assert result.attempts == 1 and result.final_step == STEPS, messages
    last_step = max(m["step"] for m in read_metrics(run_dir) if "step" in m)
    ends = [m["time"] for m in read_metrics(run_dir) if m.get("step") == last_step]
    assert ends and ends[0] > paused["resumed"], "the run ended before Redis was back: not mid-run"

    assert sorted(i["kind"] for i in run["incidents"]) == ["store", "straggler"], run["incidents"]
    [inc] = [i for i in run["incidents"] if i["kind"] == "store"]
    e = inc["evidence"]
    assert inc["action"] == "reported" and inc["culprit"] == {"store": run["url"]}
    assert PAUSE_S - 2 <= e["outage_s"] <= PAUSE_S + 3 and e["read_errors"] > 0, e
    assert e["resumed"] is True and e["ranks_resumed"] == [0, 1], e
    assert sorted(e["resumed_after_s"]) == ["0", "1"], e  # each rank's first beat after Redis answered
    assert inc["detected_at"] > paused["resumed"]
    assert any("store outage" in m for m in messages) and any("answers again" in m for m in messages)
    record = read_record(run_dir)
    assert record.evicted_nodes == [] and sorted(b["kind"] for b in record.incidents) == [
        "store",
        "straggler",
    ]

    summary = json.loads((run_dir / "heartbeats-attempt0.json").read_text())
    assert (
        summary["attempt"] == 0 and summary["heartbeat_s"] == 0.5 and sorted(summary["ranks"]) == ["0", "1"]
    )
    for rank, s in summary["ranks"].items():
        # dropped while Redis was stopped (a write times out in 0.5 s: ~10-20 per rank) and sent before
        # it (the beats after it are e["ranks_resumed"]: a rank's last beat counts the ones before it)
        assert s["dropped"] > 0 and s["sent"] > 0, (rank, s)
        assert 0 < s["cpu_s"] < s["wall_s"], (rank, s)
        assert e["dropped"][rank] <= s["dropped"]  # the summary counts up to the ranks' last beat
    print(inc["summary"], summary)


def test_a_rank_done_with_its_last_step_is_not_silent(redis_url):
    """The closing phase: a rank that logged the last step and went quiet while a peer still beats
    (its upload, its teardown) is no hang; a rank silent mid-run is."""
    import redis

    cfg = _cfg(heartbeat_s=1, min_hang_s=60, progress_factor=10)
    env = {heartbeat_redis.URL_ENV: redis_url, heartbeat_redis.PREFIX_ENV: "mega:hb:closing"}
    clock = [NOW]
    w = Watcher(cfg, env, attempt=0, log=lambda s: None, clock=lambda: clock[0])
    r = redis.Redis.from_url(redis_url)

    def beat(rank, step, at):
        rec = {"rank": rank, "time": at, "step": step, "step_s": 0.2}
        r.set(heartbeat_redis.beat_key("mega:hb:closing", 0, rank), json.dumps(rec))

    last = cfg.train.steps
    beat(0, last, clock[0])  # rank 0 finished the last step, then went quiet
    clock[0] += 10.0
    beat(1, last - 1, clock[0])  # rank 1 still beats
    w._read()
    assert not w._silent_amid_beating(clock[0])
    beat(0, last - 2, NOW)  # the same silence mid-run: a stopped or dead rank
    w._read()
    assert w._silent_amid_beating(clock[0])
