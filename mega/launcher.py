"""Launch and watch training processes: torchrun jobs, and the checkpoint-and-restart loop.

Ranks are processes started by torchrun (or a scheduler), never in-process work: ``torchrun``
runs one job in its own session so that a timeout, a stall or Ctrl-C kills every rank it started;
``run_training`` relaunches a failed job from the checkpoint ``latest`` with bounded attempts
and exponential backoff.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mega import config as mega_config
from mega.config import MegaConfig
from mega.metrics import METRICS_FILE, read_metrics

TIMEOUT_EXIT = 124


class TrainingFailed(RuntimeError):
    pass


@dataclass
class TrainingResult:
    run_dir: Path
    attempts: int
    final_step: int
    metrics: list[dict] = field(default_factory=list)
    init: dict = field(default_factory=dict)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def torchrun(
    module: str,
    args: list[str],
    nproc: int,
    *,
    env: dict | None = None,
    timeout_s: float | None = None,
    log_path: Path | None = None,
    progress_file: Path | None = None,
    stall_timeout_s: float | None = None,
) -> int:
    """Run ``module`` on ``nproc`` local ranks; return the exit code (124 on timeout or stall).

    ``progress_file``: a file the job appends to as it makes progress; when it has not changed for
    ``stall_timeout_s`` the job is taken as hung and killed, rather than waited on forever.
    A file that exists before the launch counts as progress only once it changes.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}", "--max-restarts=0",
        "-m", module, *args,
    ]
    full_env = {**os.environ, **(env or {})}
    out = open(log_path, "ab") if log_path else None
    try:
        proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True)
        started = last_progress = time.monotonic()
        initial_mtime = progress_file.stat().st_mtime if progress_file and progress_file.exists() else None
        last_mtime = None
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if progress_file is not None and progress_file.exists():
                mtime = progress_file.stat().st_mtime
                if mtime != last_mtime and mtime != initial_mtime:
                    last_mtime, last_progress = mtime, now
            if timeout_s is not None and now - started > timeout_s:
                _kill_session(proc)
                return TIMEOUT_EXIT
            # Start-up (imports, process groups, checkpoint load) is bounded by the ranks' own
            # collective timeouts; the stall clock runs from the first sign of progress.
            if stall_timeout_s is not None and last_mtime is not None and now - last_progress > stall_timeout_s:
                _kill_session(proc)
                return TIMEOUT_EXIT
    except BaseException:
        if "proc" in locals() and proc.poll() is None:
            _kill_session(proc)
        raise
    finally:
        if out:
            out.close()


def run_training(cfg: MegaConfig, index_path: Path, log: Callable[[str], None] = print) -> TrainingResult:
    """Train to ``train.steps``; when the ranks die or hang, restart them from ``latest``."""
    import json

    from mega.checkpoint import read_latest

    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    mega_config.save(cfg, config_path)
    args = ["--config", str(config_path), "--data-index", str(index_path)]
    env = {**cfg.cluster.env, "PYTHONUNBUFFERED": "1"}

    attempts = 0
    while True:
        env["MEGA_ATTEMPT"] = str(attempts)
        latest = read_latest(cfg.checkpoint.dir)
        log(f"attempt {attempts}: launching {cfg.parallelism.world_size} ranks"
            + (f", resuming from {latest.name}" if latest else ""))
        code = torchrun(
            "mega.train", args, cfg.cluster.procs_per_node, env=env,
            log_path=run_dir / f"train-attempt{attempts}.log",
            progress_file=run_dir / METRICS_FILE, stall_timeout_s=cfg.cluster.hang_timeout_s,
        )
        attempts += 1
        metrics = read_metrics(run_dir)
        final_step = metrics[-1]["step"] if metrics else 0
        if code == 0 and final_step >= cfg.train.steps:
            init_file = run_dir / "init.json"
            init = json.loads(init_file.read_text()) if init_file.exists() else {}
            return TrainingResult(run_dir, attempts, final_step, metrics, init)
        reason = "hung (no progress)" if code == TIMEOUT_EXIT else f"exited with code {code}"
        log(f"attempt {attempts - 1}: training {reason} at step {final_step}; "
            f"log: {run_dir / f'train-attempt{attempts - 1}.log'}")
        if attempts > cfg.checkpoint.max_restarts:
            raise TrainingFailed(
                f"training failed {attempts} times (last: {reason}); "
                f"see {run_dir}/train-attempt*.log"
            )
        time.sleep(cfg.checkpoint.restart_backoff_s * 2 ** (attempts - 1))
