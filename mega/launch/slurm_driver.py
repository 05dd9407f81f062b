"""launcher.slurm.driver=allocation, the submitting side: one batch job for the whole run.

``run_driver_job`` submits one ``sbatch`` job of ``cluster.nodes`` + ``restart.spare_nodes``
nodes (``--no-kill``: a failed node does not end it) whose script runs the driver on the job's
first node: ``python -m mega.launch.in_allocation --config ... --data-index ...``, the restart loop
of ``run_training`` with each attempt an ``srun`` step of the same job (mega/launch/slurm_steps.py).
The submitting process (a login host, the flow) holds the run's claim (mega.launch.runs.hold),
passes the driver's log on as it grows, waits until Slurm says the job ended, and reads the
driver's result from the run directory (a shared filesystem). Secrets take the path of every Slurm
job: the private env file (mega/launch/slurm.py), never the script or the job's environment.
A job that loses its first node (the driver's: Slurm drops it from the still running job) is
cancelled and replaced by a job of one node fewer with that host in ``--exclude``, whose driver
continues the lost driver's loop state (``LOOP_FILE``: as carried, then before each attempt) from
``latest``.
The job is ``--requeue``: Slurm's warning (``--signal=B:USR1@<launcher.slurm.signal_grace_s>``)
reaches the batch shell, whose file each step's node tasks pass on to the ranks (as in
mega/launch/slurm.py); the driver then requeues the job (mega/launch/in_allocation.py), whose next
run (same id, its log appended to) resumes from the ranks' save.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mega import config as mega_config
from mega.cluster import rendezvous
from mega.launch import runs
from mega.launch.backend import JobSpec
from mega.launch.slurm import (
    EARLY_WARNING_TRAP,
    ENDED,
    READ_PRIVATE_ENV,
    SlurmBackend,
    SlurmError,
    exported_env,
    hostnames,
    job_info,
    job_state,
    sbatch_directives,
    wait_in_background,
    warning_trap,
)
from mega.launch.slurm_preflight import verdict_path
from mega.launch.slurm_steps import CARRIED_FILE, DRIVER, INSIDE_ENV, LOOP_FILE, driver_dir, warning_file
from mega.stability import membership

if TYPE_CHECKING:
    from mega.config import MegaConfig

RESULT_FILE = "result.json"  # the driver's TrainingResult (without metrics), or {"error": ...}


class DriverJobFailed(RuntimeError):
    pass


class DriverLost(DriverJobFailed):
    """The job lost its first node, where its driver ran (``host``)."""

    def __init__(self, message: str, host: str):
        super().__init__(message)
        self.host = host


def result_path(run_dir: str | Path) -> Path:
    return driver_dir(run_dir) / RESULT_FILE


def render_driver_sbatch(
    cfg: MegaConfig, job: JobSpec, python: str = "python", nodes: int | None = None, exclude: list[str] = ()
) -> str:
    """The run's one batch script: the nodes (with spares; ``nodes`` after a lost driver's node,
    ``exclude``), the setup lines, the secrets file read into the driver's environment, then the
    driver (``job``) on the first node."""
    s, spares = cfg.launcher.slurm, cfg.restart.spare_nodes
    nodes = nodes or cfg.cluster.nodes + spares
    lines = [
        "#!/bin/bash",
        f"# mega: the driver of one training run and its {nodes} node(s) ({cfg.cluster.nodes} + "
        f"{spares} spare), rendered by mega.launch.slurm_driver.",
        "# The driver runs here, on the first node; each attempt is an srun step of this job.",
        *(f"#SBATCH {d}" for d in sbatch_directives(cfg, job, exclude, nodes=nodes, requeue=True)),
        "#SBATCH --no-kill",
        EARLY_WARNING_TRAP,
        "set -euo pipefail",
        "",
        *(["# launcher.slurm.setup", *s.setup, ""] if s.setup else []),
        *exported_env(cfg, job),
        "# the secrets (mode 0600, written by the submitter): the driver and each step's tasks read them",
        "# shellcheck source=/dev/null",
        READ_PRIVATE_ENV,
        "",
        *warning_trap(warning_file(cfg.train.run_dir)),
        "# The driver runs in the background (SIGUSR1 ignored): this shell stays free to take the warning;",
        f"(trap '' USR1; exec {python} -m {job.module} {shlex.join(job.args)}) &",
        *wait_in_background("driver_pid"),
    ]
    return "\n".join(lines)


def driver_job(cfg: MegaConfig, index_path: Path, *, recovery: bool, flow_run_id: str | None) -> JobSpec:
    """The driver's job: its config saved without secrets next to the run, and its arguments."""
    run_dir = Path(cfg.train.run_dir).absolute()
    config_path = driver_dir(run_dir) / "config.json"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    mega_config.save(rendezvous.without_secrets(cfg), config_path)
    args = ["--config", str(config_path), "--data-index", str(Path(index_path).absolute())]
    args += ["--recovery"] if recovery else []
    args += ["--flow-run-id", flow_run_id] if flow_run_id else []
    return JobSpec("mega.launch.in_allocation", args, {INSIDE_ENV: "1"}, run_dir, DRIVER)


