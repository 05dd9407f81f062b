"""``python -m mega.bench soak``: faults one after another on a real run, and what they cost
(docs/goodput.md).

* ``fault_schedule``: a seeded Poisson process over the fault kinds the system handles (exponential
  gaps of mean ``mtbf_s``, a kind drawn uniformly per fault): the same seed, the same schedule.
* ``compare``: the soak against its fault-free reference (same schedule, same skipped steps):
  the sample ledgers, the final weights bit for bit (``weights_equal``), the ledger's figures.
* ``simulate``: the ETTR a run of N GPUs would see at a per-GPU failure rate, from component
  costs measured here and stated assumptions; ``measured: false``.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np

KINDS = (
    "rank-kill",
    "rank-hang",
    "node-kill",
    "nan",
    "spike",
    "redis-stop",
    "s3-stop",
    "straggler",
    "kill-in-save",
)


def fault_schedule(minutes: float, mtbf_s: float, seed: int, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """Fault times (seconds from the soak's start) and kinds: Poisson arrivals of rate 1/mtbf_s."""
    if minutes <= 0 or mtbf_s <= 0:
        raise ValueError(f"--minutes and --mtbf-s must be positive (got {minutes}, {mtbf_s})")
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(mtbf_s))
        if t >= minutes * 60:
            return out
        out.append({"at_s": round(t, 3), "kind": kinds[int(rng.integers(len(kinds)))]})


