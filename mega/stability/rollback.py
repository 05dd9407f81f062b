"""Roll back and skip: a step whose loss or grad norm is NaN/Inf never reaches a checkpoint.

Rank side (``mega.train``): right after each step every rank checks its own numbers (the loss
lives on the last pipeline stage, the grad norm on every rank: megatron's ``optimizer.step``
returns it) and one small all-reduce (on a gloo group of its own, ``verdict_group``) makes every
rank agree. On a bad step rank 0 writes ``<run_dir>/rollback.json`` naming it, every rank commits
the save in flight (it holds the last good state) and exits with ``ROLLBACK_EXIT``. Nothing of the
bad step is saved.

Driver side (``mega.launch.driver``): after a failed attempt, ``take`` reads this attempt's
``rollback.json``; the step joins the run record's ``skipped_steps`` and the relaunch, from the
durable ``latest``, gets them in ``$MEGA_SKIP_STEPS``. A skipped step makes no update (the
learning-rate schedule still advances: it is a function of the step number, like the data order)
and the next step gets its own batch, so the loss curve after the skip is the one of a run that
never trained on that batch (``train.skip_steps``). megatron-core's rerun state machine re-runs a
step to tell a transient fault from a deterministic one; on CPU and gloo a relaunch from ``latest``
does the same job with code that is already tested (restore, bit-exact resume).

A **loss spike** is handled the same way: the last pipeline stage keeps a window of the last
``stability.spike_window`` losses and flags a loss whose robust z-score (distance to the window's
median in units of 1.4826 x its median absolute deviation) is above ``stability.spike_z`` and
which is at least ``stability.spike_min_increase`` above the median (a flat, quiet curve has a
tiny MAD: a z-score alone would call noise a spike). Only increases count: a falling loss is
training. The check runs in the ranks, not in the driver, because it must come before the step's
checkpoint: the driver reads metrics after the fact, when the step's update may already be saved.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mega import rank_env

if TYPE_CHECKING:
    from mega.config import MegaConfig

ROLLBACK_FILE = "rollback.json"
SKIP_ENV = "MEGA_SKIP_STEPS"  # comma-separated 1-based steps the driver tells the ranks to skip
ROLLBACK_EXIT = 75  # a rank's exit status after a rollback request (its agent reports 1)


# ---------------------------------------------------------------------------------------------
# Rank side


def steps_to_skip(cfg: MegaConfig) -> set[int]:
    """1-based steps whose batch this attempt must not train on: ``train.skip_steps`` and the
    driver's ``$MEGA_SKIP_STEPS``."""
    env = os.environ.get(SKIP_ENV, "")
    return set(cfg.train.skip_steps) | {int(s) for s in env.split(",") if s.strip()}


def skipped_step(trainer: Any) -> dict:
    """A step that trains on nothing: no forward, no update; the schedule advances one step."""
    trainer.scheduler.step(increment=1)
    return {
        "loss": float("nan"),
        "grad_norm": float("nan"),
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "skipped": True,
        "data_skipped": True,
    }


class LossWindow:
    """The last stage's recent losses, and the spike rule (see the module's docstring)."""

    def __init__(self, cfg: MegaConfig):
        s = cfg.stability
        self.z_max, self.min_increase, self.min_steps = s.spike_z, s.spike_min_increase, s.spike_min_steps
        self.losses: deque[float] = deque(maxlen=s.spike_window)

    @classmethod
    def resumed(cls, cfg: MegaConfig, start_step: int) -> LossWindow:
        """The window an uninterrupted run has after ``start_step`` steps: the losses of the good
        steps up to it, as logged (the logging rank's own floats; a bad step is never logged, a
        skipped one logs NaN). A restart judges the next losses exactly as the run without the
        restart would: a spike right after a relaunch is still a spike."""
        from mega.metrics import read_metrics

        window = cls(cfg)
        for row in read_metrics(cfg.train.run_dir):
            if row["step"] <= start_step and math.isfinite(row.get("loss", math.nan)):
                window.add(row["loss"])
        return window

    def z_score(self, loss: float) -> float | None:
        """The loss's robust z-score against the window, None until the window has min_steps."""
        if len(self.losses) < self.min_steps:
            return None
        med = statistics.median(self.losses)
        mad = statistics.median(abs(x - med) for x in self.losses)
        return (loss - med) / (1.4826 * mad + 1e-12 * max(1.0, abs(med)))

    def is_spike(self, loss: float) -> bool:
        if self.z_max <= 0 or not math.isfinite(loss):  # spike_z=0: off; not finite: not a spike
            return False
        z = self.z_score(loss)
        return (
            z is not None
            and z > self.z_max
            and loss > (1 + self.min_increase) * statistics.median(self.losses)
        )

    def add(self, loss: float) -> None:
        self.losses.append(loss)


