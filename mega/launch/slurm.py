"""launcher=slurm: one torchrun agent per Slurm node, the first host of the allocation the master.

Each attempt of a job is one ``sbatch`` of the script ``render_sbatch(cfg, job)`` writes (``python
-m mega.launch.slurm render [overrides] --data-index PATH --out DIR`` writes the same file for a
person to read or submit): ``#SBATCH`` resources from ``launcher.slurm`` and ``cluster``, the
setup lines, the master (the batch host: the allocation's first node) with a port free there, and
``srun`` starting one task per node that runs ``torchrun --node-rank=$SLURM_NODEID``, logging to
``<log_dir>/nodes/<k>/``. Each node's task writes its agent's exit code to ``<exit dir>/node-<k>``.

* Signals: ``--signal=B:USR1@<launcher.slurm.signal_grace_s>`` before the time limit (or on
  preemption) reaches the batch shell, which exists from the job's start (a warning sent to job
  steps before ``srun`` started one would be lost); it creates ``<exit dir>/signalled``, which every
  node's task watches and answers by passing SIGUSR1 to its ranks: they finish the step,
  save a checkpoint and exit; the node reports ``PREEMPTED`` and the driver resubmits from that
  save (in its allocation: requeues its own job), counted apart from failures
  (``launcher.slurm.max_requeues``).
* Secrets (passwords, tokens, ``AWS_SECRET_ACCESS_KEY``...) are never in the script nor in the
  environment ``sbatch`` sends to slurmctld (which stores it): they go to a file readable only by
  the user (``launcher.slurm.secrets_dir``, default the run's ``slurm/``), which each node's task
  reads just before starting its agent.
* ``SlurmBackend``: the driver's backend; ``exclude(host)`` keeps a host out of every later attempt
  (``--exclude``), ``stop()`` is ``scancel`` and a bounded wait (nodes stuck in COMPLETING are
  named, not waited for), ``server_host`` the address servers for the ranks listen on.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mega import ports
from mega.cluster import rendezvous
from mega.config import ConfigError
from mega.launch.backend import JobSpec, agent_argv
from mega.launch.watch import NODE_LOST
from mega.stability import exit_signal

if TYPE_CHECKING:
    from mega.config import MegaConfig

STOPPED = 143  # a node's task ended by Slurm, not by its own failure: scancel, or its step aborted
# a node's task whose agent was SIGKILLed (srun's abort of a step, the OOM killer)
KILLED = 128 + signal.SIGKILL
# srun's line when it cannot start a step's task on a node: the step is aborted and the tasks it
# started on the other nodes are killed without a report (they are STOPPED; the named node is lost).
# Before Slurm 20.11 the step id has no "StepId=".
LAUNCH_FAILED = re.compile(r"Task launch for (?:StepId=)?\S+ failed on node ([^\s:]+)")
PREEMPTED = exit_signal.EXIT_CODE  # a node's ranks saved and exited on Slurm's signal: the driver requeues
PYTHON = "python"  # the interpreter on the nodes, after launcher.slurm.setup (a venv, a module, a container)


# ---------------------------------------------------------------------------------------------
# Config -> Slurm


def slurm_minutes(text: str) -> int:
    """Slurm's ``--time`` formats (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) -> whole minutes."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(text).strip())
    if not m:
        raise ConfigError(
            "launcher.slurm.time", f"not a Slurm time limit: {text!r} (e.g. 04:00:00 or 2-00:00:00)"
        )
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


def check(cfg: MegaConfig) -> None:
    """What Slurm would refuse or misrun, named by key, before anything is submitted."""
    s = cfg.launcher.slurm
    minutes = slurm_minutes(s.time)
    if s.cpus_per_task is not None and s.cpus_per_task < 1:
        raise ConfigError(
            "launcher.slurm.cpus_per_task",
            f"must be >= 1 or null (all of the node's cores), got {s.cpus_per_task}",
        )
    if s.signal_grace_s < 0 or (s.signal_grace_s and s.signal_grace_s >= minutes * 60):
        raise ConfigError(
            "launcher.slurm.signal_grace_s",
            f"must be 0 (no signal) or between 1 and the time limit "
            f"({minutes * 60} s), got {s.signal_grace_s}",
        )
    if s.numa_binding is not None:
        _check_numa_binding(cfg)
    if s.driver == "allocation":
        _check_driver_in_allocation(cfg)
    if s.max_requeues < 0:
        raise ConfigError("launcher.slurm.max_requeues", f"must be >= 0, got {s.max_requeues}")
    if cfg.store.kind == "redis" and cfg.store.redis_url is None and not cfg.store.start_local_redis:
        raise ConfigError(
            "store.redis_url",
            "launcher=slurm with store.kind=redis needs a Redis server "
            "every node reaches: set store.redis_url or store.start_local_redis",
        )


