"""``python -m mega.perf.calibrate --device cuda [--out FILE] [--model NAME]``: measure the per-device
efficiencies of the performance model on a GPU node and write a calibration file for
``python -m mega.plan ... --calibration FILE``.

* GEMMs over the shapes of the model's layers (QKV, projection, MLP; forward, dgrad, wgrad) at the
  layer's token counts for tensor-parallel sizes 1-8 -> ``gemm_efficiency``: achieved / (peak x the
  model's own per-shape factor, mega.perf.hardware.Hardware.gemm_s), the median over shapes; on
  devices with FP8 tensor cores the same shapes in FP8 -> ``fp8_gemm_efficiency`` (FP8 peak);
* fused attention (torch SDPA, causal, forward + backward) -> ``attention_efficiency``;
* a device-to-device copy -> ``memory_efficiency`` against the datasheet HBM bandwidth;
* NCCL all-reduce / all-gather / reduce-scatter / all-to-all / send-recv when started by torchrun
  with 2 or more ranks (over 2-8 GPUs of a node: ``nvlink_efficiency``; with ranks on several
  nodes: ``nic_efficiency``): bus bandwidth (nccl-tests' convention) / the datasheet link rate;
* with ranks on several nodes, small all-gathers over one rank per node -> ``nic_latency_us``: the
  latency of one ring step between nodes (``ring_step_latency_us``).

What a run cannot measure (one GPU: no collectives) keeps the device's built-in value and is listed
under ``not_measured``. torch is imported inside the functions: the module imports without CUDA and
its arithmetic is unit-tested on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mega.flops import PEAK_TFLOPS, device_key
from mega.perf import device as device_mod
from mega.perf.hardware import GEMM_K_OVERHEAD, SMS, TILE_M, TILE_N
from mega.perf.step import causal_keys

DEFAULT_OUT = Path("runs/perf-calibration-cuda.json")
# Datasheet link and memory rates per device type (bytes/s): HBM, NVLink per direction, one NIC.
DATASHEET = {
    "A100": {"hbm": 2.039e12, "nvlink": 300e9, "nic": 25e9},
    "H100 SXM": {"hbm": 3.35e12, "nvlink": 450e9, "nic": 50e9},
    "H200": {"hbm": 4.8e12, "nvlink": 450e9, "nic": 50e9},
    "B200": {"hbm": 8e12, "nvlink": 900e9, "nic": 50e9},
    "GB200": {"hbm": 8e12, "nvlink": 900e9, "nic": 50e9},
}
# nccl-tests (PERFORMANCE.md): bus bandwidth = algorithm bandwidth (bytes / time) x this factor.
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


def layer_gemm_shapes(
    hidden: int, ffn: int, kv: int, tokens: int, tps=(1, 2, 4, 8), swiglu: bool = False
) -> list[tuple[int, int, int]]:
    """(m, n, k) of a layer's GEMMs (forward, dgrad, wgrad) for each tensor-parallel size; under
    SwiGLU fc1 computes the gate and the up projection in one GEMM."""
    shapes = set()
    for t in tps:
        for rows, cols, inner in (
            (tokens, (hidden + 2 * kv) // t, hidden),
            (tokens, hidden, hidden // t),
            (tokens, (2 if swiglu else 1) * ffn // t, hidden),
            (tokens, hidden, ffn // t),
        ):
            shapes |= {(rows, cols, inner), (rows, inner, cols), (inner, cols, rows)}
    return sorted(shapes)


def shape_factor(m: int, n: int, k: int, sms: int | None) -> float:
    """The model's per-shape efficiency factor (wave quantization x tile prologue), as in
    Hardware.gemm_s."""
    if not sms:
        return 1.0
    tiles = -(-m // TILE_M) * -(-n // TILE_N)
    return tiles / (-(-tiles // sms) * sms) * k / (k + GEMM_K_OVERHEAD)


def gemm_efficiency(points: list[dict[str, Any]], peak: float, sms: int | None) -> float:
    """Median over shapes of achieved FLOP/s / (peak x shape factor)."""
    return statistics.median(
        2 * p["m"] * p["n"] * p["k"] / p["seconds"] / (peak * shape_factor(p["m"], p["n"], p["k"], sms))
        for p in points
    )


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """FLOPs a causal flash kernel executes forward + backward, as mega.perf.step charges them:
    QK^T and AV over the causal half of the s x s square (``step.causal_keys``), 4 b a s k d
    forward, 2.5x that backward (S recomputed): 3.5 x forward in all."""
    return 3.5 * 4 * batch * heads * seq * causal_keys(seq, None) * head_dim


def _attention_efficiency_at(points: list[dict[str, Any]], peak: float, seq: int) -> float:
    """Median of attention_flops / seconds / peak over the points at sequence length ``seq``."""
    return statistics.median(
        attention_flops(p["batch"], p["heads"], p["seq"], p["head_dim"]) / p["seconds"] / peak
        for p in points
        if p["seq"] == seq
    )


def attention_efficiency(points: list[dict[str, Any]], peak: float) -> float:
    """The efficiency at the longest sequence measured (the model's own; the shorter ones are the
    chunks context parallelism runs its kernels on)."""
    return _attention_efficiency_at(points, peak, max(p["seq"] for p in points))


def attention_by_length(points: list[dict[str, Any]], peak: float) -> tuple[tuple[int, float], ...]:
    """(tokens, efficiency) per sequence length measured, ascending; empty with one length."""
    lengths = sorted({p["seq"] for p in points})
    if len(lengths) < 2:
        return ()
    return tuple((n, round(_attention_efficiency_at(points, peak, n), 4)) for n in lengths)


# Context parallelism over cp ranks runs each layer's attention as one kernel per ring step on a
# chunk of the sequence (s/cp queries; load-balanced causal chunks of s/(2 cp)): the calibration
# times the model's sequence and its halves and quarters, so a file records attention by length.
ATTENTION_SPLITS = (1, 2, 4)
MIN_ATTENTION_SEQ = 512


def attention_lengths(seq: int) -> list[int]:
    """The sequence lengths the attention benchmark times: the model's, then its CP chunks."""
    return [seq // k for k in ATTENTION_SPLITS if k == 1 or seq // k >= MIN_ATTENTION_SEQ]


def bus_bandwidth(kind: str, nbytes: float, ranks: int, seconds: float) -> float:
    return nbytes / seconds * BUS_FACTOR[kind](ranks)


def link_efficiency(points: list[dict[str, Any]], link_bytes_per_s: float) -> float:
    """The best bus bandwidth of the large messages (>= 64 MiB) / the datasheet link rate."""
    large = [p for p in points if p["bytes"] >= 64 * 2**20] or points
    return (
        max(bus_bandwidth(p["kind"], p["bytes"], p["ranks"], p["seconds"]) for p in large) / link_bytes_per_s
    )


def ring_step_latency_us(points: list[dict[str, Any]]) -> float:
    """The latency of one ring step between nodes, microseconds: all-gathers over one rank per node
    (n ranks) of two or more sizes B take t = (n - 1) x (latency + B / (n x bandwidth)), so t / (n - 1)
    against B / n is a line whose intercept is the latency (least squares; 0 at the least)."""
    xs = [p["bytes"] / p["ranks"] for p in points]
    ys = [p["seconds"] / (p["ranks"] - 1) for p in points]
    if len(set(xs)) < 2:
        raise ValueError("ring_step_latency_us needs all-gathers of at least two sizes")
    return max(0.0, statistics.linear_regression(xs, ys).intercept * 1e6)


def _cuda_time(fn: Callable[[], Any], repeats: int = 10, warmup: int = 3) -> float:
    """Mean device time of one call. ``warmup`` untimed calls first: the first calls of a kernel
    pay one-off costs (library handles, kernel selection, autotuning, allocator growth) that a
    training step does not; one warm-up call is not always enough (cuDNN/flash backward)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def bench_gemms(shapes: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    import torch

    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        out.append({"m": m, "n": n, "k": k, "seconds": _cuda_time(lambda: a @ b)})
    return out


def bench_fp8_gemms(shapes: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """The same GEMMs in FP8 (E4M3 x E4M3 -> bf16 with per-tensor scales, the GEMM Transformer
    Engine's FP8 linears run on Hopper). cuBLASLt's FP8 kernels take both operands K-major, so the
    second operand is the transpose of an (n, k) tensor; shapes with n or k not a multiple of 16
    (cuBLASLt's FP8 alignment) are skipped."""
    import torch

    one = torch.ones((), device="cuda")
    out = []
    for m, n, k in shapes:
        if n % 16 or k % 16:
            continue
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()

        def gemm(a=a, b=b):
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        out.append({"m": m, "n": n, "k": k, "seconds": _cuda_time(gemm)})
    return out


def bench_attention(seq: int, heads: int, head_dim: int, batch: int = 1) -> list[dict[str, Any]]:
    """Causal SDPA forward + backward. The output gradient is made once and the input gradients
    are returned, not accumulated into ``.grad``: the timed loop holds only the attention kernels."""
    import torch
    import torch.nn.functional as F

    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad_out = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad_out)

    return [
        {
            "batch": batch,
            "heads": heads,
            "seq": seq,
            "head_dim": head_dim,
            "seconds": _cuda_time(step, repeats=20, warmup=5),
        }
    ]


def bench_memory(nbytes: int = 2 << 30) -> float:
    import torch

    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * nbytes / _cuda_time(lambda: dst.copy_(src))  # read + write


def bench_collectives(sizes=(1 << 20, 64 << 20, 256 << 20)) -> list[dict[str, Any]]:
    """NCCL collectives over every rank of the torchrun job (rank 0 returns the points)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for nbytes in sizes:
        n = nbytes // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        shard = torch.empty(n // world, device="cuda", dtype=torch.bfloat16)
        ops = {
            "all_reduce": lambda: dist.all_reduce(x),
            "all_gather": lambda: dist.all_gather_into_tensor(x, shard),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, x),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(x), x),
        }
        if world == 2:
            ops["send_recv"] = (lambda: dist.send(x, 1)) if rank == 0 else (lambda: dist.recv(x, 0))
        for kind, fn in ops.items():
            dist.barrier()
            out.append({"kind": kind, "bytes": nbytes, "ranks": world, "seconds": _cuda_time(fn, 5)})
    return out


def bench_ring_latency(sizes=(64 << 10, 256 << 10, 1 << 20)) -> list[dict[str, Any]]:
    """All-gathers over one rank per node (the ranks of one local rank: a data-parallel group's
    shape when TP fills the node), small enough that the per-step latency shows. Every rank joins
    every group's creation (torch.distributed.new_group); rank 0 returns its group's points."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    groups = [dist.new_group(list(range(r, world, local))) for r in range(local)]
    group, n = groups[rank % local], world // local
    out = []
    for nbytes in sizes:
        x = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        shard = torch.randn(nbytes // 2 // n, device="cuda", dtype=torch.bfloat16)
        dist.barrier()
        seconds = _cuda_time(lambda: dist.all_gather_into_tensor(x, shard, group=group), 20)
        out.append({"kind": "all_gather", "bytes": nbytes, "ranks": n, "seconds": seconds})
    return out


def derive(
    key: str,
    gemms: list,
    attention: list,
    memory_bytes_per_s: float | None,
    collectives: list,
    multi_node: bool,
    fp8_gemms: list | None = None,
    ring: list | None = None,
) -> tuple[device_mod.DeviceCalibration, list[str]]:
    """The calibration from the measurements; what was not measured keeps the built-in value.
    ``ring``: all-gathers over one rank per node (``bench_ring_latency``), which give the NIC's
    per-hop latency; the other job constants a node cannot measure."""
    peak = PEAK_TFLOPS[key]["bf16"] * 1e12
    sheet = DATASHEET.get(key, {})
    values: dict[str, float] = {"gemm_efficiency": gemm_efficiency(gemms, peak, SMS.get(key))}
    not_measured = []
    if fp8_gemms and "fp8" in PEAK_TFLOPS[key]:
        values["fp8_gemm_efficiency"] = gemm_efficiency(
            fp8_gemms, PEAK_TFLOPS[key]["fp8"] * 1e12, SMS.get(key)
        )
    else:
        not_measured.append("fp8_gemm_efficiency")
    by_length: tuple[tuple[int, float], ...] = ()
    if attention:
        values["attention_efficiency"] = attention_efficiency(attention, peak)
        by_length = attention_by_length(attention, peak)
    if memory_bytes_per_s and "hbm" in sheet:
        values["memory_efficiency"] = memory_bytes_per_s / sheet["hbm"]
    else:
        not_measured.append("memory_efficiency")
    link = "nic" if multi_node else "nvlink"
    if collectives and link in sheet:
        values[f"{link}_efficiency"] = link_efficiency(collectives, sheet[link])
    not_measured += [f for f in ("nvlink_efficiency", "nic_efficiency") if f not in values]
    if ring:
        values["nic_latency_us"] = ring_step_latency_us(ring)
    # properties of a job (and, on one node, of its fabric), not of a device
    not_measured += [f for f in device_mod.JOB_FIELDS if f not in values]
    cal = device_mod.prior(key).replace(
        **{k: round(v, 4) for k, v in values.items()},
        attention_by_length=by_length,
        source="python -m mega.perf.calibrate --device cuda",
    )
    return cal, not_measured


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mega.perf.calibrate --device cuda",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--ffn", type=int, default=None)
    parser.add_argument("--swiglu", action="store_true", help="a SwiGLU MLP: fc1 is hidden x 2 ffn")
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=1)
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("calibrate: --device cuda needs a CUDA device (this machine has none)", file=sys.stderr)
        return 2
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    name = torch.cuda.get_device_name()
    key = device_key(name)
    if key is None:
        print(f"calibrate: unknown device {name!r} (not in mega.flops.PEAK_TFLOPS)", file=sys.stderr)
        return 2
    h, d = args.hidden, args.hidden // args.heads
    kv = (args.kv_heads or args.heads) * d
    tokens = args.seq * args.micro_batch
    shapes = layer_gemm_shapes(h, args.ffn or 4 * h, kv, tokens, swiglu=args.swiglu)
    gemms = bench_gemms(shapes)
    # Hopper and later: the FP8 GEMMs of train.precision=fp8
    fp8_gemms = bench_fp8_gemms(shapes) if "fp8" in PEAK_TFLOPS[key] else []
    heads = max(1, args.heads // 8)
    attention = [
        p for seq in attention_lengths(args.seq) for p in bench_attention(seq, heads, d, args.micro_batch)
    ]
    memory = bench_memory()
    collectives, multi_node, ring = [], False, []
    if distributed:
        collectives = bench_collectives()
        multi_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) < dist.get_world_size()
        if multi_node:
            ring = bench_ring_latency()
        if dist.get_rank() != 0:
            dist.destroy_process_group()
            return 0
    cal, not_measured = derive(key, gemms, attention, memory, collectives, multi_node, fp8_gemms, ring)
    extra = {
        "device_name": name,
        "not_measured": not_measured,
        "command": " ".join(sys.argv),
        "measurements": {
            "gemm": gemms,
            "fp8_gemm": fp8_gemms,
            "attention": attention,
            "memory_bytes_per_s": memory,
            "collectives": collectives,
            "ring_across_nodes": ring,
        },
    }
    device_mod.save(cal, args.out, extra)
    print(json.dumps({"out": args.out, "calibration": cal.to_dict(), "not_measured": not_measured}))
    if distributed:
        dist.destroy_process_group()
    return 0
