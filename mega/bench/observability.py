"""``python -m mega.bench observability [overrides] [--steps N] [--out DIR] [--json]``.

Four real training jobs of one layout (default TP2 x PP2 x DP2, tiny model), under ``--out``
(default ``runs/bench-observability``):

* ``on``: the recorder on, GC controlled (``train.gc_interval``). ``overhead`` is its counted
  cost: the recorder's CPU time (calls x calibrated unit costs, end-of-step work, the flush
  thread, set-up) plus the wall time of the pipeline post exchange, summed over ranks, over the
  ranks' wall time (mega/obs/overhead.py); ``trace`` is the merged trace of this run and
  ``ranks_in_trace`` the processes in it.
* ``off``: the same job with ``obs.enabled=false``; ``overhead_on_off`` = median step time on /
  off - 1 (for information: on a shared machine it is mostly noise).
* ``gc-auto``: the recorder on with Python's automatic GC (``train.gc_interval=0``):
  ``gc_step_time_cv_auto`` vs ``gc_step_time_cv_controlled`` (from ``on``) = stdev / mean, over
  the steps after the warm-up, of the time from a step's start to the next's on the slowest rank
  (from the span files: it includes the controlled collections between steps).
* ``straggler``: ``fault.slow_rank`` burns ``--slow-s`` CPU seconds in every forward; ``heatmap``
  is its heat map and ``straggler_named`` whether the slowed rank has the top straggler score.

The last line is ``{"overhead", "overhead_on_off", "ranks_in_trace", "world_size", "straggler_named",
"trace", "heatmap", "gc_step_time_cv_auto", "gc_step_time_cv_controlled"}``; every run's details
(per-step times, per-rank accounting, scores) go to ``<out>/result.json``.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from mega.bench import common

DEFAULT_OVERRIDES = ("model=tiny", "parallelism=tp2-pp2-dp2")


def _run(name: str, overrides: list[str], steps: int, out: Path, index: Path | None):
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a previous bench's span files must not mix in
    cfg = common.compose_run(
        [*overrides, "checkpoint.load=false", "optimizer.warmup_steps=1"], steps, run_dir
    )
    index = index or common.prepare_data(cfg)
    common.log(f"[observability] {name}: {cfg.parallelism.name}, {steps} steps -> {run_dir}")
    return cfg, common.train(cfg, index), index


def _cv(values: list[float]) -> float:
    return statistics.stdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0


def _step_intervals(tl, warmup: int) -> list[float]:
    """Seconds from one step's start to the next's, slowest rank, after the warm-up (and before
    the last step, whose tail is the job's shutdown): unlike the metrics' step_s this includes what
    runs between steps (the controlled collections)."""
    numbers = tl.step_numbers()
    steps = [s for s in numbers[:-1] if s > warmup]
    return [
        max((rec["tail_t1"] - rec["t0"]) * 1e-9 for per in tl.steps.values() if (rec := per.get(s)))
        for s in steps
    ]


def bench_observability(
    overrides: list[str], steps: int, warmup: int, out: str | Path, slow_s: float = 0.1
) -> dict:
    from mega.obs import analysis, report, trace

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = [*DEFAULT_OVERRIDES, *overrides]
    cfg_on, on, index = _run("on", base, steps, out, None)
    _, off, _ = _run("off", [*base, "obs.enabled=false"], steps, out, index)
    _, auto, _ = _run("gc-auto", [*base, "train.gc_interval=0"], steps, out, index)
    world = cfg_on.parallelism.world_size
    slow_rank = world // 2 + 1 if world > 2 else world - 1
    _, slow, _ = _run(
        "straggler",
        [*base, f"fault.slow_rank={slow_rank}", f"fault.slow_s={slow_s}"],
        max(4, warmup + 3),
        out,
        index,
    )

    timeline_on, timeline_auto = analysis.load(on.run_dir), analysis.load(auto.run_dir)
    counted = analysis.overhead(timeline_on)
    trace_path = trace.write(on.run_dir)
    processes = sum(
        1
        for e in json.loads(trace_path.read_text())["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    )
    straggler = report.build(slow.run_dir, tensorboard=False)
    steady_on, steady_off = common.steady(on.metrics, warmup), common.steady(off.metrics, warmup)
    step_on, step_off = common.median(steady_on, "step_s"), common.median(steady_off, "step_s")
    result = {
        "overhead": counted["overhead"],
        "overhead_on_off": step_on / step_off - 1,
        "ranks_in_trace": processes,
        "world_size": world,
        "straggler_named": straggler["top_stragglers"][0]["rank"] == slow_rank,
        "trace": str(trace_path),
        "heatmap": straggler["heatmap"],
        "gc_step_time_cv_auto": _cv(_step_intervals(timeline_auto, warmup)),
        "gc_step_time_cv_controlled": _cv(_step_intervals(timeline_on, warmup)),
    }
    details = {
        "result": result,
        "config": {
            "overrides": base,
            "steps": steps,
            "warmup": warmup,
            "gc_interval": cfg_on.train.gc_interval,
            "slow_rank": slow_rank,
            "slow_s": slow_s,
            "device": common.device_name(cfg_on),
        },
        "counted": counted,
        "accounting_per_rank": timeline_on.accounting,
        "step_s": {
            name: [r["step_s"] for r in res.metrics]
            for name, res in (("on", on), ("off", off), ("gc-auto", auto), ("straggler", slow))
        },
        "step_interval_s": {
            "gc-auto": _step_intervals(timeline_auto, warmup),
            "on (gc controlled)": _step_intervals(timeline_on, warmup),
        },
        "gc_s_per_step_auto": [_gc_s(timeline_auto, s) for s in range(1, steps + 1)],
        "straggler": {k: straggler[k] for k in ("top_stragglers", "straggler_scores", "exposed_mean_s")},
        "note": "timings from a shared machine are noisy; overhead is counted (CPU time of the recorder), "
        "overhead_on_off is measured end to end and reported for information",
    }
    (out / "result.json").write_text(json.dumps(details, indent=2))
    return result


def _gc_s(tl, step: int) -> float:
    """The longest GC time of any rank in a step (automatic collections: who held the others up)."""
    values = [rec.get("summary", {}).get("gc_s", 0.0) for per in tl.steps.values() if (rec := per.get(step))]
    return max(values, default=0.0)
