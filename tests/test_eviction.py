"""Diagnosis before restart and eviction (mega/stability/membership.py).

Unit tests: who runs next, given the nodes that failed their self-check and the config. Drills
(CPU, real processes, launcher=local-nodes, 2 nodes x 1 rank, DP 2): node 1 dies at step 2 and
fails its self-check; it is evicted and recorded; with a spare (checked at start-up) in its place
at once and node 1 checked beside the relaunch the run finishes at full size, and
without one (restart.min_nodes=1) on one node with DP 1 and twice the microbatches, the global
batch unchanged: both losses match an independent one-process reference within 2e-5 per step."""

import json

import pytest
from helpers import assert_same_curve, tiny_run_logged

from mega.config import compose
from mega.launch.runs import read_record
from mega.stability import membership
from mega.stability.incident import read_incidents
from mega.stability.membership import CannotContinue, Membership, decide

RTOL = 2e-5  # fp32 sums in another order (another DP size): equal to ~6 digits
STEPS = 4


def nodes_cfg(nodes=2, per_node=2, extra=()):
    return compose(
        [
            "model=tiny",
            "launcher=local-nodes",
            "parallelism=dp2",
            f"parallelism.dp={nodes * per_node}",
            f"cluster.nodes={nodes}",
            f"cluster.procs_per_node={per_node}",
            *extra,
        ]
    )


# ---------------------------------------------------------------------------------------------
# Membership decisions (no processes)


def test_a_spare_takes_the_evicted_nodes_place():
    cfg = nodes_cfg(
        extra=["restart.spare_nodes=1", "fault.bad_node=1", "fault.kill_node=1", "fault.kill_at_step=2"]
    )
    members = Membership.initial(cfg)
    assert (members.nodes, members.spares) == ([0, 1], [2])
    d = decide(cfg, members, [1])
    assert (d.membership.nodes, d.membership.spares, d.membership.evicted) == ([0, 2], [], [1])
    assert d.replaced == {1: 2} and d.evicted == [1]
    assert (d.cfg.cluster.nodes, d.cfg.parallelism.dp) == (2, 4)  # full size
    assert (d.cfg.fault.bad_node, d.cfg.fault.kill_node) == (None, None)  # the drill ends with the old node
    assert "node 1 evicted, spare node 2 in its place" in d.note


def test_swap_puts_spares_in_the_suspects_places_without_evicting_them():
    cfg = nodes_cfg(extra=["restart.spare_nodes=1", "fault.bad_node=1"])
    d = membership.swap(cfg, Membership.initial(cfg), [1])
    assert (d.membership.nodes, d.membership.spares, d.membership.evicted) == ([0, 2], [], [])
    assert d.replaced == {1: 2} and d.evicted == [] and d.cfg.fault.bad_node is None
    assert "node 1 set aside for a self-check" in d.note
    assert membership.swap(cfg, Membership.initial(cfg), [0, 1]) is None  # two suspects, one spare


def test_without_a_spare_dp_shrinks_and_the_global_batch_stays():
    cfg = nodes_cfg(extra=["restart.min_nodes=1"])
    d = decide(cfg, Membership.initial(cfg), [0])
    assert d.membership.nodes == [1] and d.evicted == [0]
    p = d.cfg.parallelism
    assert (d.cfg.cluster.nodes, p.dp, p.global_batch_size) == (1, 2, cfg.parallelism.global_batch_size)
    assert p.num_microbatches == 2 * cfg.parallelism.num_microbatches
    assert "dp 4 -> 2" in d.note


def test_model_parallel_groups_are_kept_when_shrinking():
    cfg = compose(
        [
            "model=tiny",
            "launcher=local-nodes",
            "parallelism=tp2-pp2-dp2",
            "cluster.nodes=2",
            "cluster.procs_per_node=4",
            "restart.min_nodes=1",
        ]
    )
    d = decide(cfg, Membership.initial(cfg), [1])
    p = d.cfg.parallelism
    assert (p.tp, p.pp, p.dp, d.cfg.cluster.nodes) == (2, 2, 1, 1)


