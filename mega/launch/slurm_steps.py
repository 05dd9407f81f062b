"""launcher.slurm.driver=allocation, inside the job: each attempt one ``srun`` job step.

The run's batch job (mega/launch/slurm_driver.py renders it) holds ``cluster.nodes`` +
``restart.spare_nodes`` nodes and runs the driver on its first node; ``SlurmStepBackend``
is that driver's backend. An attempt is ``srun --nodes=N --nodelist=<hosts> ... bash -c <node task>``
(the node task of mega/launch/slurm.py: secrets file, exit files, one torchrun agent per node) on
the first N hosts of the allocation that are not excluded: a lost host is left out of the next
step's ``--nodelist`` and a spare takes its place, with no new submission and no queue wait. The
job is submitted with ``--no-kill``, so Slurm does not end it when one of its nodes fails.

* ``stop()``: SIGTERM to the step (each node's task reports it in its exit file, then ends) and a
  bounded wait for ``srun``; a node whose task reported nothing by then is lost, named by
  ``lost_hosts()`` like a node Slurm holds down.
* Steps may overlap (``--overlap``): a step left on a lost node until Slurm judges it does not hold
  the next step's CPUs on the live ones.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mega import ports
from mega.launch.backend import JobSpec
from mega.launch.slurm import (
    SlurmBackend,
    hostnames,
    is_secret,
    job_env,
    node_task,
    signal_steps,
    slurm_command,
    srun_argv,
    unusable,
)

if TYPE_CHECKING:
    from mega.config import MegaConfig

# set by the driver job's script: this process is the driver inside its own allocation
INSIDE_ENV = "MEGA_SLURM_DRIVER_JOB"
DRIVER = "driver"  # the job's name part and its folder under <run_dir>/slurm/
# what a driver whose job Slurm requeues hands the next run of the job (mega.launch.in_allocation)
CARRIED_FILE = "requeued.json"
# the driver's loop state (what it was carried at its start, then before each attempt): what the
# submitter carries into a new job when this job loses the driver's node (mega.launch.slurm_driver)
LOOP_FILE = "loop.json"


def driver_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/slurm/driver``: the driver job's script, config, result and warning file."""
    return Path(run_dir).absolute() / "slurm" / DRIVER


def warning_file(run_dir: str | Path) -> Path:
    """The file the driver job's shell leaves on Slurm's warning: each step's node tasks watch it."""
    return driver_dir(run_dir) / "signalled"


def drives_in_allocation(cfg: MegaConfig) -> bool:
    """Whether ``cfg``'s driver runs inside the run's allocation (launcher.slurm.driver=allocation)."""
    return cfg.launcher.name == "slurm" and cfg.launcher.slurm.driver == "allocation"


def inside_allocation(cfg: MegaConfig) -> bool:
    """Whether this process is that driver (in the job, on its first node)."""
    return drives_in_allocation(cfg) and bool(os.environ.get(INSIDE_ENV)) and "SLURM_JOB_ID" in os.environ


