"""Roll back and skip: a step whose loss or grad norm is NaN/Inf never reaches a checkpoint.

Rank side (``mega.train``): right after each step every rank checks its own numbers (the loss
lives on the last pipeline stage, the grad norm on every rank: megatron's ``optimizer.step``
returns it) and one small all-reduce makes every rank agree. On a bad step rank 0 writes
``<run_dir>/rollback.json`` naming it, every rank commits the save in flight (it holds the last
good state) and exits with ``ROLLBACK_EXIT``. Nothing of the bad step is saved.

Driver side (``mega.launch.driver``): after a failed attempt, ``take`` reads this attempt's
``rollback.json``; the step joins the run record's ``skipped_steps`` and the relaunch, from the
durable ``latest``, gets them in ``$MEGA_SKIP_STEPS``. A skipped step makes no update (the
learning-rate schedule still advances: it is a function of the step number, like the data order)
and the next step gets its own batch, so the loss curve after the skip is the one of a run that
never trained on that batch (``train.skip_steps``). megatron-core's rerun state machine re-runs a
step to tell a transient fault from a deterministic one; on CPU and gloo a relaunch from ``latest``
does the same job with code that is already tested (restore, bit-exact resume).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mega.config import MegaConfig

ROLLBACK_FILE = "rollback.json"
SKIP_ENV = "MEGA_SKIP_STEPS"  # comma-separated 1-based steps the driver tells the ranks to skip
ROLLBACK_EXIT = 75  # a rank's exit status after a rollback request (its agent reports 1)


# ---------------------------------------------------------------------------------------------
# Rank side


def steps_to_skip(cfg: "MegaConfig") -> set[int]:
    """1-based steps whose batch this attempt must not train on: ``train.skip_steps`` and the
    driver's ``$MEGA_SKIP_STEPS``."""
    env = os.environ.get(SKIP_ENV, "")
    return set(cfg.train.skip_steps) | {int(s) for s in env.split(",") if s.strip()}


def skipped_step(trainer: Any) -> dict:
    """A step that trains on nothing: no forward, no update; the schedule advances one step."""
    trainer.scheduler.step(increment=1)
    return {"loss": float("nan"), "grad_norm": float("nan"), "lr": trainer.optimizer.param_groups[0]["lr"],
            "skipped": True, "data_skipped": True}


def maybe_poison(cfg: "MegaConfig", trainer: Any, step: int) -> None:
    """Drill (``fault.nan_at_step``, attempt 0 only): one weight of every rank becomes NaN before
    step ``step`` (1-based), so the loss and the gradients turn NaN through real arithmetic."""
    import torch

    from mega.cluster import node

    if cfg.fault.nan_at_step != step or int(os.environ.get("MEGA_ATTEMPT", "0")) != 0:
        return
    with torch.no_grad():
        next(trainer.model[0].module.parameters()).view(-1)[0] = float("nan")
    if node.local_rank() == 0:
        print(f"[fault] nan: a weight of every rank poisoned before step {step}", file=sys.stderr, flush=True)
        node.record_fault(cfg.train.run_dir, "nan", step, os.getpid())


def not_finite(result: dict) -> dict[str, bool] | None:
    """Every rank's verdict on the step just taken (collective: one 2-element all-reduce over the
    world). None when the loss (last stage) and the grad norm (every rank) are finite; else which."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    loss_bad = ps.is_pipeline_last_stage(ignore_virtual=True) and not math.isfinite(result["loss"])
    norm_bad = result["grad_norm"] is not None and not math.isfinite(result["grad_norm"])
    flags = torch.tensor([float(loss_bad), float(norm_bad)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not flags.any():
        return None
    return {"loss": bool(flags[0]), "grad_norm": bool(flags[1])}


def request_rollback(cfg: "MegaConfig", step: int, bad: dict[str, bool], checkpointer: Any) -> None:
    """Every rank: record the bad step (rank 0), commit the save in flight (collective), exit."""
    import torch.distributed as dist

    attempt = int(os.environ.get("MEGA_ATTEMPT", "0"))
    if dist.get_rank() == 0:
        what = " and ".join(f"{k} not finite" for k, v in bad.items() if v)
        write_request(cfg.train.run_dir, {"step": step, "attempt": attempt, "what": what, "time": time.time()})
        print(f"[mega] step {step}: {what}; rolling back to the last durable checkpoint and skipping its batch",
              file=sys.stderr, flush=True)
    checkpointer.close()  # the save in flight, if any, was taken before the bad step
    raise SystemExit(ROLLBACK_EXIT)


def write_request(run_dir: str | Path, row: dict) -> None:
    path = Path(run_dir) / ROLLBACK_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(row))
    os.replace(tmp, path)  # the driver reads the old request or the new, never half of one


# ---------------------------------------------------------------------------------------------
# Driver side


def take(run_dir: str | Path, attempt: int) -> dict | None:
    """Attempt ``attempt``'s rollback request, removed from the run dir (None: it made none)."""
    path = Path(run_dir) / ROLLBACK_FILE
    try:
        row = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return row if row.get("attempt") == attempt else None


def skip_env(skipped: list[dict]) -> str:
    """``$MEGA_SKIP_STEPS`` for the ranks from the run record's ``skipped_steps`` rows."""
    return ",".join(str(s["step"]) for s in sorted(skipped, key=lambda s: s["step"]))