def weights_equal(a: str | Path, b: str | Path, work: str | Path) -> dict:
    """Two megatron (torch_dist) checkpoints, every tensor compared bit for bit (model and
    optimizer state). Returns ``equal``, the tensors compared and the differing names."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    sds = []
    for name, src in (("a", a), ("b", b)):
        dcp_to_torch_save(str(src), str(work / f"{name}.pt"))
        sds.append(
            _tensors(torch.load(work / f"{name}.pt", weights_only=False))
        )  # our own files, just written
    keys = sorted(set(sds[0]) | set(sds[1]))
    differ = [k for k in keys if k not in sds[0] or k not in sds[1] or not _same_bits(sds[0][k], sds[1][k])]
    return {"equal": not differ and bool(keys), "tensors": len(keys), "differ": differ[:20]}


def _same_bits(x, y) -> bool:
    import torch

    return (
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    )


def _tensors(tree, prefix: str = "") -> dict:
    import torch

    if isinstance(tree, torch.Tensor):
        return {prefix: tree.contiguous()}
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


def compare(soak: dict, reference: dict, weights: dict, loadable: bool) -> dict:
    """The soak's result fields from its ledger, its reference's ledger, the weights comparison
    and whether the durable checkpoint loaded."""
    s, r = soak["samples"], reference["samples"]
    skipped = [x["step"] for x in s["skipped"]]
    return {
        "ettr": soak["ettr"],
        "wall_s": soak["wall_s"],
        "ledger": soak["ledger_s"],
        "unattributed_s": soak["unattributed_s"],
        "samples_exact": bool(
            s["exact"]
            and r["exact"]
            and skipped == [x["step"] for x in r["skipped"]]
            and s["trained_samples"] == r["trained_samples"]
        ),
        "final_weights_equal_reference": bool(weights.get("equal")),
        "durable_checkpoint_loadable": bool(loadable),
        "reference_ettr": reference["ettr"],
        "reference_wall_s": reference["wall_s"],
    }


# the incidents that answer each fault kind (mega/stability); an S3 outage is answered by the
# checkpoint upload's retries instead (checkpoints.jsonl)
ANSWERS = {
    "rank-kill": ("rank-exit",),
    "node-kill": ("rank-exit",),
    "kill-in-save": ("rank-exit",),
    "rank-hang": ("hang",),
    "nan": ("nan",),
    "spike": ("spike",),
    "redis-stop": ("store",),
    "straggler": ("straggler", "hang"),
    "s3-stop": (),
}


def fault_rows(
    struck: list[dict], incidents: list[dict], lost_s: dict[int, float], saves: list[dict]
) -> list[dict]:
    """Each fault that struck (``time``: when) with what the system made of it: the first
    incident of a kind that answers it detected after it (``detect_s``; an S3 outage: the first
    upload retry), its recovery (``recover_s``: the incident's time to recover; an S3 outage: the
    first save committed after it), and ``lost_s``, the lost work of the attempt it ended."""
    rows, left = [], sorted(incidents, key=lambda i: i["detected_at"])
    for f in sorted(struck, key=lambda f: f["time"]):
        t = f["time"]
        inc = next((i for i in left if i["kind"] in ANSWERS[f["kind"]] and i["detected_at"] >= t - 1), None)
        if inc is not None:
            left.remove(inc)  # one incident answers one fault
        restarts = inc is not None and inc["kind"] not in ("straggler", "store")  # reported, no relaunch
        row = {
            "kind": f["kind"],
            "at_s": f.get("at_s"),
            "detected": inc is not None,
            "detect_s": round(inc["detected_at"] - t, 3) if inc else None,
            "recovered": bool(inc and (inc.get("time_to_recover_s") is not None or not restarts)),
            "recover_s": inc.get("time_to_recover_s") if inc else None,
            "lost_s": round(lost_s.get(inc.get("attempt"), 0.0), 3) if restarts else 0.0,
        }
        if f["kind"] == "s3-stop":
            retry = next((r["time"] for r in saves if r["event"] == "retry" and r["time"] >= t), None)
            done = next((r["time"] for r in saves if r["event"] == "committed" and r["time"] >= t + 20), None)
            row.update(
                detected=retry is not None,
                detect_s=round(retry - t, 3) if retry else None,
                recovered=done is not None,
                recover_s=round(done - t - 20, 3) if done else None,
            )
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# At scale, simulated

# Component costs and where each comes from (2026-11-26; docs/goodput.md). Seconds unless named.
ASSUMPTIONS = {
    "detect_kill_s": (1.0, "measured: faults bench rank-kill detect_s 1.02 s (a dead rank's agent exits)"),
    "detect_hang_s": (62.0, "stability.min_hang_s 60 s + one heartbeat (2 s): a hang's floor"),
    "hang_fraction": (0.3, "assumption: share of failures that hang instead of exiting"),
    "teardown_s": (5.0, "measured: rank-hang stop of every process, ~5 s (ledger teardown, this machine)"),
    "diagnosis_s": (30.0, "assumption: self-check of the suspect nodes before the relaunch"),
    "startup_s": (90.0, "assumption at scale: scheduling + process start + imports of every node"),
    "group_creation_s_per_rank": (
        4.75 / 12288,
        "measured: bootstrap bench light-redis 4.75 s at 12,288 ranks, linear",
    ),
    "restore_s": (30.0, "assumption: durable checkpoint read from the object store at scale"),
    "warmup_s": (10.0, "assumption: the first step's excess (allocator, NCCL communicators)"),
    "checkpoint_stall_s": (
        5.0,
        "assumption: async save's blocking part for a large model (0.17 s tiny, here)",
    ),
}


def simulate(gpus: int, mttf_h: float, run_days: float = 30.0, overrides: dict | None = None) -> dict:
    """ETTR of an N-GPU run with a per-GPU MTTF of ``mttf_h`` hours: failures arrive at rate
    N / mttf_h; each costs detection, teardown, diagnosis, a restart (start-up, group creation
    growing with N, restore, warm-up) and on average half a checkpoint interval of lost work;
    checkpoints every Young/Daly interval sqrt(2 * stall * MTBF) cost their stall."""
    if gpus <= 0 or mttf_h <= 0:
        raise ValueError(f"--gpus and --mttf-h must be positive (got {gpus}, {mttf_h})")
    a = {k: v[0] for k, v in ASSUMPTIONS.items()} | (overrides or {})
    mtbf_s = mttf_h * 3600 / gpus
    detect = a["hang_fraction"] * a["detect_hang_s"] + (1 - a["hang_fraction"]) * a["detect_kill_s"]
    restart = a["startup_s"] + a["group_creation_s_per_rank"] * gpus + a["restore_s"] + a["warmup_s"]
    per_failure_fixed = detect + a["teardown_s"] + a["diagnosis_s"] + restart
    interval = math.sqrt(2 * a["checkpoint_stall_s"] * mtbf_s)
    # per unit of wall clock: a failure every mtbf_s costs the fixed part plus half an interval
    lost_per_failure = interval / 2
    failure_share = min(1.0, (per_failure_fixed + lost_per_failure) / mtbf_s)
    ckpt_share = a["checkpoint_stall_s"] / (interval + a["checkpoint_stall_s"])
    ettr = max(0.0, (1 - failure_share) * (1 - ckpt_share) - restart / (run_days * 86400))
    return {
        "measured": False,
        "gpus": gpus,
        "mttf_h_per_gpu": mttf_h,
        "run_days": run_days,
        "job_mtbf_h": mtbf_s / 3600,
        "failures": run_days * 86400 / mtbf_s,
        "checkpoint_interval_s": interval,
        "cost_per_failure_s": per_failure_fixed + lost_per_failure,
        "ettr": ettr,
        "assumptions": {
            k: {"value": a[k], "source": ASSUMPTIONS[k][1] if k in ASSUMPTIONS else "override"} for k in a
        },
    }


# ---------------------------------------------------------------------------------------------
# The soak: a real TP2xPP2xDP2 run on 2 local nodes x 4 ranks and a spare, real Redis and S3

LAYOUT = [
    "model=tiny",
    "parallelism=tp2-pp2-dp2",
    "launcher=local-nodes",
    "cluster.nodes=2",
    "cluster.procs_per_node=4",
    "restart.spare_nodes=1",
    "train.tensorboard=false",
    "train.eval_batches=0",
    # the default LR warm-up (a tenth of the run, at most 10 steps): with none, this model's own loss
    # spikes at step 25 (8.1 against 5.3), and the rollbacks that follow are no fault of the schedule
    "restart.backoff_s=0",
    "checkpoint.interval=4",
    "stability.heartbeat_s=1",
    "stability.min_hang_s=15",
    "stability.progress_factor=5",
    "checkpoint.upload_timeout_s=60",
    "checkpoint.upload_retry_s=1",
]
CONFIG_KINDS = {
    "nan": "fault.nan_at_step",
    "spike": "fault.spike_at_step",
    "kill-in-save": "fault.kill_at_step",
}


def config_faults(
    schedule: list[dict], step_s: float, interval: int, steps: int
) -> tuple[list[str], list[dict]]:
    """The faults the ranks inject themselves at a step (NaN, spike, a kill in a save's stage 2:
    one of each per soak, at the step the schedule's time falls on at ``step_s`` per step); the
    rest stay for the harness. Returns the overrides and the schedule with each fault's ``how``."""
    overrides, out, used = [], [], set()
    for f in schedule:
        step = max(2, min(steps - 1, int(f["at_s"] / step_s)))
        if f["kind"] in CONFIG_KINDS and f["kind"] not in used:
            if f["kind"] == "kill-in-save":
                step = max(interval, step - step % interval)  # a save's step
                overrides += ["fault.mode=kill_in_upload", "fault.kill_rank=0"]
            used.add(f["kind"])
            overrides.append(f"{CONFIG_KINDS[f['kind']]}={step}")
            out.append({**f, "how": "config", "step": step})
        elif f["kind"] in CONFIG_KINDS:
            out.append({**f, "how": "not injected (one per soak)"})
        else:
            out.append({**f, "how": "harness"})
    return overrides, out


class Harness:
    """Strikes the harness faults of a schedule at their times, against the live attempt."""

    def __init__(self, run_dir: Path, schedule: list[dict], redis_pid: int, s3, seed: int):
        import threading

        self.run_dir, self.schedule, self.redis_pid, self.s3 = run_dir, schedule, redis_pid, s3
        self.rng = np.random.default_rng(seed + 1)
        self.done: list[dict] = []
        # the attempt the last rank fault ended: the next rank fault waits for a newer one (one
        # struck at a dying attempt is absorbed by its relaunch, and would be neither detected nor
        # a fault the run survived)
        self.ended_attempt = -1
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.t0 = None  # set when the first step is logged: fault times count from training, not start-up
        self.thread.start()

    def _live_ranks(self) -> list[dict]:
        """The live ranks of the newest attempt, if it is newer than the one the last rank fault
        ended; each row with its ``attempt``."""
        import os

        from mega.cluster.node import read_processes

        attempts = sorted(
            int(p.name.split("attempt")[1].split(".")[0])
            for p in self.run_dir.glob("nodes/*/procs-attempt*.jsonl")
        )
        if not attempts or attempts[-1] <= self.ended_attempt:
            return []
        procs = [{**p, "attempt": attempts[-1]} for p in read_processes(self.run_dir, attempts[-1])]
        alive = []
        for p in procs:
            try:
                os.kill(p["pid"], 0)
                alive.append(p)
            except OSError:
                pass
        return alive

    def _run(self) -> None:
        import time

        while not (self.run_dir / "metrics.jsonl").exists():
            if self.stop.wait(0.2):
                return
        self.t0 = time.time()
        for f in self.schedule:
            if f["how"] != "harness":
                continue
            while time.time() < self.t0 + f["at_s"]:
                if self.stop.wait(0.2):
                    return
            at = time.time()  # the fault's start (an outage or a straggler lasts seconds more)
            try:
                struck = {**f, **self._strike(f["kind"]), "time": at}
            except Exception as e:  # e.g. the victim exited between choosing and striking it
                self.done.append({**f, "struck": False, "why": f"harness: {type(e).__name__}: {e}"})
                continue  # the next faults are still struck, and the result says why this one was not
            self.done.append(struck)
            self._record(struck)

    def _strike(self, kind: str) -> dict:
        import os
        import signal
        import time

        ranks = self._live_ranks()
        deadline = time.monotonic() + 180  # between attempts: strike the next one's ranks
        while kind in ("rank-kill", "rank-hang", "node-kill", "straggler") and not ranks:
            if time.monotonic() > deadline or self.stop.wait(1.0):
                return {"struck": False, "why": "no live rank"}
            ranks = self._live_ranks()
        victim = ranks[int(self.rng.integers(len(ranks)))] if ranks else None
        if kind in ("rank-kill", "rank-hang", "node-kill"):
            self.ended_attempt = victim["attempt"]
        if kind == "rank-kill":
            os.kill(victim["pid"], signal.SIGKILL)
        elif kind == "rank-hang":
            os.kill(victim["pid"], signal.SIGSTOP)  # the driver's watcher kills it
        elif kind == "node-kill":
            import psutil

            agent = psutil.Process(victim["pid"]).parent()
            for p in [agent, *agent.children(recursive=True)]:
                p.kill()
        elif kind == "redis-stop":
            self._pause(self.redis_pid, 10.0)
        elif kind == "s3-stop":
            self.s3.stop()
            time.sleep(20.0)
            self.s3.start(timeout=120)
        elif kind == "straggler":  # half of every second stopped, for 30 s
            for _ in range(30):
                os.kill(victim["pid"], signal.SIGSTOP)
                time.sleep(0.5)
                os.kill(victim["pid"], signal.SIGCONT)
                time.sleep(0.5)
        return {"struck": True, **({"rank": victim["rank"], "node": victim.get("node")} if victim else {})}

    def _record(self, f: dict) -> None:
        """Into ``faults.jsonl`` beside the ranks' own records: the ledger's fault time."""
        import json

        attempts = sorted(
            int(p.name.split("attempt")[1].split(".")[0])
            for p in self.run_dir.glob("nodes/*/procs-attempt*.jsonl")
        )
        row = {
            "kind": f["kind"],
            "time": f["time"],
            "attempt": attempts[-1] if attempts else 0,
            "step": None,
            "by": "soak harness",
            **{k: f[k] for k in ("rank", "node") if k in f},
        }
        with open(self.run_dir / "faults.jsonl", "a") as out:
            out.write(json.dumps(row) + "\n")

    def _pause(self, pid: int, seconds: float) -> None:
        import os
        import signal
        import time

        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)


