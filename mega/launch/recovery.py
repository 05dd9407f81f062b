"""The recovery policy: which runs to restart and how one is restarted, from its latest durable
checkpoint. What only the orchestrator knows (a flow run's parameters, which flow runs an operator
cancelled) comes in as functions; tasks/recover.py passes Prefect's.

* ``run_dir_of_flow_run``: the run directory a flow run drove: the one its parameters name when
  that run's record names the flow run, else the record under ``runs_root`` that names it;
* ``statuses``: verdicts (mega.launch.runs) on one run directory or every one under ``runs_root``;
  a run whose last driving flow run was cancelled stays stopped;
* ``restart``: under the run's claim, look again, stop the ranks its dead launcher left, rebuild a
  cleaned data cache and train on (mega.launch.driver); one row of the recovery table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mega.data import prepare_dataset
from mega.launch import runs
from mega.launch.driver import TrainingFailed, run_training


def run_dir_of_flow_run(
    runs_root: str | Path,
    flow_run_id: str,
    from_parameters: Callable[[str], Path],
    log: Callable[[str], None] = print,
) -> Path | None:
    """The run directory flow run ``flow_run_id`` drove (None: its run ended before training).
    ``from_parameters(id)``: the ``train.run_dir`` its parameters compose (may raise)."""
    try:
        found = from_parameters(flow_run_id)
    except Exception as e:  # parameters of another shape: fall back to the records under runs_root
        log(f"flow run {flow_run_id}: no run directory from its parameters ({e})")
        found = None
    try:  # the record must name the flow run, else a later run took the directory over
        if found is not None and flow_run_id in runs.read_record(found).flow_run_ids:
            return found
    except runs.RunRecordError:
        pass
    return runs.find_run_of_flow_run(runs_root, flow_run_id)


def statuses(
    runs_root: str | Path,
    run_dir: str | Path | None,
    stale_after_s: float,
    cancelled: Callable[[list[str]], set[str]],
    **opts,
) -> list[runs.RunStatus]:
    """Verdicts on ``run_dir`` (or on every run under ``runs_root``); ``cancelled(ids)``: which of
    these flow runs an operator cancelled: their runs are to stay stopped, not be restarted."""
    found = (
        [runs.inspect_run(run_dir, stale_after_s, **opts)]
        if run_dir is not None
        else runs.scan_runs(runs_root, stale_after_s, **opts)
    )
    last_drivers = {s.record.flow_run_ids[-1] for s in found if s.recover and s.record.flow_run_ids}
    stopped = cancelled(sorted(last_drivers)) if last_drivers else set()
    for s in found:
        if s.recover and s.record.flow_run_ids and s.record.flow_run_ids[-1] in stopped:
            s.verdict, s.reason = "cancelled", f"flow run {s.record.flow_run_ids[-1]} was cancelled"
    return found


def restart(
    status: runs.RunStatus,
    stale_after_s: float,
    *,
    flow_run_id: str | None,
    log: Callable[[str], None] = print,
    on_incident: Callable[[dict], None] | None = None,
    **opts,
) -> dict[str, Any]:
    """Claim the run, check again under the claim (another recovery may have restarted it since the
    scan), stop ranks its dead launcher left, and train on from the latest durable checkpoint.
    Returns one row of the recovery table; a run that fails again is a row with ``failed``."""
    row = {
        "run_dir": status.run_dir,
        "found": status.verdict,
        "reason": status.reason,
        "checkpoint": status.checkpoint or "none (from step 0)",
    }
    try:
        with runs.hold(status.run_dir, f"recovery (flow run {flow_run_id})"):
            now = runs.inspect_run(status.run_dir, stale_after_s, **opts)
            if now.verdict == "finished":
                runs.mark_finished(status.run_dir)
                return {**row, "action": "marked completed", "result": now.reason}
            if not now.recover:
                return {**row, "action": "skipped", "result": f"{now.verdict}: {now.reason}"}
            if now.orphans:
                log(f"{status.run_dir}: stopping rank processes {now.orphans} left by the dead launcher")
                runs.stop_processes(now.orphans)
            cfg = runs.run_config(now.record)
            index = Path(now.record.data_index)
            if not index.exists():  # a cleaned data cache: rebuild it (content-addressed, same tokens)
                index = prepare_dataset(cfg.data, cfg.model.vocab_size, progress=False)
            row["checkpoint"] = now.checkpoint or "none (from step 0)"
            log(f"{status.run_dir}: restarting from {row['checkpoint']}")
            result = run_training(
                cfg, index, log=log, flow_run_id=flow_run_id, recovery=True, on_incident=on_incident
            )
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
