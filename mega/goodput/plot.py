"""The ledger as a picture: the run's timeline coloured by category with faults marked, the
surviving step count over time, and one stacked bar of where the wall clock went."""

from __future__ import annotations

from pathlib import Path

from mega.goodput.ledger import CATEGORIES

COLORS = dict(
    zip(
        CATEGORIES,
        [
            "tab:green",
            "tab:red",
            "lightgrey",
            "tab:orange",
            "gold",
            "tab:purple",
            "peru",
            "tab:blue",
            "tab:cyan",
            "crimson",
            "tab:brown",
            "tab:pink",
            "olive",
            "whitesmoke",
            "silver",
            "black",
        ],
    )
)


def plot(
    led: dict, png_path: str | Path, title: str = "goodput", steps: list[tuple[float, int]] | None = None
) -> Path:
    """``steps``: (seconds since the start, surviving step) points to draw over the timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig, (top, bar) = plt.subplots(2, 1, figsize=(9, 4.2), dpi=100, height_ratios=[3, 1])
    try:
        for t0, t1, cat in led["timeline"]:
            top.broken_barh([(t0, t1 - t0)], (0, 1), color=COLORS[cat], lw=0)
        for i, f in enumerate(led["faults"]):
            top.axvline(
                f["at"] - led["start"], color="black", ls="--", lw=1, label="fault" if i == 0 else None
            )
        top.set(
            xlim=(0, led["wall_s"]),
            ylim=(0, 1),
            yticks=[],
            xlabel="seconds since the start",
            title=f"{title}: ETTR {led['ettr']:.3f} over {led['wall_s']:.0f} s",
        )
        if steps:
            ax = top.twinx()
            ax.plot([t for t, _ in steps], [s for _, s in steps], color="black", lw=1, marker=".", ms=2)
            ax.set_ylabel("step")
        left = 0.0
        for cat in CATEGORIES:
            s = led["ledger_s"].get(cat, 0.0)
            if s > 0:
                bar.barh(0, s, left=left, color=COLORS[cat], label=f"{cat} {100 * s / led['wall_s']:.1f}%")
                left += s
        bar.set(xlim=(0, led["wall_s"]), yticks=[], xlabel="seconds")
        bar.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6), ncol=4, fontsize=7, frameon=False)
        if led["faults"]:
            top.legend(loc="upper left", fontsize=7)
        fig.tight_layout()
        fig.savefig(png_path, format="png")
    finally:
        plt.close(fig)
    return png_path
