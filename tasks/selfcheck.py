"""Prefect task: the per-node self-check; an unhealthy node fails the flow before training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from mega.config import MegaConfig
from mega.cluster.selfcheck import run_selfcheck, verdict_table


class NodeUnhealthy(RuntimeError):
    """A node failed its self-check; the message lists the reasons."""


# No retries: run_selfcheck already turns crashes and timeouts into a verdict, and a node that
# is slow or wrong now should not get to train just because a second try passed.
@task(name="node-selfcheck", cache_policy=NO_CACHE)
def node_selfcheck(cfg: MegaConfig, out_dir: str | Path) -> dict[str, Any]:
    logger = get_run_logger()
    result = run_selfcheck(cfg, out_dir)
    verdict = "healthy" if result["healthy"] else "UNHEALTHY: " + "; ".join(result["reasons"])
    create_table_artifact(
        key="node-selfcheck",
        table=verdict_table(result),
        description=f"Self-check of node `{result['node']}` ({result['world_size']} ranks, "
                    f"{result['device']}): **{verdict}**",
    )
    if not result["healthy"]:
        raise NodeUnhealthy(f"node {result['node']} failed the self-check: " + "; ".join(result["reasons"]))
    logger.info("node %s healthy (%d ranks, %.1f s)", result["node"], result["world_size"], result["elapsed_s"])
    return result