def bench_soak(
    minutes: float, mtbf_s: float, seed: int, out: str | Path, extra: list[str], step_s: float | None = None
) -> dict:
    """The soak and its fault-free reference; the comparison fields, the faults, the PNG.
    ``step_s``: seconds per step that set ``train.steps`` (``minutes`` of training) and map the
    ranks' own faults to steps; None: measured by a short fault-free run of the same layout."""
    import os

    from mega.storage.seaweed import SeaweedS3
    from mega.store import RedisServer

    out = Path(out).absolute()
    for previous in ("seaweed", "calibration", "soak", "reference", "final"):  # a rerun starts afresh
        shutil.rmtree(out / previous, ignore_errors=True)
    saved_env = dict(os.environ)
    s3 = SeaweedS3(out / "seaweed", bucket="mega-soak").start(timeout=120)
    try:
        os.environ.update(s3.env())
        with RedisServer() as redis:
            common_overrides = [*LAYOUT, f"store.redis_url={redis.url}", *extra]
            step_s = step_s or _calibrate_step_s(out, common_overrides, s3)
            steps = max(8, int(minutes * 60 / step_s))
            schedule = fault_schedule(minutes, mtbf_s, seed)
            fault_overrides, schedule = config_faults(schedule, step_s, 4, steps)
            common_overrides.insert(len(LAYOUT), f"restart.max_restarts={len(schedule) + 3}")
            run = _run_soak(out, steps, schedule, [*common_overrides, *fault_overrides], redis, s3, seed)
            _run_reference(out, steps, common_overrides, s3, run["index"])
            weights = _final_weights(out, steps, s3)
    finally:
        s3.stop()
        os.environ.clear()
        os.environ.update(saved_env)
    return {**_result(out, run, weights, schedule, steps, seed, minutes, mtbf_s), "step_s": step_s}


