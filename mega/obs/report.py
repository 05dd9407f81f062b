"""A run's observability report: merged trace, heat map, straggler scores, exposed communication;
as files under the run, TensorBoard scalars, and Markdown (the Prefect task tasks/observability.py
turns it into artifacts)."""

from __future__ import annotations

import base64
import math
import statistics
from pathlib import Path

from mega.obs import analysis, heatmap, trace


def build(run_dir: str | Path, tensorboard: bool = True) -> dict:
    """Trace (``<run_dir>/trace.json``), heat map (``<run_dir>/obs/heatmap.png``), scores and
    exposed communication of a run whose ranks recorded spans; TensorBoard scalars under
    ``<run_dir>/tb`` (``obs/straggler_score/rank_<r>``, ``obs/max_relative_compute``)."""
    run_dir = Path(run_dir)
    tl = analysis.load(run_dir)
    data = analysis.heatmap_data(tl)
    png = heatmap.plot(data, run_dir / "obs" / "heatmap.png", straggler_threshold(run_dir))
    trace_path = trace.write(run_dir)
    exposed = analysis.exposed_per_step(tl, from_arrival=True)
    steady = exposed[1:] or exposed
    scores = dict(zip(data["ranks"], data["scores"]))
    ranking = sorted(scores, key=lambda r: -scores[r] if not math.isnan(scores[r]) else 0)
    result = {
        "trace": str(trace_path),
        "heatmap": str(png.resolve()),
        "ranks": len(tl.ranks),
        "steps": len(tl.step_numbers()),
        "straggler_scores": {str(r): round(scores[r], 4) for r in data["ranks"]},
        "top_stragglers": [
            {"rank": r, "label": tl.headers[r].get("label"), "score": round(scores[r], 4)}
            for r in ranking[:5]
        ],
        "exposed_mean_s": {
            k: _mean([row[f"exposed_{k}_max_s"] for row in steady]) for k in ("tp", "pp", "dp", "other")
        },
        # the same without the waits on a late peer (a straggler's cost, not communication);
        # pipeline p2p is counted that way already
        "exposed_from_arrival_mean_s": {
            k: _mean([row[f"exposed_{k}_from_arrival_max_s"] for row in steady]) for k in ("tp", "dp")
        },
        "overhead": analysis.overhead(tl)["overhead"],
    }
    if tensorboard:
        write_tensorboard(run_dir, tl, data)
    return result


def straggler_threshold(run_dir: Path) -> float:
    """The score above which a rank is a straggler: the run's stability.straggler_factor (its
    config.json; the default without one), the factor at which its watcher reports one."""
    from mega import config as mega_config

    path = run_dir / "config.json"
    if path.exists():
        saved = mega_config.load(path, validate_config=False)
        return saved.stability.straggler_factor
    return mega_config.StabilityConfig().straggler_factor


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{1e3 * v:.2f}"


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def write_tensorboard(run_dir: Path, tl: analysis.RunTimeline, data: dict) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir / "tb"))
    try:
        last = max(data["steps"]) if data["steps"] else 0
        for rank, score in zip(data["ranks"], data["scores"]):
            if not math.isnan(score):
                writer.add_scalar(f"obs/straggler_score/rank_{rank:05d}", score, last)
        for j, step in enumerate(data["steps"]):
            column = [
                (row[j], data["ranks"][i]) for i, row in enumerate(data["relative"]) if row[j] is not None
            ]
            if column:
                value, rank = max(column)
                writer.add_scalar("obs/max_relative_compute", value, step)
                writer.add_scalar("obs/slowest_rank", rank, step)
    finally:
        writer.close()


def markdown(result: dict, title: str = "Observability") -> str:
    """Summary tables and the heat map inlined (base64), so the Prefect UI shows it as is."""
    rows = "\n".join(f"| {s['rank']} | {s['label']} | {s['score']:.3f} |" for s in result["top_stragglers"])
    late = result.get("exposed_from_arrival_mean_s", {})
    exposed = "\n".join(
        f"| {k.upper()} | {_ms(v)} | {_ms(late[k]) if k in late else _ms(v) if k == 'pp' else 'n/a'} |"
        for k, v in result["exposed_mean_s"].items()
    )
    png = base64.b64encode(Path(result["heatmap"]).read_bytes()).decode("ascii")
    overhead = "n/a" if result["overhead"] is None else f"{result['overhead']:.3%}"
    return (
        f"# {title}\n\n{result['ranks']} ranks, {result['steps']} steps; recorder overhead (counted) "
        f"{overhead}; merged trace: `{result['trace']}` (open in ui.perfetto.dev)\n\n"
        f"## Stragglers (compute time / median of the same pipeline stage)\n\n"
        f"| rank | where | score |\n| --- | --- | --- |\n{rows}\n\n"
        f"## Exposed communication per step (slowest rank, mean over steps after the first), ms\n\n"
        f"| kind | ms | without waits on a late peer, ms |\n| --- | --- | --- |\n{exposed}\n\n"
        f"![heat map](data:image/png;base64,{png})\n"
    )
