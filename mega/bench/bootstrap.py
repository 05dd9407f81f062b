"""``python -m mega.bench bootstrap --ranks 256,1024,2048,4096,12288 [--max-seconds S] [--real LAYOUTS] [--out DIR]``
Start-up of megatron-core's group creation, two ways, side by side in one run:

* **real ranks** (``real``): the flow's own timing job (``mega.launch.node_jobs.time_process_groups``)
  for each ``--real`` layout (default ``tp2-pp2-dp2``: 8 gloo processes on this machine), with
  ``cluster.group_init`` light and default on torchrun's TCPStore, ``--real-repeats`` (3) times
  each (the median counts); start-up broken down by phase
  (process start, imports, import skew, default group, group creation's store / connection /
  megatron / barrier parts). Measured end to end: ``measured: true`` when the job completed.
* **simulated ranks** (``results``): the store traffic of N ranks, replayed against a real server
  by ``mega.cluster.bootstrap_sim`` (one client connection per rank; process start, imports and
  gloo/NCCL connections themselves are not modelled, docs/bootstrap.md).

Rows of ``results`` (``strategy``; ``ROWS``):

* ``torch-default-tcpstore`` (**the baseline**): megatron-core unchanged with torch 2.13's defaults:
  every rank calls ``new_group`` for every group, no barrier after each (``TORCH_DIST_INIT_BARRIER``
  unset), torch's TCPStore
* ``per-group-barrier-tcpstore``: the pattern MegaScale measured (torch < 2.1's default, or
  ``TORCH_DIST_INIT_BARRIER=1`` today): a world-wide store barrier after every group, TCPStore
* ``per-group-barrier-redis``: the same on Redis (``mega.store.RedisStore``'s commands)
* ``light-redis``: barrier-light creation (``mega.cluster.parallel_groups`` ``light``: each group by
  its members only) on Redis under torch's defaults: what mega runs with ``store.kind=redis``
* ``light-barrier-redis``: ``light`` with ``TORCH_DIST_INIT_BARRIER=1``: no barrier per group, one
  world barrier once all exist

Layout: TP=8 x PP=8 x DP=N/64 (``conf/parallelism/paper-175b-256gpu.yaml``'s TP and PP), NCCL
main groups, no gloo copies. Every row carries ``measured``: true only for a point that completed
(a replay that ran past ``--max-seconds`` is ``measured: false, seconds: null``, and larger N are
not attempted for that row); ``store_ops`` is always the planned number of operations.
``--probe-ranks`` (64,128) are run first for every row so that a growth exponent (time ~ N^k, least
squares on log-log over the completed points) exists even when the first requested N is already
too slow; extrapolations from it are in ``growth`` only, labelled, and never count as measured.
Speed-ups (``speedups``) are ratios of measured rows at the same N only. Last line:
``{"results": [{"strategy", "ranks", "seconds", "store_ops", "measured", "completed", ...}],
"probes": [...], "real": [...], "growth": {...}, "speedups": [...], "targets": {...}, "plot", ...}``;
the PNG (time vs N, log-log) goes to ``DIR/bootstrap_time_vs_ranks.png``.
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

# row name -> (group-creation strategy, store, TORCH_DIST_INIT_BARRIER); the first is the baseline
ROWS = {
    "torch-default-tcpstore": ("default", "tcpstore", False),
    "per-group-barrier-tcpstore": ("default", "tcpstore", True),
    "per-group-barrier-redis": ("default", "redis", True),
    "light-redis": ("light", "redis", False),
    "light-barrier-redis": ("light", "redis", True),
}
BASELINE = "torch-default-tcpstore"
PER_GROUP_BARRIER = "per-group-barrier-tcpstore"
TP, PP = 8, 8
DEFAULT_RANKS = (256, 1024, 2048, 4096, 12288)
DEFAULT_PROBES = (64, 128)
DEFAULT_MAX_SECONDS = 60.0
DEFAULT_REAL_LAYOUTS = ("tp2-pp2-dp2",)
REAL_GROUP_INITS = ("light", "default")
TARGETS = {
    "light_redis_s_at_2048": 5.0,
    "light_redis_s_at_12288": 30.0,
    "speedup_vs_per_group_barrier_at_2048": 100.0,
    "real_group_creation_s": 3.0,
}


def layout_for(ranks: int, tp: int = TP, pp: int = PP, barrier: bool = True):
    from mega.cluster.bootstrap_sim import Layout

    if ranks % (tp * pp):
        raise ValueError(f"--ranks: {ranks} is not a multiple of tp*pp={tp * pp}")
    return Layout(ranks, tp, pp, backend="nccl", gloo_groups=False, barrier=barrier)


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

    strategy, store, barrier = ROWS[name]
    lay = layout_for(ranks, tp, pp, barrier)
    load = os.getloadavg()[0]
    if store == "redis":
        # one connection per rank, plus the XREAD waiters' (the same connections here)
        with RedisServer(maxclients=max(10_000, ranks + 256)) as server:
            res = simulate(
                strategy, store, lay, max_seconds=max_seconds, workers=workers, redis_url=server.url
            )
    else:
        res = simulate(strategy, store, lay, max_seconds=max_seconds, workers=workers)
    row = {
        "strategy": name,
        "ranks": ranks,
        "seconds": res.seconds,
        "store_ops": res.store_ops,
        "measured": res.completed,
        "completed": res.completed,
        "torch_dist_init_barrier": barrier,
        "group_init": strategy,
        "store": store,
        "ops_done": res.ops_done,
        "ops_by_kind": res.ops_by_kind,
        "connect_s": res.connect_s,
        "client_cpu_s": res.client_cpu_s,
        "server_cpu_s": res.server_cpu_s,
        "load_avg_1m": round(load, 1),
    }
    if res.completed:
        row["planned_by_kind"] = plan_counts(strategy, lay)
    if res.error:
        row["error"] = res.error
    return row


def _skipped(name: str, ranks: int, tp: int, pp: int) -> dict[str, Any]:
    from mega.cluster.bootstrap_sim import plan_counts

    strategy, store, barrier = ROWS[name]
    planned = sum(plan_counts(strategy, layout_for(ranks, tp, pp, barrier)).values())
    return {
        "strategy": name,
        "ranks": ranks,
        "seconds": None,
        "store_ops": planned,
        "measured": False,
        "completed": False,
        "attempted": False,
        "torch_dist_init_barrier": barrier,
        "group_init": strategy,
        "store": store,
    }


def plot(rows: list[dict], fits: dict, png_path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes or CI
    import matplotlib.pyplot as plt

    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    try:
        for name in ROWS:
            pts = sorted((r["ranks"], r["seconds"]) for r in rows if r["strategy"] == name and r["completed"])
            if not pts:
                continue
            k = fits.get(name, {}).get("exponent")
            label = f"{name} (~N^{k:.2f})" if k is not None else name
            (line,) = ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", label=label)
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


def run_real(
    layout: str, group_init: str, out_dir: Path, overrides: list[str] | None = None, repeats: int = 1
) -> dict[str, Any]:
    """The flow's process-group timing job for a ``conf/parallelism`` layout on this machine (one
    torchrun process per rank, torchrun's TCPStore), ``repeats`` times, as a row: ``seconds`` is
    megatron-core's group creation (max over ranks, imports excluded; the median over the repeats,
    each in ``seconds_per_repeat``), ``phases`` the start-up of the median repeat's slowest rank."""
    from mega.config import compose
    from mega.launch.node_jobs import time_process_groups

    cfg = compose(
        [
            f"parallelism={layout}",
            f"cluster.group_init={group_init}",
            *(overrides or []),
            f"train.run_dir={out_dir}",
        ]
    )
    row: dict[str, Any] = {
        "strategy": f"real-{group_init}-tcpstore",
        "layout": layout,
        "ranks": cfg.parallelism.world_size,
        "group_init": group_init,
        "store": cfg.store.kind,
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }
    runs = []
    for i in range(repeats):
        try:
            runs.append(time_process_groups(cfg, out_dir / f"repeat-{i}"))
        except RuntimeError as err:  # the job failed or timed out: reported, not measured
            return {**row, "seconds": None, "measured": False, "completed": False, "error": str(err)}
    runs.sort(key=lambda r: r["model_parallel_init_s"])
    res = runs[(len(runs) - 1) // 2]  # the median (the lower one of an even count)
    slowest = max(res["ranks"], key=lambda r: r["model_parallel_init_s"])
    return {
        **row,
        "seconds": res["model_parallel_init_s"],
        "measured": True,
        "completed": True,
        "seconds_per_repeat": [r["model_parallel_init_s"] for r in runs],
        "pg_init_s": res["pg_init_s"],
        "phases": res["phases"],
        "phases_max": res["phases_max"],
        "job_s": res["job_s"],
        "exit_s": res["exit_s"],
        "new_group_calls": slowest["new_group_calls"],
        "store_ops": slowest["pg_store_ops"] + slowest["mp_store_ops"],
    }


def bench_bootstrap(
    ranks: list[int] | None = None,
    probe_ranks: list[int] | None = None,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    out_dir: str | Path = "runs/bench-bootstrap",
    workers: int = 2,
    strategies: list[str] | None = None,
    tp: int = TP,
    pp: int = PP,
    real_layouts: list[str] | None = None,
    real_group_inits: list[str] | None = None,
    real_repeats: int = 3,
) -> dict[str, Any]:
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    ranks = sorted(ranks or DEFAULT_RANKS)
    probe_ranks = sorted(
        n for n in (DEFAULT_PROBES if probe_ranks is None else probe_ranks) if n not in ranks
    )
    names = strategies or list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"--strategies: unknown {unknown}, expected some of {list(ROWS)}")
    real_layouts = list(DEFAULT_REAL_LAYOUTS if real_layouts is None else real_layouts)
    real_group_inits = list(real_group_inits or REAL_GROUP_INITS)
    if not set(real_group_inits) <= set(REAL_GROUP_INITS):
        raise ValueError(
            f"--real-group-init: expected some of {list(REAL_GROUP_INITS)}, got {real_group_inits}"
        )
    for n in [*ranks, *probe_ranks]:
        layout_for(n, tp, pp)  # refuse a bad N before anything runs
    out_dir = Path(out_dir)

    real = _real_rows(real_layouts, real_group_inits, real_repeats, out_dir, console)

    results, probes = _simulated_rows(names, ranks, probe_ranks, max_seconds, workers, tp, pp, console)
    fits = {name: _growth_fit(name, probes, results) for name in names}

    title = f"bootstrap store traffic: TP={tp} x PP={pp} x DP=N/{tp * pp}, {common_device()}"
    png = plot([*probes, *results], fits, out_dir / "bootstrap_time_vs_ranks.png", title).resolve()
    console.print(f"plot: {png}", highlight=False)
    speedups = measured_speedups([*probes, *results])
    result = {
        "results": results,
        "probes": probes,
        "real": real,
        "growth": fits,
        "speedups": speedups,
        "targets": _targets(results, speedups, real),
        "baseline": BASELINE,
        "layout": {
            "tp": tp,
            "pp": pp,
            "dp": f"N/{tp * pp}",
            "main_backend": "nccl (modelled)",
            "gloo_groups": False,
            "torch_dist_init_barrier": {name: ROWS[name][2] for name in names},
            "megatron_core": "0.16.1",
            "torch": _torch_version(),
        },
        "max_seconds": max_seconds,
        "client_workers": workers,
        "plot": str(png),
        "device": common_device(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bootstrap.json").write_text(json.dumps(result, indent=1))
    return result


def _real_rows(
    real_layouts: list[str], real_group_inits: list[str], real_repeats: int, out_dir: Path, console
) -> list[dict]:
    """Group creation timed with real ranks on this machine, one row per layout and group_init."""
    real: list[dict] = []
    for layout in real_layouts:
        for group_init in real_group_inits:
            console.print(f"[bold]real[/] {layout}, {group_init} groups: timing job ...", highlight=False)
            row = run_real(layout, group_init, out_dir / f"real-{layout}-{group_init}", repeats=real_repeats)
            real.append(row)
            if row["measured"]:
                ph = row["phases"]
                console.print(
                    f"  group creation {row['seconds']:.3f} s (median of "
                    f"{', '.join(f'{s:.3f}' for s in row['seconds_per_repeat'])}; slowest rank: store {ph['mp_store_s']:.3f}, connections "
                    f"{ph['mp_connect_s']:.3f}, megatron {ph['mp_megatron_s']:.3f}, barrier "
                    f"{ph['mp_barrier_s']:.3f}); init_process_group {row['pg_init_s']:.3f} s; imports "
                    f"{ph['import_s']:.1f} s; job {row['job_s']:.1f} s; load {row['load_avg_1m']}",
                    highlight=False,
                )
            else:
                console.print(f"  failed: {row['error']}", highlight=False)
    return real


def _simulated_rows(
    names: list[str],
    ranks: list[int],
    probe_ranks: list[int],
    max_seconds: float,
    workers: int,
    tp: int,
    pp: int,
    console,
) -> tuple[list[dict], list[dict]]:
    """The replayed store traffic of each strategy at every N (probes first); after a point that
    does not finish in ``max_seconds`` the larger ones of that strategy are skipped."""
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
                took = (
                    f"{row['seconds']:.2f} s"
                    if row["completed"]
                    else f"not finished within {max_seconds:g} s"
                )
                console.print(
                    f"  {name} N={n:,}: {took}, {row['store_ops']:,} store ops planned, "
                    f"{row['ops_done']:,} issued, load {row['load_avg_1m']}",
                    highlight=False,
                )
            (probes if n in probe_ranks else results).append(row)
    return results, probes


def _growth_fit(name: str, probes: list[dict], results: list[dict]) -> dict[str, Any]:
    """The growth exponent of a strategy's time (and planned store operations) with N, and the
    points it did not finish extrapolated from it: a fit, never a measurement."""
    rows = [r for r in [*probes, *results] if r["strategy"] == name]
    pts = sorted((r["ranks"], r["seconds"]) for r in rows if r["measured"])
    k = growth(pts)
    k_ops = growth(sorted((r["ranks"], r["store_ops"]) for r in rows))  # the plan is exact for every N
    todo = [r for r in results if r["strategy"] == name and not r["measured"]]
    fit = {
        "exponent": None if k is None else round(k, 3),
        "ops_exponent": None if k_ops is None else round(k_ops, 3),
        "points": len(pts),
        "largest_completed": pts[-1][0] if pts else None,
        "measured": False,  # what follows is a fit, never a measurement
        "extrapolated_s": {
            str(r["ranks"]): round(extrapolate(pts, k, r["ranks"]), 2) for r in todo if k is not None
        },
    }
    if pts:  # at the largest completed point's seconds per planned operation
        n0, t0 = pts[-1]
        ops0 = next(r["store_ops"] for r in rows if r["ranks"] == n0)
        fit["extrapolated_by_ops_s"] = {str(r["ranks"]): round(t0 * r["store_ops"] / ops0, 1) for r in todo}
    return fit


def measured_speedups(rows: list[dict]) -> list[dict[str, Any]]:
    """Every row against the baseline and against the per-group-barrier row, at each N where both
    were measured (time of the other row / time of this one; > 1: this row is faster)."""
    seconds = {(r["strategy"], r["ranks"]): r["seconds"] for r in rows if r["measured"]}
    out = []
    for (name, n), t in sorted(seconds.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for reference in (BASELINE, PER_GROUP_BARRIER):
            other = seconds.get((reference, n))
            if name != reference and other is not None and t > 0:
                out.append({"strategy": name, "vs": reference, "ranks": n, "speedup": round(other / t, 2)})
    return out


def _targets(results: list[dict], speedups: list[dict], real: list[dict]) -> dict[str, Any]:
    """Targets judged on measured rows only; an unmeasured point is ``value: null, met: false``."""

    def measured(name: str, n: int) -> float | None:
        return next(
            (r["seconds"] for r in results if r["strategy"] == name and r["ranks"] == n and r["measured"]),
            None,
        )

    def judged(value: float | None, target: float, below: bool = True) -> dict[str, Any]:
        met = value is not None and (value < target if below else value >= target)
        return {"value": value, "measured": value is not None, "target": target, "met": met}

    speedup_2k = next(
        (
            s["speedup"]
            for s in speedups
            if s["strategy"] == "light-barrier-redis" and s["vs"] == PER_GROUP_BARRIER and s["ranks"] == 2048
        ),
        None,
    )
    out = {
        "light_redis_s_at_2048": judged(measured("light-redis", 2048), TARGETS["light_redis_s_at_2048"]),
        "light_redis_s_at_12288": judged(measured("light-redis", 12288), TARGETS["light_redis_s_at_12288"]),
        # light's one world barrier against a barrier per group, both with TORCH_DIST_INIT_BARRIER=1
        "speedup_vs_per_group_barrier_at_2048": judged(
            speedup_2k, TARGETS["speedup_vs_per_group_barrier_at_2048"], below=False
        ),
    }
    for row in real:
        if row["group_init"] == "light":
            out[f"real_group_creation_s_{row['layout']}"] = judged(
                row["seconds"], TARGETS["real_group_creation_s"]
            )
    return out


def common_device() -> str:
    return f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()}"


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":  # convenience: python -m mega.bench.bootstrap
    start = time.perf_counter()
    print(json.dumps(bench_bootstrap()))
    common.log(f"took {time.perf_counter() - start:.0f} s")