CALIBRATION_STEPS = 24


def _calibrate_step_s(out: Path, overrides: list[str], s3) -> float:
    """Seconds per step of the soak's layout on this machine now, its checkpoint saves included:
    the mean wall time per step of a short fault-free run, after its first four steps."""
    from mega.bench import common
    from mega.metrics import read_metrics

    run_dir = out / "calibration"
    cfg = _compose(
        [*overrides, f"checkpoint.storage_uri={s3.uri('calibration')}"], CALIBRATION_STEPS, run_dir
    )
    common.train(cfg, common.prepare_data(cfg))
    times = [row["time"] for row in read_metrics(run_dir)][4:]
    return (times[-1] - times[0]) / (len(times) - 1)


def _run_soak(
    out: Path, steps: int, schedule: list[dict], overrides: list[str], redis, s3, seed: int
) -> dict:
    """The soak run itself, the harness striking its faults: its config, result and harness."""
    from mega.bench import common

    soak_dir = out / "soak"
    cfg = _compose([*overrides, f"checkpoint.storage_uri={s3.uri('soak')}"], steps, soak_dir)
    index = common.prepare_data(cfg)
    harness = Harness(soak_dir, schedule, redis.pid, s3, seed)
    harness.start()
    try:
        result = common.train(cfg, index)
    finally:
        harness.stop.set()
    return {"cfg": cfg, "dir": soak_dir, "index": index, "result": result, "harness": harness}


