"""``python -m mega.bench checkpoint [overrides] [--steps N] [--interval K] [--storage URI] [--json]``.

What a two-stage checkpoint costs training. One real training job (torchrun ranks, DP=2 by
default) with a model of ~100 MB of checkpoint state saves every ``--interval`` steps to an S3
server (SeaweedFS, started here) or to ``--storage``. At each save, in the same run and on the
same state, the ranks first time a synchronous ``dist_checkpointing`` save into a scratch
directory (the reference), then make the real, asynchronous save and time how long training is
blocked (stage 1, plus any wait for the previous save). A second job then restores the last
checkpoint and reports how many bytes each DP group read from the store against the naive path
(every rank reading everything).

Last line: {"sync_save_s", "stall_s", "stall_ratio", "upload_mb_per_s", "dp",
"restore_bytes_read", "naive_restore_bytes", ...} (medians over the saves after the first,
which pays one-off start-up costs), with stage 1 split into its parts.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from mega import config as mega_config
from mega.bench import common

# ~8.2M parameters: fp32 weights + Adam's two moments = ~100 MB of checkpoint state.
MODEL = ("model=tiny", "model.name=ckpt-bench", "model.hidden_size=320", "model.num_layers=6",
         "model.seq_length=32")
LAYOUT = ("parallelism=dp2",)


def _compose(overrides: list[str], steps: int, run_dir: Path, uri: str, interval: int) -> mega_config.MegaConfig:
    return mega_config.compose([
        *MODEL, *LAYOUT, *overrides, f"train.steps={steps}", f"train.run_dir={run_dir}",
        "train.tensorboard=false", "optimizer.warmup_steps=1", "checkpoint.max_restarts=0",
        f"checkpoint.storage_uri={uri}", f"checkpoint.interval={interval}",
    ])


def bench_checkpoint(overrides: list[str], steps: int, interval: int, storage: str | None) -> dict:
    from mega.checkpoint import SYNC_REFERENCE_ENV, read_save_log

    with tempfile.TemporaryDirectory(prefix="mega-bench-ckpt-") as tmp:
        tmp = Path(tmp)
        server = None
        saved_env = dict(os.environ)
        try:
            if storage is None:
                from mega.storage.seaweed import SeaweedS3

                server = SeaweedS3(tmp / "seaweed", bucket="mega-bench").start(timeout=120)
                os.environ.update(server.env())  # the ranks inherit the credential chain
                storage = server.uri("bench")
            os.environ[SYNC_REFERENCE_ENV] = "1"
            cfg = _compose(overrides, steps, tmp / "save", storage, interval)
            index = common.prepare_data(cfg)
            common.log(f"checkpoint bench: saving every {interval} steps to {storage}")
            common.train(cfg, index)
            del os.environ[SYNC_REFERENCE_ENV]
            log = read_save_log(cfg.train.run_dir)
            # The restore: one more step from the last checkpoint, nothing saved.
            restore_cfg = _compose(overrides, steps + 1, tmp / "restore", storage, 0)
            restored = common.train(restore_cfg, index).init["restore"]
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
            if server is not None:
                server.stop()
    saves = [r for r in log if r["event"] == "save"]
    commits = [r for r in log if r["event"] == "committed"]
    timed = saves[1:] or saves
    sync_s = statistics.median(r["sync_save_s"] for r in timed)
    stall_s = statistics.median(r["stall_s"] for r in timed)
    common.log(json.dumps({"saves": saves, "commits": commits, "restore": restored}))

    def med(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    return {
        "sync_save_s": sync_s,
        "stall_s": stall_s,
        "stall_ratio": stall_s / sync_s,
        "upload_mb_per_s": statistics.median(r["upload_mb_per_s"] for r in (commits[1:] or commits)),
        "dp": cfg.parallelism.dp,
        "restore_bytes_read": restored["restore_bytes_read"],
        "naive_restore_bytes": restored["naive_restore_bytes"],
        "checkpoint_mb": commits[-1]["bytes"] / 1e6,
        # stage 1, split: megatron's optimizer state dict (fully_reshardable: a gather over DP),
        # the host snapshot, dist_checkpointing's planning; and the wait for the previous save
        "state_dict_s": med("state_dict_s"), "snapshot_s": med("snapshot_s"), "plan_s": med("plan_s"),
        "wait_s": med("wait_s"),
        "saves": len(saves),
        "storage": "s3 (SeaweedFS, local)" if server is not None else storage.split(":", 1)[0],
        "device": common.device_name(cfg),
    }