def _check_driver_in_allocation(cfg: MegaConfig) -> None:
    """What the driver inside the allocation (mega.launch.slurm_steps) does not do."""
    s = cfg.launcher.slurm
    if s.container_image:
        raise ConfigError(
            "launcher.slurm.container_image",
            "with launcher.slurm.driver=allocation the driver runs on the first node outside any "
            "container: use driver=host with a container image",
        )
    if cfg.store.redis_url and rendezvous.split_redis_password(cfg.store.redis_url)[1] is not None:
        raise ConfigError(
            "store.redis_url",
            "with launcher.slurm.driver=allocation the driver reads its config from the run "
            "directory: put the password in $MEGA_REDIS_PASSWORD, not in the URL",
        )


def numa_modes() -> list[str]:
    """The ``torchrun --numa-binding`` modes of this torch ([] where torch has no such flag)."""
    try:
        from torch.numa.binding import AffinityMode
    except ImportError:
        return []
    return [m.value for m in AffinityMode]


def _check_numa_binding(cfg: MegaConfig) -> None:
    key, mode = "launcher.slurm.numa_binding", cfg.launcher.slurm.numa_binding
    if cfg.cluster.device != "cuda":
        raise ConfigError(
            key,
            f"binds each rank to the CPUs near its GPU: needs cluster.device=cuda, got {cfg.cluster.device}",
        )
    modes = numa_modes()
    if not modes:
        raise ConfigError(key, "this torch's torchrun has no --numa-binding; set it to null")
    if mode not in modes:
        raise ConfigError(key, f"must be one of {modes} or null, got {mode!r}")


def gpus_per_node(cfg: MegaConfig) -> int:
    return cfg.cluster.procs_per_node if cfg.cluster.device == "cuda" else 0