def verdict_group(cfg):
    """The group ``check_step`` reduces over (collective: every rank, once, at start-up): a gloo
    group of the training thread's own: two threads' collectives on one group pair up with the
    wrong peers (a deadlock seen under load), so no group is shared with another thread; and the
    flags are a CPU tensor, which NCCL cannot reduce."""
    from mega.cluster.rendezvous import gloo_side_group

    return gloo_side_group(cfg)


def check_step(result: dict, window: LossWindow, group) -> dict[str, bool] | None:
    """Every rank's verdict on the step just taken (collective: one 3-element all-reduce over
    ``group``, from ``verdict_group``). None when the loss (last stage) and the grad norm (every
    rank) are finite and the loss is no spike; else which of loss/grad_norm/spike. A good loss
    joins the window."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    loss_bad = last and not math.isfinite(result["loss"])
    norm_bad = result["grad_norm"] is not None and not math.isfinite(result["grad_norm"])
    spike = last and window.is_spike(result["loss"])
    flags = torch.tensor([float(loss_bad), float(norm_bad), float(spike)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if not flags.any():
        if last:
            window.add(result["loss"])
        return None
    return {"loss": bool(flags[0]), "grad_norm": bool(flags[1]), "spike": bool(flags[2])}


def request_rollback(
    cfg: MegaConfig,
    step: int,
    bad: dict[str, bool],
    checkpointer: Any,
    start_step: int = 0,
    skips: set[int] = frozenset(),
) -> None:
    """Every rank: record the bad step (rank 0), commit the save in flight (collective), exit.
    ``start_step``: the step this attempt restored; ``skips``: the steps it skips. A bad step
    with no step trained since the restore says the restored checkpoint itself is bad
    (``first_after_restore``): the driver goes back further (``further_back``)."""
    import torch.distributed as dist

    attempt = rank_env.attempt()
    if dist.get_rank() == 0:
        what = " and ".join("loss spike" if k == "spike" else f"{k} not finite" for k, v in bad.items() if v)
        first = start_step > 0 and all(s in skips for s in range(start_step + 1, step))
        row = {"step": step, "attempt": attempt, "what": what, "time": time.time()}
        write_request(cfg.train.run_dir, {**row, "restored_step": start_step, "first_after_restore": first})
        print(
            f"[mega] step {step}: {what}; rolling back to the last durable checkpoint and skipping its batch",
            file=sys.stderr,
            flush=True,
        )
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


def further_back(request: dict, checkpoints: list[str]) -> tuple[str | None, list[int]]:
    """A bad step right after a restore (no step trained since): the damage is in the restored
    checkpoint (a spike shows one step after the update that caused it, and the save in flight
    was committed with that update). Returns the newest complete checkpoint before it, and the
    steps after that one up to the restored step, whose batches are skipped so that the replay
    does not make the same update again ((None, []): not such a step, or no older checkpoint)."""
    from mega.storage import step_of

    restored = request.get("restored_step", 0)
    if not request.get("first_after_restore") or not restored:
        return None, []
    older = [n for n in checkpoints if step_of(n) < restored]
    if not older:
        return None, []
    target = max(older, key=step_of)
    return target, list(range(step_of(target) + 1, restored + 1))


def skip_env(skipped: list[dict]) -> str:
    """``$MEGA_SKIP_STEPS`` for the ranks from the run record's ``skipped_steps`` rows."""
    return ",".join(str(s["step"]) for s in sorted(skipped, key=lambda s: s["step"]))
