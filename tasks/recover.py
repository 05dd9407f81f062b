"""Prefect tasks of the recovery flow: find runs that should be training but are not, restart one
from its latest durable checkpoint, and report what was found and done (mega.launch.runs does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import get_run_logger, runtime, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from mega.data import prepare_dataset
from mega.launch import TrainingFailed, run_training, runs
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
        # The flow run's own config names its run directory; its record must name the flow run
        # (else a later run took the directory over, or this one ended before training).
        try:
            found = _run_dir_of_flow_run(flow_run_id)
        except Exception as e:  # parameters of another shape: fall back to the records under runs_root
            logger.info("flow run %s: no run directory from its parameters (%s)", flow_run_id, e)
            found = None
        try:
            if found is None or flow_run_id not in runs.read_record(found).flow_run_ids:
                found = runs.find_run_of_flow_run(runs_root, flow_run_id)
        except runs.RunRecordError:
            found = runs.find_run_of_flow_run(runs_root, flow_run_id)
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
    statuses = (
        [runs.inspect_run(run_dir, stale_after_s, **opts)]
        if run_dir is not None
        else runs.scan_runs(runs_root, stale_after_s, **opts)
    )
    # An operator who cancelled the flow run driving a run wants it stopped, not restarted.
    last_drivers = {s.record.flow_run_ids[-1] for s in statuses if s.recover and s.record.flow_run_ids}
    cancelled = _cancelled_flow_runs(sorted(last_drivers))
    for s in statuses:
        if s.recover and s.record.flow_run_ids and s.record.flow_run_ids[-1] in cancelled:
            s.verdict, s.reason = "cancelled", f"flow run {s.record.flow_run_ids[-1]} was cancelled"
        logger.info("%s: %s (%s)", s.run_dir, s.verdict, s.reason)
    return statuses


# No Prefect retries: run_training relaunches the ranks itself (checkpoint.max_restarts), and a
# run that still fails is left `failed` for the next scheduled recovery (up to max_recoveries).
@task(name="restart-run", cache_policy=NO_CACHE)
def restart_run(
    status: runs.RunStatus, stale_after_s: float, include_failed: bool, max_recoveries: int
) -> dict[str, Any]:
    """Claim the run, check again under the claim, stop ranks its dead launcher left, and train on
    from the latest durable checkpoint. Returns one row of the recovery table."""
    logger = get_run_logger()
    flow_run_id = runtime.flow_run.id and str(runtime.flow_run.id)
    row = {
        "run_dir": status.run_dir,
        "found": status.verdict,
        "reason": status.reason,
        "checkpoint": status.checkpoint or "none (from step 0)",
    }
    try:
        with runs.hold(status.run_dir, f"recovery (flow run {flow_run_id})"):
            # Another recovery may have restarted it between the scan and this claim.
            now = runs.inspect_run(
                status.run_dir, stale_after_s, include_failed=include_failed, max_recoveries=max_recoveries
            )
            if now.verdict == "finished":
                runs.mark_finished(status.run_dir)
                return {**row, "action": "marked completed", "result": now.reason}
            if not now.recover:
                return {**row, "action": "skipped", "result": f"{now.verdict}: {now.reason}"}
            if now.orphans:
                logger.info(
                    "%s: stopping rank processes %s left by the dead launcher", status.run_dir, now.orphans
                )
                runs.stop_processes(now.orphans)
            cfg = runs.run_config(now.record)
            index = Path(now.record.data_index)
            if not index.exists():  # a cleaned data cache: rebuild it (content-addressed, same tokens)
                index = prepare_dataset(cfg.data, cfg.model.vocab_size, progress=False)
            row["checkpoint"] = now.checkpoint or "none (from step 0)"
            logger.info("%s: restarting from %s", status.run_dir, row["checkpoint"])
            result = run_training(
                cfg,
                index,
                log=logger.info,
                flow_run_id=flow_run_id,
                recovery=True,
                on_incident=publish_incident,
            )  # and the recoveries
    except runs.RunBusy as e:
        return {**row, "action": "skipped", "result": str(e)}
    except TrainingFailed as e:
        return {**row, "action": "restarted", "result": f"failed again: {e}", "failed": True}
    final = result.metrics[-1] if result.metrics else {}
    return {
        **row,
        "action": "restarted",
        "result": f"completed step {result.final_step} in {result.attempts} attempt(s), "
        f"final loss {final.get('loss', float('nan')):.5f}",
        "final_step": result.final_step,
        "final_loss": final.get("loss"),
    }


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
