"""The self-check across nodes (mega/cluster/selfcheck.py): pair rounds, verdicts that blame the
node with slow links, floors from the hardware presets (no processes), and a run on three
network-namespace nodes (root; skipped with the reason otherwise)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import pytest
from helpers import free_subnet, needs_root

from mega.cluster.selfcheck import (
    _gemm_check,
    cluster_verdict,
    pair_bandwidths,
    pair_rounds,
    selfcheck_floors,
)
from mega.config import compose, from_dict
from mega.launch.node_jobs import run_selfcheck


@pytest.mark.parametrize("nodes", range(1, 10))
def test_pair_rounds_meet_every_pair_once_in_disjoint_rounds(nodes):
    rounds = pair_rounds(nodes)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(nodes) for b in range(a + 1, nodes)]
    for r in rounds:
        busy = [k for p in r for k in p]
        assert len(busy) == len(set(busy))  # a node is in at most one pair per round
    assert len(rounds) == (0 if nodes == 1 else nodes - 1 + nodes % 2)


def test_pair_rounds_are_capped_for_many_nodes():
    rounds = pair_rounds(100, max_rounds=16)
    assert len(rounds) == 16 and all(len(r) == 50 for r in rounds)


def _rank(node: int, rank: int) -> dict:
    return {
        "rank": rank,
        "node": node,
        "local_rank": 0,
        "host": "h",
        "address": f"10.0.0.{node + 2}",
        "device": "cpu",
        "error": None,
        "gemm_max_rel_err": 1e-7,
        "gemm_gflops": 10.0,
        "alltoall_ok": True,
        "alltoall_mb_per_s": None,
    }


def _pair(a: int, b: int, seconds: float) -> list[dict]:
    """The exchange rows of node pair (a, b): 1 MB each way per rank, taking ``seconds``."""
    return [
        {
            "round": 0,
            "node": x,
            "partner": y,
            "local_rank": 0,
            "ok": True,
            "bytes": 1_000_000,
            "elapsed_s": seconds,
            "error": None,
        }
        for x, y in ((a, b), (b, a))
    ]


# Stops the process ``argv[1]`` for 20 ms out of every 22 (a host shared by dozens of busy processes),
# for at most 20 s; SIGTERM (or the deadline) leaves it running.
PREEMPTER = """
import os, signal, sys, time
pid, end = int(sys.argv[1]), time.monotonic() + 20
signal.signal(signal.SIGTERM, lambda *_: (os.kill(pid, signal.SIGCONT), sys.exit(0)))
print("ready", flush=True)
while time.monotonic() < end:
    os.kill(pid, signal.SIGSTOP); time.sleep(0.02); os.kill(pid, signal.SIGCONT); time.sleep(0.002)
