"""``python -m mega.bench nodes [overrides] [--nodes 1,2,4] [--steps N] [--warmup N] [--netns] [--json]``.

The same world (8 ranks, TP2xPP2xDP2) as 1, 2 and 4 local nodes, each run end to end through the
driver, one after the other in one process: what a user pays to get to the first step (agents,
imports, rendezvous, groups, model) and per step, and whether the losses equal the one-node run's.
Local nodes share this machine's cores: the figures compare launch paths, not network fabrics
(``--netns`` puts every node in its own network namespace, so traffic crosses veth pairs).

Last line: {"rows": [{"nodes", "procs_per_node", "world_size", "layout", "first_step_s", "step_s",
"max_abs_loss_diff_vs_one_node", "completed"}], "details": [...], "machine": {...}, ...}
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

from mega.bench import common
from mega.metrics import METRICS_FILE

LAYOUT = "tp2-pp2-dp2"
WORLD = 8


def _first_row_time(path: Path, stop: threading.Event, out: dict) -> None:
    """Record when the first metrics row lands in ``path`` (polled every 20 ms)."""
    while not stop.is_set():
        try:
            if path.stat().st_size > 0:
                out["time"] = time.monotonic()
                return
        except FileNotFoundError:
            pass
        time.sleep(0.02)


def run_nodes(n: int, overrides: list[str], steps: int, warmup: int, netns: bool, tmp: str) -> dict:
    """One run of the layout as ``n`` local nodes; its row and what it cost."""
    from mega.launch import TrainingFailed

    procs = WORLD // n
    launcher = ["launcher=local"] if n == 1 else [
        "launcher=local-nodes", f"cluster.nodes={n}", f"cluster.procs_per_node={procs}",
        f"launcher.local_nodes.netns={str(netns).lower()}"]
    run_dir = Path(tmp) / f"nodes{n}"
    cfg = common.compose_run([f"parallelism={LAYOUT}", *overrides, *launcher,
                              f"optimizer.warmup_steps={min(warmup, steps - 1)}"], steps, run_dir)
    index = common.prepare_data(cfg)
    common.log(f"nodes: {n} node(s) x {procs} ranks ({LAYOUT}, {steps} steps){' in network namespaces' if netns and n > 1 else ''}")
    stop, first = threading.Event(), {}
    watcher = threading.Thread(target=_first_row_time, args=(run_dir / METRICS_FILE, stop, first), daemon=True)
    started = time.monotonic()
    watcher.start()
    try:
        result = common.train(cfg, index)
        metrics, attempts, completed = result.metrics, result.attempts, True
    except TrainingFailed as e:
        common.log(f"nodes: {n} node(s) failed: {e}")
        from mega.metrics import read_metrics

        metrics, attempts, completed = read_metrics(run_dir), cfg.checkpoint.max_restarts + 1, False
    finally:
        stop.set()
        watcher.join()
    wall = time.monotonic() - started
    timed = common.steady(metrics, warmup) if metrics else []
    return {"nodes": n, "procs_per_node": procs, "world_size": n * procs, "layout": LAYOUT,
            "first_step_s": round(first["time"] - started, 3) if "time" in first else None,
            "step_s": common.median(timed, "step_s") if timed else None,
            "completed": completed and len(metrics) == steps,
            "_losses": [m["loss"] for m in metrics], "_wall_s": round(wall, 3), "_attempts": attempts}


def bench_nodes(overrides: list[str], steps: int = 6, warmup: int = 2, node_counts: tuple[int, ...] = (1, 2, 4),
                netns: bool = False) -> dict:
    if node_counts[0] != 1:
        node_counts = (1, *[n for n in node_counts if n != 1])  # the reference comes first
    with tempfile.TemporaryDirectory(prefix="mega-bench-nodes-") as tmp:
        runs = [run_nodes(n, overrides, steps, warmup, netns, tmp) for n in node_counts]
    ref = runs[0]["_losses"]
    rows, details = [], []
    for r in runs:
        losses = r.pop("_losses")
        comparable = r["completed"] and runs[0]["completed"]
        r["max_abs_loss_diff_vs_one_node"] = (max(abs(a - b) for a, b in zip(losses, ref)) if comparable else None)
        details.append({"nodes": r["nodes"], "wall_s": r.pop("_wall_s"), "attempts": r.pop("_attempts"),
                        "losses": losses})
        rows.append(r)
    return {
        "rows": rows,
        "details": details,  # whole-run wall time (launch to last rank gone), attempts, per-step losses
        "steps": steps, "warmup_steps": warmup, "netns": netns,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "note": "local nodes share one machine's cores: the rows compare launch paths and rank layouts, "
                "not interconnects; first_step_s runs from the driver's start to the first metrics row",
    }
