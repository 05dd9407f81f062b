"""The model against published training results (tests/fixtures/published/*.json).

A fixture transcribes one source: where it comes from (paper, table, row), the system's
differences from megatron-core that the model knows (``system``), the overrides shared by its rows
(``common``), the knobs the source does not publish (``open``: the planner chooses them as a user
would, the best that fits), and per row the layout overrides, the published metric and value.

Metrics: ``step_s`` (seconds per iteration), ``mfu`` (fraction), ``tflops_per_gpu`` (achieved
TFLOP/s per GPU counting recomputation, Narayanan et al.'s eq. 3 = mega.flops with recompute).
``error`` is predicted / published - 1 of that metric. For the plot every row is also expressed
as a step time (the published throughput turned into seconds with the same FLOP count).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mega.flops import model_flops_per_step
from mega.perf import hardware
from mega.perf.configs import Composer
from mega.perf.planner import evaluate, hardware_for, settle_precision

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "published"
METRICS = ("step_s", "mfu", "tflops_per_gpu")


@dataclass
class RowResult:
    source: str
    group: str
    id: str
    row: str
    metric: str
    published: float
    predicted: float
    published_step_s: float
    predicted_step_s: float
    gpus: int
    knobs: dict[str, Any]
    fits: bool

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "error": self.error}


def load(directory: Path = DEFAULT_DIR) -> list[dict[str, Any]]:
    fixtures = []
    for path in sorted(Path(directory).glob("*.json")):
        data = json.loads(path.read_text())
        data["file"] = path.name
        for key in ("source", "group", "metric", "rows"):
            if key not in data:
                raise ValueError(f"{path}: missing {key!r}")
        if data["metric"] not in METRICS:
            raise ValueError(f"{path}: metric {data['metric']!r} is not one of {METRICS}")
        fixtures.append(data)
    return fixtures


@dataclass
class Case:
    """A fixture row composed for planning (composition is the slow part: done once)."""

    fixture: dict[str, Any]
    row: dict[str, Any]
    plan: Any


def cases(fixtures: list[dict[str, Any]]) -> list[Case]:
    out = []
    with Composer() as composer:
        for fx in fixtures:
            for row in fx["rows"]:
                plan = composer.plan([*fx.get("common", []), *row["overrides"]])
                plan.given -= set(fx.get("open", []))  # unpublished knobs: the planner chooses them
                out.append(Case(fx, row, plan))
    return out


def predict_rows(fixtures: list[dict[str, Any]] | list[Case], gemm_efficiency: float | None = None) -> list[RowResult]:
    """Predict every row (``gemm_efficiency`` replaces the global constant: used by the fit)."""
    todo = fixtures if fixtures and isinstance(fixtures[0], Case) else cases(fixtures)  # type: ignore[arg-type]
    results = []
    for case in todo:
        fx, row, plan = case.fixture, case.row, case.plan
        settle_precision(plan)
        hw, peak = hardware_for(plan.cfg)
        if gemm_efficiency is not None:
            hw = dataclasses.replace(hw, gemm_efficiency=gemm_efficiency)
        ev = evaluate(plan, hw, peak, p2p_scatter_gather=fx.get("system", {}).get("p2p_scatter_gather", False))
        pr, cfg = ev.prediction, ev.cfg
        gpus = cfg.parallelism.world_size
        if fx["metric"] == "step_s":
            predicted, pub_step = pr.step_s, row["value"]
        elif fx["metric"] == "mfu":
            predicted = pr.mfu
            pub_step = model_flops_per_step(cfg) / (row["value"] * gpus * peak)
        else:
            hw_flops = pr.hfu * pr.step_s * gpus * peak  # FLOPs per step counting recompute
            predicted = pr.hfu * peak / 1e12
            pub_step = hw_flops / (row["value"] * 1e12 * gpus)
        results.append(RowResult(fx["source"], fx["group"], row["id"], row.get("row", row["id"]),
                                 fx["metric"], row["value"], predicted, pub_step, pr.step_s, gpus,
                                 ev.knobs, pr.fits))
    return results


def summary(results: list[RowResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group in sorted({r.group for r in results}):
        errs = [r.error for r in results if r.group == group]
        out[group] = {"rows": len(errs), "max_abs_error": max(abs(e) for e in errs),
                      "mean_abs_error": sum(abs(e) for e in errs) / len(errs),
                      "mean_error": sum(errs) / len(errs)}
    return out


def fit_gemm_efficiency(fixtures: list[dict[str, Any]] | list[Case], lo: float = 0.5, hi: float = 1.0,
                        tol: float = 1e-3) -> float:
    """The GEMM efficiency minimizing the sum of squared log step-time errors over ``fixtures``
    (golden-section search): how hardware.GEMM_EFFICIENCY was set, on Korthikanti et al. Table 5."""
    prepared = fixtures if fixtures and isinstance(fixtures[0], Case) else cases(fixtures)  # type: ignore[arg-type]

    def loss(e: float) -> float:
        return sum(math.log(r.predicted_step_s / r.published_step_s) ** 2 for r in predict_rows(prepared, e))

    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(c), loss(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = loss(d)
    return (a + b) / 2


def plot(results: list[RowResult], path: str | Path) -> Path:
    """Predicted vs published step time, log-log, one marker per source, +-10% bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 6))
    xs = [r.published_step_s for r in results] + [r.predicted_step_s for r in results]
    lo, hi = min(xs) / 1.5, max(xs) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="predicted = published")
    for k, style in ((1.1, "--"), (1 / 1.1, "--")):
        ax.plot([lo, hi], [lo * k, hi * k], color="grey", lw=0.8, ls=style)
    markers = "osD^vP*X"
    for i, source in enumerate(dict.fromkeys(r.source for r in results)):
        rows = [r for r in results if r.source == source]
        ax.scatter([r.published_step_s for r in rows], [r.predicted_step_s for r in rows], marker=markers[i % 8],
                   s=40, label=source, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("published step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title("mega.perf: predicted vs published (A100 80GB clusters; dashed: +-10%)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def validate(directory: Path = DEFAULT_DIR, plot_path: str | Path | None = None) -> dict[str, Any]:
    results = predict_rows(load(directory))
    out = {"rows": [r.to_dict() for r in results], "summary": summary(results),
           "gemm_efficiency": hardware.GEMM_EFFICIENCY}
    if plot_path:
        out["plot"] = str(plot(results, plot_path))
    return out
