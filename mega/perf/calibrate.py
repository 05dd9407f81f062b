"""``python -m mega.plan calibrate [--out FILE] [--steps N] [--quick] [--json]``: measure this
machine, then check the model against real training steps of tiny configs over several layouts.

1. Microbenchmarks (each rank of the calibration layouts runs one thread, so do they): fp32 GEMMs
   over the shapes and operand layouts the models use (-> GEMM rate), elementwise adds (-> memory
   bandwidth, the fixed cost of one op), GeLU / softmax / LayerNorm (-> activation-op bytes/s), gloo all-reduce / all-gather / reduce-scatter / send-recv between processes
   on this machine (-> latency per ring step and bandwidth), building microbatches (-> data cost).
2. Host-overhead probes: six runs of a model too small to compute anything through the real
   launcher, two ranks of one thread (dp2: 2 or 8 layers x 1 or 4 microbatches; tp2: 2 or 8
   layers x 4 microbatches); their CPU seconds per step minus the model's compute give megatron's
   Python cost per step, per layer and step (optimizer), per microbatch, per layer and microbatch,
   and what tensor parallelism adds per microbatch and per layer. Two more dp2 probes of a model
   that computes (hidden 192, 96 tokens: another shape than the validation model) measure how much
   slower compute runs inside training than in the microbenchmarks; the GEMM and elementwise
   rates are divided by that factor.
3. Validation: real training runs (``run_training``: torchrun ranks, gloo) of one tiny-but-not-
   trivial model over the LAYOUTS below; predicted vs measured median step time (wall) and the
   ranks' CPU seconds per step (what other jobs on the cores do not change).

Nothing in step 3 feeds the hardware numbers: they come from steps 1 and 2 only. The JSON written
to ``--out`` (default runs/perf-calibration.json) is what ``python -m mega.plan cluster=local-cpu``
reads. Timings on a shared machine are noisy: the JSON records the load average around each run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from mega.perf.hardware import from_calibration_block

DEFAULT_OUT = Path("runs/perf-calibration.json")
# The validation model: big enough that GEMMs, not only Python, show in a step (vocab 512 keeps the
# tokenizer the tests and the default run already cached).
MODEL = [
    "model=tiny",
    "model.num_layers=8",
    "model.hidden_size=128",
    "model.num_attention_heads=4",
    "model.seq_length=128",
]
# TP, PP, VPP, DP and their mixes; 2 to 8 ranks (8 ranks share the cores: the core-sharing bound).
LAYOUTS: dict[str, list[str]] = {
    "tp2": ["parallelism=tp2"],
    "pp2": ["parallelism=pp2"],
    "dp2": ["parallelism=dp2"],
    "pp2-vpp2": ["parallelism=pp2-vpp2"],
    "tp2-dp2": ["parallelism=tp2", "parallelism.dp=2", "parallelism.name=tp2-dp2"],
    "pp4": ["parallelism=pp2", "parallelism.pp=4", "parallelism.name=pp4"],
    "tp2-pp2-dp2": ["parallelism=tp2-pp2-dp2"],
    "tp2-pp2-vpp2-dp2": ["parallelism=tp2-pp2-vpp2-dp2"],
}
QUICK = ("tp2", "pp2", "dp2", "pp2-vpp2", "tp2-dp2", "tp2-pp2-dp2")
PROBE_MODEL = ["model=tiny", "model.hidden_size=32", "model.num_attention_heads=2", "model.seq_length=32"]
# Probes of a model that computes, of another shape than the validation model (so that none of
# the validation rows is fitted): how much slower a layer's compute runs inside training than
# in the microbenchmarks (allocation, cache misses between ops, autograd bookkeeping).
SIZE_PROBE_MODEL = [
    "model=tiny",
    "model.hidden_size=192",
    "model.num_attention_heads=6",
    "model.seq_length=96",
]
# cold processes: RankSampler finds the ranks by their command line (a warm rank shows its zygote's)
RUN = [
    "checkpoint.interval=0",
    "restart.max_restarts=0",
    "train.tensorboard=false",
    "optimizer.warmup_steps=1",
    "launcher.warm_processes=false",
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
    }


def _time(fn, repeats: int, min_s: float = 0.02, clock=time.thread_time) -> float:
    """Median seconds of one call, each sample repeated until it lasts ``min_s``. The default clock
    is this thread's CPU time: single-threaded work measured so is not slowed by other processes
    sharing the cores (the machine this runs on usually is shared)."""
    fn()
    t0 = clock()
    fn()
    once = max(clock() - t0, 1e-7)
    inner = max(1, int(min_s / once))
    samples = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            fn()
        samples.append((clock() - t0) / inner)
    return statistics.median(samples)


def _fit(columns: list[list[float]], times: list[float]) -> list[float]:
    """Least squares of times = columns . x, weighted by 1/time (relative errors), x >= 0."""
    a = np.array(columns, dtype=float).T
    y = np.array(times, dtype=float)
    w = 1 / y
    x, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    return [max(0.0, float(v)) for v in x]


def _nnls(columns: list[list[float]], times: list[float]) -> list[float]:
    """Non-negative least squares (relative errors) by dropping the most negative coefficient
    until none is left: the overheads are times, never negative."""
    active = list(range(len(columns)))
    while True:
        x = np.zeros(len(columns))
        a = np.array([columns[i] for i in active], dtype=float).T
        y = np.array(times, dtype=float)
        sol, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            for i, v in zip(active, sol):
                x[i] = max(0.0, float(v))
            return [float(v) for v in x]
        active.pop(int(np.argmin(sol)))


def bench_gemm(threads: int = 1) -> dict[str, Any]:
    """GEMMs as a layer runs them: forward (A @ B), dgrad (A @ B^T) and wgrad (A^T @ B) operands."""
    import torch

    torch.set_num_threads(threads)
    shapes = [
        (256, 384, 128),
        (256, 128, 128),
        (256, 512, 128),
        (256, 128, 512),
        (512, 512, 512),
        (1024, 1024, 1024),
        (4096, 384, 128),
        (4096, 128, 512),
        (128, 128, 32),
        (128, 32, 128),
    ]
    points = []
    for m, n, k in shapes:
        variants = {
            "nn": (torch.randn(m, k), torch.randn(k, n)),
            "nt": (torch.randn(m, k), torch.randn(n, k).t()),
            "tn": (torch.randn(k, m).t(), torch.randn(k, n)),
        }
        for name, (a, b) in variants.items():
            t = _time(lambda: torch.mm(a, b), 5)
            points.append(
                {"m": m, "n": n, "k": k, "layout": name, "seconds": t, "gflops": 2 * m * n * k / t / 1e9}
            )
    t0, inv_rate = _fit(
        [[1.0] * len(points), [2.0 * p["m"] * p["n"] * p["k"] for p in points]],
        [p["seconds"] for p in points],
    )
    return {
        "threads": threads,
        "points": points,
        "fixed_s": t0,
        "flops_per_s": 1 / inv_rate if inv_rate else float("nan"),
    }


def bench_memory(threads: int = 1) -> dict[str, Any]:
    """Streaming adds (bandwidth, the fixed cost of one op) and the unfused activation ops a layer
    runs on a CPU (GeLU, softmax, LayerNorm, add, dropout-less bias-add): their bytes/s."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    points = []
    for n in (16, 1024, 16384, 262144, 1048576, 4194304):
        a, b = torch.randn(n), torch.randn(n)
        out = torch.empty(n)
        t = _time(lambda: torch.add(a, b, out=out), 5)
        points.append({"elements": n, "bytes": 12 * n, "seconds": t})
    fixed, inv_bw = _fit([[1.0] * len(points), [p["bytes"] for p in points]], [p["seconds"] for p in points])
    ops = {
        "gelu": lambda x: F.gelu(x),
        "softmax": lambda x: torch.softmax(x, -1),
        "layer_norm": lambda x: F.layer_norm(x, (x.shape[-1],)),
        "add": lambda x: x + x,
    }
    activation = []
    for n in (32768, 131072, 524288):
        x = torch.randn(n // 128, 128)
        for name, op in ops.items():
            t = _time(lambda: op(x), 5)
            activation.append({"op": name, "elements": n, "bytes": 8 * n, "seconds": t})
    elementwise = sum(p["bytes"] for p in activation) / sum(p["seconds"] for p in activation)
    return {
        "threads": threads,
        "points": points,
        "activation_ops": activation,
        "kernel_s": fixed,
        "bytes_per_s": 1 / inv_bw if inv_bw else float("nan"),
        "elementwise_bytes_per_s": elementwise,
    }


def _gloo_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    points = []
    try:
        for nbytes in (4096, 65536, 1 << 20, 4 << 20):
            n = nbytes // 4
            x = torch.randn(n)
            gathered, part, shard = torch.empty(n), x[: n // world].clone(), torch.empty(n // world)
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            ops = {
                "all_reduce": lambda: dist.all_reduce(x),
                "all_gather": lambda: all_gather(gathered, part),
                "reduce_scatter": lambda: reduce_scatter(shard, x),
                "send": (lambda: dist.send(x, 1)) if rank == 0 else (lambda: dist.recv(x, 0)),
            }
            iters = 20 if nbytes <= 65536 else 5  # the same on every rank: collectives must pair up
            for kind, fn in ops.items():
                try:
                    fn()
                    wall, cpu = [], []
                    for _ in range(11):
                        dist.barrier()
                        t0, c0 = time.perf_counter(), time.process_time()
                        for _ in range(iters):
                            fn()
                        wall.append((time.perf_counter() - t0) / iters)
                        cpu.append((time.process_time() - c0) / iters)
                except (RuntimeError, NotImplementedError) as err:  # an op gloo lacks
                    points.append({"kind": kind, "bytes": nbytes, "error": str(err).splitlines()[0]})
                    continue
                # the fastest sample: the least disturbed by other processes on the cores
                points.append(
                    {
                        "kind": kind,
                        "bytes": nbytes,
                        "world": world,
                        "seconds": min(wall),
                        "median_s": statistics.median(wall),
                        "cpu_seconds": statistics.median(cpu),
                    }
                )
        if rank == 0:
            Path(out).write_text(json.dumps(points))
    finally:
        dist.destroy_process_group()


def bench_gloo(world: int = 2) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:  # a free port for the workers' TCP rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/gloo.json"
        mp.spawn(_gloo_worker, args=(world, port, out), nprocs=world, join=True)
        points = json.loads(Path(out).read_text())
    ok = [p for p in points if "seconds" in p]
    n = world
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "send": 1}
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "send": 1.0,
    }
    # Two points rather than a joint fit (one disturbed sample can drive a joint fit's bandwidth
    # negative): the latency per ring step from the smallest messages, the bandwidth from the
    # largest once that latency is taken off.
    small, large = min(p["bytes"] for p in ok), max(p["bytes"] for p in ok)
    latency = statistics.median(p["seconds"] / steps[p["kind"]] for p in ok if p["bytes"] == small)
    bandwidth = statistics.median(
        factor[p["kind"]] * p["bytes"] / max(p["seconds"] - steps[p["kind"]] * latency, 0.1 * p["seconds"])
        for p in ok
        if p["bytes"] == large
    )
    # the same for the core time a call costs its rank (CPU seconds: not inflated by other jobs)
    cpu_latency = statistics.median(p["cpu_seconds"] / steps[p["kind"]] for p in ok if p["bytes"] == small)
    cpu_bandwidth = statistics.median(
        factor[p["kind"]]
        * p["bytes"]
        / max(p["cpu_seconds"] - steps[p["kind"]] * cpu_latency, 0.1 * p["cpu_seconds"])
        for p in ok
        if p["bytes"] == large
    )
    return {
        "world": world,
        "points": points,
        "latency_s": latency,
        "bytes_per_s": bandwidth,
        "cpu_latency_s": cpu_latency,
        "cpu_bytes_per_s": cpu_bandwidth,
    }


