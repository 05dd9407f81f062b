"""TEMPORARY stand-in for part A's ``mega/launch/backend.py`` (issue 9): delete at merge.

Only what the Slurm and Kubernetes backends (mega/launch/slurm.py, kubernetes.py) use of part A's
interface, written to its announced signatures. What the lead reconciles at merge:

* ``agent_argv`` takes two extras here: ``node_rank`` may be a ``str`` (a placeholder the node's
  shell or the kubelet expands: ``${SLURM_NODEID}``, ``$(NODE_RANK)``), and ``python`` (the
  interpreter on the node, not the driver's ``sys.executable``).
* ``node_log_path``: where node k writes its agent's log (part A owns the layout
  ``<run_dir>/nodes/<k>/``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mega.config import MegaConfig


@dataclass
class JobSpec:
    """One attempt of one job: what every node's torchrun agent runs."""

    module: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = Path(".")
    name: str = "train"


class Backend(Protocol):
    def start(self, job: JobSpec) -> None: ...  # one torchrun agent per node

    def poll(self) -> dict[int, int | None]: ...  # node rank -> exit code, None while running

    def stop(self) -> None: ...  # every agent and rank of every node gone on return

    def close(self) -> None: ...


def agent_argv(cfg: "MegaConfig", node_rank: int | str, master_addr: str, master_port: int | str,
               job: JobSpec, python: str = sys.executable) -> list[str]:
    """The torchrun agent of one node: static membership (the driver owns it), no agent restarts."""
    return [
        python, "-m", "torch.distributed.run",
        f"--nnodes={cfg.cluster.nodes}", f"--node-rank={node_rank}",
        f"--nproc-per-node={cfg.cluster.procs_per_node}",
        f"--master-addr={master_addr}", f"--master-port={master_port}",
        "--max-restarts=0",
        "-m", job.module, *job.args,
    ]


def node_log_path(job: JobSpec, node_rank: int | str) -> Path:
    return Path(job.log_dir) / "nodes" / str(node_rank) / f"{job.name}.log"