@pytest.mark.parametrize(
    "extra, bad, fragment",
    [
        ([], [1], "restart.min_nodes=null (never shrink) does not allow 1"),  # no spare, no shrinking allowed
        (["restart.min_nodes=2"], [1], "restart.min_nodes=2 does not allow 1"),
        (["restart.spare_nodes=1", "restart.min_nodes=2"], [0, 1], "does not allow 1"),  # one spare, two bad
    ],
)
def test_cannot_continue_says_why(extra, bad, fragment):
    cfg = nodes_cfg(extra=extra)
    with pytest.raises(CannotContinue, match="failed the self-check") as info:
        decide(cfg, Membership.initial(cfg), bad)
    assert fragment in str(info.value)


def test_a_layout_that_does_not_fit_fewer_nodes_is_refused():
    # 3 nodes x 2 = DP 6 with a global batch of 12; on 2 nodes DP 4 would need 12 % (2*4) == 0
    cfg = nodes_cfg(nodes=3, extra=["parallelism.global_batch_size=12", "restart.min_nodes=1"])
    with pytest.raises(CannotContinue, match="parallelism.global_batch_size"):
        decide(cfg, Membership.initial(cfg), [2])
    # TP 2 on 4 single-rank nodes: 3 ranks cannot hold TP groups of 2
    cfg = compose(
        [
            "model=tiny",
            "launcher=local-nodes",
            "parallelism=tp2",
            "parallelism.dp=2",
            "cluster.nodes=4",
            "cluster.procs_per_node=1",
            "restart.min_nodes=1",
        ]
    )
    with pytest.raises(CannotContinue, match="not a multiple of tp\\*pp\\*cp=2\\*1\\*1"):
        decide(cfg, Membership.initial(cfg), [3])


def test_healthy_verdicts_change_nothing_and_map_to_physical_nodes():
    cfg = nodes_cfg(extra=["restart.spare_nodes=1"])
    members = Membership([0, 2], [], [1])  # after a first eviction: job node 1 is physical node 2
    result = {
        "nodes": [
            {"node": 0, "healthy": False, "reasons": ["link to node 1: 1.0 MB/s below 10"]},
            {"node": 1, "healthy": False, "reasons": ["local rank 1: GEMM", "link to node 0: wrong data"]},
        ]
    }
    verdicts = membership.selfcheck_verdicts(result, members)  # the job's node 1 named as node 2
    assert verdicts == {
        0: {"healthy": False, "reasons": ["link to node 2: 1.0 MB/s below 10"]},
        2: {"healthy": False, "reasons": ["local rank 1: GEMM", "link to node 0: wrong data"]},
    }
    d = decide(cfg, members, [5])  # not a member
    assert d.membership is members and d.cfg is cfg and d.evicted == []
    assert not membership.diagnosis_enabled(nodes_cfg())
    assert membership.diagnosis_enabled(nodes_cfg(extra=["restart.min_nodes=2"]))


# ---------------------------------------------------------------------------------------------
# Drills: real processes


SAVED_EVERY_2 = [
    "parallelism=dp2",
    "train.eval_batches=0",
    "checkpoint.async_save=false",
    "checkpoint.interval=2",
]


def train(run_dir, data_index, data_cache, overrides):
    return tiny_run_logged(run_dir, data_index, data_cache, [*SAVED_EVERY_2, *overrides], steps=STEPS)


NODE_1_DIES_AND_IS_BAD = [
    "launcher=local-nodes",
    "cluster.nodes=2",
    "cluster.procs_per_node=1",
    "fault.kill_node=1",
    "fault.kill_at_step=2",
    "fault.bad_node=1",
]


@pytest.fixture(scope="module")
def reference(single_process_reference):
    """One process, the same global batch: the curve every membership must continue (conftest)."""
    assert len(single_process_reference.metrics) == STEPS
    return single_process_reference.metrics


