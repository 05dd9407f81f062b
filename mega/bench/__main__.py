"""``python -m mega.bench <benchmark> [hydra overrides] [options] [--json]``; the last line is JSON.

  step      time training steps of a config (mega/bench/step.py):
            --steps N (8), --warmup N (2) -> {"tokens_per_s", "mfu", "step_s", "device", "config"}
  ablation  convergence of baseline / ptb / ptb+swa / ptb+swa+lamb4x for one token budget
            (mega/bench/ablation.py): --tokens N, --window W, --lamb-lr LR, --out DIR
            -> {"rows": [{"name", "final_loss", "loss_vs_baseline", "tokens_per_s", ...}], "plot", ...}

See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from mega import config as mega_config
from mega.bench.ablation import DEFAULT_WINDOW, bench_ablation
from mega.bench.step import bench_step

__all__ = ["bench_ablation", "bench_step", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mega.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=["step", "ablation"])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallelism=dp2")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line on stdout")
    step = parser.add_argument_group("step")
    step.add_argument("--steps", type=int, default=8)
    step.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    ablation = parser.add_argument_group("ablation")
    ablation.add_argument("--tokens", type=int, default=None,
                          help="token budget of every row (default: 128 baseline steps' worth)")
    ablation.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="SWA window of the +swa rows")
    ablation.add_argument("--out", default="runs/bench-ablation", help="where the plot and ablation.json go")
    ablation.add_argument("--lamb-lr", type=float, default=None,
                          help="peak LR of the lamb row (default: conf/optimizer/lamb.yaml's)")
    args = parser.parse_intermixed_args(argv)
    try:
        if args.benchmark == "step":
            result = bench_step(args.overrides, args.steps, args.warmup)
        else:
            result = bench_ablation(args.overrides, args.tokens, args.window, args.out, args.lamb_lr)
    except mega_config.ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if not args.json:
        _print_human(args.benchmark, result)
    print(json.dumps(result))
    return 0


def _print_human(benchmark: str, result: dict) -> None:
    if benchmark == "ablation":
        print(f"{'row':<16} {'final loss':>10} {'vs baseline':>11} {'tokens/s':>9} {'steps':>5} {'batch':>5}",
              file=sys.stderr)
        for row in result["rows"]:
            print(f"{row['name']:<16} {row['final_loss']:>10.4f} {row['loss_vs_baseline']:>+11.2%} "
                  f"{row['tokens_per_s']:>9.0f} {row['steps']:>5} {row['global_batch_size']:>5}", file=sys.stderr)
        return
    for key, value in result.items():
        print(f"{key:>14}: {value}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
