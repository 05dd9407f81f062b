"""``python -m mega.plan [hydra overrides] [--search] [--explain] [--json]``: predict a training step.

  (default)   evaluate the layout the overrides give; knobs they leave open (micro-batch size,
              recomputation, sequence parallelism, precision) are chosen as the best that fits
              -> {"mfu", "step_s", "tokens_per_s", "memory_gib", "fits", "knobs", "breakdown", ...}
  --search    every layout (tp, pp, vpp, dp) of the cluster's GPU count that fits, ranked by MFU;
              layout keys the overrides set stay fixed -> {"best": {...}, "rows": [...]}
  --explain   the terms of the step time, one per line, with what each counts (stderr)
  -m          a Hydra sweep: one evaluation per job (e.g. -m parallelism.pp=4,8,16), each job's
              JSON in its sweep directory (plan.json) and on stdout
  calibrate   measure this machine, time tiny configs over six+ layouts with the real launcher and
              compare with the model (mega/perf/calibrate.py): --out FILE, --steps N, --quick
  validate    leave-one-source-out against the published runs in tests/fixtures/published:
              per row published/predicted MFU and the error in MFU points; --plot PNG

The last line of stdout is JSON. A CPU cluster (cluster=local-cpu) needs a calibration:
``--calibration FILE`` (default runs/perf-calibration.json); on a GPU cluster ``--calibration FILE``
replaces the device's built-in efficiencies with a measured set (python -m mega.perf.calibrate
--device cuda). See docs/perf-model.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mega.config import ConfigError, run_hydra_main

_STATE: dict[str, Any] = {}


def _fits(mem: dict[str, Any]) -> str:
    """Device memory against what is usable, and offloaded activations against a node's host memory."""
    usable = mem.get("usable", float("nan"))
    out = f"{'fits' if mem['total'] <= usable else 'does NOT fit'} in {usable:.1f}"
    if "host_per_node" in mem:
        over = mem["host_per_node"] > mem["host_usable"]
        out += (
            f"; offloaded {mem['host_per_node']:.1f} GiB a node, {'MORE than' if over else 'within'} "
            f"its {mem['host_usable']:.0f} GiB host memory"
        )
    return out


def _print_explain(result: dict[str, Any]) -> None:
    out = sys.stderr
    step = result["step_s"]
    print(
        f"step {step:.4f} s   MFU {result['mfu']:.1%}   HFU {result['hfu']:.1%}   "
        f"{result['tokens_per_s']:,.0f} tokens/s   memory {result['memory_gib']:.1f} GiB "
        f"({_fits(result['memory'])})",
        file=out,
    )
    print(
        f"knobs: {result['knobs']}   (chosen by the planner: {', '.join(result['chosen']) or 'none'})",
        file=out,
    )
    print(f"{'term':<18} {'seconds':>10} {'share':>6} {'total (before overlap)':>22}  what", file=out)
    for name, t in result["breakdown"].items():
        total = f"{t['total_s']:.4f}" if "total_s" in t else ""
        print(
            f"{name:<18} {t['seconds']:>10.4f} {t['seconds'] / step:>6.1%} {total:>22}  {t['what']}", file=out
        )
    mem = result["memory"]
    print(
        "memory GiB: "
        + ", ".join(f"{k} {v:.2f}" for k, v in mem.items() if k != "stage")
        + f" (pipeline stage {mem['stage']})",
        file=out,
    )


def _summary(result: dict[str, Any]) -> None:
    if "best" in result:
        print(f"{len(result['rows'])} layouts fit (rejected: {result['rejected']})", file=sys.stderr)
        for row in result["rows"][:10]:
            lay = row["layout"]
            print(
                f"  tp{lay['tp']} pp{lay['pp']} vpp{lay['vpp']} dp{lay['dp']}  MFU {row['mfu']:.1%}  "
                f"step {row['step_s']:.3f} s  {row['memory_gib']:.1f} GiB  {row['knobs']}",
                file=sys.stderr,
            )
        return
    print(
        f"MFU {result['mfu']:.1%}, step {result['step_s']:.4f} s, {result['tokens_per_s']:,.0f} tokens/s, "
        f"{result['memory_gib']:.1f} GiB per GPU ({'fits' if result['fits'] else 'does not fit'}), "
        f"knobs {result['knobs']}",
        file=sys.stderr,
    )


BASELINE_FEATURES = "megatron-baseline"


