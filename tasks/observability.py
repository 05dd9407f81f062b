"""Prefect task: the run's merged trace, heat map and straggler scores, and its goodput ledger,
as artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from mega.goodput import report as goodput_report
from mega.obs import report as obs_report


@task(name="observability", cache_policy=NO_CACHE)
def observability(run_dir: str | Path, title: str, tensorboard: bool = True) -> dict[str, Any]:
    logger = get_run_logger()
    goodput = _goodput(run_dir, title, tensorboard)
    if not (Path(run_dir) / "obs").is_dir():
        logger.info("no span files under %s (obs.enabled=false): no trace or heat map", run_dir)
        return {"enabled": False, "goodput": goodput}
    result = obs_report.build(run_dir, tensorboard=tensorboard)
    create_markdown_artifact(
        key="observability",
        markdown=obs_report.markdown(result, title=f"{title}: observability"),
        description=f"heat map, stragglers and exposed communication of {run_dir}",
    )
    create_table_artifact(
        key="stragglers",
        table=result["top_stragglers"],
        description="straggler score per rank: compute time over the median of its pipeline stage",
    )
    top = result["top_stragglers"][0] if result["top_stragglers"] else None
    logger.info(
        "merged trace %s; heat map %s; slowest rank %s",
        result["trace"],
        result["heatmap"],
        f"{top['rank']} ({top['label']}, score {top['score']:.2f})" if top else "n/a",
    )
    return {"enabled": True, **result, "goodput": goodput}


def _goodput(run_dir: str | Path, title: str, tensorboard: bool) -> dict[str, Any]:
    """The ledger of every second of the run so far (docs/goodput.md): table, PNG, timeline."""
    led = goodput_report.build(run_dir, title=f"{title}: goodput", tensorboard=tensorboard)
    create_table_artifact(
        key="goodput",
        table=led["table"],
        description=f"where the wall clock of {run_dir} went; ETTR {led['ettr']:.4f}",
    )
    create_markdown_artifact(
        key="goodput-ledger",
        markdown=goodput_report.markdown(led, led["png"], title),
        description="the ledger as a stacked bar and the run's timeline with its faults",
    )
    get_run_logger().info(
        "ETTR %.4f over %.1f s; unattributed %.2f s; ledger %s",
        led["ettr"],
        led["wall_s"],
        led["unattributed_s"],
        led["png"],
    )
    return {k: led[k] for k in ("ettr", "wall_s", "ledger_s", "unattributed_s", "png")}
