"""``python -m mega.bench checkpoint [overrides] [--steps N] [--interval K] [--repeats R] [--modes M,...]
[--storage URI] [--json]``.

What checkpoints cost a user, measured end to end in one run of the bench, at TP2xPP2xDP2 (8
torchrun ranks) with a model of ~100 MB of checkpoint state, against an S3 server (SeaweedFS,
started here) or ``--storage``:

* Training: the same ``--steps`` (30) four times -- saving every ``--interval`` (10) steps with
  asynchronous (two-stage) saves, with synchronous saves to the same store, with no saves, and
  with in-memory copies (below); ``--repeats R`` runs R rounds of the four, each round in a
  rotated order (so a drifting load on a shared machine does not always favour the same mode),
  and reports medians. ``--modes none,memory`` runs only the no-save and in-memory runs (and
  reports only their figures); ``none,sync,async`` only the saves.
  steps/s is wall clock from the end of step 1 to the end of the last step (the saves at 10, 20
  fall inside, the one at the last step after it), from the ``time`` of each metrics row.
  ``train_slowdown`` = async run time / no-save run time - 1, ``sync_train_slowdown`` the same
  for the synchronous run; the target is ``train_slowdown <= sync_train_slowdown / 3``. Beside
  them, measured inside each saving run (``save_costs``): ``save_cost_s``, what a save cost the
  steps it overlapped, per mode, and ``save_cost_ratio`` (async / sync); ``none_rate_spread``,
  the spread of the no-save runs, says what the end-to-end slowdowns can resolve; and
  ``s3_server_cpu_s_per_run``, the CPU of the bench's own S3 server, which shares the cores.
* In-memory copies: the fourth run, no saves, ``checkpoint.memory_interval=1``: the counted cost
  of a copy per rank (the training thread's wait plus the CPU of the copy thread and of the copy
  group's gloo threads, ``memory_copy_s``) and ``memory_overhead`` = that per step / the step time of the run without
  saves (target <= 0.02). Replicated to a peer only on several nodes (``launcher=local-nodes
  cluster.nodes=2 cluster.procs_per_node=4``); ``memory_replicated`` says whether it was.
* Stage 2's CPU seconds per save summed over ranks (``stage2_cpu_s``: process CPU less the
  training thread's) and split: ``stage2_build_cpu_s``, ``stage2_serialise_cpu_s``,
  ``stage2_upload_cpu_s`` (reading, hashing, sending); and ``upload_cpu_ms_per_mb``: the CPU per
  MB of ``upload_files`` in the bench process, with the project's S3 client against botocore's
  defaults (which sha256 every payload over http and CRC32 every part).
* Restore: another job restores the asynchronous run's last checkpoint, then (in the same job)
  loads it again the naive way -- every rank fetching everything it needs itself. The byte
  counts are the store's counters summed over all ranks (``restore_bytes_read`` vs
  ``naive_restore_bytes``), and ``restore_peak_bytes_per_rank`` the most bytes one rank held at
  once (staged files, fetched pieces, load buffers).

Last line: {"steps_per_s": {...}, "train_slowdown", "sync_train_slowdown", "slowdown_target_met",
"sync_save_s", "stall_s", "stall_ratio", "upload_mb_per_s", "stage2_cpu_s", "memory_overhead",
"restore_bytes_read",
"naive_restore_bytes", "restore_peak_bytes_per_rank", ...} (save timings are medians over the
saves after the first, which pays one-off start-up costs).
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
MODEL = (
    "model=tiny",
    "model.name=ckpt-bench",
    "model.hidden_size=320",
    "model.num_layers=6",
    "model.seq_length=32",
)
LAYOUT = ("parallelism=tp2-pp2-dp2",)
MODES = ("none", "sync", "async", "memory")  # round r runs them rotated by r


def _compose(
    overrides: list[str],
    steps: int,
    run_dir: Path,
    uri: str,
    interval: int,
    async_save: bool = True,
    memory_interval: int = 0,
) -> mega_config.MegaConfig:
    return mega_config.compose(
        [
            *MODEL,
            *LAYOUT,
            *overrides,
            f"train.steps={steps}",
            f"train.run_dir={run_dir}",
            "train.tensorboard=false",
            "optimizer.warmup_steps=1",
            "restart.max_restarts=0",
            f"checkpoint.storage_uri={uri}",
            f"checkpoint.interval={interval}",
            f"checkpoint.async_save={str(async_save).lower()}",
            f"checkpoint.memory_interval={memory_interval}",
        ]
    )


def memory_costs(run_dir: Path) -> list[dict]:
    """Every rank's counted cost of its in-memory copies (mega/checkpoint/memory.py)."""
    from mega.checkpoint.memory import STATS_DIR

    return [json.loads(p.read_text()) for p in sorted((Path(run_dir) / STATS_DIR).glob("rank*.json"))]