def _features(overrides: list[str]) -> str | None:
    return next(
        (o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0].lstrip("+~") == "features"),
        None,
    )


def _evaluate(overrides: list[str], calibration: str | None) -> dict[str, Any]:
    from mega.perf import configs, planner

    plan = configs.for_planning(overrides)
    planner.settle_precision(plan)
    hw, peak = planner.hardware_for(plan.cfg, calibration)
    return planner.evaluate(plan, hw, peak).to_dict(hw)


def _device_warnings(result: dict[str, Any]) -> None:
    """``validated``: whether a published run of this device type checks its calibration."""
    cal = result.get("hardware", {}).get("calibration")
    if cal is None:
        return
    result["validated"] = bool(cal["validated"])
    if not cal["validated"]:
        result.setdefault("warnings", []).append(
            f"device {cal['device']!r} has no published run to validate its efficiencies against "
            f"(calibration: {cal['source']}); calibrate it: python -m mega.perf.calibrate --device cuda"
        )
        return
    from mega.perf import device

    like = device.PRIOR_LIKE.get(cal["device"])
    if like and cal["source"] == device.prior(cal["device"]).source:
        result.setdefault("warnings", []).append(
            f"device {cal['device']!r} plans with the {like}'s efficiencies carried over: its published "
            "runs check them, none is fitted on (docs/perf-model.md, 'Blackwell by transfer'); calibrate "
            "it: python -m mega.perf.calibrate --device cuda"
        )


def _accuracy(result: dict[str, Any]) -> None:
    """``accuracy``: the planner's held-out error on the published runs of this device type and
    precision (``device.ACCURACY``, or that of the device whose calibration it takes), when the plan
    uses the built-in calibration those runs validate."""
    from mega.perf import device

    plan = result.get("best", result)
    cal = plan.get("hardware", {}).get("calibration")
    precision = plan.get("knobs", {}).get("precision")
    if not cal or cal["source"] != device.prior(cal["device"]).source:
        return
    for dev in (cal["device"], device.PRIOR_LIKE.get(cal["device"])):
        record = device.ACCURACY.get(dev or "", {}).get(precision)
        if record:
            result["accuracy"] = {"device": dev, "precision": precision, "held_out": True, **record}
            return


def _accuracy_line(acc: dict[str, Any]) -> str:
    ex, every = acc["explained"], acc["all"]
    if not ex["rows"]:  # only rows of systems the model does not describe
        ex = every
    line = (
        f"accuracy: on published {acc['device']} {acc['precision']} runs held out, the model erred "
        f"{ex['min_err_mfu_pts']:+.1f} to {ex['max_err_mfu_pts']:+.1f} MFU points (MAE {ex['mae_mfu_pts']:.1f}, "
        f"{ex['within_3_pts']} of {ex['rows']} within +-3)"
    )
    if every is not ex and every["rows"] > ex["rows"]:
        line += (
            f"; {every['min_err_mfu_pts']:+.1f} to {every['max_err_mfu_pts']:+.1f} with the "
            f"{every['rows'] - ex['rows']} it does not explain"
        )
    return line + " (docs/perf-model.md)"


# Share of a GPU step spent in unfused attention above which the plan says what flash attention gives.
UNFUSED_ATTENTION_SHARE = 0.05


def _attention_warning(
    evaluation: dict[str, Any], overrides: list[str], calibration: str | None
) -> str | None:
    """On a GPU, ``model.fused_ops=false`` keeps megatron-core's unfused attention (the s x s scores
    written and read back), which no production GPU run uses: where it costs a visible share of the
    step, the plan says so with the same layout's MFU under flash attention."""
    hw = evaluation.get("hardware", {})
    if hw.get("cores") is not None or hw.get("flash_attention", True):
        return None
    attention = evaluation["breakdown"]["attention"]["seconds"]
    share = attention / evaluation["step_s"]
    if share < UNFUSED_ATTENTION_SHARE:
        return None
    layout = evaluation["layout"]
    pinned = [f"parallelism.{k}={layout[k]}" for k in ("tp", "pp", "cp", "dp")]
    pinned.append(f"parallelism.vpp={layout['vpp'] if layout['vpp'] > 1 else 'null'}")
    said = (
        f"attention runs unfused (model.fused_ops=false: megatron-core's DotProductAttention writes "
        f"the s x s scores): {attention:.3g} s of the {evaluation['step_s']:.3g} s step ({share:.0%}); "
        f"with model.fused_ops=true (flash-attn, fused element-wise kernels)"
    )
    try:
        fused = _evaluate([*overrides, *pinned, "model.fused_ops=true"], calibration)
    except ConfigError as err:  # the warning must not fail the plan it annotates
        return f"{said} the same layout does not plan ({err})"
    return f"{said} the same layout plans at {fused['mfu']:.1%} MFU"