def is_secret(name: str) -> bool:
    """Whether an environment variable holds a credential: never sent to slurmctld, never in a script."""
    return (
        bool(re.search(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|PRIVATE_KEY", name)) or name == "AWS_ACCESS_KEY_ID"
    )


def _shell_word(token: str, variables: dict[str, str]) -> str:
    """``token`` quoted for the shell, with each placeholder in it expanded as ``"${VAR}"``."""
    parts = re.split("(" + "|".join(map(re.escape, variables)) + ")", token)
    return "".join(
        f'"${{{variables[p]}}}"' if p in variables else (shlex.quote(p) if p else "") for p in parts
    )


# The node task: read the secrets file (only this shell and the agent it starts see them), start the
# agent in the background with SIGUSR1 ignored (inherited through exec: a rank that is not yet
# listening for it is not killed by it), pass the warning (the batch shell's file, or a SIGUSR1 to
# the step: `scancel --signal=USR1`) on to the ranks as SIGUSR1 every 2 s until they
# are gone (a rank installs its handler once it is up), write the exit code: PREEMPTED when the
# agent failed after the signal (its ranks saved and exited), 0 when they finished anyway. After the
# signal the task exits 0 so that srun's --kill-on-bad-exit leaves the other nodes to finish their save.
# A SIGTERM (scancel, the end of the job) is reported as STOPPED: a node that reports nothing was
# lost, unless srun names another node its step could not start on (``SlurmBackend.unreported_lost``).
# run by the batch shell when launcher.rdzv_port=0 (python - <<heredoc): prints a free port
_PORTS_SOURCE = Path(ports.__file__).read_text()

# the shell line that reads the secrets file into the environment (a node's task, the driver's job)
READ_PRIVATE_ENV = (
    'if [ -n "${MEGA_PRIVATE_ENV_FILE:-}" ]; then set -a; . "$MEGA_PRIVATE_ENV_FILE"; set +a; fi'
)

_NODE_TASK = """signalled=0
trap 'signalled=1' USR1
mkdir -p @LOGDIR@ @EXITDIR@
@READ_PRIVATE_ENV@
report() {
  printf '{"node": %s, "exit_code": %s, "host": "%s"}' "$SLURM_NODEID" "$1" "$(hostname)" > @EXIT@.tmp
  mv @EXIT@.tmp @EXIT@
}
trap 'report @STOPPED@; exit @STOPPED@' TERM
(trap '' USR1; exec @AGENT@ >> @LOG@ 2>&1) &
agent=$!
while kill -0 "$agent" 2>/dev/null; do
  if [ -e @SIGNALLED@ ]; then signalled=1; fi
  if [ "$signalled" = 1 ]; then pkill -USR1 -P "$agent" || true; fi
  sleep 2 & wait $! || true
done
rc=0; wait "$agent" || rc=$?
if [ "$signalled" = 1 ] && [ "$rc" != 0 ]; then rc=@PREEMPTED@; fi
report "$rc"
if [ "$rc" = @PREEMPTED@ ]; then exit 0; fi
exit "$rc"
"""


def job_name(job: JobSpec) -> str:
    """Slurm's name of one attempt: the run (its directory's name) and the attempt, e.g.
    ``mega-run42-train-attempt3`` (``squeue``, ``sacct``; recovery finds a run's jobs by it)."""
    return f"mega-{Path(job.log_dir).absolute().name}-{job.name}"


def sbatch_directives(
    cfg: MegaConfig, job: JobSpec, exclude: list[str] = (), nodes: int | None = None, requeue: bool = False
) -> list[str]:
    """``#SBATCH`` options of ``job`` on ``nodes`` nodes (default ``cluster.nodes``); ``requeue``:
    Slurm may run the job again (same id, its log appended to), else the driver resubmits."""
    s = cfg.launcher.slurm
    log_dir = Path(job.log_dir).absolute()
    d = [f"--job-name={job_name(job)}", f"--nodes={nodes or cfg.cluster.nodes}", "--ntasks-per-node=1"]
    if gpus := gpus_per_node(cfg):
        d.append(f"--gpus-per-node={gpus}")
    if s.cpus_per_task:
        d.append(f"--cpus-per-task={s.cpus_per_task}")
    if s.mem is not None:
        d.append(f"--mem={s.mem}")
    d.append(f"--time={s.time}")
    for key in ("partition", "account", "qos"):
        if getattr(s, key):
            d.append(f"--{key}={getattr(s, key)}")
    if s.exclusive:
        d.append("--exclusive")
    if hosts := sorted({*s.exclude, *exclude}):
        d.append(f"--exclude={','.join(hosts)}")
    if s.signal_grace_s:
        d.append(f"--signal=B:USR1@{s.signal_grace_s}")
    if requeue:
        d += ["--requeue", "--open-mode=append"]
    else:  # the driver resubmits (with --exclude, a new attempt number); Slurm's own requeue would not
        d.append("--no-requeue")
    d.append(f"--output={log_dir}/slurm-%j.out")
    return d


def render_sbatch(
    cfg: MegaConfig, job: JobSpec, python: str = PYTHON, exclude: list[str] = (), exit_dir: Path | None = None
) -> str:
    """The sbatch script of one attempt of ``job`` on ``cluster.nodes`` nodes (``exclude``: hosts
    kept out; ``exit_dir``: where each node writes its exit code, default ``<log_dir>/slurm/exit``)."""
    check(cfg)
    log_dir = Path(job.log_dir).absolute()
    exit_dir = Path(exit_dir or log_dir / "slurm" / "exit").absolute()
    secret = sorted(k for k in job.env if is_secret(k))
    if secret:
        raise ValueError(f"secrets in a job's environment never go into a script: {secret}")
    c = cfg.cluster
    lines = [
        "#!/bin/bash",
        f"# mega: one attempt ({job.name}) of a training job on {c.nodes} node(s) x {c.procs_per_node} processes,",
        "# rendered from the config by mega.launch.slurm. The driver resubmits failed or signalled attempts",
        "# from `latest` (docs/cluster.md); submitted by hand, this script runs one attempt.",
        *(f"#SBATCH {d}" for d in sbatch_directives(cfg, job, exclude)),
        EARLY_WARNING_TRAP,
        "set -euo pipefail",
        "",
    ]
    if cfg.launcher.slurm.setup:
        lines += ["# launcher.slurm.setup", *cfg.launcher.slurm.setup, ""]
    lines += exported_env(cfg, job)
    lines += _signal_and_master(cfg, python, exit_dir, log_dir)
    lines += _srun_nodes(cfg, job, node_task(cfg, job, python, exit_dir))
    return "\n".join(lines)


def node_task(
    cfg: MegaConfig, job: JobSpec, python: str, exit_dir: Path, signalled: Path | None = None
) -> str:
    """``_NODE_TASK`` for this job: its agent's command line, log and exit files, each node's own
    (``$SLURM_NODEID``) expanded by that node's bash; ``signalled``: the file of Slurm's warning
    (``warning_trap``; default ``<exit_dir>/signalled``)."""
    placeholders = {
        "@NODE_RANK@": "SLURM_NODEID",
        "@MASTER_ADDR@": "MASTER_ADDR",
        "@MASTER_PORT@": "MASTER_PORT",
    }
    argv = agent_argv(cfg, "@NODE_RANK@", "@MASTER_ADDR@", "@MASTER_PORT@", job, python=python)
    if cfg.launcher.slurm.numa_binding:  # a torchrun flag: right after `python -m torch.distributed.run`
        argv.insert(3, f"--numa-binding={cfg.launcher.slurm.numa_binding}")
    log = _absolute(job).log_path("@NODE_RANK@", cfg.cluster.nodes)
    task = _NODE_TASK
    for key, value in {
        "@LOGDIR@": str(log.parent),
        "@EXITDIR@": str(exit_dir),
        "@LOG@": str(log),
        "@EXIT@": str(exit_dir / "node-@NODE_RANK@.json"),
        "@SIGNALLED@": str(signalled or exit_dir / "signalled"),
    }.items():
        task = task.replace(key, _shell_word(value, placeholders))
    task = task.replace("@AGENT@", " ".join(_shell_word(a, placeholders) for a in argv))
    task = task.replace("@PREEMPTED@", str(PREEMPTED)).replace("@STOPPED@", str(STOPPED))
    return task.replace("@READ_PRIVATE_ENV@", READ_PRIVATE_ENV)


def job_env(cfg: MegaConfig, job: JobSpec) -> dict[str, str]:
    """What every node's task gets in its environment: ``cluster.env`` and the job's variables."""
    env = {**cfg.cluster.env, **job.env}
    if cfg.launcher.slurm.signal_grace_s:
        env[exit_signal.ENV] = "USR1"  # the ranks save and exit on it (mega/stability/exit_signal.py)
    return env


def exported_env(cfg: MegaConfig, job: JobSpec) -> list[str]:
    """``export`` lines of ``cluster.env`` and the attempt's variables (never a secret)."""
    env = job_env(cfg, job)
    if not env:
        return []
    return [
        "# cluster.env presets and this attempt's variables, exported to every node (srun); no secret:",
        "# those are read from $MEGA_PRIVATE_ENV_FILE by each node's task",
        *(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
        "",
    ]


# The batch script's first command. Slurm's warning can come the moment the job starts: slurmctld
# checks time limits every 30 s and sends a warning due before its next check at once (so anywhere in
# the first 30 s of each run, a requeued one's too, when the limit is under the grace time plus 30 s),
# and a preemption sends it whenever it happens. A shell that has not trapped USR1 yet dies of it, the job
# FAILED with nothing run (ExitCode 0:10); so it is noted before anything else runs (the setup lines,
# the secrets) and turned into the file by ``warning_trap``.
EARLY_WARNING_TRAP = "warned=0; trap 'warned=1' USR1  # Slurm's warning, before anything else (warning_trap)"


def warning_trap(signalled: Path) -> list[str]:
    """The batch shell's lines that turn Slurm's warning into the file ``signalled`` (removed first:
    a requeued job starts unwarned), which every node's task (``node_task``) watches; a warning that
    came earlier (``EARLY_WARNING_TRAP``) leaves the file as soon as the old one is gone."""
    q = shlex.quote(str(signalled))
    return [
        "# Slurm's warning (--signal=B:USR1) comes to this shell, from the job's start on: it leaves a file",
        "# every node's task watches and answers by passing SIGUSR1 to its ranks.",
        f"mkdir -p {shlex.quote(str(signalled.parent))}",
        f"rm -f {q}",
        f"trap 'touch {q}' USR1",
        f'if [ "$warned" = 1 ]; then touch {q}; fi',
        "",
    ]


def wait_in_background(pid_var: str) -> list[str]:
    """The batch shell's wait for its background child ``$pid_var`` (started with SIGUSR1 ignored)
    that lets the shell take Slurm's warning meanwhile, then its exit with the child's code."""
    return [
        "# each trapped signal ends a `wait` early, so wait again until the child has ended, then exit as it did.",
        f"{pid_var}=$!",
        "while :; do",
        f'  rc=0; wait "${pid_var}" || rc=$?',
        f'  kill -0 "${pid_var}" 2>/dev/null || break',
        "done",
        'exit "$rc"',
        "",
    ]


def _signal_and_master(cfg: MegaConfig, python: str, exit_dir: Path, log_dir: Path) -> list[str]:
    """The batch shell's trap of Slurm's warning, and the rendezvous master (the first node)."""
    # rdzv_port=0: mega/ports.py, its source in the script (the batch host may lack mega: containers)
    port = str(cfg.launcher.rdzv_port) if cfg.launcher.rdzv_port else f"$({python} - <<'MEGA_PORTS'"
    return [
        *warning_trap(exit_dir / "signalled"),
        "# The master is the batch host, the first node of the allocation: node 0's agent serves the",
        "# rendezvous there, on a port free there. (sed reads every line: `head -n 1` would let",
        "# scontrol die of SIGPIPE, fatal under pipefail.)",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"MASTER_PORT={port}",
        *([] if cfg.launcher.rdzv_port else [*_PORTS_SOURCE.splitlines(), "MEGA_PORTS", ")"]),
        "export MASTER_ADDR MASTER_PORT",
        f"mkdir -p {shlex.quote(str(log_dir))}",
        "",
    ]


def srun_argv(cfg: MegaConfig, job: JobSpec, node_cpus: str, nodelist: list[str] = ()) -> list[str]:
    """``srun`` of one task per node of ``job`` (before the task's command): ``node_cpus`` CPUs per
    task unless ``launcher.slurm.cpus_per_task`` says; ``nodelist``: these hosts of the allocation."""
    s, nodes = cfg.launcher.slurm, cfg.cluster.nodes
    # srun no longer passes the job's --cpus-per-task on (Slurm >= 22.05): each task gets its node's cores
    cpus = str(s.cpus_per_task) if s.cpus_per_task else node_cpus
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    srun.append(f"--cpus-per-task={cpus}")
    if nodelist:
        srun.append(f"--nodelist={','.join(nodelist)}")
    if s.container_image:
        srun += [
            f"--container-image={s.container_image}",
            f"--container-mounts={','.join(_mounts(cfg, job))}",
        ]
    return srun


def _srun_nodes(cfg: MegaConfig, job: JobSpec, task: str) -> list[str]:
    """``srun`` of one ``task`` per node, in the background, and the wait for it that lets the batch
    shell take Slurm's warning meanwhile."""
    srun = srun_argv(cfg, job, '"$SLURM_CPUS_ON_NODE"')
    return [
        "# One task per node, each a torchrun agent whose node rank is its SLURM_NODEID; a node that",
        "# fails ends every node (--kill-on-bad-exit). The single quotes are meant: each node's bash",
        "# expands SLURM_NODEID (and the master, exported above) for itself.",
        "# shellcheck disable=SC2016",
        "(trap '' USR1; exec " + " ".join(srun) + " \\",
        f"  bash -c {shlex.quote(task)}) &",
        "",
        "# srun runs in the background (SIGUSR1 ignored): this shell stays free to take the warning;",
        *wait_in_background("srun_pid"),
    ]


def _mounts(cfg: MegaConfig, job: JobSpec) -> list[str]:
    """Container mounts: the run directory and the data (same paths inside as outside)."""
    paths = {str(Path(job.log_dir).absolute())}
    paths |= {str(Path(a).absolute().parent) for a in job.args if a.endswith(".json") and os.path.isabs(a)}
    return sorted(f"{p}:{p}" for p in paths)


def _absolute(job: JobSpec) -> JobSpec:
    return JobSpec(job.module, list(job.args), dict(job.env), Path(job.log_dir).absolute(), job.name)


# ---------------------------------------------------------------------------------------------
# Talking to Slurm


class SlurmError(RuntimeError):
    pass


def slurm_command(
    *argv: str, timeout_s: float = 60.0, env: dict[str, str] | None = None, check: bool = True
) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not answer in {timeout_s:g} s (slurmctld down?)") from None
    except FileNotFoundError:
        raise SlurmError(
            f"`{argv[0]}` not found: launcher=slurm needs Slurm's client commands on PATH"
        ) from None
    if check and proc.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, NodeList, ExcHNodeList, ...); {} once Slurm forgot it."""
    out = slurm_command("scontrol", "show", "job", "-o", job_id, check=False)
    fields = {}
    for m in re.finditer(r"(\w+(?:/\w+)?)=(\S*)", out):
        fields.setdefault(m.group(1), m.group(2))
    return fields if fields.get("JobId") == job_id else {}


def signal_steps(steps: list[str], sig: str, attempts: int = 3) -> str | None:
    """Send ``sig`` to the tasks of job steps (``<job>.<step>``) through slurmctld (``--ctld``):
    scancel's default, straight to each node's slurmd, waits out MessageTimeout (~11 s) on a dead
    node before it returns. None once slurmctld took it; else scancel's error after ``attempts``
    tries half a second apart (a slurmctld busy for a moment refuses), for the caller to report."""
    error = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.5)
        try:
            slurm_command("scancel", "--ctld", f"--signal={sig}", *steps, timeout_s=30.0)
            return None
        except SlurmError as err:
            error = str(err)
    return error


def job_state(job_id: str) -> str | None:
    """The job's state (RUNNING, COMPLETED, ...); None once Slurm forgot it."""
    return job_info(job_id).get("JobState")


def hostnames(nodelist: str) -> list[str]:
    """``node[1-3]`` -> [node1, node2, node3] (Slurm's order: node rank k runs on the k-th)."""
    if not nodelist or nodelist == "(null)":
        return []
    return slurm_command("scontrol", "show", "hostnames", nodelist).split()


def unusable(state: str) -> bool:
    """A node state (``sinfo %t``) a job cannot run on: down, drained, failing, or not responding (*)."""
    return state.endswith("*") or bool(re.match(r"(down|drain|drng|fail|maint|unk|npc)", state))


ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


def controller_address() -> str:
    """The address of slurmctld (``SlurmctldHost`` in the configuration the clients read)."""
    out = slurm_command("scontrol", "show", "config")
    m = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", out, re.M)
    if not m:
        raise SlurmError("`scontrol show config` names no SlurmctldHost")
    return m.group(2) or socket.gethostbyname(m.group(1))


def address_towards(peer: str) -> str:
    """This machine's address on the route to ``peer`` (no packet is sent: a UDP connect only routes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


# ---------------------------------------------------------------------------------------------
# The driver's backend

_said_prefect = False  # the note on PREFECT_API_URL: once per driver process


def prefect_note(environ: dict[str, str] = os.environ) -> str | None:
    """What a driver without ``PREFECT_API_URL`` means on a cluster (None when it is set)."""
    if environ.get("PREFECT_API_URL"):
        return None
    home = environ.get("PREFECT_HOME", "~/.prefect")
    return (
        f"PREFECT_API_URL is not set: unless a Prefect profile sets it, this driver's flow runs go to a "
        f"temporary Prefect server it starts itself, with a SQLite database under {home} (often NFS on a "
        f"cluster), seen in no shared UI and gone with this process. Set PREFECT_API_URL to the site's "
        f"Prefect server (docs/cluster.md)."
    )


class SlurmBackend:
    """``Backend`` on Slurm: one ``sbatch`` of the rendered script per attempt, one task per node."""

    def __init__(
        self,
        cfg: MegaConfig,
        run_dir: str | Path,
        *,
        stop_timeout_s: float | None = None,
        log: Callable[[str], None] = print,
    ):
        check(cfg)
        self.cfg = rendezvous.without_secrets(cfg)
        self.folder = Path(run_dir).absolute() / "slurm"
        self.folder.mkdir(parents=True, exist_ok=True)
        s = cfg.launcher.slurm
        self.stop_timeout_s = s.stop_timeout_s if stop_timeout_s is None else stop_timeout_s
        self.secrets_file = Path(s.secrets_dir or self.folder).absolute() / "secrets.env"
        self.excluded: list[str] = []
        self.log = log
        self.job_id: str | None = None
        self.left_to_slurm: str | None = None  # the job stop() gave up waiting for (a dead node)
        self._exit_dir: Path | None = None
        self._output: Path | None = None  # where this attempt's srun writes its errors
        self._output_from = 0  # ... from this offset on (a file earlier attempts wrote to)
        self._hosts: list[str] = []
        self._stuck_hosts: list[str] = []  # the attempt's hosts left COMPLETING after stop()
        self._server_host = s.server_host
        global _said_prefect
        if not _said_prefect and (note := prefect_note()):
            log(note)
            _said_prefect = True

    @property
    def server_host(self) -> str:
        """Where servers for the ranks listen: ``launcher.slurm.server_host``, else this machine's
        address on the route to slurmctld (the network the nodes share; never loopback)."""
        if not self._server_host:
            self._server_host = address_towards(controller_address())
        return self._server_host

    def exclude(self, host: str) -> None:
        """Keep ``host`` out of every later attempt of this run (``--exclude``)."""
        if host not in self.excluded:
            self.excluded.append(host)

    def hosts(self) -> list[str]:
        """The current attempt's hosts, node rank k on the k-th ([] before the job runs). Read while
        the job runs (``poll``) and kept: a completing job lists only its nodes still completing,
        so a node whose failure ended the job is already gone from it."""
        if not self._hosts and self.job_id:
            info = job_info(self.job_id)
            if info.get("JobState") != "COMPLETING":
                self._hosts = hostnames(info.get("NodeList", ""))
        return self._hosts

    def start(self, job: JobSpec) -> None:
        if self.job_id is not None and self.job_id != self.left_to_slurm and not self._ended():
            raise RuntimeError(f"Slurm job {self.job_id} is still running: stop() it first")
        public = self.private(job)
        self._exit_dir = self.folder / job.name / "exit"
        shutil.rmtree(self._exit_dir, ignore_errors=True)
        self.submit(
            job.name,
            render_sbatch(
                self.cfg, public, python=sys.executable, exclude=self.excluded, exit_dir=self._exit_dir
            ),
        )
        self._output, self._output_from = Path(public.log_dir) / f"slurm-{self.job_id}.out", 0

    def private(self, job: JobSpec) -> JobSpec:
        """``job`` without its secrets, which go (with this process's) to the secrets file, named by
        ``MEGA_PRIVATE_ENV_FILE`` in the returned job's environment."""
        self._write_secrets({k: v for k, v in {**os.environ, **job.env}.items() if is_secret(k)})
        public = JobSpec(
            job.module,
            list(job.args),
            {k: v for k, v in job.env.items() if not is_secret(k)},
            Path(job.log_dir).absolute(),
            job.name,
        )
        public.env["MEGA_PRIVATE_ENV_FILE"] = str(self.secrets_file)
        return public

    def submit(self, name: str, script: str) -> str:
        """``sbatch`` of ``script`` (kept as ``slurm/<name>/job.sbatch``, its id in ``job_id`` there),
        with an environment free of secrets (slurmctld stores it)."""
        attempt_dir = self.folder / name
        attempt_dir.mkdir(parents=True, exist_ok=True)
        path = attempt_dir / "job.sbatch"
        path.write_text(script)
        submit_env = {k: v for k, v in os.environ.items() if not is_secret(k)}
        self.job_id = slurm_command("sbatch", "--parsable", str(path), env=submit_env).strip().split(";")[0]
        self._hosts = []
        self._stuck_hosts = []
        (attempt_dir / "job_id").write_text(self.job_id)
        return self.job_id

    def _write_secrets(self, secrets: dict[str, str]) -> None:
        self.secrets_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.secrets_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.writelines(f"{k}={shlex.quote(v)}\n" for k, v in sorted(secrets.items()))

    def poll(self) -> dict[int, int | None]:
        if self.job_id is None:
            return {}
        ended = self._ended()  # first: a node reports its exit code before the job ends
        if not ended:
            self.hosts()
        codes = self._reported()
        if ended:
            codes = self.ended_codes(codes)
        if PREEMPTED in codes.values() and None in codes.values():
            return {k: None for k in codes}  # the other nodes are still saving: not a failure to stop on
        return codes

    def _reported(self) -> dict[int, int | None]:
        """Each node's reported exit code (its exit file), None for a node that reported nothing."""
        codes: dict[int, int | None] = {}
        for k in range(self.cfg.cluster.nodes):
            try:
                codes[k] = int(json.loads((self._exit_dir / f"node-{k}.json").read_text())["exit_code"])
            except (OSError, ValueError, KeyError, TypeError):
                codes[k] = None
        return codes

    def ended_codes(self, codes: dict[int, int | None]) -> dict[int, int]:
        """An ended attempt's reported codes with every node judged: one that reported nothing is lost
        (NODE_LOST) or STOPPED (``unreported_lost``). When srun could not start the step on some
        hosts (``LAUNCH_FAILED``) it aborted the step and killed the other nodes' tasks: a task
        whose agent that kill reached before its own shell reports SIGKILL's code (137), which is
        the abort's too, so STOPPED."""
        lost = self.unreported_lost(codes)
        aborted = bool(self.launch_failed_hosts())

        def judged(k: int, c: int | None) -> int:
            if c is None:
                return NODE_LOST if k in lost else STOPPED
            return STOPPED if aborted and c == KILLED else c

        return {k: judged(k, c) for k, c in codes.items()}

    def unreported_lost(self, codes: dict[int, int | None]) -> list[int]:
        """Of the nodes that reported nothing (None in ``codes``), the lost ones: every one, unless
        srun says its step could not start on some hosts (``LAUNCH_FAILED``); then only those. The
        others' tasks were killed by the step's abort: blaming them would evict healthy nodes."""
        silent = [k for k, c in codes.items() if c is None]
        hosts = self.hosts()
        failed = self.launch_failed_hosts()
        if not failed or len(hosts) != len(codes):
            return silent
        return [k for k in silent if hosts[k] in failed]

    def launch_failed_hosts(self) -> set[str]:
        """Hosts srun could not start this attempt's task on (its output's ``LAUNCH_FAILED`` lines)."""
        if self._output is None:
            return set()
        try:
            with open(self._output, "rb") as f:
                f.seek(self._output_from)
                return set(LAUNCH_FAILED.findall(f.read().decode(errors="replace")))
        except OSError:
            return set()

    def lost_hosts(self) -> list[str]:
        """Hosts of the current attempt that Slurm holds down, drained or failing, or that were left
        completing the cancelled attempt (a lost node Slurm has not judged yet)."""
        hosts = self.hosts()
        if not hosts:
            return []
        out = slurm_command("sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N %t", check=False)
        bad = {
            n for n, state in (line.split() for line in out.splitlines() if line.strip()) if unusable(state)
        }
        return [h for h in hosts if h in bad or h in self._stuck_hosts]

    def usable_nodes(self) -> int:
        """Nodes of the partition that are up and not excluded: how many a next attempt can get."""
        argv = ["sinfo", "-h", "-N", "-o", "%N %t"]
        if self.cfg.launcher.slurm.partition:
            argv += ["-p", self.cfg.launcher.slurm.partition]
        out = slurm_command(*argv, check=False)
        states = dict(line.split() for line in out.splitlines() if line.strip())
        excluded = {*self.excluded, *self.cfg.launcher.slurm.exclude}
        return sum(1 for n, st in states.items() if n not in excluded and not unusable(st))

    def resize(self, cfg: MegaConfig) -> None:
        """Later attempts run ``cfg`` (fewer nodes after a loss, mega.stability.membership.resize)."""
        self.cfg = rendezvous.without_secrets(cfg)

    def _ended(self) -> bool:
        info = job_info(self.job_id)
        return not info or info.get("JobState") in ENDED

    def stop(self) -> None:
        """``scancel`` the attempt and wait until Slurm says it ended; a job left COMPLETING after
        ``stop_timeout_s`` (a dead node) is logged with its nodes and left to Slurm."""
        if self.job_id is None:
            return
        self.hosts()  # while Slurm still knows the job
        if not self._ended() and any(c is None for c in self.poll().values()):
            slurm_command("scancel", self.job_id, check=False)
        deadline = time.monotonic() + self.stop_timeout_s
        while (info := job_info(self.job_id)) and info.get("JobState") not in ENDED:
            if time.monotonic() > deadline:
                self.log(
                    f"slurm job {self.job_id} is still {info.get('JobState')} {self.stop_timeout_s:g} s after "
                    f"scancel (nodes {info.get('NodeList')}); going on without waiting for it"
                )
                self.left_to_slurm = self.job_id
                # a node that cannot finish a cancelled job is lost (its slurmd or host is gone), whether
                # or not Slurm has marked it down yet (it waits SlurmdTimeout, often minutes)
                self._stuck_hosts = hostnames(info.get("NodeList", ""))
                return
            time.sleep(1.0)
        self.hosts()  # ended: Slurm lists the whole allocation again

    def close(self) -> None:
        self.stop()
        self.secrets_file.unlink(missing_ok=True)

    def cancel_run_jobs(self) -> list[str]:
        """``scancel`` every queued or running job of this run (its script lies under this run's
        ``slurm/``) and wait, bounded, until Slurm says they ended: a recovery calls it before it
        submits, so one run never has two jobs writing the same checkpoints."""
        out = slurm_command("squeue", "-h", "-o", "%i %o")
        ids = [
            i
            for i, command in (line.split(None, 1) for line in out.splitlines() if " " in line.strip())
            if command.startswith(str(self.folder) + "/")
        ]
        if not ids:
            return []
        slurm_command("scancel", *ids, check=False)
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            if all(not (info := job_info(i)) or info.get("JobState") in ENDED for i in ids):
                break
            time.sleep(1.0)
        else:
            self.log(
                f"slurm job(s) {', '.join(ids)} of this run still not ended {self.stop_timeout_s:g} s after "
                "scancel; submitting anyway"
            )
        return ids


# ---------------------------------------------------------------------------------------------
# CLI


def check_args(argv: list[str]) -> MegaConfig:
    """Validate ``render`` arguments without writing anything (mega.launch.render.check)."""
    from mega.launch import render

    return render.check_args(argv, prog="python -m mega.launch.slurm", what="an sbatch script")


def main(argv: list[str] | None = None) -> int:
    from mega.launch import render

    return render.cli(
        argv,
        prog="python -m mega.launch.slurm",
        what="an sbatch script",
        write=lambda cfg, job, out: _write_script(cfg, job, out),
    )


def _write_script(cfg: MegaConfig, job: JobSpec, out: Path) -> list[Path]:
    Path(job.log_dir).mkdir(parents=True, exist_ok=True)  # sbatch opens --output there before the script runs
    path = out / f"{job.name}.sbatch"
    public = JobSpec(
        job.module,
        list(job.args),
        {k: v for k, v in job.env.items() if not is_secret(k)},
        job.log_dir,
        job.name,
    )
    path.write_text(render_sbatch(cfg, public))
    path.chmod(0o755)
    return [path]


if __name__ == "__main__":
    sys.exit(main())
