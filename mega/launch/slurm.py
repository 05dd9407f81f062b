"""launcher=slurm: one torchrun agent per Slurm node, the first host of the allocation the master.

Two forms of the same launch:

* ``render_sbatch(cfg, job)``: a complete sbatch script (``python -m mega.launch.slurm render
  [overrides] --data-index PATH --out DIR`` writes one) -- ``#SBATCH`` resources from
  ``launcher.slurm`` and ``cluster``, the setup lines, ``cluster.env`` exported, the master taken
  from ``scontrol show hostnames``, and ``srun`` starting one task per node that runs
  ``torchrun --node-rank=$SLURM_NODEID``, logging to ``<log_dir>/nodes/<k>/``. One attempt; a
  failing node ends every node (``srun --kill-on-bad-exit``).
* ``SlurmBackend(cfg, run_dir)``: the driver's backend (``mega.launch.backend.Backend``), through
  submitit: each attempt is one submitit job of ``cluster.nodes`` tasks, one per node, each task
  running ``run_node`` -- the node's rank and the master's host come from submitit's
  ``JobEnvironment``. ``poll`` reads every node's exit code, ``stop`` cancels the job (``scancel``)
  and waits until Slurm reports it ended. With ``cluster="local"`` submitit's LocalExecutor runs
  the tasks as local processes (task k plays node k): the tests, and a dry run without Slurm.

A Redis password (``cluster.store=redis``) is never written into the script or submitit's pickles:
it travels in the environment ``sbatch`` is called from (``--export=ALL``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from mega.cluster import rendezvous
from mega.config import ConfigError
from mega.launch.backend import JobSpec, agent_argv

if TYPE_CHECKING:
    from mega.config import MegaConfig

NODE_LOST = -1  # poll(): the node's task ended without reporting an exit code (killed, node lost)
PYTHON = "python"  # the interpreter on the nodes, after launcher.slurm.setup (a venv, a module, a container)


# ---------------------------------------------------------------------------------------------
# Config -> Slurm


def slurm_minutes(text: str) -> int:
    """Slurm's ``--time`` formats (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) -> whole minutes."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(text).strip())
    if not m:
        raise ConfigError("launcher.slurm.time", f"not a Slurm time limit: {text!r} (e.g. 04:00:00 or 2-00:00:00)")
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if days is not None:  # D-H[:M[:S]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # H:M:S
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # M:S
        seconds = a * 60 + b
    else:  # M
        seconds = a * 60
    if seconds <= 0:
        raise ConfigError("launcher.slurm.time", f"must be positive, got {text!r}")
    return -(-seconds // 60)


def check(cfg: "MegaConfig") -> None:
    """What Slurm would refuse or misrun, named by key, before anything is submitted."""
    s = cfg.launcher.slurm
    slurm_minutes(s.time)
    if s.cpus_per_task is not None and s.cpus_per_task < 1:
        raise ConfigError("launcher.slurm.cpus_per_task", f"must be >= 1 or null, got {s.cpus_per_task}")
    if cfg.cluster.store == "redis" and cfg.cluster.redis_url is None:
        raise ConfigError("cluster.redis_url", "launcher=slurm with cluster.store=redis needs a Redis server "
                                               "every node reaches: set cluster.redis_url")


def gpus_per_node(cfg: "MegaConfig") -> int:
    return cfg.cluster.procs_per_node if cfg.cluster.device == "cuda" else 0


def master_port(cfg: "MegaConfig", job_id: str) -> int:
    """``launcher.rdzv_port``, or (0) a port every node derives from the Slurm job id alike."""
    return cfg.launcher.rdzv_port or 20000 + zlib.crc32(job_id.encode()) % 20000


def _shell_word(token: str, variables: dict[str, str]) -> str:
    """``token`` quoted for the shell, with each placeholder in it expanded as ``"${VAR}"``."""
    parts = re.split("(" + "|".join(map(re.escape, variables)) + ")", token)
    return "".join(f'"${{{variables[p]}}}"' if p in variables else (shlex.quote(p) if p else "") for p in parts)


def render_sbatch(cfg: "MegaConfig", job: JobSpec, python: str = PYTHON) -> str:
    """The sbatch script of one attempt of ``job`` on ``cluster.nodes`` nodes."""
    check(cfg)
    c, s = cfg.cluster, cfg.launcher.slurm
    nodes, gpus = c.nodes, gpus_per_node(cfg)
    log_dir = Path(job.log_dir).absolute()
    sbatch = [f"--job-name={job.name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    if gpus:
        sbatch.append(f"--gpus-per-node={gpus}")
    if s.cpus_per_task:
        sbatch.append(f"--cpus-per-task={s.cpus_per_task}")
    if s.mem is not None:
        sbatch.append(f"--mem={s.mem}")
    sbatch.append(f"--time={s.time}")
    for key in ("partition", "account", "qos"):
        if getattr(s, key):
            sbatch.append(f"--{key}={getattr(s, key)}")
    if s.exclusive:
        sbatch.append("--exclusive")
    sbatch += [f"--output={log_dir}/slurm-%j.out", "--export=ALL"]

    placeholders = {"@NODE_RANK@": "SLURM_NODEID", "@MASTER_ADDR@": "MASTER_ADDR", "@MASTER_PORT@": "MASTER_PORT"}
    argv = agent_argv(cfg, "@NODE_RANK@", "@MASTER_ADDR@", "@MASTER_PORT@", job, python=python)
    log = _absolute(job).log_path("@NODE_RANK@", nodes)
    node = (f"mkdir -p {_shell_word(str(log.parent), placeholders)} && "
            f"exec {' '.join(_shell_word(a, placeholders) for a in argv)} >> {_shell_word(str(log), placeholders)} 2>&1")
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if s.cpus_per_task:
        srun.append(f"--cpus-per-task={s.cpus_per_task}")  # srun no longer inherits it (Slurm >= 22.05)
    if s.container_image:
        srun.append(f"--container-image={s.container_image}")
    port = str(cfg.launcher.rdzv_port) if cfg.launcher.rdzv_port else "$((20000 + SLURM_JOB_ID % 20000))"

    lines = [
        "#!/bin/bash",
        f"# mega: one attempt ({job.name}) of a training job on {nodes} node(s) x {c.procs_per_node} processes,",
        "# rendered from the config by mega.launch.slurm. The driver relaunches failed attempts from",
        "# `latest` (docs/cluster.md); submitted by hand, this script runs one attempt.",
        *(f"#SBATCH {d}" for d in sbatch),
        "set -euo pipefail",
        "",
    ]
    if s.setup:
        lines += ["# launcher.slurm.setup", *s.setup, ""]
    env = {**c.env, **rendezvous.public_env(job.env)}
    if env:
        lines += ["# cluster.env presets and this attempt's variables, exported to every node (srun)"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
        lines.append("")
    if c.store == "redis":
        lines += [f"# ${rendezvous.REDIS_PASSWORD_ENV}, if the server needs one, comes from the environment sbatch",
                  "# was called in (--export=ALL), never from this file.", ""]
    lines += [
        "# The master is the first host of the allocation: node 0's agent serves the rendezvous there.",
        "# (sed reads every line: `head -n 1` would let scontrol die of SIGPIPE, fatal under pipefail.)",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"MASTER_PORT={port}",
        "export MASTER_ADDR MASTER_PORT",
        f"mkdir -p {shlex.quote(str(log_dir))}",
        "",
        "# One task per node, each a torchrun agent whose node rank is its SLURM_NODEID; a node that",
        "# fails ends every node (--kill-on-bad-exit). The single quotes are meant: each node's bash",
        "# expands SLURM_NODEID (and the master, exported above) for itself.",
        "# shellcheck disable=SC2016",
        " ".join(srun) + " \\",
        f"  bash -c {shlex.quote(node)}",
        "",
    ]
    return "\n".join(lines)


def _absolute(job: JobSpec) -> JobSpec:
    return JobSpec(job.module, list(job.args), dict(job.env), Path(job.log_dir).absolute(), job.name)


# ---------------------------------------------------------------------------------------------
# The driver's backend, through submitit


def executor_parameters(cfg: "MegaConfig", cluster: str) -> dict:
    """submitit's AutoExecutor parameters for one attempt (generic names, ``slurm_`` the rest)."""
    check(cfg)
    c, s = cfg.cluster, cfg.launcher.slurm
    params = {
        "nodes": c.nodes if cluster == "slurm" else 1,
        # Slurm: one task per node; the local executor has one host, where task k plays node k.
        "tasks_per_node": 1 if cluster == "slurm" else c.nodes,
        "timeout_min": slurm_minutes(s.time),
    }
    if cluster == "slurm":
        params.update(gpus_per_node=gpus_per_node(cfg) or None, cpus_per_task=s.cpus_per_task,
                      slurm_partition=s.partition, slurm_account=s.account, slurm_qos=s.qos,
                      slurm_mem=s.mem, slurm_exclusive=s.exclusive or None, slurm_setup=list(s.setup) or None,
                      slurm_srun_args=[f"--container-image={s.container_image}"] if s.container_image else None)
    return {k: v for k, v in params.items() if v is not None}


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _submission_environment(secrets: dict[str, str]) -> Iterator[None]:
    """The secrets in this process's environment while submitting: ``sbatch`` (and the local
    executor's controller) hand it to the tasks, and nothing is written to disk."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in secrets}
        os.environ.update(secrets)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class SlurmBackend:
    """``Backend`` on Slurm through submitit: one submitit job per attempt, one task per node."""

    def __init__(self, cfg: "MegaConfig", run_dir: str | Path, *, cluster: str = "slurm",
                 stop_timeout_s: float = 300.0):
        import submitit

        if cluster not in ("slurm", "local"):
            raise ValueError(f"cluster must be 'slurm' or 'local' (submitit's LocalExecutor), got {cluster!r}")
        self.cfg = rendezvous.without_secrets(cfg)
        self.cluster = cluster
        self.stop_timeout_s = stop_timeout_s
        self.folder = Path(run_dir).absolute() / "slurm"
        self.executor = submitit.AutoExecutor(folder=self.folder / "%j", cluster=cluster)
        self.executor.update_parameters(**executor_parameters(cfg, cluster))
        self._job = None

    @property
    def job_id(self) -> str | None:
        return None if self._job is None else str(self._job.job_id)

    def start(self, job: JobSpec) -> None:
        if self._job is not None and not self._job.done():
            raise RuntimeError(f"job {self._job.job_id} is still running: stop() it first")
        self.executor.update_parameters(name=job.name)
        port = self.cfg.launcher.rdzv_port
        if self.cluster == "local" and not port:
            port = _free_port()  # one host: the driver can pick it
        public = JobSpec(job.module, list(job.args), rendezvous.public_env(job.env), Path(job.log_dir).absolute(), job.name)
        secrets = {k: v for k, v in job.env.items() if k not in public.env}
        with _submission_environment(secrets):
            self._job = self.executor.submit(run_node, self.cfg, public, port)

    def poll(self) -> dict[int, int | None]:
        if self._job is None:
            return {}
        ended = self._job.done()  # first: a task reports its exit code before it ends
        codes: dict[int, int | None] = {}
        for k in range(self.cfg.cluster.nodes):
            path = _exit_file(Path(self._job.paths.folder), k)
            if path.exists():
                codes[k] = int(json.loads(path.read_text())["exit_code"])
            else:
                codes[k] = NODE_LOST if ended else None
        return codes

    def stop(self) -> None:
        """End the attempt and wait until the job has: Slurm kills every process of a job step
        (scancel), and ``run_node`` kills its agent's whole process tree on the way out (locally
        the only guarantee). A job whose nodes all reported is given a moment to end by itself."""
        job = self._job
        if job is None or self._ended(job):
            return
        if all(code is not None for code in self.poll().values()):
            try:
                self._wait_ended(job, timeout_s=10.0)
                return
            except TimeoutError:
                pass  # every node reported but the job lingers: cancel it
        if self.cluster == "slurm":
            job.cancel(check=False)  # scancel
        else:
            # The local controller (its pid is the job id) forwards SIGTERM to the node tasks and
            # returns once they are gone; cancel()'s SIGINT would leave a KeyboardInterrupt trace.
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(job.job_id), signal.SIGTERM)
        self._wait_ended(job, timeout_s=self.stop_timeout_s)

    def _ended(self, job) -> bool:
        return job.done(force_check=True) if self.cluster == "slurm" else job.done()

    def _wait_ended(self, job, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ended(job):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.cluster} job {job.job_id} has not ended {timeout_s:.0f} s after being stopped")
            time.sleep(2.0 if self.cluster == "slurm" else 0.1)

    def close(self) -> None:
        self.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_file(folder: Path, node: int) -> Path:
    return folder / f"node-{node}.exit.json"


# ---------------------------------------------------------------------------------------------
# One node (a submitit task)


class _Stopped(Exception):
    pass


def _raise_stopped(signum, frame):  # noqa: ARG001 - signal handler signature
    raise _Stopped(signal.Signals(signum).name)


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(option, value, 0, 0, 0)


_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def _kill_descendants() -> list[int]:
    """SIGKILL every process below this one (as child subreaper, orphans of a dead agent -- its
    ranks run in sessions of their own -- are still below it); wait until they are gone."""
    import psutil

    procs = psutil.Process().children(recursive=True)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=30)
    return [p.pid for p in procs]


def run_node(cfg: "MegaConfig", job: JobSpec, port: int) -> int:
    """The submitit task of one node: run its torchrun agent to the end and report its exit code.

    Node rank = the task's global rank (one task per node); the master = the first host of the
    allocation (locally 127.0.0.1). No process of the node outlives this function: on SIGTERM or
    SIGINT (scancel, the local controller) and after the agent ends, every descendant is killed.
    """
    import submitit

    env = submitit.JobEnvironment()
    if env.num_tasks != cfg.cluster.nodes:
        raise RuntimeError(f"the job has {env.num_tasks} tasks, cluster.nodes={cfg.cluster.nodes}: "
                           "one task per node (--ntasks-per-node=1)")
    node = env.global_rank
    master = "127.0.0.1" if env.cluster == "local" else env.hostnames[0]
    port = port or master_port(cfg, str(env.raw_job_id))
    argv = agent_argv(cfg, node, master, port, job)
    log = job.log_path(node, cfg.cluster.nodes)
    log.parent.mkdir(parents=True, exist_ok=True)

    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGINT)}
    code = NODE_LOST
    try:
        with open(log, "ab") as out:
            out.write(f"[mega] node {node}/{cfg.cluster.nodes} on {env.hostname}, master {master}:{port}: "
                      f"{shlex.join(argv)}\n".encode())
            out.flush()
            agent = subprocess.Popen(argv, env={**os.environ, **cfg.cluster.env, **job.env}, stdout=out,
                                     stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL))
            code = agent.wait()
    except _Stopped:
        code = -signal.SIGTERM
    finally:
        _kill_descendants()  # the ranks of an agent that died, or of a stopped node
        for s, handler in previous.items():
            signal.signal(s, handler)
        path = _exit_file(Path(env.paths.folder), node)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"node": node, "exit_code": code, "host": env.hostname}))
        os.replace(tmp, path)
    return code


# ---------------------------------------------------------------------------------------------
# CLI


def check_args(argv: list[str]) -> "MegaConfig":
    """Validate ``render`` arguments without writing anything (mega.launch.render.check)."""
    from mega.launch import render

    return render.check_args(argv, prog="python -m mega.launch.slurm", what="an sbatch script")


def main(argv: list[str] | None = None) -> int:
    from mega.launch import render

    return render.cli(argv, prog="python -m mega.launch.slurm", what="an sbatch script",
                      write=lambda cfg, job, out: _write_script(cfg, job, out))


def _write_script(cfg: "MegaConfig", job: JobSpec, out: Path) -> list[Path]:
    Path(job.log_dir).mkdir(parents=True, exist_ok=True)  # sbatch opens --output there before the script runs
    path = out / f"{job.name}.sbatch"
    path.write_text(render_sbatch(cfg, job))
    path.chmod(0o755)
    return [path]


if __name__ == "__main__":
    sys.exit(main())