def memory_overhead(costs: list[dict], step_s: float) -> dict:
    """Per copy, the mean over ranks of the training thread's wait plus the CPU of the copy thread
    and of the copy group's gloo threads, and that as a fraction of a step (of the run without
    saves) per step."""
    ranks = [c for c in costs if c["copies"]]

    def per_copy(*keys: str) -> float:
        return statistics.mean(sum(c[k] for k in keys) / c["copies"] for c in ranks)

    mean = per_copy("blocking_s", "background_cpu_s", "exchange_cpu_s")
    return {
        "memory_copy_s": mean,
        "memory_blocking_s": per_copy("blocking_s"),
        # the training thread's CPU in that wait: the rest of it is descheduling on a busy machine
        "memory_blocking_cpu_s": per_copy("blocking_cpu_s"),
        "memory_background_cpu_s": per_copy("background_cpu_s"),
        "memory_exchange_cpu_s": per_copy("exchange_cpu_s"),
        "memory_copy_mb": ranks[0]["bytes"] / ranks[0]["copies"] / 1e6,
        "memory_replicated": all(c["replicated"] == c["copies"] for c in ranks),
        "memory_overhead": mean / ranks[0]["interval"] / step_s,
    }


def upload_cpu_ms_per_mb(uri: str, tmp: Path, rounds: int = 3, files: int = 4, mb: int = 16) -> dict:
    """CPU milliseconds per MB this process spends in ``upload_files`` to the S3 store ``uri``:
    with the project's client, and with botocore's defaults (payload sha256 over http, CRC32 of
    every part) -- alternately, ``rounds`` times, medians."""
    import random
    import resource

    import boto3
    from botocore.config import Config

    from mega.storage import open_storage

    src = tmp / "upload-cpu"
    src.mkdir()
    names = [f"f{i}.bin" for i in range(files)]
    for name in names:
        (src / name).write_bytes(random.Random(name).randbytes(mb << 20))
    spent: dict[str, list[float]] = {"botocore_defaults": [], "mega": []}
    for r in range(rounds):
        for mode in spent:
            store = open_storage(f"{uri}/upload-cpu-{mode}-{r}")
            if mode == "botocore_defaults":
                store._client = boto3.client(
                    "s3",
                    endpoint_url=store.endpoint,
                    region_name="us-east-1",
                    config=Config(s3={"addressing_style": "path"}),
                )
            usage = resource.getrusage(resource.RUSAGE_SELF)
            before = usage.ru_utime + usage.ru_stime
            store.upload_files(src, "iter_0000001", names)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            spent[mode].append((usage.ru_utime + usage.ru_stime - before) * 1e3 / (files * mb))
    return {mode: statistics.median(v) for mode, v in spent.items()}


def steps_per_s(metrics: list[dict]) -> float:
    """Wall-clock steps/s from the end of the first logged step to the end of the last."""
    rows = sorted(metrics, key=lambda r: r["step"])
    first, last = rows[0], rows[-1]
    return (last["step"] - first["step"]) / (last["time"] - first["time"])


def save_costs(metrics: list[dict], log: list[dict]) -> dict:
    """In-run attribution of what each save cost training, from one run's own records: the steps
    whose wall-clock interval overlaps the save -- from its stage 1 to its commit or failure --
    and the seconds they took beyond the mean step of the same run with no save in flight
    (``clean_step_s``; the mean, not the median: step times are skewed, and a sum over the
    overlapped steps is compared with it). Saves after the first (one-off start-up costs) whose commit falls within
    the logged steps only. Unlike two runs' step rates, it is not moved by a load that drifts
    between runs, only by load that changes within seconds."""
    rows = sorted(metrics, key=lambda r: r["step"])
    steps = [(a["time"], b["time"]) for a, b in zip(rows, rows[1:])]
    ends = {r["step"]: r["time"] for r in log if r["event"] in ("committed", "failed")}
    saves = [
        (r["time"] - r["stall_s"], ends.get(r["step"], float("inf"))) for r in log if r["event"] == "save"
    ]

    def overlapped(w: tuple[float, float]) -> list[float]:
        return [b - a for a, b in steps if a < w[1] and b > w[0]]

    clean = [b - a for a, b in steps if not any(a < w[1] and b > w[0] for w in saves)]
    base = statistics.mean(clean) if clean else float("nan")
    timed = [w for w in saves[1:] if steps and w[1] <= steps[-1][1]]
    return {
        "cost_s": [sum(d - base for d in overlapped(w)) for w in timed],
        "overlapped_steps": [len(overlapped(w)) for w in timed],
        "clean_step_s": base,
    }


