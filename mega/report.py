"""Training run report: metrics from ``metrics.jsonl``, a loss curve, a summary and Markdown.

``metrics.jsonl`` has one JSON object per logged step (see ``mega.train``); after a restart from a
checkpoint the replayed steps appear again, and the last line written for a step is the truth.
"""

from __future__ import annotations

import base64
import statistics
from pathlib import Path
from typing import Any

from mega.metrics import read_metrics as load_metrics  # noqa: F401  (the report's input)


def restart_steps(metrics: list[dict[str, Any]]) -> list[int]:
    """Steps at which a new attempt's metrics begin (where ``attempt`` changes)."""
    return [
        cur["step"]
        for prev, cur in zip(metrics, metrics[1:])
        if cur.get("attempt", 0) != prev.get("attempt", 0)
    ]


def summarize(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Final loss, total steps, restarts, and mean throughput over steps after the first.

    The first step pays for warm-up (allocations, first communicator use), so it is left out of
    the means unless it is the only step.
    """
    if not metrics:
        return {
            "total_steps": 0,
            "final_loss": None,
            "val_loss": None,
            "mean_tokens_per_s": None,
            "mean_mfu": None,
            "mean_step_s": None,
            "restarts": 0,
        }
    steady = metrics[1:] or metrics
    return {
        "total_steps": metrics[-1]["step"],
        "final_loss": metrics[-1]["loss"],
        # the last held-out evaluation (mega/heldout.py), None when the run made none
        "val_loss": next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), None),
        "min_loss": min(m["loss"] for m in metrics),
        "mean_tokens_per_s": _mean(steady, "tokens_per_s"),
        "mean_mfu": _mean(steady, "mfu"),
        "mean_step_s": _mean(steady, "step_s"),
        "restarts": len(restart_steps(metrics)),
    }


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def plot_loss_curve(
    metrics: list[dict[str, Any]], png_path: str | Path, title: str = "training loss"
) -> Path:
    """Loss vs step as a PNG; a dashed line marks each restart from a checkpoint."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes or CI
    import matplotlib.pyplot as plt

    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    try:
        ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], marker=".", lw=1.2, label="loss")
        evaluated = [m for m in metrics if "val_loss" in m]
        if evaluated:
            ax.plot(
                [m["step"] for m in evaluated],
                [m["val_loss"] for m in evaluated],
                marker="D",
                ls="--",
                lw=1,
                label="validation loss (held-out)",
            )
        for i, step in enumerate(restart_steps(metrics)):
            ax.axvline(step, color="tab:red", ls="--", lw=1, label="restart" if i == 0 else None)
        ax.set(xlabel="step", ylabel="loss", title=title)
        ax.grid(alpha=0.3)
        if metrics:
            ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(png_path, format="png")
    finally:
        plt.close(fig)
    return png_path


def node_table(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's nodes (node, host, address, global ranks) as its ranks last reported them
    (``init.json``); empty when they never got that far."""
    import json

    try:
        return json.loads((Path(run_dir) / "init.json").read_text()).get("nodes") or []
    except (OSError, ValueError):
        return []


def markdown_report(
    summary: dict[str, Any],
    png_path: str | Path,
    title: str = "Training report",
    nodes: list[dict[str, Any]] | None = None,
) -> str:
    """Markdown with a summary table, the nodes (``node_table``) and the loss curve inlined as a
    base64 data URI.

    Inlining makes the report self-contained: the Prefect UI renders it without file access.
    """
    rows = [
        ("steps", summary.get("total_steps")),
        ("final loss", _fmt(summary.get("final_loss"), ".4f")),
        ("validation loss (held-out)", _fmt(summary.get("val_loss"), ".4f")),
        ("mean tokens/s", _fmt(summary.get("mean_tokens_per_s"), ",.0f")),
        ("mean MFU", _fmt(summary.get("mean_mfu"), ".2%")),
        ("mean step time (s)", _fmt(summary.get("mean_step_s"), ".3f")),
        ("restarts", summary.get("restarts")),
    ]
    table = "\n".join(["| metric | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)])
    if nodes:
        table += "\n\n" + "\n".join(
            [
                "| node | host | address | ranks |",
                "| --- | --- | --- | --- |",
                *(f"| {n['node']} | {n['host']} | {n['address']} | {_ranks(n['ranks'])} |" for n in nodes),
            ]
        )
    png = base64.b64encode(Path(png_path).read_bytes()).decode("ascii")
    return f"# {title}\n\n{table}\n\n![loss curve](data:image/png;base64,{png})\n"


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> "0-3" (a node's ranks are consecutive)."""
    return (
        f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1))
        else ", ".join(map(str, ranks))
    )


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