class SlurmStepBackend(SlurmBackend):
    """``Backend`` inside the run's allocation: one ``srun`` step per attempt, on hosts of the job."""

    def __init__(self, cfg: MegaConfig, run_dir: str | Path, **kwargs):
        super().__init__(cfg, run_dir, **kwargs)
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.allocated = hostnames(os.environ["SLURM_JOB_NODELIST"])
        self._srun: subprocess.Popen | None = None
        self._step_name = ""

    def hosts(self) -> list[str]:
        return self._hosts

    def _pick_hosts(self) -> list[str]:
        excluded = {*self.excluded, *self.cfg.launcher.slurm.exclude}
        free = [h for h in self.allocated if h not in excluded]
        n = self.cfg.cluster.nodes
        if len(free) < n:
            raise RuntimeError(
                f"{n} node(s) needed, {len(free)} of the allocation left ({', '.join(free)}); "
                f"excluded: {', '.join(sorted(excluded))}"
            )
        return free[:n]

    def start(self, job: JobSpec) -> None:
        if self._srun is not None and self._srun.poll() is None:
            raise RuntimeError(
                f"step {self._step_name} of job {self.job_id} is still running: stop() it first"
            )
        hosts = self._pick_hosts()
        public = self.private(job)
        attempt_dir = self.folder / job.name
        self._exit_dir = attempt_dir / "exit"
        shutil.rmtree(self._exit_dir, ignore_errors=True)
        self._exit_dir.mkdir(parents=True)
        port = self.cfg.launcher.rdzv_port or ports.free_ports(1)[0]  # free on this host: node 0's
        env = {k: v for k, v in os.environ.items() if not is_secret(k)}
        env.update(job_env(self.cfg, public), MASTER_ADDR=hosts[0], MASTER_PORT=str(port))
        self._step_name = job.name
        argv = [
            *srun_argv(self.cfg, public, env.get("SLURM_CPUS_ON_NODE", "1"), nodelist=hosts),
            f"--job-name={job.name}",
            "--overlap",
            "bash",
            "-c",
            node_task(self.cfg, public, sys.executable, self._exit_dir, warning_file(self.folder.parent)),
        ]
        (attempt_dir / "srun.sh").write_text(shlex.join(argv) + "\n")  # for a person to read
        self._output = attempt_dir / "srun.log"  # appended to by every step of this name: read from here
        self._output_from = self._output.stat().st_size if self._output.exists() else 0
        with open(self._output, "ab") as out:
            self._srun = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self._hosts, self._stuck_hosts = hosts, []

    def _ended(self) -> bool:
        return self._srun is None or self._srun.poll() is not None

    def _step_ids(self) -> list[str]:
        out = slurm_command("squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j", check=False)
        return [
            i
            for i, name in (line.split(None, 1) for line in out.splitlines() if " " in line)
            if name == self._step_name
        ]

    def stop(self) -> None:
        """SIGTERM to the step's tasks (each reports it, then ends), a wait for ``srun`` of at most
        ``stop_timeout_s``, then ``scancel`` of the step; nodes whose task reported nothing are lost
        (``lost_hosts``), never this driver's own."""
        if not self._ended():
            steps = self._step_ids()
            if steps:
                if error := signal_steps(steps, "TERM"):
                    self.log(f"step {self._step_name} of job {self.job_id}: SIGTERM not sent: {error}")
            else:
                self._srun.terminate()  # the step is not in squeue yet: srun ends it
            try:
                self._srun.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.log(
                    f"step {self._step_name} of job {self.job_id}: still running after SIGTERM; cancelling it"
                )
                if steps:
                    slurm_command("scancel", *steps, check=False)
                self._srun.kill()
                self._srun.wait(30)
        self._stuck_hosts = [h for h in self._silent_hosts() if h != socket.gethostname()]
        if self._stuck_hosts:
            self.log(
                f"step {self._step_name} of job {self.job_id}: no report from {', '.join(self._stuck_hosts)}"
            )

    def _silent_hosts(self) -> list[str]:
        """The step's hosts whose task reported nothing and was not killed by the step's abort for
        another node (``unreported_lost``): the node is lost."""
        return [self._hosts[k] for k in self.unreported_lost(self._reported()) if k < len(self._hosts)]

    def usable_nodes(self) -> int:
        """Hosts of the allocation that are up and not excluded."""
        out = slurm_command("sinfo", "-h", "-N", "-n", ",".join(self.allocated), "-o", "%N %t", check=False)
        states = dict(line.split() for line in out.splitlines() if line.strip())
        excluded = {*self.excluded, *self.cfg.launcher.slurm.exclude}
        return sum(1 for h in self.allocated if h not in excluded and not unusable(states.get(h, "down")))

    def close(self) -> None:
        """Stop the step; the secrets file stays: it is the submitter's, read again by a requeued job."""
        self.stop()

    def cancel_run_jobs(self) -> list[str]:
        """Nothing: the submitting process cancelled the run's old jobs before it submitted this one."""
        return []
