"""The ledger for people: goodput.json, the PNG, a table, Markdown and TensorBoard scalars
(the Prefect task tasks/observability.py turns them into artifacts)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from mega.goodput import ledger, plot


def steps_over_time(run_dir: Path, start: float) -> list[tuple[float, int]]:
    """(seconds since the start, step) of every logged step, replays included (metrics.jsonl)."""
    path = run_dir / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
    return [(r["time"] - start, r["step"]) for r in rows if "time" in r]


def build(run_dir: str | Path, title: str = "goodput", tensorboard: bool = True) -> dict:
    """Write ``goodput.json`` and ``goodput.png``; TensorBoard ``goodput/<category>_s`` and
    ``goodput/ettr``. Returns the ledger with ``png`` and ``table`` added."""
    run_dir = Path(run_dir)
    led = ledger.write(run_dir)
    png = plot.plot(led, run_dir / "goodput.png", title=title, steps=steps_over_time(run_dir, led["start"]))
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        try:
            writer.add_scalar("goodput/ettr", led["ettr"], 0)
            for cat, s in led["ledger_s"].items():
                writer.add_scalar(f"goodput/{cat}_s", s, 0)
        finally:
            writer.close()
    return {**led, "png": str(png), "table": table(led)}


def table(led: dict) -> list[dict]:
    wall = led["wall_s"] or 1.0
    return [
        {"category": c, "seconds": round(s, 3), "percent": round(100 * s / wall, 3)}
        for c, s in led["ledger_s"].items()
        if s > 0 or c in ("productive", "unattributed")
    ]


def markdown(led: dict, png: str | Path, title: str) -> str:
    image = base64.b64encode(Path(png).read_bytes()).decode()
    rows = "\n".join(f"| {r['category']} | {r['seconds']:.2f} | {r['percent']:.2f} |" for r in table(led))
    parts = "".join(f"\n- unattributed: {k}: {v:.2f} s" for k, v in led["unattributed_parts"].items())
    faults = "".join(
        f"\n- {f['kind']} (attempt {f['attempt']}, step {f['step']}) at {f['at'] - led['start']:.1f} s"
        for f in led["faults"]
    )
    return (
        f"# {title}\n\nETTR **{led['ettr']:.4f}** (productive / wall clock) over {led['wall_s']:.1f} s, "
        f"{len(led['attempts'])} attempt(s); samples exact: {led['samples']['exact']}\n\n"
        f"![ledger](data:image/png;base64,{image})\n\n| category | seconds | % |\n|---|---|---|\n{rows}\n"
        f"{parts}{faults}\n"
    )
