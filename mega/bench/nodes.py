"""``python -m mega.bench nodes [overrides] [--nodes 1,2,4] [--steps N] [--warmup N] [--netns] [--launcher slurm] [--json]``.

The same world (8 ranks, TP2xPP2xDP2) as 1, 2 and 4 local nodes, each run end to end through the
driver, one after the other in one process: what a user pays to get to the first step (agents,
imports, rendezvous, groups, model) and per step, and whether the losses equal the one-node run's.
Local nodes share this machine's cores: the figures compare launch paths, not network fabrics
(``--netns`` puts every node in its own network namespace, so traffic crosses veth pairs).

``--launcher slurm``: the 2..N-node runs go through Slurm (``SLURM_CONF``'s cluster, else a local
one started for the benchmark, mega/launch/slurm_local.py) against one local node, plus a row with
``fault: "node-loss"``: 2 Slurm nodes, node 1 killed at step 2, a third node spare.

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


SLURM = [
    "launcher=slurm",
    "cluster.launchers=[local,local-nodes,slurm]",
    "launcher.slurm.exclusive=false",
    "launcher.slurm.mem=null",
    "launcher.slurm.stop_timeout_s=30",
    "launcher.slurm.driver=host",  # node-loss: the relaunch is a new job on a node of the partition
    "restart.backoff_s=0",
]


def run_nodes(
    n: int,
    overrides: list[str],
    steps: int,
    warmup: int,
    netns: bool,
    tmp: str,
    launcher_name: str = "local-nodes",
    name: str | None = None,
    restarts: int | None = None,
) -> dict:
    """One run of the layout as ``n`` nodes (local-nodes or Slurm); its row and what it cost."""
    from mega.launch import TrainingFailed

    procs = WORLD // n
    launcher = (
        ["launcher=local"]
        if n == 1 and launcher_name != "slurm"
        else [
            f"cluster.nodes={n}",
            f"cluster.procs_per_node={procs}",
            *(
                SLURM
                if launcher_name == "slurm"
                else ["launcher=local-nodes", f"launcher.local_nodes.netns={str(netns).lower()}"]
            ),
        ]
    )
    run_dir = Path(tmp) / (name or f"nodes{n}-{launcher_name}")
    cfg = common.compose_run(
        [f"parallelism={LAYOUT}", *overrides, *launcher, f"optimizer.warmup_steps={min(warmup, steps - 1)}"],
        steps,
        run_dir,
    )
    if restarts is not None:  # a fault row: the run must relaunch, from a checkpoint every 2 steps
        cfg.restart.max_restarts, cfg.checkpoint.interval = restarts, 2
    index = common.prepare_data(cfg)
    common.log(
        f"nodes: {n} node(s) x {procs} ranks ({LAYOUT}, {steps} steps){' in network namespaces' if netns and n > 1 else ''}"
    )
    stop, first = threading.Event(), {}
    watcher = threading.Thread(
        target=_first_row_time, args=(run_dir / METRICS_FILE, stop, first), daemon=True
    )
    started = time.monotonic()
    watcher.start()
    try:
        result = common.train(cfg, index)
        metrics, attempts, completed = result.metrics, result.attempts, True
    except TrainingFailed as e:
        common.log(f"nodes: {n} node(s) failed: {e}")
        from mega.metrics import read_metrics

        metrics, attempts, completed = read_metrics(run_dir), cfg.restart.max_restarts + 1, False
    finally:
        stop.set()
        watcher.join()
    wall = time.monotonic() - started
    timed = common.steady(metrics, warmup) if metrics else []
    return {
        "nodes": n,
        "procs_per_node": procs,
        "world_size": n * procs,
        "layout": LAYOUT,
        "launcher": "local" if "launcher=local" in launcher else launcher_name,
        "first_step_s": round(first["time"] - started, 3) if "time" in first else None,
        "step_s": common.median(timed, "step_s") if timed else None,
        "completed": completed and len(metrics) == steps,
        "_losses": [m["loss"] for m in metrics],
        "_wall_s": round(wall, 3),
        "_attempts": attempts,
        "_history": result.history if completed else [],
    }


def node_loss_row(overrides: list[str], steps: int, warmup: int, tmp: str, state) -> dict:
    """2 Slurm nodes, node 1 killed (every process in its namespace) once step 2 is logged: when the
    attempt's end was seen, when the next attempt logged a step, which host was excluded."""
    from mega.launch import slurm_local
    from mega.metrics import read_metrics

    run_dir = Path(tmp) / "node-loss"
    killed: dict = {}

    def kill_at_step_2():
        while not killed.get("stop"):
            if (run_dir / METRICS_FILE).exists() and any(r["step"] >= 2 for r in read_metrics(run_dir)):
                killed["t"] = time.time()
                slurm_local.kill_node(state, 1)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_at_step_2, daemon=True)
    killer.start()
    try:
        row = run_nodes(2, overrides, max(steps, 4), warmup, False, tmp, "slurm", "node-loss", restarts=1)
    finally:
        killed["stop"] = True
        killer.join(10)
        slurm_local.restart_node(state, 1)
    history = row.pop("_history")
    first_after = [r["time"] for r in read_metrics(run_dir) if r.get("attempt", 0) > 0]
    detected = bool(history) and history[0]["code"] != 0
    return {
        **row,
        "fault": "node-loss",
        "detected": detected,
        "detect_s": round(history[0]["elapsed_s"] - (killed["t"] - _started(run_dir)), 3)
        if detected and "t" in killed
        else None,
        "recovered": row["completed"] and len(history) > 1,
        "recover_s": round(min(first_after) - killed["t"], 3) if first_after and "t" in killed else None,
        "excluded_host": (history[0].get("excluded_hosts") or [None])[0] if history else None,
    }