def _run_mode(overrides, steps, interval, mode, r, where, tmp: Path) -> tuple:
    """One training run of ``mode`` in round ``r``: (its config, data index, metrics rows)."""
    cfg = _compose(
        overrides,
        steps,
        tmp / f"{mode}-{r}",
        where,
        interval if mode in ("sync", "async") else 0,
        async_save=mode == "async",
        memory_interval=1 if mode == "memory" else 0,
    )
    index = common.prepare_data(cfg)
    what = {"none": "no saves", "memory": "in-memory copies every step, no saves"}.get(
        mode, f"{mode} saves every {interval} steps to {where}"
    )
    common.log(f"checkpoint bench, round {r + 1}: {steps} steps, {what}")
    return cfg, index, common.train(cfg, index).metrics


def _rounds(overrides, steps, interval, storage, repeats, modes, tmp: Path, server=None) -> dict:
    """``repeats`` rounds of every mode in ``modes``, round r rotated by r; what each measured
    (with the bench's own S3 ``server``: its CPU seconds during each run too)."""
    from mega.checkpoint import read_save_log

    out = {
        "rates": {mode: [] for mode in modes},
        "saves": {mode: [] for mode in ("sync", "async") if mode in modes},
        "copies": [],  # of the memory runs, per rank
        "commits": [],  # of the async runs
        "costs": {mode: [] for mode in ("sync", "async") if mode in modes},  # save_costs of each run
        "server_cpu_s": {mode: [] for mode in modes},
    }
    for r in range(repeats):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            server_cpu = server.cpu_s() if server is not None else 0.0
            cfg, out["index"], metrics = _run_mode(
                overrides, steps, interval, mode, r, f"{storage}/{mode}-{r}", tmp
            )
            out["rates"][mode].append(steps_per_s(metrics))
            if server is not None:
                out["server_cpu_s"][mode].append(server.cpu_s() - server_cpu)
            out["cfg"] = cfg
            # the first save of a run pays one-off start-up costs: left out of the timings
            log = read_save_log(cfg.train.run_dir)
            if mode == "memory":
                out["copies"] += memory_costs(cfg.train.run_dir)
            if mode in out["saves"]:
                out["costs"][mode].append(save_costs(metrics, log))
                here = [x for x in log if x["event"] == "save"]
                out["saves"][mode] += here[1:] or here
            if mode == "async":
                here = [x for x in log if x["event"] == "committed"]
                out["commits"] += here[1:] or here
    return out


def _restore(overrides, steps, storage, repeats, index, tmp: Path) -> dict:
    """One more step from the last async run's last checkpoint, nothing saved; then the same
    checkpoint loaded again the naive way, for its byte count. The restore's record."""
    from mega.checkpoint.restore import NAIVE_REFERENCE_ENV

    os.environ[NAIVE_REFERENCE_ENV] = "1"
    cfg = _compose(overrides, steps + 1, tmp / "restore", f"{storage}/async-{repeats - 1}", 0)
    return common.train(cfg, index).init["restore"]


def _save_figures(saves: dict, commits: list[dict], slowdown: dict) -> dict:
    """Saves: training slowdown async vs sync, the stall per save, stage 2's CPU per save."""

    def med(key: str, mode: str = "async") -> float:
        return statistics.median(r[key] for r in saves[mode])

    sync_s, stall_s = med("stall_s", "sync"), med("stall_s")
    return {
        "train_slowdown": slowdown["async"],
        "sync_train_slowdown": slowdown["sync"],
        "slowdown_target_met": slowdown["async"] <= slowdown["sync"] / 3,
        # training blocked per save: synchronous (serialise, upload, commit) vs two-stage
        "sync_save_s": sync_s,
        "stall_s": stall_s,
        "stall_ratio": stall_s / sync_s,
        "upload_mb_per_s": statistics.median(r["upload_mb_per_s"] for r in commits),
        # CPU seconds of stage 2 per save, summed over ranks, and where they went
        **{
            k: statistics.median(r[k] for r in commits)
            for k in ("stage2_cpu_s", "stage2_build_cpu_s", "stage2_serialise_cpu_s", "stage2_upload_cpu_s")
        },
        # stage 1 of an async save, split; and the wait for the previous save
        **{k: med(k) for k in ("state_dict_s", "snapshot_s", "plan_s", "wait_s")},
        "saves_timed": len(saves["async"]),
    }