def _warn_unfused_attention(result: dict[str, Any], overrides: list[str], calibration: str | None) -> None:
    """``_attention_warning`` for an evaluation, or for a search's best layout."""
    if "best" in result:
        warning = result["best"] and _attention_warning(result["best"], overrides, calibration)
        warning = warning and f"best layout: {warning}"
    else:
        warning = _attention_warning(result, overrides, calibration)
    if warning:
        result.setdefault("warnings", []).append(warning)


def plan_once(overrides: list[str], search: bool, calibration: str | None) -> dict[str, Any]:
    """One evaluation (or search); with ``features`` other than the baseline, also the baseline's
    evaluation of the same layout and ``speedup_vs_baseline`` (tokens/s ratio)."""
    from mega.perf import configs, planner

    if search:
        plan = configs.for_planning(overrides)
        result = planner.search(plan, calibration)
        _warn_unfused_attention(result, overrides, calibration)
        _accuracy(result)
        return result
    result = _evaluate(overrides, calibration)
    _device_warnings(result)
    _accuracy(result)
    _warn_unfused_attention(result, overrides, calibration)
    features = _features(overrides)
    if features is not None and features != BASELINE_FEATURES:
        base = _evaluate(
            [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "features"]
            + [f"features={BASELINE_FEATURES}"],
            calibration,
        )
        result["baseline"] = {k: base[k] for k in ("mfu", "step_s", "tokens_per_s", "knobs", "fits")}
        result["speedup_vs_baseline"] = result["tokens_per_s"] / base["tokens_per_s"]
    return result


def _emit(result: dict[str, Any]) -> None:
    if _STATE.get("explain") and "breakdown" in result:
        _print_explain(result)
    elif _STATE.get("explain") and result.get("best"):
        _print_explain(result["best"])
    if not _STATE.get("json"):
        _summary(result)
        if result.get("accuracy"):
            print(f"plan: {_accuracy_line(result['accuracy'])}", file=sys.stderr)
    for warning in result.get("warnings", []):
        print(f"plan: warning: {warning}", file=sys.stderr)
    print(json.dumps(result), flush=True)


def _hydra_job(dcfg: Any) -> dict[str, Any]:
    """One job of a ``-m`` sweep: the job's overrides, composed by Hydra, planned like a single run."""
    from hydra.core.hydra_config import HydraConfig

    from mega.config import from_container
    from mega.perf import configs, planner

    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    try:
        plan = configs.prepare(from_container(dcfg, validate_config=False), configs.given_keys(overrides))
        if _STATE.get("search"):
            result = planner.search(plan, _STATE.get("calibration"))
        else:
            planner.settle_precision(plan)
            hw, peak = planner.hardware_for(plan.cfg, _STATE.get("calibration"))
            result = planner.evaluate(plan, hw, peak).to_dict(hw)
            _device_warnings(result)
        _warn_unfused_attention(result, overrides, _STATE.get("calibration"))
        _accuracy(result)
    except ConfigError as err:
        result = {"error": str(err), "key": err.key}
    result["overrides"] = overrides
    out = Path(hc.runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(result, indent=1))
    _emit(result)
    return result


def _multirun(overrides: list[str]) -> int:
    # Sweep jobs write only plan.json; no training run directory is involved. Logging is left
    # as the caller set it: Hydra's "disabled" preset would disable every logger that exists.
    defaults = [
        "hydra.sweep.dir=runs/plan-multirun/${now:%Y-%m-%d_%H-%M-%S}",
        "hydra.job.chdir=false",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]
    given = {o.split("=", 1)[0] for o in overrides}
    argv = [a for a in defaults if a.split("=", 1)[0] not in given] + overrides
    saved = sys.argv
    sys.argv = [saved[0], "-m", *argv]
    try:
        run_hydra_main(_hydra_job, "plan")
    finally:
        sys.argv = saved
    return 0


