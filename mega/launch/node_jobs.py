"""Jobs the driver and the flows start on every node besides training, each on the launch backend
of ``launcher`` (mega/launch/backends.py): the self-check (``run_selfcheck``; its ranks run
mega/cluster/selfcheck.py) and the process-group timing (``time_process_groups``; its ranks run
mega/cluster/bootstrap.py). What the ranks do stays in mega.cluster; starting and watching them
is the launcher's.
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mega import faults
from mega.cluster.bootstrap import LAUNCH_TIME_ENV
from mega.cluster.rendezvous import drop_attempt_keys, rendezvous_env, without_secrets
from mega.cluster.selfcheck import DEFAULT_TIMEOUT_S, selfcheck_floors
from mega.config import save
from mega.launch.backend import Backend, JobSpec, server_host
from mega.launch.backends import backend_for
from mega.launch.watch import TIMEOUT_EXIT, JobOutcome, describe_exit, run_job
from mega.rank_env import ATTEMPT_ENV

if TYPE_CHECKING:
    from mega.config import MegaConfig


def run_selfcheck(
    cfg: MegaConfig,
    out_dir: str | Path,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    fail_rank: int | None = None,
    backend: Backend | None = None,
    bad_node: int | None = None,
) -> dict[str, Any]:
    """Check every node of cfg's cluster (``cluster.procs_per_node`` ranks each) on the launch
    backend of ``launcher`` (or ``backend``, left open); always returns a verdict dict.

    The dict is rank 0's result (``ranks`` rows, ``nodes`` verdicts, ``pairs`` bandwidths,
    ``healthy``, ``reasons``, ``floors``) plus ``exit_code``, ``elapsed_s`` and ``result_path``.
    A job that crashes or times out yields ``healthy: False`` with the reason (the nodes whose
    agent failed are named), never an exception or a hang.
    """
    c = cfg.cluster
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result_path = out_dir / "result.json"
    result_path.unlink(missing_ok=True)  # a stale verdict must never pass for this run's
    floors = selfcheck_floors(cfg)
    # collectives give up a little before the job does, so a dead peer shows as a rank error
    pg_timeout = max(10.0, min(float(c.pg_timeout_s), timeout_s - 10.0))
    args = [
        "--out",
        str(result_path),
        "--floors",
        json.dumps(floors),
        "--device",
        c.device,
        "--timeout-s",
        str(pg_timeout),
    ]
    env = {**c.env, **faults.selfcheck_env(fail_rank=fail_rank, bad_node=bad_node)}  # drills
    job = JobSpec("mega.cluster.selfcheck", args, env, out_dir, "selfcheck")

    start = time.perf_counter()
    own = backend is None
    backend = backend_for(cfg, out_dir) if own else backend
    try:
        outcome = run_job(backend, job, timeout_s=timeout_s)
    finally:
        if own:
            backend.close()
    elapsed = time.perf_counter() - start

    if outcome.ok and result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        result = _no_verdict(cfg, job, outcome, floors, timeout_s)
    result.update(exit_code=outcome.code, elapsed_s=round(elapsed, 3), result_path=str(result_path))
    return result


def _no_verdict(
    cfg: MegaConfig, job: JobSpec, outcome: JobOutcome, floors: dict, timeout_s: float
) -> dict[str, Any]:
    """The verdict of a self-check job that wrote none (it crashed or timed out): unhealthy, the
    nodes whose agents failed blamed, the others not judged (None)."""
    c = cfg.cluster
    logs = ", ".join(str(job.log_path(k, c.nodes)) for k in (outcome.failed_nodes or range(c.nodes)))
    if outcome.code == TIMEOUT_EXIT:
        why, blamed = f"timed out after {timeout_s:g} s", []
    elif outcome.failed_nodes:
        blamed = outcome.failed_nodes
        why = (
            "; ".join(
                f"node {k} {describe_exit(outcome.exit_codes[k]).replace('torchrun agent ', '')}"
                for k in blamed
            )
            if c.nodes > 1
            else f"exited with code {outcome.code}"
        )
    else:
        why, blamed = f"exited with code {outcome.code}", []
    reason = f"selfcheck job {why} without a verdict (see {logs})"
    result = {
        "node": socket.gethostname(),
        "device": c.device,
        "world_size": c.world_size,
        "nodes_count": c.nodes,
        "procs_per_node": c.procs_per_node,
        "floors": floors,
        "ranks": [],
        "pairs": [],
        "healthy": False,
        "reasons": [reason],
        # a node whose agent failed is unhealthy; the others could not be judged (None)
        "nodes": [
            {
                "node": k,
                "host": None,
                "address": None,
                "healthy": False if k in blamed else None,
                "reasons": [reason] if k in blamed or not blamed else [],
            }
            for k in range(c.nodes)
        ],
    }
    return result


def time_process_groups(
    cfg: MegaConfig, out_dir: str | Path | None = None, *, timeout_s: float | None = None
) -> dict[str, Any]:
    """Launch cfg's world on every node (the launch backend of ``launcher``); the slowest rank's
    init times, overall and per node.

    Returns {"pg_init_s", "model_parallel_init_s", "world_size", "store", "group_init", "ranks":
    per-rank rows (with their node), "nodes": per-node maxima, "phases": {phase: seconds} of the
    rank slowest to create its groups (``PHASES``), "phases_max": each phase's max over ranks,
    "job_s": the launcher's wall time, "exit_s": the part of it after the result was written
    (teardown)}. ``model_parallel_init_s`` is megatron-core's group creation only: every import
    happens before the ranks line up, and it is the sum of the ``mp_*`` phases. Files (config
    without secrets, result, logs) go to out_dir, by default ``<train.run_dir>/bootstrap``. The job
    rendezvouses over ``store.kind`` (its own job id). Raises RuntimeError when the job fails or
    times out.
    """
    c = cfg.cluster
    out_dir = Path(out_dir or Path(cfg.train.run_dir) / "bootstrap")
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path, result_path = out_dir / "config.json", out_dir / "result.json"
    save(without_secrets(cfg), config_path)
    result_path.unlink(missing_ok=True)
    # imports (~10 s per rank on small CPUs) plus one pg timeout bound a job that cannot finish
    timeout_s = timeout_s or c.pg_timeout_s + 120.0
    job = JobSpec(
        "mega.cluster.bootstrap",
        ["--config", str(config_path), "--out", str(result_path)],
        log_dir=out_dir,
        name="bootstrap",
    )
    with (
        closing(backend_for(cfg, out_dir)) as backend,
        rendezvous_env(cfg, host=server_host(backend)) as store_env,
    ):
        launched = time.time()
        job.env = {**c.env, **store_env, ATTEMPT_ENV: "0", LAUNCH_TIME_ENV: repr(launched)}
        outcome = run_job(backend, job, timeout_s=timeout_s)
        job_s = time.time() - launched
        try:
            drop_attempt_keys(store_env, 0)
        except Exception:
            pass
    if not outcome.ok or not result_path.exists():
        why = f"timed out after {timeout_s:g} s" if outcome.code == TIMEOUT_EXIT else outcome.reason
        logs = ", ".join(str(job.log_path(k, c.nodes)) for k in (outcome.failed_nodes or range(c.nodes)))
        raise RuntimeError(f"process-group timing job {why} (see {logs})")
    result = json.loads(result_path.read_text())
    result["job_s"] = job_s
    # after the result: gathering it, destroying the groups, interpreter exit, the agents' shutdown
    result["exit_s"] = launched + job_s - result.pop("written_at")
    result_path.write_text(json.dumps(result, indent=2))
    return result
