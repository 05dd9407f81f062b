"""``python -m mega.bench step [overrides] [--steps N] [--json]``: time training steps of a config.

Runs the real training job (torchrun ranks, the configured layout) for a few steps on the prepared
corpus, without checkpoints, and reports the median over the steps after the warm-up ones. The
last line printed is JSON: {"tokens_per_s", "mfu", "step_s", "device", "config"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from mega import config as mega_config


def bench_step(overrides: list[str], steps: int, warmup: int) -> dict:
    from mega.data import prepare_dataset
    from mega.launcher import run_training

    with tempfile.TemporaryDirectory(prefix="mega-bench-") as tmp:
        cfg = mega_config.compose(
            [*overrides, f"train.steps={steps}", f"train.run_dir={tmp}/run", "checkpoint.interval=0",
             "checkpoint.max_restarts=0", "train.tensorboard=false",
             f"optimizer.warmup_steps={min(warmup, steps - 1)}"]
        )
        index = prepare_dataset(cfg.data, cfg.model.vocab_size, progress=False)
        result = run_training(cfg, index, log=lambda msg: print(msg, file=sys.stderr))
    timed = [row for row in result.metrics if row["step"] > warmup] or result.metrics
    step_s = statistics.median(row["step_s"] for row in timed)
    return {
        "tokens_per_s": cfg.parallelism.global_batch_size * cfg.model.seq_length / step_s,
        "mfu": statistics.median(row["mfu"] for row in timed),
        "step_s": step_s,
        "device": _device_name(cfg),
        "config": {
            "model": cfg.model.name, "parallelism": cfg.parallelism.name, "world_size": cfg.parallelism.world_size,
            "global_batch_size": cfg.parallelism.global_batch_size, "seq_length": cfg.model.seq_length,
            "precision": cfg.train.precision, "steps": steps, "warmup_steps": warmup,
        },
    }


def _device_name(cfg) -> str:
    import torch

    if cfg.cluster.device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    import platform

    return f"cpu:{platform.processor() or platform.machine()}x{__import__('os').cpu_count()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mega.bench", description=__doc__)
    parser.add_argument("benchmark", choices=["step"])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallelism=dp2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args(argv)
    try:
        result = bench_step(args.overrides, args.steps, args.warmup)
    except mega_config.ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if not args.json:
        for key, value in result.items():
            print(f"{key:>14}: {value}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