def check_args(argv: list[str]) -> None:
    """Parse ``argv`` as ``python -m mega.plan`` does and compose the config of every evaluation it
    would make (each point of a ``-m`` sweep) as the planner does, measuring nothing. A bad flag
    exits (argparse); a bad override raises ConfigError naming the key."""
    from mega.config import sweep_jobs
    from mega.perf import configs

    if argv and argv[0] == "calibrate":
        from mega.perf.calibrate import parser as calibrate_parser

        calibrate_parser().parse_args(argv[1:])
        return
    if argv and argv[0] == "validate":
        _validate_parser().parse_args(argv[1:])
        return
    args = _parser().parse_intermixed_args(argv)
    for job in sweep_jobs(args.overrides) if args.multirun else [args.overrides]:
        configs.for_planning(job)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        from mega.perf.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv and argv[0] == "validate":
        return _validate(argv[1:])
    args = _parser().parse_intermixed_args(argv)
    _STATE.update(search=args.search, explain=args.explain, json=args.json, calibration=args.calibration)
    if args.multirun:
        return _multirun(args.overrides)
    try:
        result = plan_once(args.overrides, args.search, args.calibration)
    except ConfigError as err:
        print(f"plan: invalid config: {err}", file=sys.stderr)
        return 2
    _emit(result)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mega.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt-175b cluster=a100-8x")
    parser.add_argument("--search", action="store_true", help="rank every layout that fits")
    parser.add_argument("--explain", action="store_true", help="print the step-time terms (stderr)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line on stdout")
    parser.add_argument("--calibration", default=None, help="calibration JSON for CPU clusters")
    parser.add_argument("-m", "--multirun", action="store_true", help="Hydra sweep: one evaluation per job")
    return parser


def _validate_parser() -> argparse.ArgumentParser:
    from mega.perf import published

    parser = argparse.ArgumentParser(
        prog="python -m mega.plan validate",
        description="leave-one-source-out: each published source "
        "(tests/fixtures/published) predicted with the per-device "
        "calibration fitted on all the others",
    )
    parser.add_argument("--fixtures", default=str(published.DEFAULT_DIR))
    parser.add_argument("--plot", default=None, help="write the predicted-vs-published PNG here")
    parser.add_argument(
        "--rounds",
        type=int,
        default=published.FIT_ROUNDS,
        help="at most this many coordinate-descent rounds per fit (each stops once converged)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="fit the sources in this many processes (default: one per core; the result is the same)",
    )
    parser.add_argument("--json", action="store_true")
    return parser


def _validate(argv: list[str]) -> int:
    from mega.perf import published

    args = _validate_parser().parse_args(argv)
    started = time.monotonic()

    def progress(done: int, total: int, label: str) -> None:
        what = "fitted on" if label == published.ALL_SOURCES else "held out"
        elapsed = time.monotonic() - started
        print(f"validate: {done}/{total} fits ({elapsed:.0f} s): {what} {label}", file=sys.stderr, flush=True)

    try:
        result = published.validate(Path(args.fixtures), args.plot, args.rounds, max(1, args.jobs), progress)
    except (ValueError, OSError) as err:  # a fixture that is missing, not JSON or not a valid layout
        print(f"validate: {err}", file=sys.stderr)
        return 2
    if not args.json:
        for r in result["rows"]:
            print(
                f"{r['source'][:34]:<34} {r['name']:<22} published {100 * r['published_mfu']:5.1f} "
                f"predicted {100 * r['predicted_mfu']:5.1f} {r['err_mfu_pts']:+5.1f} pts"
                + (f"  ({r['reason']})" if r.get("reason") else ""),
                file=sys.stderr,
            )
        s = result["summary"]
        print(
            f"{s['rows']} rows: MAE {s['mae_mfu_pts']:.2f} MFU points, max |error| {s['max_abs_err_mfu_pts']:.1f}, "
            f"{s['within_3_pts']} within +-3; targets met: {s['targets_met']}",
            file=sys.stderr,
        )
        for dev, by_precision in result["accuracy"].items():
            for precision, record in by_precision.items():
                line = _accuracy_line({"device": dev, "precision": precision, **record})
                print(line, file=sys.stderr)
    stale = published.stale_built_ins(result)
    result["built_in_up_to_date"] = not stale
    for name in stale:
        print(
            f"validate: mega/perf/device.py {name} is not what this validation derives: update it "
            "(the fit on all sources is `fitted_on_all`, the held-out errors `accuracy`)",
            file=sys.stderr,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
