"""Launch backends: how one job's torchrun agents are started, watched and stopped, one per node.

A job (``JobSpec``: training attempt, self-check, bootstrap timing) is one torchrun agent per
node; the agents rendezvous statically on node 0 (``--master-addr/--master-port``,
``--node-rank=k``), so global ranks are laid out node by node exactly as on one node. Agents run
at ``--max-restarts=0``: restarts, and with them membership, belong to the driver
(mega/launch/driver.py), which relaunches every node from ``latest`` when any node fails.

Backends:

* ``local`` (mega/launch/local_nodes.py): one agent on this machine (``--standalone``);
* ``local-nodes`` (same module): ``cluster.nodes`` agents on this machine, optionally each in its
  own network namespace (mega/launch/netns.py);
* ``slurm``: mega/launch/slurm.py (``SlurmBackend``);
* ``kubernetes``: not driven from here; ``python -m mega.launch.kubernetes`` renders a JobSet whose
  pods start the agents, restarted by the cluster (mega/launch/incluster_watch.py ends a hang).

``backend_for`` (mega/launch/backends.py) picks the backend of ``launcher.name``; this module is what
every backend and the driver share (the job, the agent's command line), and imports none of them.
A backend may also have ``server_host``: the address that servers the driver starts for the nodes
(a local redis-server) must listen on so every node reaches them (``server_host(backend)``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from mega.rank_env import ATTEMPT_ENV

if TYPE_CHECKING:
    from mega.config import MegaConfig


@dataclass
class JobSpec:
    """One attempt of one job; every rank of every node runs ``python -m module *args``."""

    module: str  # python -m target of every rank, e.g. "mega.train"
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every rank
    log_dir: Path = Path(
        "."
    )  # node k's agent log: log_dir/nodes/<k>/<name>.log (one local node: log_dir/<name>.log)
    name: str = "job"  # e.g. "train-attempt3"

    def log_path(self, node: int | str, nodes: int) -> Path:
        """Node ``node``'s agent log: ``log_dir/nodes/<k>/<name>.log``, or ``log_dir/<name>.log``
        when the job has one node (where single-node runs have always kept it). ``node`` may be a
        placeholder a node's shell expands."""
        if nodes == 1:
            return Path(self.log_dir) / f"{self.name}.log"
        return Path(self.log_dir) / "nodes" / str(node) / f"{self.name}.log"


def training_job(
    cfg: MegaConfig,
    config_path: str | Path,
    data_index: str | Path,
    attempt: int,
    env: dict[str, str],
    log_dir: str | Path | None = None,
) -> JobSpec:
    """Training attempt ``attempt``: every rank runs ``mega.train`` on the saved config, with
    ``cluster.env``, ``env`` (the store's, the rollback's) and its attempt number. ``log_dir``:
    ``train.run_dir`` unless given. The driver hands it to a backend; ``render`` writes it for a
    scheduler."""
    return JobSpec(
        "mega.train",
        ["--config", str(config_path), "--data-index", str(data_index)],
        {**cfg.cluster.env, **env, "PYTHONUNBUFFERED": "1", ATTEMPT_ENV: str(attempt)},
        Path(cfg.train.run_dir if log_dir is None else log_dir),
        f"train-attempt{attempt}",
    )


class Backend(Protocol):
    def start(self, job: JobSpec) -> None:
        """Start one torchrun agent per node for ``job`` (returns once they are started)."""

    def poll(self) -> dict[int, int | None]:
        """Node rank -> its agent's exit code, None while it runs."""

    def stop(self) -> None:
        """End the job: on return every agent AND every rank of every node is gone (bounded time)."""

    def close(self) -> None:
        """Release what the backend holds (namespaces, bridges, allocations); stops a running job."""


def agent_argv(
    cfg: MegaConfig,
    node_rank: int | str,
    master_addr: str,
    master_port: int | str,
    job: JobSpec,
    python: str = sys.executable,
    warm: bool = False,
) -> list[str]:
    """The torchrun command line of node ``node_rank``'s agent.

    One node under ``launcher=local`` keeps ``--standalone`` (torchrun picks its own port);
    otherwise a static rendezvous on node 0's address, whose agent hosts the TCPStore. The
    rendezvous gives up after ``cluster.pg_timeout_s`` if a node never joins. ``node_rank`` and
    ``master_port`` may be placeholders a node's shell expands (``${SLURM_NODEID}``), ``python``
    the interpreter on the nodes. ``warm``: the agent and each rank are forks of the node's zygote,
    asked for by mega.warm.client (mega/warm/zygote.py)."""
    c = cfg.cluster
    client = ["-m", "mega.warm.client"] if warm else []
    argv = [python, *(["-u", *client] if warm else ["-m"]), "torch.distributed.run"]
    if c.nodes == 1 and cfg.launcher.name == "local":
        argv += ["--standalone", "--nnodes=1"]
    else:
        argv += [
            f"--nnodes={c.nodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
            f"--rdzv-conf=timeout={int(c.pg_timeout_s)}",
        ]
    return argv + [
        f"--nproc-per-node={c.procs_per_node}",
        "--max-restarts=0",
        *(client or ["-m"]),
        job.module,
        *job.args,
    ]


def server_host(backend: Backend) -> str:
    """Where servers for the nodes listen: the backend's ``server_host``, else loopback."""
    return getattr(backend, "server_host", None) or "127.0.0.1"
