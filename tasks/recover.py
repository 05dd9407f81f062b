"""Prefect tasks of the recovery flow: find runs that should be training but are not, restart one
from its latest durable checkpoint, and report what was found and done (mega.launch.recovery does
the work; Prefect's flow runs are looked up here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import get_run_logger, runtime, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from mega.launch import recovery, runs
from tasks.incidents import publish_incident


def _cancelled_flow_runs(ids: list[str]) -> set[str]:
    """Which of these flow runs an operator cancelled (their runs must stay stopped)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    uuids = []
    for i in ids:
        try:
            uuids.append(UUID(i))
        except ValueError:
            continue
    if not uuids:
        return set()
    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=uuids)))
    return {
        str(fr.id)
        for fr in flow_runs
        if fr.state is not None and fr.state.type.value in ("CANCELLED", "CANCELLING")
    }


def _run_dir_of_flow_run(flow_run_id: str) -> Path | None:
    """The train.run_dir a pretrain flow run composed, from its parameters (overrides or config)."""
    from prefect.client.orchestration import get_client

    from mega.config import compose, from_dict

    with get_client(sync_client=True) as client:
        params = client.read_flow_run(UUID(flow_run_id)).parameters
    cfg = from_dict(params["config"]) if params.get("config") else compose(params.get("overrides") or [])
    return Path(cfg.train.run_dir)


@task(name="find-runs", cache_policy=NO_CACHE)
def find_runs(
    runs_root: str,
    run_dir: str | None,
    flow_run_id: str | None,
    stale_after_s: float,
    include_failed: bool,
    max_recoveries: int,
) -> list[runs.RunStatus]:
    """Verdicts on one run directory (given, or the one a flow run drove) or on all under runs_root."""
    logger = get_run_logger()
    opts = dict(include_failed=include_failed, max_recoveries=max_recoveries)
    if flow_run_id is not None and run_dir is None:
        flow_run_id = flow_run_id.removeprefix("prefect.flow-run.")  # a raw event resource id works too
        found = recovery.run_dir_of_flow_run(runs_root, flow_run_id, _run_dir_of_flow_run, logger.info)
        if found is None:
            logger.info(
                "no run record under %s names flow run %s (it ended before training started)",
                runs_root,
                flow_run_id,
            )
            return [
                runs.RunStatus(
                    f"(flow run {flow_run_id})",
                    "none",
                    f"no run record under {runs_root} names this flow run: it ended before training",
                )
            ]
        run_dir = str(found)
    statuses = recovery.statuses(runs_root, run_dir, stale_after_s, _cancelled_flow_runs, **opts)
    for s in statuses:
        logger.info("%s: %s (%s)", s.run_dir, s.verdict, s.reason)
    return statuses


# No Prefect retries: run_training relaunches the ranks itself (restart.max_restarts), and a
# run that still fails is left `failed` for the next scheduled recovery (up to max_recoveries).
@task(name="restart-run", cache_policy=NO_CACHE)
def restart_run(
    status: runs.RunStatus, stale_after_s: float, include_failed: bool, max_recoveries: int
) -> dict[str, Any]:
    """Train the run on from its latest durable checkpoint (mega.launch.recovery.restart). Returns
    one row of the recovery table."""
    return recovery.restart(
        status,
        stale_after_s,
        flow_run_id=runtime.flow_run.id and str(runtime.flow_run.id),
        log=get_run_logger().info,
        on_incident=publish_incident,
        include_failed=include_failed,
        max_recoveries=max_recoveries,
    )


@task(name="recovery-report", cache_policy=NO_CACHE)
def recovery_report(rows: list[dict[str, Any]], scope: str) -> None:
    columns = ("run_dir", "found", "reason", "checkpoint", "action", "result")
    restarted = sum(r["action"] == "restarted" for r in rows)
    create_table_artifact(
        key="recovery",
        table=[{c: r.get(c, "") for c in columns} for r in rows] or [{c: "" for c in columns}],
        description=f"Recovery over {scope}: {len(rows)} run(s) looked at, {restarted} restarted "
        f"from their latest durable checkpoint",
    )
