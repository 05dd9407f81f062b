"""A first per-node health check, run before a training job is allowed onto the node.

MegaScale (NSDI'24, section 4.2) screens every node with light-weight self-checks before a job
starts, so a slow GEMM unit or a broken link is found in seconds instead of as a hang hours in.
This module is both:

* a torchrun job (``python -m mega.cluster.selfcheck --out result.json ...``): every rank of the node
  checks its matrix unit (float32 GEMM vs a float64 reference, and GFLOP/s) and its links
  (all-to-all between the node's ranks: every rank must receive exactly what the others sent,
  and at what MB/s; on GPUs also an NCCL all-reduce); rank 0 gathers the rows and writes the
  node verdict;
* the library function ``run_selfcheck(cfg, out_dir)``, which launches that job and turns any
  failure of the job itself (a dead rank, a timeout, no result file) into an unhealthy verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mega.config import MegaConfig

# float32 GEMM error relative to the float64 reference, normalized by the largest output entry:
# correct hardware stays near 1e-6; silent data corruption is orders of magnitude above this.
MAX_GEMM_REL_ERR = 1e-3
ALLTOALL_BYTES = 4 * 1024 * 1024  # per rank and iteration: big enough for a bandwidth figure
ALLTOALL_ITERS = 5
DEFAULT_TIMEOUT_S = 180.0  # the whole job; a node that needs longer than this is not healthy


# ---------------------------------------------------------------------------------------------
# Checks run on every rank


def _gemm_check(device: "torch.device", n: int, min_time_s: float = 0.25) -> dict[str, float]:
    """Max relative error of a float32 matmul vs float64, and float32 GEMM throughput."""
    import torch

    gen = torch.Generator().manual_seed(1234)  # same matrices on every rank: comparable rows
    a64 = torch.randn(n, n, dtype=torch.float64, generator=gen).to(device)
    b64 = torch.randn(n, n, dtype=torch.float64, generator=gen).to(device)
    a, b = a64.float(), b64.float()

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # measure float32, not TF32 rounding
    try:
        ref = a64 @ b64
        out = (a @ b).double()
        rel_err = ((out - ref).abs().max() / ref.abs().max()).item()

        _sync(device)
        reps, start = 0, time.perf_counter()
        while True:  # repeat until the timing is long enough to trust
            a @ b
            reps += 1
            if reps % 4 == 0:
                _sync(device)
                elapsed = time.perf_counter() - start
                if elapsed >= min_time_s:
                    break
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return {"gemm_max_rel_err": rel_err, "gemm_gflops": 2 * n**3 * reps / elapsed / 1e9}


def _alltoall_check(device: "torch.device", rank: int, world: int) -> dict[str, Any]:
    """Every rank sends chunk j to rank j; check each received chunk names its sender and us."""
    import torch
    import torch.distributed as dist

    chunk = ALLTOALL_BYTES // 4 // world
    pos = torch.arange(chunk, dtype=torch.float32) % 251  # catches reordered or shifted bytes
    # chunk for destination j carries (rank * world + j) * 1000 + position; exact in float32
    send = torch.cat([(rank * world + j) * 1000 + pos for j in range(world)]).to(device)
    recv = torch.empty_like(send)
    expected = torch.cat([(src * world + rank) * 1000 + pos for src in range(world)]).to(device)

    dist.all_to_all_single(recv, send)  # warm-up, and the correctness check
    _sync(device)
    ok = bool(torch.equal(recv, expected))

    dist.barrier()
    start = time.perf_counter()
    for _ in range(ALLTOALL_ITERS):
        dist.all_to_all_single(recv, send)
    _sync(device)
    elapsed = time.perf_counter() - start
    # bytes that actually leave this rank (its own chunk stays local)
    sent = send.numel() * 4 * (world - 1) / world * ALLTOALL_ITERS
    mb_per_s = sent / elapsed / 1e6 if world > 1 else None
    return {"alltoall_ok": ok, "alltoall_mb_per_s": mb_per_s}


def _allreduce_check(device: "torch.device", world: int) -> dict[str, Any]:
    """NCCL all-reduce of 1..world: correctness, and bus bandwidth in GB/s (nccl-tests formula)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    x = torch.full((64 * 1024 * 1024 // 4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    _sync(device)
    ok = bool((x == world * (world + 1) / 2).all().item())
    iters = 5
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    _sync(device)
    elapsed = time.perf_counter() - start
    bus_bytes = x.numel() * 4 * 2 * (world - 1) / world * iters
    return {"allreduce_ok": ok, "allreduce_bus_gb_per_s": bus_bytes / elapsed / 1e9 if world > 1 else None}


def _sync(device: "torch.device") -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_rank(device_kind: str, rank: int, local_rank: int, world: int) -> dict[str, Any]:
    """This rank's row; an exception in a check becomes the row's ``error`` instead of a crash."""
    import torch

    row: dict[str, Any] = {"rank": rank, "local_rank": local_rank, "host": socket.gethostname(),
                           "device": device_kind, "error": None}
    try:
        if device_kind == "cuda":
            row["device_count"] = torch.cuda.device_count()
            device = torch.device("cuda", local_rank)
            row["device_name"] = torch.cuda.get_device_name(device)
            row.update(_gemm_check(device, n=4096))
            row.update(_allreduce_check(device, world))
        else:
            device = torch.device("cpu")
            row["threads"] = torch.get_num_threads()
            row.update(_gemm_check(device, n=256))
        row.update(_alltoall_check(device, rank, world))
    except Exception as err:  # noqa: BLE001 - any failure is a finding, reported by rank 0
        row["error"] = f"{type(err).__name__}: {err}".splitlines()[0]
    return row


# ---------------------------------------------------------------------------------------------
# Verdict


def node_verdict(rows: list[dict[str, Any]], *, expected_ranks: int, min_gemm_gflops: float,
                 min_alltoall_mb_per_s: float, max_gemm_rel_err: float = MAX_GEMM_REL_ERR) -> dict:
    """healthy / reasons for one node; each reason names the rank and the config floor it missed."""
    reasons: list[str] = []
    if len(rows) != expected_ranks:
        reasons.append(f"{len(rows)} of {expected_ranks} ranks reported")
    for row in sorted(rows, key=lambda r: r["rank"]):
        who = f"rank {row['rank']}"
        if row.get("error"):
            reasons.append(f"{who}: check failed: {row['error']}")
            continue
        if row.get("device") == "cuda" and row.get("device_count", 0) <= row["local_rank"]:
            reasons.append(f"{who}: sees {row.get('device_count')} GPUs, needs local rank {row['local_rank']}")
        if row["gemm_max_rel_err"] > max_gemm_rel_err:
            reasons.append(f"{who}: GEMM max relative error {row['gemm_max_rel_err']:.2e} "
                           f"above {max_gemm_rel_err:.0e} (wrong results)")
        if row["gemm_gflops"] < min_gemm_gflops:
            reasons.append(f"{who}: GEMM {row['gemm_gflops']:.2f} GFLOP/s below "
                           f"cluster.selfcheck_min_gemm_gflops={min_gemm_gflops:g}")
        if not row["alltoall_ok"]:
            reasons.append(f"{who}: all-to-all delivered wrong data")
        mbps = row.get("alltoall_mb_per_s")
        if mbps is not None and mbps < min_alltoall_mb_per_s:
            reasons.append(f"{who}: all-to-all {mbps:.1f} MB/s below "
                           f"cluster.selfcheck_min_alltoall_mb_per_s={min_alltoall_mb_per_s:g}")
        if row.get("allreduce_ok") is False:
            reasons.append(f"{who}: NCCL all-reduce returned a wrong sum")
    return {"healthy": not reasons, "reasons": reasons}


# ---------------------------------------------------------------------------------------------
# The torchrun entry point (one process per rank)


def _rank_main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.fail_rank == rank:  # drill: this rank dies before any collective
        os._exit(17)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    # every collective below fails after this long instead of hanging the node check
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        row = _check_rank(args.device, rank, local_rank, world)
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            result = {
                "node": socket.gethostname(), "device": args.device, "backend": backend, "world_size": world,
                "floors": {"min_gemm_gflops": args.min_gemm_gflops,
                           "min_alltoall_mb_per_s": args.min_alltoall_mb_per_s,
                           "max_gemm_rel_err": MAX_GEMM_REL_ERR},
                "ranks": rows,
                **node_verdict(rows, expected_ranks=world, min_gemm_gflops=args.min_gemm_gflops,
                               min_alltoall_mb_per_s=args.min_alltoall_mb_per_s),
            }
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
    finally:
        dist.destroy_process_group()
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mega.cluster.selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result.json written by rank 0")
    p.add_argument("--min-gemm-gflops", type=float, required=True)
    p.add_argument("--min-alltoall-mb-per-s", type=float, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="process-group timeout")
    p.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)  # test drill
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Library side: launch the job and read its verdict


def run_selfcheck(cfg: "MegaConfig", out_dir: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                  fail_rank: int | None = None) -> dict[str, Any]:
    """Check this node with cfg.cluster.procs_per_node ranks; always returns a verdict dict.

    The dict is rank 0's result (``node``, ``ranks`` rows, ``healthy``, ``reasons``) plus
    ``exit_code``, ``elapsed_s`` and ``result_path``. A job that crashes or times out yields
    ``healthy: False`` with the reason, never an exception or a hang.
    """
    from mega.launch import torchrun

    c = cfg.cluster
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result_path = out_dir / "result.json"
    result_path.unlink(missing_ok=True)  # a stale verdict must never pass for this run's
    # collectives give up a little before the job does, so a dead peer shows as a rank error
    pg_timeout = max(10.0, min(float(c.pg_timeout_s), timeout_s - 10.0))
    args = ["--out", str(result_path), "--min-gemm-gflops", str(c.selfcheck_min_gemm_gflops),
            "--min-alltoall-mb-per-s", str(c.selfcheck_min_alltoall_mb_per_s),
            "--device", c.device, "--timeout-s", str(pg_timeout)]
    if fail_rank is not None:
        args += ["--fail-rank", str(fail_rank)]

    start = time.perf_counter()
    code = torchrun("mega.cluster.selfcheck", args, c.procs_per_node, env=dict(c.env), timeout_s=timeout_s,
                    log_path=out_dir / "selfcheck.log")
    elapsed = time.perf_counter() - start

    if code == 0 and result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        why = f"timed out after {timeout_s:g} s" if code == 124 else f"exited with code {code}"
        result = {"node": socket.gethostname(), "device": c.device, "world_size": c.procs_per_node,
                  "ranks": [], "healthy": False,
                  "reasons": [f"selfcheck job {why} without a verdict (see {out_dir / 'selfcheck.log'})"]}
    result.update(exit_code=code, elapsed_s=round(elapsed, 3), result_path=str(result_path))
    return result


def verdict_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rank (or one row for a job that died), ready for a table artifact."""
    rows = [{"node": result["node"], "rank": r["rank"], "gemm_gflops": _round(r.get("gemm_gflops")),
             "gemm_max_rel_err": _sig(r.get("gemm_max_rel_err")), "alltoall_ok": r.get("alltoall_ok"),
             "alltoall_mb_per_s": _round(r.get("alltoall_mb_per_s")), "error": r.get("error") or ""}
            for r in result["ranks"]]
    if not rows:
        rows = [{"node": result["node"], "rank": "-", "error": "; ".join(result["reasons"])}]
    return rows


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.3g}")


if __name__ == "__main__":
    sys.exit(_rank_main())