def _started(run_dir: Path) -> float:
    """When attempt 0's job was submitted (its script's mtime)."""
    return (run_dir / "slurm" / "train-attempt0" / "job.sbatch").stat().st_mtime


def bench_nodes(
    overrides: list[str],
    steps: int = 6,
    warmup: int = 2,
    node_counts: tuple[int, ...] = (1, 2, 4),
    netns: bool = False,
    launcher: str = "local-nodes",
) -> dict:
    if node_counts[0] != 1:
        node_counts = (1, *[n for n in node_counts if n != 1])  # the reference comes first
    with tempfile.TemporaryDirectory(prefix="mega-bench-nodes-") as tmp:
        if launcher == "slurm":
            runs = _slurm_runs(overrides, steps, warmup, node_counts, tmp)
        else:
            runs = [run_nodes(n, overrides, steps, warmup, netns, tmp) for n in node_counts]
    ref = runs[0]["_losses"]
    rows, details = [], []
    for r in runs:
        r.pop("_history", None)
        losses = r.pop("_losses")
        comparable = r["completed"] and runs[0]["completed"]
        r["max_abs_loss_diff_vs_one_node"] = (
            max(abs(a - b) for a, b in zip(losses, ref)) if comparable else None
        )
        details.append(
            {
                "nodes": r["nodes"],
                "wall_s": r.pop("_wall_s"),
                "attempts": r.pop("_attempts"),
                "losses": losses,
            }
        )
        rows.append(r)
    return {
        "launcher": launcher,
        "rows": rows,
        "details": details,  # whole-run wall time (launch to last rank gone), attempts, per-step losses
        "steps": steps,
        "warmup_steps": warmup,
        "netns": netns,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "note": "local nodes share one machine's cores: the rows compare launch paths and rank layouts, "
        "not interconnects; first_step_s runs from the driver's start to the first metrics row",
    }


def _slurm_runs(
    overrides: list[str], steps: int, warmup: int, node_counts: tuple[int, ...], tmp: str
) -> list[dict]:
    """One local node (the reference), then each node count through Slurm, then the node-loss row;
    on the cluster of ``$SLURM_CONF`` or, without one, a local 3-node cluster started for this."""
    from mega.launch import slurm_local

    own = None
    if "SLURM_CONF" not in os.environ:
        own = Path(tmp) / "slurm"
        state = slurm_local.up(max(3, *node_counts), own, "10.217.0.0/24", net_id="slurmb")
        os.environ.update(state.env())
    else:
        state = slurm_local.read_state(Path(os.environ["SLURM_CONF"]).parent)
    try:
        runs = [run_nodes(1, overrides, steps, warmup, False, tmp, "local")]
        runs += [run_nodes(n, overrides, steps, warmup, False, tmp, "slurm") for n in node_counts]
        if state is not None:  # a node-loss drill needs a cluster whose nodes this process can kill
            runs.append(node_loss_row(overrides, steps, warmup, tmp, state))
        return runs
    finally:
        if own is not None:
            os.environ.pop("SLURM_CONF", None)
            slurm_local.down(own)
