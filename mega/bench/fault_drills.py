"""The rollback and eviction drills of ``python -m mega.bench faults`` (rows ``nan`` and
``bad-node``); runnable alone: ``python -m mega.bench.fault_drills [--only nan,bad-node] [--json]``.

* ``nan``: a PP2 run (2 ranks) whose every rank's loss turns NaN at step 4 of attempt 0 (a
  poisoned weight, ``fault.nan_at_step``). Detected = the driver recorded a skip of that step;
  culprit named = the skipped step is the poisoned one; recovered = the run finished with every
  other step's loss finite. detect_s: poisoning -> rollback request (ranks' clocks, same machine);
  recover_s: request -> the skipped step logged by the relaunch (training past the bad batch);
  steps_lost: steps computed again (logged by attempt 0 after the checkpoint it restored).
* ``bad-node``: 2 local nodes x 1 rank (DP 2) with one spare; node 1's ranks are SIGKILLed at step
  2 and node 1 fails its self-check (``fault.bad_node``). Detected = the driver saw node 1 fail;
  culprit named = node 1 and only node 1 was evicted; recovered = the run finished at full size on
  the spare. detect_s: kill -> the driver's failure log line; recover_s: that line -> the first step
  logged after the restart (stopping, self-check, relaunch, restore); steps_lost as above.

Every figure is measured end to end on this machine (timings on a shared 2-core machine are noisy).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from mega.bench import common

NAN_STEP = 4
KILL_STEP = 2
STEPS = 6
ROW_KEYS = ("fault", "detected", "detect_s", "culprit_named", "recovered", "recover_s", "steps_lost")


def _run(overrides: list[str], run_dir: Path) -> tuple[object | None, list[tuple[float, str]], str | None]:
    """Train through the driver with checkpoints every 2 steps; returns (result or None, the
    driver's log lines with their wall-clock times, the error)."""
    from mega.config import compose
    from mega.launch import TrainingFailed, run_training

    cfg = compose(["model=tiny", f"train.steps={STEPS}", f"train.run_dir={run_dir}", "train.tensorboard=false",
                   "train.eval_batches=0", "optimizer.warmup_steps=1", "checkpoint.restart_backoff_s=0",
                   "checkpoint.async_save=false", f"checkpoint.dir={run_dir}/checkpoints", "checkpoint.interval=2",
                   *overrides])
    index = common.prepare_data(cfg)
    lines: list[tuple[float, str]] = []

    def log(message: str) -> None:
        lines.append((time.time(), message))
        common.log(message)

    try:
        return run_training(cfg, index, log=log), lines, None
    except TrainingFailed as e:
        return None, lines, str(e)


def _faults(run_dir: Path) -> list[dict]:
    path = run_dir / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps_lost(history: list[dict]) -> int:
    """Steps attempt 0 logged after the checkpoint the next attempt restored."""
    first, second = history[0], history[1]
    restored = int(second["restored"].split("_")[-1]) if second.get("restored") else 0
    return first["final_step"] - restored


def drill_nan(tmp: Path) -> dict:
    from mega.launch.runs import read_record

    run_dir = tmp / "nan"
    result, _, error = _run(["parallelism=pp2", f"fault.nan_at_step={NAN_STEP}"], run_dir)
    row = dict.fromkeys(ROW_KEYS)
    row.update(fault="nan", detected=False, culprit_named=False, recovered=False, error=error)
    skips = read_record(run_dir).skipped_steps if (run_dir / "run.json").exists() else []
    poisoned = [f for f in _faults(run_dir) if f["kind"] == "nan"]
    if skips and poisoned:
        row.update(detected=True, detect_s=round(skips[0]["time"] - poisoned[0]["time"], 3),
                   culprit_named=skips[0]["step"] == NAN_STEP)
    if result is not None and len(result.history) > 1:
        rows = {m["step"]: m for m in result.metrics}
        skipped = rows.get(NAN_STEP, {})
        row.update(recovered=bool(skipped.get("data_skipped")) and result.final_step == STEPS and all(
            math.isfinite(m["loss"]) for m in result.metrics if not m.get("data_skipped")),
            steps_lost=_steps_lost(result.history))
        if skips and "time" in skipped:
            row["recover_s"] = round(skipped["time"] - skips[0]["time"], 3)
    return row


def drill_bad_node(tmp: Path) -> dict:
    run_dir = tmp / "bad-node"
    result, lines, error = _run(["parallelism=dp2", "launcher=local-nodes", "cluster.nodes=2",
                                 "cluster.procs_per_node=1", "cluster.spare_nodes=1", "fault.kill_node=1",
                                 f"fault.kill_at_step={KILL_STEP}", "fault.bad_node=1"], run_dir)
    row = dict.fromkeys(ROW_KEYS)
    row.update(fault="bad-node", detected=False, culprit_named=False, recovered=False, error=error)
    killed = [f for f in _faults(run_dir) if f["kind"] == "kill"]
    seen = [t for t, line in lines if line.startswith("attempt 0:") and "stopping every node" in line]
    if result is None:
        return row
    first = result.history[0]
    row["detected"] = first["failed_nodes"] == [1]
    if killed and seen:
        row["detect_s"] = round(seen[0] - killed[0]["time"], 3)
    row["culprit_named"] = first.get("evicted") == [1]
    resumed = [m["time"] for m in result.metrics if m["attempt"] > first["attempt"]]
    row.update(recovered=result.final_step == STEPS and result.init.get("world_size") == 2 and len(result.history) == 2,
               steps_lost=_steps_lost(result.history))
    if seen and resumed:
        row["recover_s"] = round(min(resumed) - seen[0], 3)
    return row


DRILLS = {"nan": drill_nan, "bad-node": drill_bad_node}


def run_drills(names: list[str] | None = None, out: str | Path | None = None) -> list[dict]:
    """The rows of the named drills (all by default), each run end to end in its own run dir."""
    with tempfile.TemporaryDirectory(prefix="mega-fault-drills-") as tmp:
        base = Path(out) if out else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        return [DRILLS[name](base) for name in (names or list(DRILLS))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mega.bench.fault_drills", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(DRILLS), help=f"comma-separated drills of {', '.join(DRILLS)}")
    parser.add_argument("--out", default=None, help="keep the run directories here (default: a temporary dir)")
    parser.add_argument("--json", action="store_true", help="last line: {\"faults\": [rows]}")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in DRILLS]
    if unknown:
        parser.error(f"unknown drill(s) {unknown}; known: {', '.join(DRILLS)}")
    rows = run_drills(names, args.out)
    if args.json:
        print(json.dumps({"faults": rows}))
    else:
        for r in rows:
            print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
