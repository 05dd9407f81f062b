"""Prefect task: the self-check of every node; an unhealthy node fails the flow before training.

With the driver in the run's Slurm allocation the driver checks the job's nodes itself, as the
job's first step (mega/launch/slurm_preflight.py); ``publish_selfcheck`` publishes its verdict,
passed on from the train task, as the same artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from mega.cluster.selfcheck import pair_table, verdict_table
from mega.config import MegaConfig
from mega.launch.node_jobs import run_selfcheck


class NodeUnhealthy(RuntimeError):
    """A node failed its self-check; the message lists the reasons."""


# No retries: run_selfcheck already turns crashes and timeouts into a verdict, and a node that
# is slow or wrong now should not get to train just because a second try passed.
@task(name="node-selfcheck", cache_policy=NO_CACHE)
def node_selfcheck(cfg: MegaConfig, out_dir: str | Path) -> dict[str, Any]:
    logger = get_run_logger()
    result = run_selfcheck(cfg, out_dir)
    publish_selfcheck(result)
    if not result["healthy"]:
        raise NodeUnhealthy("self-check failed: " + "; ".join(result["reasons"]))
    logger.info(
        "%d node(s) healthy (%d ranks, %.1f s)",
        len(result["nodes"]),
        result["world_size"],
        result["elapsed_s"],
    )
    return result


def publish_selfcheck(result: dict[str, Any]) -> None:
    """The verdict's artifacts: one row per rank, and the node pairs' exchange rates; the hosts the
    driver in the allocation excluded for it (``excluded_hosts``) in the description."""
    verdicts = ", ".join(
        f"node {n['node']}: " + {True: "healthy", False: "UNHEALTHY", None: "not judged"}[n["healthy"]]
        for n in result["nodes"]
    )
    verdict = "healthy" if result["healthy"] else "UNHEALTHY: " + "; ".join(result["reasons"])
    done = f" Then: {result['note']}." if result.get("note") else ""
    create_table_artifact(
        key="node-selfcheck",
        table=verdict_table(result),
        description=f"Self-check of {len(result['nodes'])} node(s) ({result['world_size']} ranks, "
        f"{result['device']}): **{verdict}** ({verdicts}).{done}",
    )
    if result.get("pairs"):
        create_table_artifact(
            key="node-links",
            table=pair_table(result),
            description="Inter-node exchange per node pair (MB/s each way)",
        )