def bench_data(index: Path, seq_length: int, micro_batch: int = 2) -> float:
    """Seconds per token to build a microbatch (TokenDataset.microbatch), as each rank does."""
    from mega.data import TokenDataset

    ds = TokenDataset(index, seq_length=seq_length, seed=1234)
    step = iter(range(10**9))
    t = _time(lambda: ds.microbatch(next(step), 0, 0, 1, micro_batch, 1), 5)
    return t / (micro_batch * seq_length)


class RankSampler(threading.Thread):
    """Every ``period`` seconds: the CPU seconds used so far by the training ranks (this process's
    descendants running mega.train) and the number of steps logged to metrics.jsonl. CPU seconds
    per step do not grow when other jobs share the cores; wall seconds do."""

    def __init__(self, metrics: Path, period: float = 0.01):
        super().__init__(daemon=True)
        self.metrics, self.period = metrics, period
        self.samples: list[tuple[float, int, float]] = []  # (wall, steps logged, rank CPU seconds)
        self._done = threading.Event()

    def run(self) -> None:
        import psutil

        me, ranks, cpu = psutil.Process(), {}, {}
        while not self._done.wait(self.period):
            for child in me.children(recursive=True):
                if child.pid not in ranks:
                    try:
                        if "mega.train" in " ".join(child.cmdline()):
                            ranks[child.pid] = child
                    except psutil.Error:
                        continue
            for pid, proc in ranks.items():
                try:
                    t = proc.cpu_times()
                    cpu[pid] = t.user + t.system  # an exited rank keeps its last reading
                except psutil.Error:
                    pass
            try:
                steps = self.metrics.read_text().count("\n")
            except OSError:
                steps = 0
            self.samples.append((time.perf_counter(), steps, sum(cpu.values())))

    def stop(self) -> None:
        self._done.set()
        self.join()

    def per_step(self, first: int, last: int) -> dict[str, float]:
        """CPU and wall seconds per step between the logging of step ``first`` and ``last``."""

        def at(step: int) -> tuple[float, int, float]:
            return next(x for x in self.samples if x[1] >= step)

        end = at(last) if any(x[1] >= last for x in self.samples) else max(self.samples, key=lambda x: x[1])
        start = at(first)
        n = end[1] - start[1]
        if n <= 0:
            return {"cpu_s": float("nan"), "wall_s": float("nan"), "steps": 0}
        return {"cpu_s": (end[2] - start[2]) / n, "wall_s": (end[0] - start[0]) / n, "steps": n}


