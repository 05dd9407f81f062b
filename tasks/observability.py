"""Prefect task: the run's merged trace, heat map and straggler scores as artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from mega.obs import report as obs_report


@task(name="observability", cache_policy=NO_CACHE)
def observability(run_dir: str | Path, title: str, tensorboard: bool = True) -> dict[str, Any]:
    logger = get_run_logger()
    if not (Path(run_dir) / "obs").is_dir():
        logger.info("no span files under %s (obs.enabled=false): no trace or heat map", run_dir)
        return {"enabled": False}
    result = obs_report.build(run_dir, tensorboard=tensorboard)
    create_markdown_artifact(key="observability", markdown=obs_report.markdown(result, title=f"{title}: observability"),
                             description=f"heat map, stragglers and exposed communication of {run_dir}")
    create_table_artifact(key="stragglers", table=result["top_stragglers"],
                          description="straggler score per rank: compute time over the median of its pipeline stage")
    top = result["top_stragglers"][0] if result["top_stragglers"] else None
    logger.info("merged trace %s; heat map %s; slowest rank %s", result["trace"], result["heatmap"],
                f"{top['rank']} ({top['label']}, score {top['score']:.2f})" if top else "n/a")
    return {"enabled": True, **result}