def _cost_figures(costs: dict, rates: dict) -> dict:
    """The in-run attribution (``save_costs``) per save, medians over the runs' saves, beside the
    spread of the no-save runs' step rates: what the end-to-end slowdowns can resolve."""
    per_save = {m: [c for run in costs[m] for c in run["cost_s"]] for m in costs}
    med = {m: statistics.median(v) if v else float("nan") for m, v in per_save.items()}
    none = rates["none"]
    return {
        "save_cost_s": med,  # training time per save beyond the run's own clean steps
        "save_cost_s_each": per_save,
        "save_cost_ratio": med["async"] / med["sync"],  # the target's question, in-run
        "save_cost_overlapped_steps": {
            m: [n for run in costs[m] for n in run["overlapped_steps"]] for m in costs
        },
        "clean_step_s": {m: [run["clean_step_s"] for run in costs[m]] for m in costs},
        # (max - min) / median of the no-save runs' steps/s: the noise of the end-to-end slowdowns
        "none_rate_spread": (max(none) - min(none)) / statistics.median(none),
    }


def _restore_figures(restored: dict) -> dict:
    keys = ("restore_bytes_read", "naive_restore_bytes", "restore_peak_bytes_per_rank", "restore_s")
    return {"checkpoint_mb": restored["checkpoint_bytes"] / 1e6, **{k: restored[k] for k in keys}}


def bench_checkpoint(
    overrides: list[str],
    steps: int,
    interval: int,
    storage: str | None,
    repeats: int = 1,
    modes: tuple[str, ...] = MODES,
) -> dict:
    """The bench (see the module docstring); ``modes``: the runs of each round, a subset of
    MODES with "none" (the reference of every slowdown); "async" and "sync" go together."""
    modes = tuple(m for m in MODES if m in modes)
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if "none" not in modes or ("sync" in modes) != ("async" in modes) or len(modes) < 2:
        raise ValueError(f"--modes must name none and memory, sync+async or both, got {','.join(modes)}")
    load_before = os.getloadavg()[0]
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
            storage = storage.rstrip("/")
            got = _rounds(overrides, steps, interval, storage, repeats, modes, tmp, server)
            saving = "async" in modes
            restored = _restore(overrides, steps, storage, repeats, got["index"], tmp) if saving else None
            upload_cpu = (
                upload_cpu_ms_per_mb(storage, tmp) if saving and storage.startswith("s3://") else None
            )
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
            if server is not None:
                server.stop()
    rate = {mode: statistics.median(v) for mode, v in got["rates"].items()}
    slowdown = {mode: rate["none"] / rate[mode] - 1 for mode in modes if mode != "none"}
    common.log(json.dumps({"saves": got["saves"], "commits": got["commits"], "restore": restored}))
    cfg, p = got["cfg"], got["cfg"].parallelism
    out = {
        **{"layout": p.name, "tp": p.tp, "pp": p.pp, "dp": p.dp, "modes": list(modes)},
        **{"steps": steps, "interval": interval, "repeats": repeats},
        "steps_per_s": rate,  # median over the rounds
        "steps_per_s_runs": got["rates"],
    }
    if saving:
        out.update(_save_figures(got["saves"], got["commits"], slowdown), **_restore_figures(restored))
        out.update(_cost_figures(got["costs"], got["rates"]))
        if server is not None:  # the S3 server shares the cores: its CPU per run (3 saves in one)
            out["s3_server_cpu_s_per_run"] = {m: statistics.median(v) for m, v in got["server_cpu_s"].items()}
        # the upload's CPU per MB in this process: the project's S3 client vs botocore's defaults
        out["upload_cpu_ms_per_mb"] = upload_cpu
    if "memory" in modes:
        # in-memory copies every step: counted cost per copy and per step, measured slowdown
        out.update(memory_overhead(got["copies"], 1 / rate["none"]), memory_train_slowdown=slowdown["memory"])
    return {
        **out,
        "storage": "s3 (SeaweedFS, local)" if server is not None else storage.split(":", 1)[0],
        "device": common.device_name(cfg),
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # 1-min, before and after
    }
