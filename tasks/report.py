"""Prefect task: the loss curve and throughput summary as a Markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from mega.report import load_metrics, markdown_report, node_table, plot_loss_curve, summarize


@task(name="report", cache_policy=NO_CACHE)
def report(run_dir: str | Path, title: str, metrics: list[dict] | None = None) -> dict[str, Any]:
    logger = get_run_logger()
    run_dir = Path(run_dir)
    metrics = load_metrics(run_dir) if metrics is None else metrics
    png = plot_loss_curve(metrics, run_dir / "loss.png", title=title)
    summary = summarize(metrics)
    nodes = node_table(run_dir)
    summary["nodes"] = len(nodes) or None
    create_markdown_artifact(
        key="training-report",
        markdown=markdown_report(summary, png, title=title, nodes=nodes),
        description=f"loss curve and throughput of {run_dir}",
    )
    logger.info(
        "final loss %s after %s steps, validation loss %s (held-out split); loss curve %s",
        summary["final_loss"],
        summary["total_steps"],
        summary["val_loss"],
        png,
    )
    return {**summary, "loss_curve": str(png)}
