"""The heat map PNG: compute time per rank x step, ranks laid out by parallel coordinates.

Each cell is a rank's compute time in a step divided by the median of the ranks doing the same
work (its pipeline stage) in that step, so a slow machine is a red row whatever its stage's share
of the model; rows are grouped by pipeline stage, then DP, then TP rank. Next to it: the
straggler score per rank (mega.obs.analysis.straggler_scores), red where it crosses the threshold
at which the run's watcher reports a straggler (stability.straggler_factor): a healthy run has no
red bar.
"""

from __future__ import annotations

import math
from pathlib import Path

STRAGGLER_COLOUR, PEER_COLOUR = "tab:red", "tab:gray"


def bar_colours(scores: list[float], threshold: float) -> list[str]:
    """The per-rank bars: red for a score above ``threshold`` (stability.straggler_factor)."""
    return [STRAGGLER_COLOUR if s > threshold else PEER_COLOUR for s in scores]


def plot(
    data: dict, png_path: str | Path, threshold: float, title: str = "compute time per rank and step"
) -> Path:
    """Draw ``data`` (mega.obs.analysis.heatmap_data) into ``png_path``; ranks whose straggler score
    is above ``threshold`` get a red bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    ranks, steps = data["ranks"], data["steps"]
    rel = [[math.nan if v is None else v for v in row] for row in data["relative"]]
    finite = [v for row in rel for v in row if not math.isnan(v)] or [1.0]
    vmin, vmax = min(0.5, min(finite)), max(1.5, max(finite))
    height = min(16.0, 1.6 + 0.28 * len(ranks))
    fig, (ax, bars) = plt.subplots(
        1, 2, figsize=(11, height), dpi=100, sharey=True, gridspec_kw={"width_ratios": [4, 1]}
    )
    try:
        norm = TwoSlopeNorm(vcenter=1.0, vmin=vmin, vmax=vmax)
        image = ax.imshow(rel, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
        if len(steps) > 30:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(15, integer=True))
        labels = data["labels"] if len(ranks) <= 64 else ["" for _ in ranks]
        ax.set_yticks(range(len(ranks)), labels, fontsize=7)
        stages = data["stages"]
        for i in range(1, len(ranks)):
            if stages[i] != stages[i - 1]:
                ax.axhline(i - 0.5, color="black", lw=1.2)
                bars.axhline(i - 0.5, color="black", lw=0.8)
        if len(ranks) * len(steps) <= 400:
            for i, row in enumerate(data["compute_s"]):
                for j, v in enumerate(row):
                    if v is not None:
                        dark = abs(float(norm(rel[i][j])) - 0.5) > 0.3
                        ax.text(
                            j,
                            i,
                            f"{1e3 * v:.0f}",
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white" if dark else "black",
                        )
        ax.set(xlabel="step", title=f"{title}\n(cell: ms; colour: vs. the median of its pipeline stage)")
        fig.colorbar(image, ax=ax, fraction=0.04, pad=0.01, label="compute / stage median")
        scores = [0.0 if s is None or math.isnan(s) else s for s in data["scores"]]
        bars.barh(range(len(ranks)), scores, color=bar_colours(scores, threshold))
        bars.axvline(1.0, color="black", lw=0.8, ls="--")
        bars.axvline(threshold, color="black", lw=0.8, ls=":")
        bars.set_xlim(0, 1.1 * max([threshold, *scores]))  # the threshold in view in a healthy run too
        bars.set(
            xlabel="straggler score",
            title=f"per rank\n(red: above {threshold:g},\nstability.straggler_factor)",
        )
        fig.tight_layout()
        fig.savefig(png_path, format="png")
    finally:
        plt.close(fig)
    return png_path
