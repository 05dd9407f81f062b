"""The driver: train to ``train.steps``, relaunching the job from ``latest`` when it fails.

Ranks are processes started by torchrun (mega/launch/torchrun.py), never in-process work;
``run_training`` relaunches a failed job from the checkpoint ``latest`` with bounded attempts
and exponential backoff.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mega import config as mega_config
from mega.cluster import rendezvous
from mega.config import MegaConfig
from mega.launch import runs
from mega.launch.torchrun import TIMEOUT_EXIT, torchrun
from mega.metrics import METRICS_FILE, read_metrics


class TrainingFailed(RuntimeError):
    pass


@dataclass
class TrainingResult:
    run_dir: Path
    attempts: int
    final_step: int
    metrics: list[dict] = field(default_factory=list)
    init: dict = field(default_factory=dict)

    @property
    def restored(self) -> str | None:
        """The checkpoint the last attempt's ranks actually restored (None: started fresh)."""
        return self.init.get("restore", {}).get("checkpoint")


def run_training(cfg: MegaConfig, index_path: Path, log: Callable[[str], None] = print, *,
                 flow_run_id: str | None = None, recovery: bool = False) -> TrainingResult:
    """Train to ``train.steps``; when the ranks die or hang, restart them from ``latest``.

    While it runs, the run's record (``<run_dir>/run.json``, mega.launch.runs) says training, with a
    heartbeat; after, completed or failed. ``flow_run_id`` names the flow run driving it and
    ``recovery`` marks a restart by the recovery flow; attempt numbers continue the run's own
    (so a fault drill of attempt 0 does not strike again, and no attempt log is overwritten).
    """
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with runs.track(run_dir, config=run_dir / "config.json", data_index=index_path,
                    target_steps=cfg.train.steps, flow_run_id=flow_run_id, recovery=recovery) as run, \
            rendezvous.rendezvous_env(cfg) as store_env:  # cluster.store=redis: URL, job id (, server)
        result = _train_with_restarts(cfg, index_path, log, run, store_env)
        run.finish("completed", result.final_step)
        return result


def _train_with_restarts(cfg: MegaConfig, index_path: Path, log: Callable[[str], None],
                         run: runs.RunTracker, store_env: dict[str, str]) -> TrainingResult:
    import json

    from mega.checkpoint import latest_durable
    from mega.storage import StorageError

    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    mega_config.save(rendezvous.without_secrets(cfg), config_path)  # ranks get the password by env
    args = ["--config", str(config_path), "--data-index", str(index_path)]
    env = {**cfg.cluster.env, **store_env, "PYTHONUNBUFFERED": "1"}

    first = run.record.attempts
    attempts = 0
    while True:
        n = first + attempts  # this attempt's number over the run's life
        run.beat(attempts=n + 1)
        env["MEGA_ATTEMPT"] = str(n)
        # The ranks restore `latest` of the durable store themselves (mega.checkpoint.restore,
        # falling back past a corrupt one) and write what they restored into init.json.
        try:
            latest = latest_durable(cfg) if cfg.checkpoint.load else None
        except StorageError as e:
            latest = None
            log(f"attempt {n}: checkpoint store: {e}")
        log(f"attempt {n}: launching {cfg.parallelism.world_size} ranks"
            + (f"; `latest` is {latest}" if latest else ""))
        init_file = run_dir / "init.json"
        init_file.unlink(missing_ok=True)  # written anew by this attempt's rank 0
        code = torchrun(
            "mega.train", args, cfg.cluster.procs_per_node, env=env,
            log_path=run_dir / f"train-attempt{n}.log",
            progress_file=run_dir / METRICS_FILE, stall_timeout_s=cfg.cluster.hang_timeout_s,
            on_poll=run.beat,
        )
        attempts += 1
        try:
            dropped = rendezvous.drop_attempt_keys(store_env, n)
        except Exception as e:  # noqa: BLE001 - the keys expire anyway (RedisStore's TTL)
            log(f"attempt {n}: could not drop its store keys ({type(e).__name__}); they expire by TTL")
        else:
            if dropped is not None:
                log(f"attempt {n}: dropped its {dropped} store keys")
        try:
            init = json.loads(init_file.read_text()) if init_file.exists() else {}
        except ValueError:  # rank 0 died while writing it
            init = {}
        if init.get("restore", {}).get("checkpoint"):
            r = init["restore"]
            log(f"attempt {n}: resumed from {r['checkpoint']}"
                + (f" (refused {', '.join(x['name'] for x in r['refused'])})" if r.get("refused") else ""))
        metrics = read_metrics(run_dir)
        final_step = metrics[-1]["step"] if metrics else 0
        run.beat(final_step=final_step)
        if code == 0 and final_step >= cfg.train.steps:
            return TrainingResult(run_dir, attempts, final_step, metrics, init)
        reason = "hung (no progress)" if code == TIMEOUT_EXIT else f"exited with code {code}"
        log(f"attempt {n}: training {reason} at step {final_step}; "
            f"log: {run_dir / f'train-attempt{n}.log'}")
        if attempts > cfg.checkpoint.max_restarts:
            failed = TrainingFailed(
                f"training failed {attempts} times (last: {reason}); "
                f"see {run_dir}/train-attempt*.log"
            )
            run.finish("failed", final_step, error=str(failed))
            raise failed
        time.sleep(cfg.checkpoint.restart_backoff_s * 2 ** (attempts - 1))
