"""``python -m mega.bench bootstrap --ranks 256,1024,2048,4096,12288 [--max-seconds S] [--out DIR]``
Start-up store traffic at scale: megatron-core's group creation for N simulated ranks, replayed
against a real server by ``mega.cluster.bootstrap_sim`` (one client connection per rank).

Rows (``strategy``):

* ``default-tcpstore``: megatron's pattern (every rank calls ``new_group`` for every group, a
  world-wide store barrier after each) on torch's TCPStore server
* ``default-redis``: the same on Redis (``mega.store.RedisStore``'s commands)
* ``light-redis``: barrier-light creation (``mega.cluster.parallel_groups`` ``light``: each group by its
  members only, no barrier per group, one world barrier once all exist) on Redis

Layout: TP=8 x PP=8 x DP=N/64 (``conf/parallelism/paper-175b-256gpu.yaml``'s TP and PP), NCCL
main groups, no gloo copies, ``TORCH_DIST_INIT_BARRIER=1`` (see docs/bootstrap.md for why).
A point that runs past ``--max-seconds`` is ``completed=false, seconds=null`` and larger N are
not attempted for that strategy; ``store_ops`` is always the planned number of operations.
``--probe-ranks`` (64,128) are run first for every strategy so that a growth exponent (time ~ N^k,
least squares on log-log over the completed points) exists even when the first requested N is
already too slow. Last line: ``{"results": [{"strategy", "ranks", "seconds", "store_ops",
"completed", ...}], "probes": [...], "growth": {...}, "targets": {...}, "plot", ...}``; the PNG
(time vs N, log-log) goes to ``DIR/bootstrap_time_vs_ranks.png``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

from mega.bench import common

STRATEGIES = {  # row name -> (group-creation strategy, store)
    "default-tcpstore": ("default", "tcpstore"),
    "default-redis": ("default", "redis"),
    "light-redis": ("light", "redis"),
}
TP, PP = 8, 8
DEFAULT_RANKS = (256, 1024, 2048, 4096, 12288)
DEFAULT_PROBES = (64, 128)
DEFAULT_MAX_SECONDS = 60.0
TARGETS = {"light_redis_s_at_2048": 5.0, "light_redis_s_at_12288": 30.0, "speedup_vs_default_tcpstore_at_2048": 100.0}


def layout_for(ranks: int, tp: int = TP, pp: int = PP):
    from mega.cluster.bootstrap_sim import Layout

    if ranks % (tp * pp):
        raise ValueError(f"--ranks: {ranks} is not a multiple of tp*pp={tp * pp}")
    return Layout(ranks, tp, pp, backend="nccl", gloo_groups=False, barrier=True)


def growth(points: list[tuple[int, float]]) -> float | None:
    """k of time ~ N^k: least squares on (log N, log t); None with fewer than two distinct N."""
    pts = [(math.log(n), math.log(t)) for n, t in points if t > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def extrapolate(points: list[tuple[int, float]], k: float | None, n: int) -> float | None:
    if k is None or not points:
        return None
    n0, t0 = max(points)  # from the largest completed point
    return t0 * (n / n0) ** k


def _run_point(name: str, ranks: int, max_seconds: float, workers: int, tp: int, pp: int) -> dict[str, Any]:
    from mega.cluster.bootstrap_sim import plan_counts, simulate
    from mega.store import RedisServer

    strategy, store = STRATEGIES[name]
    lay = layout_for(ranks, tp, pp)
    load = os.getloadavg()[0]
    if store == "redis":
        # one connection per rank, plus the XREAD waiters' (the same connections here)
        with RedisServer(maxclients=max(10_000, ranks + 256)) as server:
            res = simulate(strategy, store, lay, max_seconds=max_seconds, workers=workers, redis_url=server.url)
    else:
        res = simulate(strategy, store, lay, max_seconds=max_seconds, workers=workers)
    row = {"strategy": name, "ranks": ranks, "seconds": res.seconds, "store_ops": res.store_ops,
           "completed": res.completed, "ops_done": res.ops_done, "ops_by_kind": res.ops_by_kind,
           "connect_s": res.connect_s,
           "client_cpu_s": res.client_cpu_s, "server_cpu_s": res.server_cpu_s,
           "load_avg_1m": round(load, 1)}
    if res.completed:
        row["planned_by_kind"] = plan_counts(strategy, lay)
    if res.error:
        row["error"] = res.error
    return row


def _skipped(name: str, ranks: int, tp: int, pp: int) -> dict[str, Any]:
    from mega.cluster.bootstrap_sim import plan_counts

    strategy, _ = STRATEGIES[name]
    planned = sum(plan_counts(strategy, layout_for(ranks, tp, pp)).values())
    return {"strategy": name, "ranks": ranks, "seconds": None, "store_ops": planned,
            "completed": False, "attempted": False}


def plot(rows: list[dict], fits: dict, png_path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes or CI
    import matplotlib.pyplot as plt

    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    try:
        for name in STRATEGIES:
            pts = sorted((r["ranks"], r["seconds"]) for r in rows if r["strategy"] == name and r["completed"])
            if not pts:
                continue
            k = fits.get(name, {}).get("exponent")
            label = f"{name} (~N^{k:.2f})" if k is not None else name
            line, = ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", label=label)
            asked = sorted({r["ranks"] for r in rows if r["strategy"] == name and not r["completed"]})
            if k is not None and asked:
                xs = [pts[-1][0], *asked]
                ax.plot(xs, [extrapolate(pts, k, n) for n in xs], ls="--", color=line.get_color(), lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated ranks N")
        ax.set_ylabel("group creation wall time (s)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png_path, format="png")
    finally:
        plt.close(fig)
    return png_path


def bench_bootstrap(ranks: list[int] | None = None, probe_ranks: list[int] | None = None,
                    max_seconds: float = DEFAULT_MAX_SECONDS, out_dir: str | Path = "runs/bench-bootstrap",
                    workers: int = 2, strategies: list[str] | None = None, tp: int = TP,
                    pp: int = PP) -> dict[str, Any]:
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    ranks = sorted(ranks or DEFAULT_RANKS)
    probe_ranks = sorted(n for n in (DEFAULT_PROBES if probe_ranks is None else probe_ranks) if n not in ranks)
    names = strategies or list(STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"--strategies: unknown {unknown}, expected some of {list(STRATEGIES)}")
    for n in [*ranks, *probe_ranks]:
        layout_for(n, tp, pp)  # refuse a bad N before anything runs

    results: list[dict] = []
    probes: list[dict] = []
    for name in names:
        failed = False
        for n in [*probe_ranks, *ranks]:
            if failed:
                row = _skipped(name, n, tp, pp)
            else:
                console.print(f"[bold]{name}[/] N={n:,}: replaying ...", highlight=False)
                row = _run_point(name, n, max_seconds, workers, tp, pp)
                failed = not row["completed"]
                took = f"{row['seconds']:.2f} s" if row["completed"] else f"not finished within {max_seconds:g} s"
                console.print(f"  {name} N={n:,}: {took}, {row['store_ops']:,} store ops planned, "
                              f"{row['ops_done']:,} issued, load {row['load_avg_1m']}", highlight=False)
            (probes if n in probe_ranks else results).append(row)

    fits: dict[str, Any] = {}
    for name in names:
        rows = [r for r in [*probes, *results] if r["strategy"] == name]
        pts = sorted((r["ranks"], r["seconds"]) for r in rows if r["completed"])
        k = growth(pts)
        k_ops = growth(sorted((r["ranks"], r["store_ops"]) for r in rows))  # the plan is exact for every N
        todo = [r for r in results if r["strategy"] == name and not r["completed"]]
        fit = {"exponent": None if k is None else round(k, 3),
               "ops_exponent": None if k_ops is None else round(k_ops, 3),
               "points": len(pts), "largest_completed": pts[-1][0] if pts else None,
               "extrapolated_s": {str(r["ranks"]): round(extrapolate(pts, k, r["ranks"]), 2)
                                  for r in todo if k is not None}}
        if pts:  # at the largest completed point's seconds per planned operation
            n0, t0 = pts[-1]
            ops0 = next(r["store_ops"] for r in rows if r["ranks"] == n0)
            fit["extrapolated_by_ops_s"] = {str(r["ranks"]): round(t0 * r["store_ops"] / ops0, 1) for r in todo}
        fits[name] = fit

    out_dir = Path(out_dir)
    title = f"bootstrap store traffic: TP={tp} x PP={pp} x DP=N/{tp * pp}, {common_device()}"
    png = plot([*probes, *results], fits, out_dir / "bootstrap_time_vs_ranks.png", title).resolve()
    console.print(f"plot: {png}", highlight=False)
    result = {
        "results": results,
        "probes": probes,
        "growth": fits,
        "targets": _targets(results, fits),
        "layout": {"tp": tp, "pp": pp, "dp": f"N/{tp * pp}", "main_backend": "nccl (modelled)", "gloo_groups": False,
                   "torch_dist_init_barrier": True, "megatron_core": "0.16.1", "torch": _torch_version()},
        "max_seconds": max_seconds,
        "client_workers": workers,
        "plot": str(png),
        "device": common_device(),
    }
    (out_dir / "bootstrap.json").write_text(json.dumps(result, indent=1))
    return result


def _targets(results: list[dict], fits: dict) -> dict[str, Any]:
    def seconds(name: str, n: int) -> tuple[float | None, str]:
        for r in results:
            if r["strategy"] == name and r["ranks"] == n:
                if r["completed"]:
                    return r["seconds"], "measured"
                fit = fits.get(name, {})
                if str(n) in fit.get("extrapolated_s", {}):
                    return fit["extrapolated_s"][str(n)], "extrapolated (time ~ N^k)"
                if str(n) in fit.get("extrapolated_by_ops_s", {}):
                    return fit["extrapolated_by_ops_s"][str(n)], "extrapolated (seconds per planned op)"
                return None, "unknown"
        return None, "not run"

    light_2k, how_l2 = seconds("light-redis", 2048)
    light_12k, how_l12 = seconds("light-redis", 12288)
    default_2k, how_d2 = seconds("default-tcpstore", 2048)
    speedup = default_2k / light_2k if default_2k and light_2k else None
    return {
        "light_redis_s_at_2048": {"value": light_2k, "how": how_l2, "target": TARGETS["light_redis_s_at_2048"],
                                  "met": how_l2 == "measured" and light_2k < TARGETS["light_redis_s_at_2048"]},
        "light_redis_s_at_12288": {"value": light_12k, "how": how_l12, "target": TARGETS["light_redis_s_at_12288"],
                                   "met": how_l12 == "measured" and light_12k < TARGETS["light_redis_s_at_12288"]},
        "speedup_vs_default_tcpstore_at_2048": {
            "value": None if speedup is None else round(speedup, 1), "how": f"default {how_d2}, light {how_l2}",
            "target": TARGETS["speedup_vs_default_tcpstore_at_2048"],
            "met": speedup is not None and speedup >= TARGETS["speedup_vs_default_tcpstore_at_2048"]},
    }


def common_device() -> str:
    return f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()}"


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":  # convenience: python -m mega.bench.bootstrap
    start = time.perf_counter()
    print(json.dumps(bench_bootstrap()))
    common.log(f"took {time.perf_counter() - start:.0f} s")
