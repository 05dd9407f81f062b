"""Health checks of every node of a job, run before training is allowed onto them.

MegaScale (NSDI'24, section 4.2) screens every node with light-weight self-checks before a job
starts, so a slow GEMM unit or a broken link is found in seconds instead of as a hang hours in.
This module is both:

* a job on every node (``python -m mega.cluster.selfcheck --out result.json ...``, one torchrun
  agent per node through the launch backend). Every rank checks its matrix unit (a float32 GEMM
  against a float64 reference, and GEMM throughput: bf16 on GPUs, float32 on CPUs) and its node's
  links (an all-to-all between the node's ranks: each rank must receive exactly what the others
  sent, and at what MB/s; on GPUs also an NCCL all-reduce). Between nodes, the inter-node
  all-to-all is run as rounds of pairwise exchanges (a round-robin schedule: every node pair once,
  disjoint pairs at the same time), local rank i of one node with local rank i of the other, so
  each node pair gets a bandwidth of its own. Rank 0 gathers everything and writes a verdict per
  node;
* ``run_selfcheck(cfg, out_dir)`` (mega/launch/node_jobs.py), which launches that job and turns any
  failure of the job itself (a dead rank, a timeout, no result file) into an unhealthy verdict.

Floors (``selfcheck_floors``) come from the cluster preset's hardware facts, so that a degraded
node fails: GEMM >= ``selfcheck.gemm_fraction`` x ``peak_tflops``; a rank's intra-node all-to-all
>= ``selfcheck.nvlink_fraction`` x one direction of ``nvlink_gb_per_s``; a node pair's exchange >=
``selfcheck.nic_fraction`` x ``node_nic_gb_per_s``. Without the facts (the CPU presets) the
absolute ``selfcheck.min_*`` apply.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mega import faults

if TYPE_CHECKING:
    import torch

    from mega.config import MegaConfig

# float32 GEMM error relative to the float64 reference, normalized by the largest output entry:
# correct hardware stays near 1e-6; silent data corruption is orders of magnitude above this.
MAX_GEMM_REL_ERR = 1e-3
# Sizes per device kind: the GEMM check's and timing's matrix sides, bytes per rank and iteration
# of the intra-node all-to-all and of an inter-node pair exchange (large enough on GPUs to measure
# bandwidth rather than latency, small on CPUs where ranks share a few cores).
SIZES = {
    "cpu": {"gemm_check_n": 256, "gemm_time_n": 256, "alltoall_bytes": 4 << 20, "pair_bytes": 1 << 20},
    "cuda": {"gemm_check_n": 1024, "gemm_time_n": 8192, "alltoall_bytes": 256 << 20, "pair_bytes": 64 << 20},
}
ALLTOALL_ITERS = 5
PAIR_ITERS = 3
MAX_PAIR_ROUNDS = 16  # beyond 17 nodes each node is paired with 16 others, not all of them
DEFAULT_TIMEOUT_S = 180.0  # the whole job; a node that needs longer than this is not healthy


# ---------------------------------------------------------------------------------------------
# Floors


def selfcheck_floors(cfg: MegaConfig) -> dict[str, Any]:
    """The floors of ``cfg.selfcheck`` on ``cfg.cluster``'s hardware and, for each, what it was
    derived from (named in every verdict)."""
    c, sc = cfg.cluster, cfg.selfcheck
    nvlink_one_way = c.nvlink_gb_per_s and c.nvlink_gb_per_s / 2 * 1e3  # the datasheet counts both directions
    checks = [  # floor, tag, fraction key, hardware figure in the floor's unit (None: unknown), as read
        (
            "min_gemm_gflops",
            "gemm",
            "gemm_fraction",
            c.peak_tflops and c.peak_tflops * 1e3,
            f"cluster.peak_tflops={c.peak_tflops}",
        ),
        (
            "min_alltoall_mb_per_s",
            "alltoall",
            "nvlink_fraction",
            nvlink_one_way,
            f"cluster.nvlink_gb_per_s={c.nvlink_gb_per_s}/2",
        ),
        (
            "min_inter_node_mb_per_s",
            "inter_node",
            "nic_fraction",
            c.node_nic_gb_per_s and c.node_nic_gb_per_s * 1e3,
            f"{c.nics_per_node} x cluster.nic_gbit_per_s={c.nic_gbit_per_s}/8",
        ),
    ]
    floors: dict[str, Any] = {"max_gemm_rel_err": MAX_GEMM_REL_ERR}
    for floor, tag, fraction_key, figure, figure_text in checks:
        if figure:
            fraction = getattr(sc, fraction_key)
            floors[floor], floors[f"{tag}_from"] = (
                fraction * figure,
                f"selfcheck.{fraction_key}={fraction:g} x {figure_text}",
            )
        else:  # the absolute floor has the floor's own name
            value = getattr(sc, floor)
            floors[floor], floors[f"{tag}_from"] = value, f"selfcheck.{floor}={value:g}"
    return floors


# ---------------------------------------------------------------------------------------------
# Checks run on every rank


def _gemm_check(
    device: torch.device, check_n: int, time_n: int, time_dtype: torch.dtype, min_time_s: float = 0.25
) -> dict[str, Any]:
    """Max relative error of a float32 matmul vs float64, and GEMM throughput in ``time_dtype``:
    the best rate over windows of 4 GEMMs within ``min_time_s`` (``gemm_gflops``; the mean over the
    whole time is ``gemm_gflops_mean``). A device that is really slow (throttled, degraded) is slow
    in every window; a process the OS preempted for a while on a busy host is not (seen: a healthy
    CPU node measured 0.38 GFLOP/s on average under a loaded test run, against 4.8 on its peer).
    On a CPU a window is timed in CPU seconds: on a host shared by dozens of busy processes no
    window runs unpreempted (seen: 0.29-0.37 GFLOP/s per wall second at load 50-67). It is one
    thread's GEMM timed by that thread's clock: with several threads, one that waits at torch's
    parallel barrier for a descheduled peer spins and bills CPU time for no work (seen: 2.5 against
    217 GFLOP/s per process CPU second under a loaded test run), so the rate is per core."""
    import torch

    gen = torch.Generator().manual_seed(1234)  # same matrices on every rank: comparable rows
    a64 = torch.randn(check_n, check_n, dtype=torch.float64, generator=gen).to(device)
    b64 = torch.randn(check_n, check_n, dtype=torch.float64, generator=gen).to(device)

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # check float32, not TF32 rounding
    try:
        ref = a64 @ b64
        out = (a64.float() @ b64.float()).double()
        rel_err = ((out - ref).abs().max() / ref.abs().max()).item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32

    a = torch.randn(time_n, time_n, generator=gen).to(device=device, dtype=time_dtype)
    b = torch.randn(time_n, time_n, generator=gen).to(device=device, dtype=time_dtype)
    on_cpu = device.type == "cpu"
    threads = torch.get_num_threads()
    if on_cpu:
        torch.set_num_threads(1)
    try:
        a @ b  # warm-up (kernel selection, clocks)
        _sync(device)
        flop = 2 * time_n**3
        clock = time.thread_time if on_cpu else time.perf_counter
        reps, best, start = 0, 0.0, time.perf_counter()
        window = clock()
        while True:  # repeat until the timing is long enough to trust
            a @ b
            reps += 1
            if reps % 4 == 0:
                _sync(device)
                now, ticks = time.perf_counter(), clock()
                best = max(best, 4 * flop / max(ticks - window, 1e-9))
                window, elapsed = ticks, now - start
                if elapsed >= min_time_s:
                    break
    finally:
        torch.set_num_threads(threads)
    return {
        "gemm_max_rel_err": rel_err,
        "gemm_gflops": best / 1e9,
        "gemm_gflops_mean": flop * reps / elapsed / 1e9,
        "gemm_dtype": str(time_dtype).removeprefix("torch."),
    }


def _pattern(tag: int, n: int) -> torch.Tensor:
    """n int32 values that identify ``tag`` and each position (catches swapped, shifted, stale data)."""
    import torch

    pos = torch.arange(n, dtype=torch.int64)
    return ((tag * 1_000_003 + pos * 7919) % 2_147_483_647).to(torch.int32)


def _alltoall_check(device: torch.device, nbytes: int, group=None) -> dict[str, Any]:
    """All-to-all among ``group`` (the node's ranks): every rank sends chunk j to member j; each
    received chunk must name its sender and us."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunk = nbytes // 4 // world
    send = torch.cat([_pattern(rank * world + j, chunk) for j in range(world)]).to(device)
    expected = torch.cat([_pattern(src * world + rank, chunk) for src in range(world)]).to(device)
    recv = torch.empty_like(send)

    dist.all_to_all_single(recv, send, group=group)  # warm-up, and the correctness check
    _sync(device)
    ok = bool(torch.equal(recv, expected))

    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(ALLTOALL_ITERS):
        dist.all_to_all_single(recv, send, group=group)
    _sync(device)
    elapsed = time.perf_counter() - start
    # bytes that actually leave this rank (its own chunk stays local)
    sent = send.numel() * 4 * (world - 1) / world * ALLTOALL_ITERS
    return {"alltoall_ok": ok, "alltoall_mb_per_s": sent / elapsed / 1e6 if world > 1 else None}


def _allreduce_check(device: torch.device, world: int) -> dict[str, Any]:
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


def pair_rounds(nodes: int, max_rounds: int = MAX_PAIR_ROUNDS) -> list[list[tuple[int, int]]]:
    """Round-robin schedule (circle method): every node pair exactly once over nodes-1 rounds
    (nodes rounds when odd; one node sits each out), the pairs of a round disjoint."""
    if nodes < 2:
        return []
    ids: list[int | None] = list(range(nodes)) + ([None] if nodes % 2 else [])
    m = len(ids)
    rounds = []
    for _ in range(min(m - 1, max_rounds)):
        pairs = [(ids[i], ids[m - 1 - i]) for i in range(m // 2)]
        rounds.append(sorted((min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None))
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return rounds


def exchange_ops(send: torch.Tensor, recv: torch.Tensor, peer: int) -> list:
    """The pair exchange's send and receive, posted together (``batch_isend_irecv``): NCCL runs
    a send and a receive to one peer, posted one after the other, on one stream, where each waits
    for the other side's; batched they are one group call."""
    import torch.distributed as dist

    return [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]


def _pair_checks(
    device: torch.device, node: int, nodes: int, procs: int, local_rank: int, nbytes: int
) -> list[dict[str, Any]]:
    """This rank's part of every round: exchange with the same local rank of the partner node."""
    import torch
    import torch.distributed as dist

    rows = []
    for i, pairs in enumerate(pair_rounds(nodes)):
        dist.barrier()  # rounds never overlap
        partner = next((b if a == node else a for a, b in pairs if node in (a, b)), None)
        if partner is None:
            continue
        peer = partner * procs + local_rank
        n = nbytes // 4
        send = _pattern(node * nodes + partner, n).to(device)
        expected = _pattern(partner * nodes + node, n).to(device)
        recv = torch.empty_like(send)

        def exchange() -> None:
            for req in dist.batch_isend_irecv(exchange_ops(send, recv, peer)):
                req.wait()

        row: dict[str, Any] = {"round": i, "node": node, "partner": partner, "local_rank": local_rank}
        try:
            exchange()  # warm-up (connections), and the correctness check
            _sync(device)
            row["ok"] = bool(torch.equal(recv, expected))
            start = time.perf_counter()
            for _ in range(PAIR_ITERS):
                exchange()
            _sync(device)
            row.update(bytes=n * 4 * PAIR_ITERS, elapsed_s=time.perf_counter() - start, error=None)
        except Exception as err:
            row.update(
                ok=False, bytes=0, elapsed_s=None, error=f"{type(err).__name__}: {err}".splitlines()[0]
            )
        rows.append(row)
    return rows


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_rank(device_kind: str, rank: int, local_rank: int, world: int, intra_group=None) -> dict[str, Any]:
    """This rank's row; an exception in a check becomes the row's ``error`` instead of a crash."""
    import torch

    from mega.cluster import node

    sizes = SIZES[device_kind]
    row: dict[str, Any] = {
        "rank": rank,
        "node": node.node_rank(),
        "local_rank": local_rank,
        "host": socket.gethostname(),
        "address": node.address(),
        "device": device_kind,
        "error": None,
    }
    try:
        if device_kind == "cuda":
            row["device_count"] = torch.cuda.device_count()
            device = torch.device("cuda", local_rank)
            row["device_name"] = torch.cuda.get_device_name(device)
            row.update(_gemm_check(device, sizes["gemm_check_n"], sizes["gemm_time_n"], torch.bfloat16))
            row.update(_allreduce_check(device, world))
        else:
            device = torch.device("cpu")
            row["threads"] = torch.get_num_threads()
            row.update(_gemm_check(device, sizes["gemm_check_n"], sizes["gemm_time_n"], torch.float32))
        row.update(_alltoall_check(device, sizes["alltoall_bytes"], intra_group))
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}".splitlines()[0]
    return row


# ---------------------------------------------------------------------------------------------
# Verdict


def node_verdict(rows: list[dict[str, Any]], *, expected_ranks: int, floors: dict[str, Any]) -> dict:
    """healthy / reasons for one node's ranks; each reason names the rank (its local rank: the
    device on the node, which the check job and the training job share) and the floor it missed
    (with the config keys the floor came from)."""
    reasons: list[str] = []
    if len(rows) != expected_ranks:
        reasons.append(f"{len(rows)} of {expected_ranks} ranks reported")
    for row in sorted(rows, key=lambda r: r["rank"]):
        who = f"local rank {row['local_rank']}" if "local_rank" in row else f"rank {row['rank']}"
        if row.get("error"):
            reasons.append(f"{who}: check failed: {row['error']}")
            continue
        if row.get("device") == "cuda" and row.get("device_count", 0) <= row["local_rank"]:
            reasons.append(
                f"{who}: sees {row.get('device_count')} GPUs, needs local rank {row['local_rank']}"
            )
        if row["gemm_max_rel_err"] > floors["max_gemm_rel_err"]:
            reasons.append(
                f"{who}: GEMM max relative error {row['gemm_max_rel_err']:.2e} "
                f"above {floors['max_gemm_rel_err']:.0e} (wrong results)"
            )
        if row["gemm_gflops"] < floors["min_gemm_gflops"]:
            reasons.append(
                f"{who}: {row.get('gemm_dtype', '')} GEMM {row['gemm_gflops']:.2f} GFLOP/s below "
                f"{floors['min_gemm_gflops']:.4g} ({floors['gemm_from']})"
            )
        if not row["alltoall_ok"]:
            reasons.append(f"{who}: all-to-all delivered wrong data")
        mbps = row.get("alltoall_mb_per_s")
        if mbps is not None and mbps < floors["min_alltoall_mb_per_s"]:
            reasons.append(
                f"{who}: all-to-all {mbps:.1f} MB/s below {floors['min_alltoall_mb_per_s']:.4g} "
                f"({floors['alltoall_from']})"
            )
        if row.get("allreduce_ok") is False:
            reasons.append(f"{who}: NCCL all-reduce returned a wrong sum")
    return {"healthy": not reasons, "reasons": reasons}


def pair_bandwidths(pair_rows: list[dict[str, Any]], floors: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per node pair from the ranks' exchange rows: MB/s each way (bytes one node's ranks
    sent, over the slowest rank's time), data correct, and whether it meets the floor."""
    by_pair: dict[tuple[int, int], list[dict]] = {}
    for r in pair_rows:
        by_pair.setdefault((min(r["node"], r["partner"]), max(r["node"], r["partner"])), []).append(r)
    out = []
    for (a, b), rows in sorted(by_pair.items()):
        errors = sorted({r["error"] for r in rows if r.get("error")})
        times = [r["elapsed_s"] for r in rows if r.get("elapsed_s")]
        sent = sum(r["bytes"] for r in rows if r["node"] == a)
        mbps = sent / max(times) / 1e6 if times and not errors else None
        ok = all(r["ok"] for r in rows) and not errors
        out.append(
            {
                "nodes": [a, b],
                "mb_per_s": mbps,
                "data_ok": ok,
                "errors": errors,
                "healthy": ok and mbps is not None and mbps >= floors["min_inter_node_mb_per_s"],
            }
        )
    return out


LINK_REASON = re.compile(r"link to node (\d+)")


def on_physical_nodes(reasons: list[str], nodes: list[int]) -> list[str]:
    """A check job's reasons with its node indices (``link to node j``) named as the physical
    nodes the job ran on (``nodes[j]``), the numbering the driver's membership and log use."""
    return [LINK_REASON.sub(lambda m: f"link to node {nodes[int(m[1])]}", r) for r in reasons]


def cluster_verdict(
    rows: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    *,
    nodes: int,
    procs_per_node: int,
    floors: dict[str, Any],
) -> dict[str, Any]:
    """A verdict per node: its ranks' checks, and its links. A bad pair is blamed on the node with
    more bad pairs (the common end of a node's slow links); a tie blames both (two nodes alone
    cannot tell whose link is slow)."""
    bad = [p for p in pairs if not p["healthy"]]
    count = {k: sum(k in p["nodes"] for p in bad) for k in range(nodes)}
    table = []
    for k in range(nodes):
        mine = [r for r in rows if r.get("node", 0) == k]
        verdict = node_verdict(mine, expected_ranks=procs_per_node, floors=floors)
        for p in bad:
            if k in p["nodes"]:
                other = p["nodes"][1] if p["nodes"][0] == k else p["nodes"][0]
                if count[k] >= count[other]:
                    what = (
                        f"{p['mb_per_s']:.1f} MB/s below {floors['min_inter_node_mb_per_s']:.4g} "
                        f"({floors['inter_node_from']})"
                        if p["data_ok"] and p["mb_per_s"] is not None
                        else "; ".join(p["errors"]) or "wrong data"
                    )
                    verdict["reasons"].append(f"link to node {other}: {what}")
        verdict["healthy"] = not verdict["reasons"]
        first = mine[0] if mine else {}
        table.append({"node": k, "host": first.get("host"), "address": first.get("address"), **verdict})
    return {
        "healthy": all(n["healthy"] for n in table),
        "reasons": [f"node {n['node']}: {r}" for n in table for r in n["reasons"]],
        "nodes": table,
        "pairs": pairs,
    }


# ---------------------------------------------------------------------------------------------
# The torchrun entry point (one process per rank, every node)


def _rank_main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch
    import torch.distributed as dist

    from mega.cluster import node

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, procs = node.local_rank(), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // procs
    faults.at_selfcheck_start(rank)  # a drill's rank dies here
    floors = json.loads(args.floors)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    # every collective below fails after this long instead of hanging the check
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        intra = (
            dist.new_subgroups(group_size=procs)[0] if nodes > 1 else None
        )  # ranks are laid out node by node
        row = _check_rank(args.device, rank, local_rank, world, intra)
        faults.selfcheck_gemm(row, node.node_rank())  # a drill's node: its matrix unit is broken
        device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
        pair_rows = (
            _pair_checks(device, node.node_rank(), nodes, procs, local_rank, SIZES[args.device]["pair_bytes"])
            if nodes > 1
            else []
        )
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (row, pair_rows))
        if rank == 0:
            rows = [g[0] for g in gathered]
            pairs = pair_bandwidths([p for g in gathered for p in g[1]], floors)
            result = {
                "node": socket.gethostname(),
                "device": args.device,
                "backend": backend,
                "world_size": world,
                "nodes_count": nodes,
                "procs_per_node": procs,
                "floors": floors,
                "ranks": rows,
                **cluster_verdict(rows, pairs, nodes=nodes, procs_per_node=procs, floors=floors),
            }
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
    finally:
        dist.destroy_process_group()
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mega.cluster.selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result.json written by rank 0")
    p.add_argument("--floors", required=True, help="JSON of selfcheck_floors(cfg)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="process-group timeout")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Library side: launch the job on every node and read its verdict


def verdict_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rank (or one row for a job that died), ready for a table artifact."""
    rows = [
        {
            "node": r.get("node", 0),
            "host": r.get("host"),
            "rank": r["rank"],
            "gemm_gflops": _round(r.get("gemm_gflops")),
            "gemm_dtype": r.get("gemm_dtype"),
            "gemm_max_rel_err": _sig(r.get("gemm_max_rel_err")),
            "alltoall_ok": r.get("alltoall_ok"),
            "alltoall_mb_per_s": _round(r.get("alltoall_mb_per_s")),
            "error": r.get("error") or "",
        }
        for r in result["ranks"]
    ]
    if not rows:
        rows = [{"node": "-", "host": result["node"], "rank": "-", "error": "; ".join(result["reasons"])}]
    return rows


def pair_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per node pair of the inter-node exchange (empty for one node)."""
    return [
        {
            "nodes": f"{p['nodes'][0]}-{p['nodes'][1]}",
            "mb_per_s": _round(p["mb_per_s"]),
            "data_ok": p["data_ok"],
            "healthy": p["healthy"],
            "error": "; ".join(p["errors"]),
        }
        for p in result.get("pairs", [])
    ]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.3g}")


if __name__ == "__main__":
    sys.exit(_rank_main())
