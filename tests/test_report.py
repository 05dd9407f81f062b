"""The run report from metrics.jsonl: dedup of replayed steps, summary numbers, PNG, Markdown."""

from __future__ import annotations

import base64
import json
import re

import pytest

from mega.report import load_metrics, markdown_report, node_table, plot_loss_curve, restart_steps, summarize


def row(step, loss, attempt, tokens_per_s=1000.0, mfu=0.1, step_s=0.5):
    return {
        "step": step,
        "loss": loss,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "attempt": attempt,
    }


@pytest.fixture
def restarted_run(tmp_path):
    """Attempt 0 logs steps 1-4 and dies; attempt 1 resumes from the step-2 checkpoint."""
    rows = [
        row(1, 6.0, 0, tokens_per_s=10.0, mfu=0.01),
        row(2, 5.0, 0),
        row(3, 4.5, 0),
        row(4, 4.2, 0),
        row(3, 4.4, 1, tokens_per_s=2000.0, mfu=0.2),
        row(4, 4.1, 1, tokens_per_s=2000.0, mfu=0.2),
        row(5, 3.9, 1, tokens_per_s=2000.0, mfu=0.2),
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return tmp_path


def test_load_metrics_keeps_the_last_line_of_each_step(restarted_run, tmp_path_factory):
    metrics = load_metrics(restarted_run)

    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["attempt"] for m in metrics] == [0, 0, 1, 1, 1]
    assert metrics[2]["loss"] == 4.4
    assert restart_steps(metrics) == [3]
    assert load_metrics(tmp_path_factory.mktemp("empty")) == []


def test_summarize(restarted_run):
    summary = summarize(load_metrics(restarted_run))

    assert summary["total_steps"] == 5
    assert summary["final_loss"] == 3.9
    assert summary["restarts"] == 1
    # steps 2..5 (the first step's warm-up is left out): 1000, 2000, 2000, 2000
    assert summary["mean_tokens_per_s"] == pytest.approx(1750.0)
    assert summary["mean_mfu"] == pytest.approx(0.175)
    assert summary["mean_step_s"] == pytest.approx(0.5)
    assert summary["val_loss"] is None  # no evaluation in these rows


def test_summary_and_plot_carry_the_last_validation_loss(tmp_path):
    metrics = [
        row(1, 4.0, 0),
        {**row(2, 3.5, 0), "val_loss": 3.8},
        row(3, 3.2, 0),
        {**row(4, 3.0, 0), "val_loss": 3.3},
    ]
    summary = summarize(metrics)
    assert summary["val_loss"] == 3.3 and summary["final_loss"] == 3.0
    png = plot_loss_curve(metrics, tmp_path / "loss.png")
    assert "| validation loss (held-out) | 3.3000 |" in markdown_report(summary, png)


def test_summarize_edge_cases():
    assert summarize([])["total_steps"] == 0
    only = summarize([row(1, 2.0, 0, tokens_per_s=5.0)])
    assert only["mean_tokens_per_s"] == 5.0 and only["final_loss"] == 2.0


def test_plot_and_markdown(restarted_run):
    metrics = load_metrics(restarted_run)
    png = plot_loss_curve(metrics, restarted_run / "plots" / "loss.png", title="tiny / dp2")

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000

    md = markdown_report(summarize(metrics), png, title="tiny / dp2")
    assert md.startswith("# tiny / dp2")
    assert "| final loss | 3.9000 |" in md and "| restarts | 1 |" in md and "| mean MFU | 17.50% |" in md
    uri = re.search(r"!\[loss curve\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)
    assert uri and base64.b64decode(uri.group(1)) == data


def test_plot_of_no_metrics_still_writes_a_png(tmp_path):
    assert plot_loss_curve([], tmp_path / "empty.png").read_bytes()[:4] == b"\x89PNG"


def test_markdown_names_the_nodes(restarted_run):
    nodes = [
        {"node": 0, "host": "vm", "address": "10.9.0.2", "ranks": [0, 1, 2, 3]},
        {"node": 1, "host": "vm", "address": "10.9.0.3", "ranks": [4, 5, 6, 7]},
    ]
    (restarted_run / "init.json").write_text(json.dumps({"world_size": 8, "nodes": nodes}))
    assert node_table(restarted_run) == nodes
    md = markdown_report(
        summarize(load_metrics(restarted_run)),
        plot_loss_curve([], restarted_run / "l.png"),
        nodes=node_table(restarted_run),
    )
    assert "| 0 | vm | 10.9.0.2 | 0-3 |" in md and "| 1 | vm | 10.9.0.3 | 4-7 |" in md
    assert node_table(restarted_run / "nowhere") == []