QUIET = {"max_load": None, "max_wait_s": 0.0}  # --max-load / --max-wait: wait for a quieter machine


def wait_for_quiet() -> float:
    """Wait (up to --max-wait seconds) until the 1-minute load average is at most --max-load: on a
    shared machine other jobs' bursts come and go, and even CPU seconds grow under heavy load
    (caches and memory bandwidth are shared too). Returns the load average at the start."""
    deadline = time.monotonic() + QUIET["max_wait_s"]
    while (
        QUIET["max_load"] is not None
        and os.getloadavg()[0] > QUIET["max_load"]
        and time.monotonic() < deadline
    ):
        time.sleep(5)
    return os.getloadavg()[0]


def run_layout(overrides: list[str], steps: int, warmup: int) -> dict[str, Any]:
    """Train ``steps`` steps with the real launcher: the median step time (wall) after ``warmup``
    and the ranks' CPU seconds per step over the same steps."""
    from mega.bench import common
    from mega.metrics import METRICS_FILE

    with tempfile.TemporaryDirectory(prefix="mega-calibrate-") as tmp:
        cfg = common.compose_run([*overrides, *RUN], steps, f"{tmp}/run")
        index = common.prepare_data(cfg)
        load_before = wait_for_quiet()
        sampler = RankSampler(Path(cfg.train.run_dir) / METRICS_FILE)
        sampler.start()
        try:
            result = common.train(cfg, index)
        finally:
            sampler.stop()
    timed = common.steady(result.metrics, warmup)
    usage = sampler.per_step(warmup, steps)
    return {
        "step_s": common.median(timed, "step_s"),
        "steps_s": [r["step_s"] for r in timed],
        "cpu_s": usage["cpu_s"],
        "sampled_wall_s": usage["wall_s"],
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def hardware_block(mach: dict, gemm: dict, mem: dict, gloo: dict, data_s_per_token: float) -> dict[str, Any]:
    """The microbenchmarks' part of a calibration's hardware block (the probes add the rest)."""
    return {
        "name": f"cpu: {mach['cpu']} x{mach['cores']}",
        "gemm_flops_per_s": gemm["flops_per_s"],
        "kernel_s": mem["kernel_s"],
        "memory_bytes_per_s": mem["bytes_per_s"],
        "elementwise_bytes_per_s": mem["elementwise_bytes_per_s"],
        "memory_bytes": mach["memory_bytes"],
        "gloo_latency_s": gloo["latency_s"],
        "gloo_bytes_per_s": gloo["bytes_per_s"],
        "cores": mach["cores"],
        "data_s_per_token": data_s_per_token,
        "gloo_cpu_latency_s": gloo["cpu_latency_s"],
        "gloo_cpu_bytes_per_s": gloo["cpu_bytes_per_s"],
    }


PROBES = [("dp2", 2, 1), ("dp2", 2, 4), ("dp2", 8, 1), ("dp2", 8, 4), ("tp2", 2, 4), ("tp2", 8, 4)]


def probe_configs() -> list[dict[str, Any]]:
    """The probes: six overhead probes, two ranks of one thread each (as in the validation layouts:
    a rank with two threads would charge OpenMP's spinning), a model too small to compute (dp2: 2 or
    8 layers x 1 or 4 microbatches; tp2: 2 or 8 layers x 4 microbatches); two compute probes, dp2,
    SIZE_PROBE_MODEL with 2 and 8 layers."""
    out = []
    for layout, layers, mb in PROBES:
        out.append(
            {
                "kind": "overhead",
                "layout": layout,
                "layers": layers,
                "microbatches": mb,
                "overrides": [
                    *PROBE_MODEL,
                    f"model.num_layers={layers}",
                    f"parallelism={layout}",
                    "parallelism.micro_batch_size=1",
                    f"parallelism.global_batch_size={mb * (2 if layout == 'dp2' else 1)}",
                    "parallelism.name=probe",
                ],
            }
        )
    for layers in (2, 8):
        out.append(
            {
                "kind": "compute",
                "layout": "dp2",
                "layers": layers,
                "microbatches": 4,
                "overrides": [
                    *SIZE_PROBE_MODEL,
                    f"model.num_layers={layers}",
                    "parallelism=dp2",
                    "parallelism.micro_batch_size=2",
                    "parallelism.global_batch_size=16",
                    "parallelism.name=probe",
                ],
            }
        )
    return out


def measure_probes(steps: int, warmup: int) -> list[dict[str, Any]]:
    """Overhead probes run 4x the steps: theirs last milliseconds, and the CPU clock ticks 10 ms."""
    rows = []
    for probe in probe_configs():
        log(
            f"calibrate: {probe['kind']} probe {probe['layout']}, {probe['layers']} layers x "
            f"{probe['microbatches']} microbatches"
        )
        n = steps * 4 if probe["kind"] == "overhead" else steps
        measured = run_layout(probe["overrides"], n, warmup)
        rows.append(
            {
                **probe,
                "cpu_s": measured["cpu_s"],
                "measured_step_s": measured["step_s"],
                "load_before": measured["load_before"],
                "load_after": measured["load_after"],
            }
        )
    return rows


def _predict_probe(block: dict[str, Any], overrides: list[str]):
    from mega.config import compose
    from mega.perf.step import predict

    return predict(compose([*overrides, *RUN]), from_calibration_block(block, 2))


def fit_overheads(block: dict[str, Any], probes: list[dict[str, Any]]) -> dict[str, float]:
    """Per rank, after the modelled compute and collectives (non-negative least squares):
    cpu = c_step + L c_layer_step + M (c_mb + L c_layer) [+ M (c_tp_mb + L c_tp_layer) with TP]."""
    rows = [r for r in probes if r["kind"] == "overhead" and math.isfinite(r["cpu_s"])]
    residual = [max(1e-4, (r["cpu_s"] - _predict_probe(block, r["overrides"]).busy_s) / 2) for r in rows]
    tp = [1.0 if r["layout"] == "tp2" else 0.0 for r in rows]
    c_step, c_layer_step, c_mb, c_layer, c_tp_mb, c_tp_layer = _nnls(
        [
            [1.0] * len(rows),
            [r["layers"] for r in rows],
            [r["microbatches"] for r in rows],
            [r["microbatches"] * r["layers"] for r in rows],
            [t * r["microbatches"] for t, r in zip(tp, rows)],
            [t * r["microbatches"] * r["layers"] for t, r in zip(tp, rows)],
        ],
        residual,
    )
    return {
        "step_overhead_s": c_step,
        "layer_step_overhead_s": c_layer_step,
        "microbatch_overhead_s": c_mb,
        "layer_overhead_s": c_layer / 3,
        "tp_microbatch_overhead_s": c_tp_mb,
        "tp_layer_overhead_s": c_tp_layer / 3,
    }  # a layer's backward costs twice its forward


def fit_compute_scale(block: dict[str, Any], probes: list[dict[str, Any]]) -> float:
    """k = (measured CPU - modelled overheads and collectives) / modelled compute, over the compute
    probes: how much slower compute runs inside training than in the microbenchmarks (allocation,
    cache misses between ops, autograd bookkeeping)."""
    extra, compute = 0.0, 0.0
    for r in (r for r in probes if r["kind"] == "compute" and math.isfinite(r["cpu_s"])):
        pr = _predict_probe(block, r["overrides"])
        terms = {t.name: t.seconds for t in pr.terms}
        per_rank = terms["gemm"] + terms["attention"] + terms["elementwise"]  # one stage: its only one
        extra += r["cpu_s"] / 2 - pr.busy_s / 2
        compute += per_rank
    return max(1.0, 1 + extra / compute)


def derive_hardware(cal: dict[str, Any]) -> dict[str, Any]:
    """The hardware block of a calibration from its raw measurements, with the current model:
    microbenchmarks, then the overhead probes' fit, then the compute scale."""
    mach, meas = cal["machine"], cal["measurements"]
    block = hardware_block(mach, meas["gemm"], meas["memory"], meas["gloo"], meas["data_s_per_token"])
    block.update(fit_overheads(block, meas["probes"]))
    scale = fit_compute_scale(block, meas["probes"])
    block["compute_scale"] = scale
    block["gemm_flops_per_s"] = meas["gemm"]["flops_per_s"] / scale
    block["elementwise_bytes_per_s"] = meas["memory"]["elementwise_bytes_per_s"] / scale
    return block


def compare(calibration: dict[str, Any]) -> list[dict[str, Any]]:
    """Predicted vs measured per recorded layout: step time (wall) and the ranks' CPU seconds per
    step (busy time). Used by ``calibrate`` and by the tests on recorded calibrations."""
    from mega.perf.configs import Composer
    from mega.perf.step import predict

    block = derive_hardware(calibration)
    out = []
    with Composer() as composer:
        for row in calibration["layouts"]:
            cfg = composer.plan(row["overrides"]).cfg
            pr = predict(cfg, from_calibration_block(block, cfg.cluster.procs_per_node))
            out.append(
                {
                    "name": row["name"],
                    "measured_step_s": row["measured_step_s"],
                    "predicted_step_s": pr.step_s,
                    "error": pr.step_s / row["measured_step_s"] - 1,
                    "measured_cpu_s": row["cpu_s"],
                    "predicted_cpu_s": pr.busy_s,
                    "cpu_error": pr.busy_s / row["cpu_s"] - 1,
                    "breakdown": {k: v["seconds"] for k, v in pr.breakdown().items() if v["seconds"]},
                }
            )
    return out


def calibrate(out: Path, steps: int, warmup: int, names: tuple[str, ...]) -> dict[str, Any]:
    from mega.bench import common
    from mega.config import compose

    mach = machine()
    log(f"calibrate: {mach['cpu']} x{mach['cores']}, load average {mach['load_average']}")
    gemm, mem = bench_gemm(1), bench_memory(1)
    log(
        f"calibrate: GEMM {gemm['flops_per_s'] / 1e9:.1f} GFLOP/s per thread, memory "
        f"{mem['bytes_per_s'] / 1e9:.1f} GB/s, {mem['kernel_s'] * 1e6:.1f} us per op"
    )
    gloo = bench_gloo(2)
    log(
        f"calibrate: gloo {gloo['latency_s'] * 1e6:.0f} us per ring step, {gloo['bytes_per_s'] / 1e9:.2f} GB/s"
    )
    cfg = compose([*MODEL, "parallelism=tp2"])
    data = bench_data(common.prepare_data(cfg), cfg.model.seq_length)
    result: dict[str, Any] = {
        "machine": mach,
        "measurements": {
            "gemm": gemm,
            "memory": mem,
            "gloo": gloo,
            "data_s_per_token": data,
            "probes": measure_probes(steps, warmup),
        },
        "model": MODEL,
        "steps": steps,
        "warmup": warmup,
        "layouts": [],
        "command": " ".join(sys.argv),
        "note": "measured on a machine shared with other jobs unless the load averages say otherwise; "
        "re-run on a quiet machine for final figures",
    }
    result["hardware"] = derive_hardware(result)
    log(
        "calibrate: "
        + ", ".join(f"{k} {v:.3g}" for k, v in result["hardware"].items() if k.endswith(("_s", "scale")))
    )
    for name in names:
        overrides = [*MODEL, *LAYOUTS[name]]
        log(f"calibrate: layout {name}")
        measured = run_layout(overrides, steps, warmup)
        result["layouts"].append(
            {
                "name": name,
                "overrides": overrides,
                "measured_step_s": measured["step_s"],
                "steps_s": measured["steps_s"],
                "cpu_s": measured["cpu_s"],
                "sampled_wall_s": measured["sampled_wall_s"],
                "load_before": measured["load_before"],
                "load_after": measured["load_after"],
            }
        )
    result["machine"]["load_average_end"] = os.getloadavg()
    return finish(result, out)


def finish(result: dict[str, Any], out: Path) -> dict[str, Any]:
    """Hardware from the measurements, predicted vs measured per layout, the summary; written to ``out``."""
    result["hardware"] = derive_hardware(result)
    for row, cmp in zip(result["layouts"], compare(result)):
        row.update(
            {k: cmp[k] for k in ("predicted_step_s", "error", "predicted_cpu_s", "cpu_error", "breakdown")}
        )
        log(
            f"calibrate: {row['name']:<18} step measured {row['measured_step_s']:.3f} s predicted "
            f"{row['predicted_step_s']:.3f} s ({row['error']:+.1%}); CPU s/step measured {row['cpu_s']:.3f} "
            f"predicted {row['predicted_cpu_s']:.3f} ({row['cpu_error']:+.1%}); load {row['load_before']:.1f}"
        )
    result["summary"] = {"layouts": len(result["layouts"])}
    for key in ("error", "cpu_error"):
        errors = [abs(r[key]) for r in result["layouts"]]
        result["summary"][key] = {
            "max_abs": max(errors),
            "mean_abs": sum(errors) / len(errors),
            "within_15_percent": sum(e <= 0.15 for e in errors),
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mega.plan calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help=f"six layouts only: {', '.join(QUICK)}")
    parser.add_argument("--layouts", default=None, help="comma-separated subset of " + ", ".join(LAYOUTS))
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="before each run wait until the 1-minute load average is at most this",
    )
    parser.add_argument(
        "--max-wait", type=float, default=300.0, help="... for at most this many seconds per run"
    )
    parser.add_argument(
        "--refit",
        default=None,
        metavar="FILE",
        help="measure nothing: derive the hardware of a recorded calibration again with the "
        "current model and compare its layouts (written to --out)",
    )
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.refit:
        result = finish(json.loads(Path(args.refit).read_text()), Path(args.out))
        print(json.dumps({"out": args.out, "summary": result["summary"]}))
        return 0
    QUIET.update(max_load=args.max_load, max_wait_s=args.max_wait)
    names = tuple(args.layouts.split(",")) if args.layouts else (QUICK if args.quick else tuple(LAYOUTS))
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"calibrate: unknown layouts {unknown}; known: {list(LAYOUTS)}", file=sys.stderr)
        return 2
    result = calibrate(Path(args.out), args.steps, args.warmup, names)
    if not args.json:
        log(f"calibrate: {result['summary']}; written to {args.out}")
    print(
        json.dumps(
            {
                "out": args.out,
                "summary": result["summary"],
                "layouts": [
                    {
                        k: r[k]
                        for k in (
                            "name",
                            "measured_step_s",
                            "predicted_step_s",
                            "error",
                            "cpu_s",
                            "predicted_cpu_s",
                            "cpu_error",
                            "load_before",
                        )
                    }
                    for r in result["layouts"]
                ],
            }
        )
    )
    return 0


