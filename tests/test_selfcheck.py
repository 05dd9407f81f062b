"""The per-node self-check as a real 2-rank torchrun job on CPU (gloo)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mega.cluster.selfcheck import node_verdict, selfcheck_floors, verdict_table
from mega.config import from_dict
from mega.launch.node_jobs import run_selfcheck


def node_config(**selfcheck):
    return from_dict({"parallelism": {"dp": 2}, "cluster": {"procs_per_node": 2}, "selfcheck": selfcheck})


def test_two_ranks_are_healthy_with_default_floors(tmp_path):
    result = run_selfcheck(node_config(), tmp_path)

    assert result["healthy"], result["reasons"]
    assert result["reasons"] == [] and result["exit_code"] == 0
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for row in result["ranks"]:
        assert row["error"] is None
        assert row["gemm_max_rel_err"] < 1e-5  # float32 vs float64 on a 256x256 GEMM
        assert row["gemm_gflops"] > 0
        assert row["alltoall_ok"] and row["alltoall_mb_per_s"] > 0
    assert json.loads((tmp_path / "result.json").read_text())["healthy"]
    assert [row["rank"] for row in verdict_table(result)] == [0, 1]


def test_absurd_gemm_floor_is_unhealthy_and_named(tmp_path):
    result = run_selfcheck(node_config(min_gemm_gflops=1e9), tmp_path)

    assert not result["healthy"]
    assert len(result["ranks"]) == 2  # the checks ran; the floor failed them
    assert len(result["reasons"]) == 2
    assert all("selfcheck.min_gemm_gflops=1e+09" in r for r in result["reasons"]), result["reasons"]


def test_a_dead_rank_gives_an_unhealthy_verdict_not_a_hang(tmp_path):
    result = run_selfcheck(node_config(), tmp_path, fail_rank=1)

    assert not result["healthy"]
    assert result["exit_code"] not in (0, 124)
    assert "exited with code" in result["reasons"][0]
    assert verdict_table(result)[0]["error"] == result["reasons"][0]


def test_a_timeout_gives_an_unhealthy_verdict(tmp_path):
    result = run_selfcheck(node_config(), tmp_path, timeout_s=1.0)  # ranks cannot even import torch

    assert not result["healthy"] and result["exit_code"] == 124
    assert "timed out after 1 s" in result["reasons"][0]


ROW = {
    "rank": 0,
    "local_rank": 0,
    "device": "cpu",
    "error": None,
    "gemm_max_rel_err": 1e-7,
    "gemm_gflops": 10.0,
    "alltoall_ok": True,
    "alltoall_mb_per_s": 100.0,
}
FLOORS = selfcheck_floors(from_dict({"selfcheck": {"min_gemm_gflops": 1.0, "min_alltoall_mb_per_s": 1.0}}))


@pytest.mark.parametrize(
    ("rows", "expected", "reason"),
    [
        ([ROW, {**ROW, "rank": 1}], 2, None),
        ([{**ROW, "alltoall_mb_per_s": None}], 1, None),  # one rank: no bandwidth to judge
        ([ROW], 2, "1 of 2 ranks reported"),
        ([{**ROW, "error": "RuntimeError: gloo timeout"}], 1, "rank 0: check failed: RuntimeError"),
        # the device on the node, not the check job's global rank (a spare's check has other ranks)
        ([{**ROW, "rank": 5, "local_rank": 1, "error": "OSError"}], 1, "local rank 1: check failed: OSError"),
        ([{**ROW, "gemm_max_rel_err": 0.5}], 1, "wrong results"),
        ([{**ROW, "alltoall_ok": False}], 1, "all-to-all delivered wrong data"),
        ([{**ROW, "alltoall_mb_per_s": 0.1}], 1, "selfcheck.min_alltoall_mb_per_s=1"),
        ([{**ROW, "device": "cuda", "device_count": 0, "allreduce_ok": True}], 1, "sees 0 GPUs"),
        ([{**ROW, "device": "cuda", "device_count": 1, "allreduce_ok": False}], 1, "all-reduce"),
    ],
)
def test_node_verdict(rows, expected, reason):
    verdict = node_verdict(rows, expected_ranks=expected, floors=FLOORS)
    if reason is None:
        assert verdict == {"healthy": True, "reasons": []}
    else:
        assert not verdict["healthy"]
        assert any(reason in r for r in verdict["reasons"]), verdict["reasons"]


def test_launcher_side_modules_import_neither_megatron_nor_gpu_packages():
    # at import time (Prefect anywhere in mega is refused by the import contracts, tests/test_contracts.py)
    code = (
        "import sys, mega.cluster.selfcheck, mega.cluster.bootstrap, mega.report; "
        "bad = [m for m in ('megatron', 'transformer_engine', 'apex', 'flash_attn') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