def _run_reference(out: Path, steps: int, overrides: list[str], s3, index: Path) -> None:
    """The fault-free reference: the same run skipping the steps the soak skipped."""
    from mega.bench import common

    skipped = sorted(s["step"] for s in _skipped(out / "soak"))
    ref_cfg = _compose(
        [
            *overrides,
            f"checkpoint.storage_uri={s3.uri('reference')}",
            f"train.skip_steps=[{','.join(map(str, skipped))}]",
        ],
        steps,
        out / "reference",
    )
    common.train(ref_cfg, index)


def _final_weights(out: Path, steps: int, s3) -> dict:
    """Both runs' final durable checkpoints downloaded (verified) and compared bit for bit."""
    from mega.storage import open_storage

    last = f"iter_{steps:07d}"
    for name in ("soak", "reference"):
        open_storage(s3.uri(name)).download_dir(last, out / "final" / name)  # verified against its manifest
    return weights_equal(out / "final" / "soak", out / "final" / "reference", out / "final" / "torch")


def _result(
    out: Path,
    run: dict,
    weights: dict,
    schedule: list[dict],
    steps: int,
    seed: int,
    minutes: float,
    mtbf_s: float,
) -> dict:
    """The soak's JSON: the comparison with its reference, the faults and what recovery ran on."""
    from mega.goodput import recovery
    from mega.goodput import report as goodput_report
    from mega.stability.incident import read_incidents
    from mega.storage.save_log import read_save_log

    soak_dir, cfg, harness = run["dir"], run["cfg"], run["harness"]
    soak_led = goodput_report.build(soak_dir, title="soak", tensorboard=False)
    ref_led = goodput_report.build(out / "reference", title="reference", tensorboard=False)
    struck = [f for f in harness.done if f.get("struck")] + _config_struck(soak_dir, schedule)
    faults = fault_rows(
        struck, read_incidents(soak_dir), soak_led["lost_s_by_attempt"], read_save_log(soak_dir)
    )
    return {
        **compare(soak_led, ref_led, weights, bool(weights["tensors"])),
        "faults": faults,
        "faults_survived": run["result"].final_step == steps,  # the run ended, every step trained
        "schedule": schedule,
        "not_struck": _not_struck(schedule, harness.done, struck),
        "steps": steps,
        "attempts": run["result"].attempts,
        "seed": seed,
        "minutes": minutes,
        "mtbf_s": mtbf_s,
        "png": soak_led["png"],
        # what recovery ran on: warm processes (mega/warm), in-memory copies every N steps (0: off)
        "warm_processes": bool(cfg.launcher.warm_processes),
        "memory_interval": int(cfg.checkpoint.memory_interval),
        "recoveries": recovery.recoveries(soak_dir),
        "weights": weights,
        "measured": True,
    }


