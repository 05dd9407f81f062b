"""``python -m mega.bench <benchmark> [hydra overrides] [options] [--json]``; the last line is JSON.

  step      time training steps of a config (mega/bench/step.py):
            --steps N (8), --warmup N (2) -> {"tokens_per_s", "mfu", "step_s", "device", "config"}
  ablation  convergence of baseline / ptb / ptb+swa / ptb+swa+lamb4x for one token budget, on held-out
            data, over seeds (mega/bench/ablation.py): --tokens N, --seeds S,S, --window W, --lamb-lr LR,
            --tune-lamb-lr LR,LR, --eval-sequences N, --out DIR
            -> {"rows": [{"name", "seeds", "val_loss", "val_loss_per_seed", "val_loss_vs_baseline",
                "final_loss", "loss_vs_baseline", "tokens_per_s", ...}], "plot", ...}
            --throughput instead: tokens/s and exposed communication of ptb+swa, +tp-overlap,
            +pp-overlap, +dp-overlap (cumulative) on tp2-pp2-vpp2-dp2, one seed, --steps N (8)
            -> {"throughput_rows": [{"name", "tokens_per_s", "tokens_per_s_vs_previous", "step_s",
                "exposed_tp_s", "exposed_pp_s", "exposed_dp_s", "losses"}], ...}
  checkpoint  at TP2xPP2xDP2: steps/s with async, sync and no saves over the same steps, training
            blocked per save, restore bytes counted against the naive restore, the largest per-rank
            restore footprint (mega/bench/checkpoint.py): --steps N (30), --interval K (10),
            --repeats R (1), --modes none,sync,async,memory (the runs of each round),
            --storage URI (default: a local SeaweedFS S3 server)
            -> {"train_slowdown", "sync_train_slowdown", "stall_s", "restore_bytes_read",
                "naive_restore_bytes", "restore_peak_bytes_per_rank", ...}
  bootstrap  megatron's group creation: real ranks of --real layouts (default tp2-pp2-dp2, start-up
            by phase) and the store traffic of N simulated ranks on a real TCPStore / Redis server
            (mega/bench/bootstrap.py): --ranks 256,1024,..., --max-seconds S (60), --real L, --out DIR
            -> {"results": [{"strategy", "ranks", "seconds", "store_ops", "measured", ...}], "real": [...],
                "speedups", "growth", "targets", "plot", ...}
  observability  the span recorder's counted overhead, on/off step times, the merged trace, the heat
            map of a slowed rank, step-time variance with automatic vs controlled GC
            (mega/bench/observability.py): --steps N (20), --warmup N (2), --out DIR, --slow-s S
            -> {"overhead", "overhead_on_off", "ranks_in_trace", "world_size", "straggler_named",
                "trace", "heatmap", "gc_step_time_cv_auto", "gc_step_time_cv_controlled"}

  data      data preparation vs Megatron-LM's preprocess_data.py on a generated corpus, and the
            node loader's wait on TP2xPP2xDP2 (mega/bench/data.py): --corpus-mb 25,100,300, --workers N,
            --vocab V, --steps N -> {"prep_tokens_per_s", "baseline_tokens_per_s", "peak_rss_mb",
            "baseline_peak_rss_mb", "loader_wait_fraction", "corpus_mb", "layout"}

  nodes     the same 8-rank TP2xPP2xDP2 world as 1, 2 and 4 local nodes through the driver
            (mega/bench/nodes.py): --nodes 1,2,4, --steps N (6), --warmup N (2), --netns
            -> {"rows": [{"nodes", "procs_per_node", "world_size", "layout", "first_step_s", "step_s",
                          "max_abs_loss_diff_vs_one_node", "completed"}], "details", ...}

  overlap   TP / PP / DP communication overlap off vs on, 2 ranks on 2 netns nodes over a tc-shaped
            veth (mega/bench/overlap.py, root): --steps N (8), --warmup N (3), --link-mbit M (1000)
            -> {"rows": [{"name", "link", "exposed_comm_off_s", "exposed_comm_on_s", "step_off_s",
                          "step_on_s", "loss_equal", "target_met", ...}], ...}

  soak      faults drawn from a seeded Poisson process thrown at a TP2xPP2xDP2 run on 2 local nodes x 4
            ranks + a spare (real Redis, S3), then a fault-free reference (mega/bench/soak.py):
            --minutes M (10), --mtbf-s T (60), --seed S (0), --out DIR
            -> {"ettr", "wall_s", "ledger", "unattributed_s", "faults", "faults_survived", "samples_exact",
                "final_weights_equal_reference", "durable_checkpoint_loadable", "png", ...}
            --simulate --gpus N --mttf-h H: the ETTR at N GPUs, modelled -> {"measured": false, "ettr",
                "assumptions", ...}

  faults    every fault the driver handles, injected into real runs (model=tiny; 2 ranks, or 2 nodes x 4
            for rank-kill, rank-hang and bad-node, which also run on cold processes) and timed end to
            end (mega/bench/faults.py): --only rank-kill,rank-hang,straggler,nan,bad-node,
            redis-outage,overhead (default all), --out DIR (keep the run dirs)
            -> {"faults": [{"fault", "detected", "detect_s", "culprit_named", "recovered", "recover_s",
                "recover_s_cold", "steps_lost", ...}], "heartbeat_overhead", "heartbeat_overhead_on_off", ...}

See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from mega import config as mega_config
from mega import optional_packages
from mega.bench.ablation import (
    DEFAULT_LAMB_LR,
    DEFAULT_OVERRIDES,
    DEFAULT_SEEDS,
    DEFAULT_WINDOW,
    TUNING_SEED,
    bench_ablation,
    bench_ablation_throughput,
)
from mega.bench.bootstrap import DEFAULT_REAL_LAYOUTS, bench_bootstrap
from mega.bench.bootstrap import ROWS as BOOTSTRAP_ROWS
from mega.bench.checkpoint import bench_checkpoint
from mega.bench.data import bench_data
from mega.bench.faults import bench_faults
from mega.bench.nodes import bench_nodes
from mega.bench.observability import bench_observability
from mega.bench.overlap import bench_overlap
from mega.bench.soak import bench_soak, simulate
from mega.bench.step import bench_step

__all__ = [
    "bench_ablation",
    "bench_bootstrap",
    "bench_checkpoint",
    "bench_data",
    "bench_faults",
    "bench_nodes",
    "bench_observability",
    "bench_overlap",
    "bench_step",
    "main",
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mega.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "benchmark",
        choices=list(_RUNS),
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallelism=dp2")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line on stdout")
    _add_step_and_ablation_args(parser)
    _add_checkpoint_and_bootstrap_args(parser)
    _add_other_args(parser)
    return parser


def _add_step_and_ablation_args(parser: argparse.ArgumentParser) -> None:
    step = parser.add_argument_group("step")
    step.add_argument(
        "--steps", type=int, default=None, help="step: 8; checkpoint: 30; observability: 20; nodes: 6"
    )
    step.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    ablation = parser.add_argument_group("ablation")
    ablation.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="token budget of every row (default: 512 baseline steps' worth)",
    )
    ablation.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="SWA window of the +swa rows")
    ablation.add_argument(
        "--out",
        default=None,
        help="where the plot and JSON go (default runs/bench-ablation, runs/bench-bootstrap, "
        "runs/bench-observability)",
    )
    ablation.add_argument(
        "--lamb-lr",
        type=float,
        default=DEFAULT_LAMB_LR,
        help=f"peak LR of the lamb row (default {DEFAULT_LAMB_LR}, chosen for model=tiny on "
        f"seed {TUNING_SEED})",
    )
    ablation.add_argument(
        "--seeds",
        default=",".join(map(str, DEFAULT_SEEDS)),
        help="train.seed of every row's runs (the reported seeds)",
    )
    ablation.add_argument(
        "--tune-lamb-lr",
        default="",
        help="candidate peak LRs of the lamb row, tried on --tuning-seed first; the lowest "
        "validation loss replaces --lamb-lr",
    )
    ablation.add_argument(
        "--throughput",
        action="store_true",
        help="instead of the convergence rows: the throughput rows ptb+swa, +tp-overlap, "
        "+pp-overlap, +dp-overlap on 8 ranks, one seed (--steps, default 8)",
    )
    ablation.add_argument(
        "--tuning-seed", type=int, default=TUNING_SEED, help="the seed hyperparameters are chosen on"
    )
    ablation.add_argument(
        "--eval-sequences",
        type=int,
        default=None,
        help="held-out sequences every run evaluates (default: the whole split, whole batches)",
    )


def _add_checkpoint_and_bootstrap_args(parser: argparse.ArgumentParser) -> None:
    ckpt = parser.add_argument_group("checkpoint")
    ckpt.add_argument("--interval", type=int, default=10, help="steps between saves")
    ckpt.add_argument(
        "--repeats", type=int, default=1, help="rounds of the async/sync/no-save/in-memory runs (medians)"
    )
    ckpt.add_argument(
        "--modes",
        default="none,sync,async,memory",
        help="runs of each round: none (always) with memory, sync+async or both",
    )
    ckpt.add_argument(
        "--storage", default=None, help="store URI (default: a SeaweedFS S3 server started here)"
    )
    boot = parser.add_argument_group("bootstrap")
    boot.add_argument(
        "--ranks", default="256,1024,2048,4096,12288", help="simulated world sizes, comma-separated"
    )
    boot.add_argument(
        "--probe-ranks", default="64,128", help="smaller N run first for the growth fit ('' for none)"
    )
    boot.add_argument("--max-seconds", type=float, default=60.0, help="per point; slower = completed=false")
    boot.add_argument(
        "--strategies", default=None, help="simulated rows, a subset of " + ",".join(BOOTSTRAP_ROWS)
    )
    boot.add_argument(
        "--real",
        default=",".join(DEFAULT_REAL_LAYOUTS),
        help="conf/parallelism layouts to time with real ranks on this machine ('' for none)",
    )
    boot.add_argument(
        "--real-group-init", default="light,default", help="cluster.group_init of the real rows"
    )
    boot.add_argument(
        "--real-repeats", type=int, default=3, help="timing jobs per real row (the median counts)"
    )
    boot.add_argument("--tp", type=int, default=8, help="layout of the simulated job: TP x PP x DP=N/(TP*PP)")
    boot.add_argument("--pp", type=int, default=8)


def _add_other_args(parser: argparse.ArgumentParser) -> None:
    obs = parser.add_argument_group("observability")
    obs.add_argument(
        "--slow-s", type=float, default=0.1, help="the straggler run's extra CPU seconds per forward"
    )
    data = parser.add_argument_group("data")
    data.add_argument(
        "--corpus-mb", default="25,100,300", help="generated corpus sizes (MB); the JSON reports the largest"
    )
    data.add_argument(
        "--workers", type=int, default=None, help="tokenizer processes of both sides (default: the cores)"
    )
    data.add_argument("--vocab", type=int, default=32768, help="BPE vocabulary of the shared tokenizer")
    nodes = parser.add_argument_group("nodes")
    nodes.add_argument(
        "--nodes", default="1,2,4", help="local node counts of the 8-rank world (1 always runs first)"
    )
    nodes.add_argument("--netns", action="store_true", help="each node in its own network namespace (root)")
    nodes.add_argument(
        "--launcher",
        choices=["local-nodes", "slurm"],
        default="local-nodes",
        help="slurm: the runs go through Slurm ($SLURM_CONF, else a local cluster), plus a node-loss row",
    )
    faults = parser.add_argument_group("faults")
    faults.add_argument(
        "--only", default=None, help="faults: comma-separated drills (default: all, and overhead)"
    )
    soak = parser.add_argument_group("soak")
    soak.add_argument("--minutes", type=float, default=10.0, help="soak: how long faults arrive")
    soak.add_argument("--mtbf-s", type=float, default=60.0, help="soak: mean time between faults")
    soak.add_argument("--seed", type=int, default=0, help="soak: the fault schedule's seed")
    soak.add_argument("--simulate", action="store_true", help="soak: model --gpus N at --mttf-h H instead")
    soak.add_argument("--gpus", type=int, default=16384, help="soak --simulate: GPUs of the run")
    soak.add_argument(
        "--mttf-h",
        type=float,
        default=50000.0,
        help="soak --simulate: hours between failures of one GPU (Llama 3: ~50,000)",
    )
    parser.add_argument(
        "--link-mbit", type=float, default=1000.0, help="overlap: tc tbf rate of the veth link"
    )


def _bootstrap(a: argparse.Namespace) -> dict:
    return bench_bootstrap(
        _ints(a.ranks),
        _ints(a.probe_ranks),
        a.max_seconds,
        a.out or "runs/bench-bootstrap",
        strategies=a.strategies.split(",") if a.strategies else None,
        tp=a.tp,
        pp=a.pp,
        real_layouts=_names(a.real),
        real_group_inits=_names(a.real_group_init),
        real_repeats=a.real_repeats,
    )


def _ablation(a: argparse.Namespace) -> dict:
    if a.throughput:
        return bench_ablation_throughput(a.overrides, a.window, a.steps or 8)
    return bench_ablation(
        a.overrides,
        a.tokens,
        a.window,
        a.out or "runs/bench-ablation",
        a.lamb_lr,
        seeds=_ints(a.seeds),
        tune_lamb_lr=[float(x) for x in _names(a.tune_lamb_lr)],
        tuning_seed=a.tuning_seed,
        n_eval_sequences=a.eval_sequences,
    )


def _soak(a: argparse.Namespace) -> dict:
    if a.simulate:
        return simulate(a.gpus, a.mttf_h)
    return bench_soak(a.minutes, a.mtbf_s, a.seed, a.out or "runs/bench-soak", a.overrides)


# each benchmark from the parsed arguments (the defaults of --steps differ per benchmark)
_RUNS = {
    "step": lambda a: bench_step(a.overrides, a.steps or 8, a.warmup),
    "ablation": _ablation,
    "checkpoint": lambda a: bench_checkpoint(
        a.overrides, a.steps or 30, a.interval, a.storage, a.repeats, tuple(a.modes.split(","))
    ),
    "bootstrap": _bootstrap,
    "observability": lambda a: bench_observability(
        a.overrides, a.steps or 20, a.warmup, a.out or "runs/bench-observability", a.slow_s
    ),
    "data": lambda a: bench_data(
        _ints(a.corpus_mb), a.workers, a.vocab, a.steps or 12, a.out or "runs/bench-data", a.overrides
    ),
    "nodes": lambda a: bench_nodes(
        a.overrides, a.steps or 6, a.warmup, tuple(_ints(a.nodes)), a.netns, a.launcher
    ),
    "overlap": lambda a: bench_overlap(a.overrides, a.steps or 8, max(a.warmup, 3), a.link_mbit),
    "faults": lambda a: bench_faults(_names(a.only) if a.only else None, a.out, a.overrides),
    "soak": _soak,
}


def check_args(argv: list[str]) -> mega_config.MegaConfig:
    """Parse ``argv`` as ``python -m mega.bench`` does and validate its Hydra overrides on the
    benchmark's base config, running nothing. A bad flag exits (argparse); a bad override raises
    ConfigError naming the key."""
    args = _parser().parse_intermixed_args(argv)
    base = list(DEFAULT_OVERRIDES) if args.benchmark == "ablation" else []
    return mega_config.compose([*base, *args.overrides])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    # the launcher side imports megatron-core too (checkpoint discovery): its warnings about absent
    # GPU packages are said once here instead
    optional_packages.quiet_megatron()
    if args.benchmark != "bootstrap" and optional_packages.notice("cpu"):
        print(optional_packages.notice("cpu"), file=sys.stderr)
    try:
        result = _RUNS[args.benchmark](args)
    except mega_config.ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if not args.json:
        _print_human(args.benchmark, result)
    print(json.dumps(result))
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _print_human(benchmark: str, result: dict) -> None:
    if benchmark == "bootstrap":
        print(f"{'strategy':<27} {'ranks':>6} {'seconds':>8} {'store ops':>14}", file=sys.stderr)
        for row in [*result["real"], *result["results"]]:
            took = f"{row['seconds']:.2f}" if row["measured"] else "-"
            ops = f"{row['store_ops']:,}" if row.get("store_ops") is not None else "-"
            print(f"{row['strategy']:<27} {row['ranks']:>6} {took:>8} {ops:>14}", file=sys.stderr)
        for name, fit in result["growth"].items():
            print(f"{name}: time ~ N^{fit['exponent']}, store ops ~ N^{fit['ops_exponent']}", file=sys.stderr)
        return
    if benchmark == "nodes":
        print(
            f"{'nodes':>5} {'x procs':>7} {'first step s':>12} {'step s':>8} {'max |dloss|':>11} completed",
            file=sys.stderr,
        )

        def fmt(x, spec: str, width: int) -> str:
            return format("-" if x is None else format(x, spec), f">{width}")

        for row in result["rows"]:
            print(
                f"{row['nodes']:>5} {row['procs_per_node']:>7} {fmt(row['first_step_s'], '.2f', 12)} "
                f"{fmt(row['step_s'], '.3f', 8)} {fmt(row['max_abs_loss_diff_vs_one_node'], '.3g', 11)} "
                f"{row['completed']}",
                file=sys.stderr,
            )
        return
    if benchmark == "faults":
        print(
            f"{'fault':<13} {'detected':>8} {'detect s':>8} {'culprit':>7} {'recovered':>9} {'recover s':>9} "
            f"{'lost':>4}",
            file=sys.stderr,
        )

        def num(x) -> str:
            return "-" if x is None else f"{x:.2f}"

        for row in result["faults"]:
            print(
                f"{row['fault']:<13} {row['detected']!s:>8} {num(row['detect_s']):>8} {row['culprit_named']!s:>7} "
                f"{row['recovered']!s:>9} {num(row['recover_s']):>9} {row['steps_lost']!s:>4}",
                file=sys.stderr,
            )
        print(
            f"heartbeat overhead {result['heartbeat_overhead']}, on/off step time "
            f"{result['heartbeat_overhead_on_off']}",
            file=sys.stderr,
        )
        return
    if benchmark == "ablation" and "throughput_rows" in result:
        print(
            f"{'row':<14} {'tokens/s':>9} {'vs prev':>8} {'exposed tp s':>12} {'pp s':>7} {'dp s':>7}",
            file=sys.stderr,
        )
        for row in result["throughput_rows"]:
            vs = "-" if row["tokens_per_s_vs_previous"] is None else f"{row['tokens_per_s_vs_previous']:+.1%}"
            print(
                f"{row['name']:<14} {row['tokens_per_s']:>9.0f} {vs:>8} {row['exposed_tp_s']:>12.4f} "
                f"{row['exposed_pp_s']:>7.4f} {row['exposed_dp_s']:>7.4f}",
                file=sys.stderr,
            )
        return
    if benchmark == "ablation":
        print(
            f"{'row':<16} {'val loss':>9} {'vs baseline':>11} {'train loss':>10} {'vs baseline':>11} "
            f"{'tokens/s':>9} {'steps':>5} {'batch':>5}  seeds",
            file=sys.stderr,
        )
        for row in result["rows"]:
            print(
                f"{row['name']:<16} {row['val_loss']:>9.4f} {row['val_loss_vs_baseline']:>+11.2%} "
                f"{row['final_loss']:>10.4f} {row['loss_vs_baseline']:>+11.2%} {row['tokens_per_s']:>9.0f} "
                f"{row['steps']:>5} {row['global_batch_size']:>5}  {row['seeds']}",
                file=sys.stderr,
            )
        return
    for key, value in result.items():
        print(f"{key:>14}: {value}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