def run_driver_job(
    cfg: MegaConfig,
    index_path: Path,
    log: Callable[[str], None] = print,
    *,
    recovery: bool = False,
    flow_run_id: str | None = None,
    poll_s: float = 2.0,
    on_selfcheck: Callable[[dict], None] | None = None,
) -> dict:
    """Submit the run's job, wait for it and return the driver's result (``RESULT_FILE``); raises
    DriverJobFailed when the job ended without one (its state and log named). ``on_selfcheck``:
    called with each verdict of the driver's self-check of its nodes (mega.launch.slurm_preflight)
    as it appears."""
    run_dir = Path(cfg.train.run_dir).absolute()
    with runs.hold(run_dir, "slurm driver job (launcher.slurm.driver=allocation)"):
        backend = SlurmBackend(cfg, run_dir, log=log)
        if recovery and (cancelled := backend.cancel_run_jobs()):
            log(f"recovery: cancelled this run's Slurm job(s) {', '.join(cancelled)} before resubmitting")
        for path in (result_path(run_dir), *(driver_dir(run_dir) / f for f in (CARRIED_FILE, LOOP_FILE))):
            path.unlink(missing_ok=True)  # an earlier launch's
        verdict_path(run_dir).unlink(missing_ok=True)
        verdicts = _Verdicts(verdict_path(run_dir), on_selfcheck, log)
        nodes, exclude = cfg.cluster.nodes + cfg.restart.spare_nodes, []
        try:
            while True:  # one job, or one more each time a job loses its driver's node
                job = backend.private(driver_job(cfg, index_path, recovery=recovery, flow_run_id=flow_run_id))
                script = render_driver_sbatch(cfg, job, sys.executable, nodes=nodes, exclude=exclude)
                job_id = backend.submit(DRIVER, script)
                log(f"submitted Slurm job {job_id}: the driver and {nodes} node(s) of this run")
                try:
                    _wait(job_id, run_dir, log, poll_s, verdicts)
                    break
                except DriverLost as e:
                    backend.cancel_run_jobs()
                    nodes, exclude = _resubmission(cfg, run_dir, e.host, str(e), log)
                    recovery = False
        except BaseException:
            backend.cancel_run_jobs()  # Ctrl-C or an error here: the job does not run on unwatched
            raise
        finally:
            backend.secrets_file.unlink(missing_ok=True)
    try:
        return json.loads(result_path(run_dir).read_text())
    except (OSError, ValueError):
        state = job_state(job_id) or "(forgotten by Slurm)"
        raise DriverJobFailed(
            f"Slurm job {job_id} ended {state} without the driver's result; see {run_dir}/slurm-{job_id}.out"
        ) from None


