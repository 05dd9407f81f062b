"""The driver inside its Slurm allocation (launcher.slurm.driver=allocation): ``python -m
mega.launch.in_allocation --config PATH --data-index PATH [--recovery] [--flow-run-id ID]``.

The run's batch job (mega/launch/slurm_driver.py) runs this on its first node: ``run_training``,
whose backend there starts each attempt as an ``srun`` step of the same job
(mega/launch/slurm_steps.py), then the result for the submitting process in
``<run_dir>/slurm/driver/result.json`` (``{"error": ...}`` when training failed).

When Slurm's warning (time limit, preemption) ended an attempt and its ranks saved, the driver
lets go of its servers, leaves its budgets and history in ``<run_dir>/slurm/driver/requeued.json``
and requeues its own job (``scontrol requeue``, which ends this process): the job's next run (same
id, after Slurm's ``cred_expire``) starts this driver again, which resumes from that save.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from mega import config as mega_config
from mega.launch.driver import JobRequeued, TrainingFailed, run_training
from mega.launch.slurm import SlurmError, slurm_command
from mega.launch.slurm_driver import result_path
from mega.launch.slurm_steps import CARRIED_FILE, LOOP_FILE, driver_dir

REQUEUE_WAIT_S = 60.0  # after `scontrol requeue`: Slurm ends this process with the job's first run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mega.launch.in_allocation", description=__doc__)
    p.add_argument("--config", required=True, type=Path, help="the run's config (JSON, without secrets)")
    p.add_argument("--data-index", required=True, type=Path)
    p.add_argument("--recovery", action="store_true", help="a restart by the recovery flow")
    p.add_argument("--flow-run-id", default=None, help="the flow run that submitted the job")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = mega_config.load(args.config)
    out = result_path(cfg.train.run_dir)

    def log(line: str) -> None:
        print(line, flush=True)

    log(f"driver on {socket.gethostname()} in Slurm job {os.environ.get('SLURM_JOB_ID')}")
    carried = _take_carried(cfg.train.run_dir, log)
    try:
        result = run_training(
            cfg,
            args.data_index,
            log=log,
            flow_run_id=args.flow_run_id,
            recovery=args.recovery,
            carried=carried,
        )
    except JobRequeued as e:
        return _requeue(cfg.train.run_dir, e.carried, log)
    except TrainingFailed as e:
        out.write_text(json.dumps({"error": str(e)}))
        log(f"training failed: {e}")
        return 1
    row = {"attempts": result.attempts, "final_step": result.final_step, "init": result.init}
    out.write_text(json.dumps({**row, "history": result.history}, default=str))
    return 0


def _take_carried(run_dir: str | Path, log) -> dict | None:
    """What the previous run of this requeued job left, or the submitter for a job replacing one
    that lost its driver's node (None: neither)."""
    path = driver_dir(run_dir) / CARRIED_FILE
    if not path.exists():
        if int(os.environ.get("SLURM_RESTART_COUNT", "0")):
            log("this job was requeued by Slurm, not by its driver: resuming from `latest`")
        return None
    carried = json.loads(path.read_text())
    # the loop state until this driver writes its own: a submitter that loses this job's first
    # node before then carries it on (mega.launch.slurm_driver._resubmission), not a fresh one
    path.replace(path.with_name(LOOP_FILE))
    excluded = ", ".join(carried["excluded_hosts"]) or "none"
    log(
        f"continuing the run (job run {os.environ.get('SLURM_RESTART_COUNT', '0')}): requeue "
        f"{carried['requeues']}, {carried['failures']} failure(s) so far, hosts excluded: {excluded}"
    )
    return carried


def _requeue(run_dir: str | Path, carried: dict, log) -> int:
    """Leave ``carried`` for the job's next run, then ask Slurm to requeue the job: the last thing
    this driver does (Slurm ends it with the job). A refusal is the run's error."""
    job_id = os.environ["SLURM_JOB_ID"]
    path = driver_dir(run_dir) / CARRIED_FILE
    path.write_text(json.dumps(carried, default=str))
    log(f"requeueing Slurm job {job_id}: its next run resumes from the save")
    try:
        slurm_command("scontrol", "requeue", job_id)
    except SlurmError as e:
        path.unlink(missing_ok=True)
        result_path(run_dir).write_text(json.dumps({"error": f"could not requeue Slurm job {job_id}: {e}"}))
        log(str(e))
        return 1
    time.sleep(REQUEUE_WAIT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
