"""Node identity on the rank side: which node this process is, and where its node keeps files.

A node is one torchrun agent (mega/launch/backend.py). torchrun tells each worker its node as
``GROUP_RANK`` and the node count as ``GROUP_WORLD_SIZE``; global ranks are laid out node by node
(rank = node * procs_per_node + local rank, static rendezvous), so a multi-node job has the same
ranks as the one-node job of the same world. The launch backends add:

* ``MEGA_NODE_ADDR``: the address of this node's interface (a network-namespace node's own address),
* ``MEGA_RANKS_ON_HOST``: how many ranks share this machine (local nodes share its cores).

Per-node files live under ``<run_dir>/nodes/<k>/`` (agent logs, the ranks' process records).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from mega import rank_env

NODE_ADDR_ENV = "MEGA_NODE_ADDR"
RANKS_ON_HOST_ENV = "MEGA_RANKS_ON_HOST"


def node_rank() -> int:
    """This process's node (torchrun's GROUP_RANK; 0 outside torchrun)."""
    return int(os.environ.get("GROUP_RANK", "0"))


def node_count() -> int:
    """Nodes in the job (torchrun's GROUP_WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def agent_pid() -> int:
    """This rank's torchrun agent: its parent, or, for a warm rank (a fork of the node's zygote,
    mega/warm), the agent its client named."""
    return int(os.environ.get(rank_env.AGENT_PID_ENV) or os.getppid())


def ranks_on_host() -> int:
    """Ranks sharing this machine's cores: every local node's ranks under launcher=local-nodes,
    else this node's (LOCAL_WORLD_SIZE)."""
    return int(os.environ.get(RANKS_ON_HOST_ENV) or os.environ.get("LOCAL_WORLD_SIZE", "1"))


def address() -> str:
    """The address this node is reached at (its namespace's address for network-namespace nodes)."""
    return os.environ.get(NODE_ADDR_ENV) or socket.gethostname()


def node_dir(run_dir: str | Path, node: int | None = None) -> Path:
    """``<run_dir>/nodes/<k>``: a node's agent logs and its ranks' process records."""
    return Path(run_dir) / "nodes" / str(node_rank() if node is None else node)


def identity() -> dict[str, Any]:
    """This rank's place: global rank, node, local rank, host, node address, pid."""
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "node": node_rank(),
        "local_rank": local_rank(),
        "host": socket.gethostname(),
        "address": address(),
        "pid": os.getpid(),
    }


def record_process(run_dir: str | Path, attempt: int) -> Path:
    """Append this rank's identity to ``nodes/<k>/procs-attempt<n>.jsonl``: which pids ran on
    which node in which attempt (the driver kills by its own marker; this is for people and drills)."""
    path = node_dir(run_dir) / f"procs-attempt{attempt}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({**identity(), "pgid": os.getpgid(0), "time": time.time()}) + "\n"
    with open(path, "a") as f:  # one short O_APPEND write per rank: lines never interleave
        f.write(line)
    return path


def read_processes(run_dir: str | Path, attempt: int, node: int | None = None) -> list[dict[str, Any]]:
    """The process records of one attempt (every node, or one), as ``record_process`` wrote them."""
    nodes = [node_dir(run_dir, node)] if node is not None else sorted((Path(run_dir) / "nodes").glob("*"))
    rows = []
    for d in nodes:
        path = d / f"procs-attempt{attempt}.jsonl"
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["rank"])


def gather_table() -> list[dict[str, Any]]:
    """Collective over the default group: one row per node (host, address, its global ranks),
    the same list on every rank."""
    import torch.distributed as dist

    mine = identity()
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    table: dict[int, dict[str, Any]] = {}
    for r in rows:
        entry = table.setdefault(
            r["node"], {"node": r["node"], "host": r["host"], "address": r["address"], "ranks": []}
        )
        entry["ranks"].append(r["rank"])
    return [table[k] for k in sorted(table)]