def _split_device(argv: list[str]) -> tuple[str, list[str]]:
    """(the ``--device`` value, default cpu; the other arguments)."""
    if "--device" not in argv:
        return "cpu", argv
    i = argv.index("--device")
    return (argv[i + 1] if i + 1 < len(argv) else ""), argv[:i] + argv[i + 2 :]


def check_args(argv: list[str]) -> None:
    """Parse ``argv`` as ``python -m mega.perf.calibrate`` does, measuring nothing."""
    device, argv = _split_device(argv)
    if device == "cuda":
        from mega.perf.calibrate_cuda import parser as cuda_parser

        cuda_parser().parse_args(argv)
    elif device == "cpu":
        parser().parse_args(argv)
    else:
        raise SystemExit(f"calibrate: --device must be cpu or cuda, got {device!r}")


def cli(argv: list[str]) -> int:
    """``python -m mega.perf.calibrate [--device cpu|cuda] ...``: the CPU calibration (this module)
    or the GPU one (mega.perf.calibrate_cuda)."""
    device, argv = _split_device(argv)
    if device == "cuda":
        from mega.perf.calibrate_cuda import main as cuda_main

        return cuda_main(argv)
    if device != "cpu":
        print(f"calibrate: --device must be cpu or cuda, got {device!r}", file=sys.stderr)
        return 2
    return main(argv)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