def assert_evicted(run_dir, result, replaced_by):
    """With a spare: it took node 1's place at once (it passed its check at start-up) and node 1
    was checked beside the relaunch; without one: both nodes were checked before it."""
    first, second = result.history
    assert first["failed_nodes"] == [1] and first["evicted"] == [1]
    assert second["restored"] == "iter_0000002"
    record = read_record(run_dir)
    [row] = record.evicted_nodes
    assert (row["node"], row["attempt"], row["replaced_by"]) == (1, 0, replaced_by)
    assert any("fault.bad_node" in r for r in row["reasons"]), row  # the self-check's own verdict
    verdict = json.loads(open(row["selfcheck"]).read())
    aside = replaced_by is not None
    assert [n["healthy"] for n in verdict["nodes"]] == ([False] if aside else [True, False])
    if aside:
        spares = json.loads((run_dir / "diagnosis" / "spares" / "result.json").read_text())
        assert [n["healthy"] for n in spares["nodes"]] == [True]  # the spare passed before it trained
        assert first["set_aside"] == [1]
    # the node's death and its eviction are incidents, both recovered by the next attempt
    by_kind = {i["kind"]: i for i in read_incidents(run_dir) if i["kind"] != "straggler"}
    assert sorted(by_kind) == ["eviction", "rank-exit"]
    died, evicted = by_kind["rank-exit"], by_kind["eviction"]
    assert (died["culprit"]["rank"], died["culprit"]["node"]) == (1, 1) and "killed by SIGKILL" in died[
        "diagnosis"
    ]
    assert aside or "self-check of node 1: unhealthy" in died["diagnosis"]  # aside: checked after
    assert evicted["culprit"]["node"] == 1 and "fault.bad_node" in evicted["diagnosis"]
    assert evicted["action"] == (
        f"evicted node 1, spare node {replaced_by} in its place"
        if replaced_by is not None
        else "evicted node 1; continuing on 1 nodes (dp 2 -> 1, same global batch)"
    )
    assert died["time_to_recover_s"] > 0
    assert (
        evicted["time_to_recover_s"] == 0 if aside else evicted["time_to_recover_s"] > 0
    )  # aside: ran on already
    return record


@pytest.mark.slow
def test_bad_node_is_evicted_and_a_spare_keeps_full_size(tmp_path, data_index, data_cache, reference):
    result, logs = train(tmp_path, data_index, data_cache, [*NODE_1_DIES_AND_IS_BAD, "restart.spare_nodes=1"])
    record = assert_evicted(tmp_path, result, replaced_by=2)
    assert record.membership == {"nodes": [0, 2], "spares": [], "evicted": [1]}
    assert json.loads((tmp_path / "config.json").read_text())["parallelism"]["dp"] == 2  # full size
    assert any("spare node 2 in node 1's place, node 1 set aside" in line for line in logs), logs
    assert_same_curve(result.metrics, reference, RTOL)


@pytest.mark.slow
def test_without_a_spare_the_run_shrinks_and_matches(tmp_path, data_index, data_cache, reference):
    result, logs = train(tmp_path, data_index, data_cache, [*NODE_1_DIES_AND_IS_BAD, "restart.min_nodes=1"])
    record = assert_evicted(tmp_path, result, replaced_by=None)
    assert record.membership == {"nodes": [0], "spares": [], "evicted": [1]}
    config = json.loads((tmp_path / "config.json").read_text())
    assert (
        config["cluster"]["nodes"],
        config["parallelism"]["dp"],
        config["parallelism"]["global_batch_size"],
    ) == (1, 1, 16)
    assert result.init["world_size"] == 1  # the last attempt ran on the one node left
    assert any("dp 2 -> 1, 4 -> 8 microbatches per step, global batch 16" in line for line in logs), logs
    assert_same_curve(result.metrics, reference, RTOL)
