"""``python -m mega.bench step [overrides] [--steps N] [--warmup N] [--json]``: time training steps.

Runs the real training job (torchrun ranks, the configured layout) for a few steps on the prepared
corpus, without checkpoints, and reports the median over the steps after the warm-up ones:
{"tokens_per_s", "mfu", "step_s", "device", "config"}.
"""

from __future__ import annotations

import tempfile

from mega.bench import common


def bench_step(overrides: list[str], steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="mega-bench-") as tmp:
        cfg = common.compose_run(
            [*overrides, f"optimizer.warmup_steps={min(warmup, steps - 1)}"], steps, f"{tmp}/run"
        )
        result = common.train(cfg, common.prepare_data(cfg))
    timed = common.steady(result.metrics, warmup)
    step_s = common.median(timed, "step_s")
    return {
        "tokens_per_s": common.tokens_per_step(cfg) / step_s,
        "mfu": common.median(timed, "mfu"),
        "step_s": step_s,
        "device": common.device_name(cfg),
        "config": {
            "model": cfg.model.name,
            "parallelism": cfg.parallelism.name,
            "world_size": cfg.parallelism.world_size,
            "global_batch_size": cfg.parallelism.global_batch_size,
            "seq_length": cfg.model.seq_length,
            "precision": cfg.train.precision,
            "steps": steps,
            "warmup_steps": warmup,
        },
    }
