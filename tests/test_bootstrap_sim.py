"""The bootstrap simulator against real ranks: RecordingStore, the op model, replays on real servers."""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta

import pytest
import torch.distributed as dist

from mega.cluster import bootstrap_sim as bs
from mega.store.recording import RecordingStore, load_recordings

LAST_WORKER = ":last_worker"
READY_DONE = ":done"  # mega.cluster.parallel_groups.world_barrier's release key


def _is_barrier_release(op) -> bool:
    """Which rank writes a barrier's release key depends on arrival order: timing, not model."""
    return op[0] == "set" and (op[1].endswith(LAST_WORKER) or bs.READY_BARRIER_PREFIX in op[1])


def test_recording_store_forwards_and_counts(tmp_path):
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    rec = RecordingStore(server, rank=3)
    rec.set("a", b"1")
    assert rec.get("a") == b"1"
    assert rec.add("n", 2) == 2 and rec.add("n", 0) == 2
    rec.wait(["a"])
    rec.wait(["a"], timedelta(seconds=1))
    assert rec.check(["a", "n"]) and not rec.check(["missing"])
    rec.multi_set(["b", "c"], [b"x", b"y"])
    assert rec.multi_get(["b", "c"]) == [b"x", b"y"]
    assert rec.compare_set("a", b"1", b"2") == b"2" and server.get("a") == b"2"  # forwarded to the real store
    # through torch's C++ PrefixStore: keys arrive prefixed, as new_group's stores issue them
    prefixed = dist.PrefixStore("g7", rec)
    prefixed.set("k", b"v")
    assert prefixed.get("k") == b"v"
    assert rec.counts == {
        "set": 2,
        "get": 2,
        "add": 2,
        "wait": 2,
        "check": 2,
        "multi_set": 1,
        "multi_get": 1,
        "compare_set": 1,
    }
    assert rec.ops[-1] == ("get", ("g7/k",))
    rec.dump(tmp_path)
    row = load_recordings(tmp_path)[3]
    assert row["counts"] == rec.counts and ["multi_get", "b", "c"] in row["ops"]


@pytest.mark.parametrize(
    "layout",
    [
        bs.Layout(8, 2, 2, backend="gloo", gloo_groups=True, barrier=True),
        bs.Layout(8, 2, 2, backend="gloo", gloo_groups=True, barrier=False),
        bs.Layout(16, 2, 2, backend="nccl", gloo_groups=False, barrier=True),
    ],
)
@pytest.mark.parametrize("strategy", bs.STRATEGIES)
def test_plan_counts_equal_executed_programs(strategy, layout):
    executed = sum(bs.run_in_memory(strategy, layout), Counter())
    assert dict(sorted(executed.items())) == bs.plan_counts(strategy, layout)


def test_op_counts_grow_as_modelled():
    # default: every rank joins a world-wide barrier for each of ~3N groups -> ~N^2;
    # light: a fixed number of groups per rank, one world barrier -> ~N
    ops = {
        (s, n): sum(bs.plan_counts(s, bs.Layout(n, 8, 8)).values()) for s in bs.STRATEGIES for n in (256, 512)
    }
    assert 3.5 < ops["default", 512] / ops["default", 256] < 4.5
    assert 1.9 < ops["light", 512] / ops["light", 256] < 2.1
    groups = len(bs.megatron_groups(512, 8, 8, False))
    barrier_ops = 3 * 512 * (groups + 1)  # 2 add + 1 wait per rank per barrier (init + each group)
    counts = bs.plan_counts("default", bs.Layout(512, 8, 8))
    assert counts["add"] + counts["wait"] == barrier_ops


@pytest.mark.parametrize("world", [4, 8])
def test_simulator_matches_recorded_real_ranks(world):
    """Real gloo ranks over a RecordingStore-wrapped TCPStore, megatron tp=2 x pp=2 (x dp), both
    strategies, TORCH_DIST_INIT_BARRIER=1: every rank's (op, key) sequence equals the simulator's."""
    recorded = bs.record_real_ranks(bs.STRATEGIES, world, 2, 2, gloo_groups=True, barrier=True)
    layout = bs.Layout(world, 2, 2, backend="gloo", gloo_groups=True, barrier=True)
    for strategy in bs.STRATEGIES:
        simulated: list = []
        bs.run_in_memory(strategy, layout, ops=simulated)
        real_total = Counter()
        releases = Counter()
        for rank in range(world):
            ops = [tuple(op[:2]) for op in recorded[strategy][rank]["ops"]]
            real_total.update(op[0] for op in ops)
            releases.update(op[1] for op in ops if _is_barrier_release(op) and op[1].endswith(LAST_WORKER))
            # the last rank to arrive at a barrier writes last_worker; when arrivals interleave,
            # several may see the full count and write it: that one set is timing, not model
            assert [op for op in ops if not _is_barrier_release(op)] == [
                op for op in simulated[rank] if not _is_barrier_release(op)
            ], (strategy, rank)
        plan = bs.plan_counts(strategy, layout)
        waiters = Counter(
            op[1][: -len(LAST_WORKER)]
            for seq in simulated
            for op in seq
            if op[0] == "wait" and op[1].endswith(LAST_WORKER)
        )
        assert {k[: -len(LAST_WORKER)] for k in releases} == set(waiters)  # every barrier released
        assert all(1 <= n <= waiters[k[: -len(LAST_WORKER)]] for k, n in releases.items())
        assert {k: v for k, v in real_total.items() if k != "set"} == {
            k: v for k, v in plan.items() if k != "set"
        }
        assert real_total["set"] - plan["set"] == sum(n - 1 for n in releases.values())  # torch's barriers
        ready = {
            k: n
            for k, n in Counter(
                op[1]
                for r in range(world)
                for op in recorded[strategy][r]["ops"]
                if op[0] == "set" and bs.READY_BARRIER_PREFIX in op[1]
            ).items()
        }
        # light's one world barrier: released by exactly one rank (the one whose add completed it)
        assert ready == ({"0//mega_groups_ready:1:done": 1} if strategy == "light" else {}), ready
        if strategy == "light":  # one barrier after the groups: one add per rank beyond init's two
            assert plan["add"] == 3 * world < bs.plan_counts("default", layout)["add"]


@pytest.mark.parametrize("store", bs.STORES)
def test_replay_on_a_real_server_issues_the_planned_operations(store, redis_url):
    layout = bs.Layout(64, 8, 8)  # TP=8 x PP=8, the bench's layout, one DP replica
    res = bs.simulate(
        "light", store, layout, max_seconds=120, redis_url=redis_url if store == "redis" else None
    )
    assert res.completed and res.error is None, res
    assert res.seconds is not None and res.seconds > 0
    plan = bs.plan_counts("light", layout)
    assert res.store_ops == sum(plan.values())
    assert {k: v for k, v in res.ops_by_kind.items() if k != "set"} == {
        k: v for k, v in plan.items() if k != "set"
    }
    assert res.ops_by_kind["set"] >= plan["set"]
    assert json.loads(json.dumps(res.as_dict()))["ranks"] == 64


def test_replay_that_cannot_finish_is_reported_incomplete(redis_url):
    res = bs.simulate("default", "redis", bs.Layout(64, 8, 8), max_seconds=0.5, redis_url=redis_url)
    assert not res.completed and res.seconds is None
    assert 0 < res.ops_done < res.store_ops