def _resubmission(
    cfg: MegaConfig, run_dir: Path, host: str, why: str, log: Callable[[str], None]
) -> tuple[int, list[str]]:
    """After the job lost its driver's node ``host``: the next job's size and ``--exclude`` (every
    host the run lost), and what its driver continues with in ``CARRIED_FILE``: the lost driver's
    last loop state (``LOOP_FILE``), the lost attempt counted as a failure, the config shrunk to
    the hosts left when no spare of the job is (``restart.min_nodes``). Raises DriverJobFailed (for
    a recovery) when neither a spare nor ``restart.min_nodes`` fits or the failure budget is spent."""
    d = driver_dir(run_dir)
    source = next((p for p in (d / CARRIED_FILE, d / LOOP_FILE) if p.exists()), None)
    carried = json.loads(source.read_text()) if source else _fresh(cfg)
    excluded = sorted({*carried["excluded_hosts"], host})
    carried.update(failures=carried["failures"] + 1, excluded_hosts=excluded)
    carried["history"].append({"attempt": _last_attempt(run_dir), "reason": why, "excluded_hosts": [host]})
    nodes = cfg.cluster.nodes + cfg.restart.spare_nodes - len(excluded)  # the job's hosts not lost
    current = mega_config.from_dict(carried["config"])
    if nodes < current.cluster.nodes:  # no spare of the job left
        floor = cfg.restart.min_nodes
        try:
            if floor is None or nodes < floor:
                raise membership.CannotContinue(f"no spare of the job left, restart.min_nodes={floor}")
            carried["config"] = mega_config.to_dict(membership.resize(current, nodes))
        except membership.CannotContinue as e:
            raise DriverJobFailed(f"{why}; the job is cancelled ({e}): a recovery restarts the run") from None
    if carried["failures"] > cfg.restart.max_restarts:
        limit = f"restart.max_restarts={cfg.restart.max_restarts}"
        raise DriverJobFailed(f"{why}; the job is cancelled ({limit}): a recovery restarts the run")
    (d / CARRIED_FILE).write_text(json.dumps(carried, default=str))
    (d / LOOP_FILE).unlink(missing_ok=True)  # the next driver writes its own
    shrunk = f", continuing on {nodes} node(s)" if nodes < current.cluster.nodes else ""
    left = f"without {', '.join(excluded)}{shrunk} (failure {carried['failures']})"
    log(f"{why}; the job is cancelled and the run resubmitted {left}")
    return nodes, excluded


def _fresh(cfg: MegaConfig) -> dict:
    """The loop state of a driver lost before its first attempt."""
    config = mega_config.to_dict(rendezvous.without_secrets(cfg))
    return {"config": config, "failures": 0, "requeues": 0, "history": [], "env": {}, "excluded_hosts": []}


def _last_attempt(run_dir: Path) -> int | None:
    """The number of the run's last launched attempt (its record), None before any."""
    try:
        return json.loads((run_dir / "run.json").read_text())["attempts"] - 1
    except (OSError, ValueError, KeyError):
        return None


def driver_lost(info: dict[str, str]) -> str | None:
    """The driver's host when Slurm took it out of the still running job (``job_info``): with
    ``--no-kill`` the job lives on without its driver, which nothing would end before the time limit."""
    batch = info.get("BatchHost")
    if info.get("JobState") != "RUNNING" or not batch or batch == "(null)":
        return None
    try:
        return None if batch in hostnames(info.get("NodeList", "")) else batch
    except SlurmError:  # scontrol did not answer this time: judged at the next poll
        return None


class _Verdicts:
    """Passes each new verdict of the driver's self-check (a new version of ``path``) to ``on``;
    ``on`` failing (a report not published) is logged: it never stops the wait, nor the job."""

    def __init__(self, path: Path, on: Callable[[dict], None] | None, log: Callable[[str], None] = print):
        self.path, self.on, self.log, self.seen = path, on, log, None

    def poll(self) -> None:
        try:
            stamp = self.path.stat().st_mtime_ns
            if self.on is None or stamp == self.seen:
                return
            verdict = json.loads(self.path.read_text())
        except (OSError, ValueError):  # not there yet, or being written: the next poll
            return
        self.seen = stamp
        try:
            self.on(verdict)
        except Exception as e:
            self.log(f"self-check verdict {self.path}: on_selfcheck failed: {type(e).__name__}: {e}")


def _wait(job_id: str, run_dir: Path, log: Callable[[str], None], poll_s: float, verdicts: _Verdicts) -> None:
    """Until Slurm says the job ended: pass each new line of the driver's log on to ``log`` and
    each self-check verdict on. Raises DriverJobFailed when the job lost its driver's node (the
    caller cancels the job)."""
    driver_log = run_dir / f"slurm-{job_id}.out"
    seen, partial = 0, b""
    while True:
        info = job_info(job_id)
        # first: once ended, the log and the verdicts are complete (a verdict written just
        # before the job ended, a failed check's, is passed on before the wait returns)
        ended = not info or info.get("JobState") in ENDED
        verdicts.poll()
        if lost := driver_lost(info):
            raise DriverLost(f"Slurm job {job_id} lost its first node {lost}, where its driver ran", lost)
        if driver_log.exists():
            with open(driver_log, "rb") as f:
                f.seek(seen)
                new = f.read()
            seen += len(new)
            *lines, partial = (partial + new).split(b"\n")
            for line in lines:
                log(line.decode(errors="replace"))
        if ended:
            if partial:
                log(partial.decode(errors="replace"))
            return
        time.sleep(poll_s)