os.kill(pid, signal.SIGCONT)
"""


def test_a_preempted_cpu_rank_keeps_its_gemm_rate():
    """A CPU rank that runs 2 ms in every 22 reports the GEMM rate of its CPU seconds, not of the
    wall time it waited: a healthy node on a loaded host passes the GEMM floor."""
    import torch

    cpu = torch.device("cpu")
    free = _gemm_check(cpu, 64, 256, torch.float32)["gemm_gflops"]
    helper = subprocess.Popen([sys.executable, "-c", PREEMPTER, str(os.getpid())], stdout=subprocess.PIPE)
    try:
        assert helper.stdout.readline() == b"ready\n"
        row = _gemm_check(cpu, 64, 256, torch.float32, min_time_s=0.5)
    finally:
        helper.terminate()
        helper.wait(timeout=30)
    assert row["gemm_gflops_mean"] < 0.5 * free  # the wall clock saw the stops
    assert row["gemm_gflops"] > 0.5 * free


def test_a_node_with_slow_links_is_blamed_not_its_peers():
    floors = selfcheck_floors(from_dict({"selfcheck": {"min_inter_node_mb_per_s": 10.0}}))
    # node 2's links run at 1 MB/s, the others' at 100 MB/s
    pairs = pair_bandwidths(_pair(0, 1, 0.01) + _pair(0, 2, 1.0) + _pair(1, 2, 1.0), floors)
    assert [(p["nodes"], round(p["mb_per_s"])) for p in pairs] == [([0, 1], 100), ([0, 2], 1), ([1, 2], 1)]
    verdict = cluster_verdict(
        [_rank(k, k) for k in range(3)], pairs, nodes=3, procs_per_node=1, floors=floors
    )
    assert [n["healthy"] for n in verdict["nodes"]] == [True, True, False]
    assert verdict["reasons"] == [
        "node 2: link to node 0: 1.0 MB/s below 10 (selfcheck.min_inter_node_mb_per_s=10)",
        "node 2: link to node 1: 1.0 MB/s below 10 (selfcheck.min_inter_node_mb_per_s=10)",
    ]
    # two nodes alone cannot tell whose link is slow: both fail
    two = cluster_verdict(
        [_rank(0, 0), _rank(1, 1)],
        pair_bandwidths(_pair(0, 1, 1.0), floors),
        nodes=2,
        procs_per_node=1,
        floors=floors,
    )
    assert [n["healthy"] for n in two["nodes"]] == [False, False]


def test_floors_are_fractions_of_the_presets_hardware():
    h100 = selfcheck_floors(compose(["cluster=h100-8x", "selfcheck.gemm_fraction=0.6"]))
    assert h100["min_gemm_gflops"] == pytest.approx(0.6 * 989e3)  # bf16 dense TFLOP/s -> GFLOP/s
    assert h100["min_alltoall_mb_per_s"] == pytest.approx(0.3 * 450e3)  # 900 GB/s counts both directions
    assert h100["min_inter_node_mb_per_s"] == pytest.approx(0.3 * 8 * 400 / 8 * 1e3)  # 8 x 400 Gbit/s NICs
    assert "cluster.peak_tflops=989" in h100["gemm_from"]
    cpu = selfcheck_floors(compose())  # no hardware facts: the measured absolute floors
    assert cpu["gemm_from"].startswith("selfcheck.min_gemm_gflops=")
    assert cpu["inter_node_from"].startswith("selfcheck.min_inter_node_mb_per_s=")


@pytest.mark.slow
@needs_root
def test_selfcheck_on_three_namespace_nodes_fails_the_one_with_a_slow_link(tmp_path):
    """3 nodes x 2 ranks; node 2's link is slowed to 32 Mbit/s (tc tbf): the pair exchanges name
    node 2, nodes 0 and 1 stay healthy, the intra-node all-to-all runs per node."""
    from mega.launch.local_nodes import LocalNodesBackend

    cfg = from_dict(
        {
            "parallelism": {"dp": 6, "global_batch_size": 12},
            "cluster": {"nodes": 3, "procs_per_node": 2},
            "selfcheck": {"min_inter_node_mb_per_s": 20.0},
            "launcher": {"name": "local-nodes", "local_nodes": {"netns": True, "subnet": free_subnet()}},
        }
    )
    backend = LocalNodesBackend(cfg, tmp_path)
    try:
        backend.network.shape(2, 32)  # 4 MB/s each way: a fifth of the floor, 8 MiB a round in ~2 s
        result = run_selfcheck(cfg, tmp_path, backend=backend)
    finally:
        backend.close()
    assert [n["healthy"] for n in result["nodes"]] == [True, True, False], result["reasons"]
    subnet = ipaddress.ip_network(cfg.launcher.local_nodes.subnet)
    assert [n["address"] for n in result["nodes"]] == [str(subnet.network_address + k + 2) for k in range(3)]
    assert all(
        "link to node" in r and "selfcheck.min_inter_node_mb_per_s=20" in r
        for r in result["nodes"][2]["reasons"]
    )
    pairs = {tuple(p["nodes"]): p for p in result["pairs"]}
    assert set(pairs) == {(0, 1), (0, 2), (1, 2)} and all(p["data_ok"] for p in pairs.values())
    assert pairs[(0, 1)]["mb_per_s"] > 20 and pairs[(0, 2)]["mb_per_s"] < 8 and pairs[(1, 2)]["mb_per_s"] < 8
    assert sorted((r["node"], r["rank"]) for r in result["ranks"]) == [(k // 2, k) for k in range(6)]
    assert all(r["alltoall_ok"] and r["alltoall_mb_per_s"] > 0 for r in result["ranks"])  # within each node
    assert (tmp_path / "nodes" / "2" / "selfcheck.log").exists()