def _not_struck(schedule: list[dict], done: list[dict], struck: list[dict]) -> list[dict]:
    """Scheduled faults that never struck, and why (the run ended first, a config fault's step not
    trained or not saved, a second one of a kind, no live rank)."""
    hit = {(f["kind"], f.get("at_s")) for f in struck}
    tried = {(f["kind"], f["at_s"]): f.get("why") for f in done}
    out = []
    for f in schedule:
        if (f["kind"], f["at_s"]) in hit:
            continue
        if f["how"].startswith("not injected"):
            why = f["how"]
        elif f["how"] == "harness":
            why = tried.get((f["kind"], f["at_s"])) or "the run ended first"
        elif f["kind"] == "kill-in-save":
            # it strikes once, in the first attempt whose rank 0 uploads its step (mega/faults.py):
            # a save skipped while an earlier upload retried never uploads it
            why = (
                f"step {f.get('step')}'s checkpoint never uploaded (its save skipped, or the run ended first)"
            )
        else:
            # armed in every attempt; a rollback skips the steps it rolls back over
            why = f"step {f.get('step')} not trained (skipped by a rollback, or the run ended first)"
        out.append({"kind": f["kind"], "at_s": f["at_s"], "why": why})
    return out


def _config_struck(run_dir: Path, schedule: list[dict]) -> list[dict]:
    """The config faults the ranks recorded (``faults.jsonl``), each once, at its first record."""
    from mega.faults import recorded

    rows = recorded(run_dir)
    names = {"nan": "nan", "spike": "spike", "kill_in_upload": "kill-in-save"}
    out = {}
    for r in rows:
        kind = names.get(r["kind"])
        if kind and r.get("by") != "soak harness" and kind not in out:
            at = next((f["at_s"] for f in schedule if f["kind"] == kind), None)
            out[kind] = {"kind": kind, "at_s": at, "time": r["time"], "step": r.get("step")}
    return list(out.values())


def _compose(overrides: list[str], steps: int, run_dir: Path):
    from mega.config import compose

    return compose([*overrides, f"train.steps={steps}", f"train.run_dir={run_dir}"])


def _skipped(run_dir: Path) -> list[dict]:
    from mega.launch.runs import read_record

    return read_record(run_dir).skipped_steps
