"""Model FLOPs and model FLOPs utilization (MFU); the formula is derived in docs/mfu.md.

MFU = (model FLOPs per step / step time) / (devices * dense peak FLOP/s per device). Model FLOPs
count the matmuls a GPT needs, independent of how it runs: activation recompute is not model work,
so ``model_flops_per_step`` leaves it out (pass ``recompute=True`` to the per-token count for the
hardware FLOPs, HFU).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from mega.config import MegaConfig, ModelConfig

if TYPE_CHECKING:  # torch is imported where a GEMM is timed: the FLOP counts stay torch-free
    import torch


def attention_layer_counts(
    num_layers: int, window: int | None, full_attention_every: int | None
) -> tuple[int, int]:
    """(sliding-window layers, full-attention layers): with ``full_attention_every=k`` layers
    k, 2k, ... (1-based, megatron's ``window_attn_skip_freq``) attend fully, the rest use the window."""
    if window is None:
        return 0, num_layers
    full = num_layers // full_attention_every if full_attention_every else 0
    return num_layers - full, full


def model_flops_per_token(
    model: ModelConfig,
    recompute: bool = False,
    window: int | None = None,
    full_attention_every: int | None = None,
) -> float:
    """Training FLOPs (forward + backward) per token of a megatron GPT, counting matmuls only.

    ``recompute``: full activation recompute runs the transformer layers' forward once more (the
    logits layer sits outside the recomputed region, as in Megatron). ``window``: sliding-window
    attention, each query sees at most ``window + 1`` keys; None = full causal attention, counted
    over the whole sequence (Megatron's convention: the masked half is not discounted).
    ``full_attention_every``: with a window, every k-th layer still attends over the whole sequence.
    """
    h, s = model.hidden_size, model.seq_length
    kv = h * (model.num_query_groups or model.num_attention_heads) // model.num_attention_heads

    def attention(keys_per_query: int) -> int:
        return 2 * 2 * keys_per_query * h  # scores Q K^T and the weighted sum of V

    qkv = 2 * h * (h + 2 * kv)
    projection = 2 * h * h
    mlp = 2 * h * (model.fc1_size + model.ffn)  # h -> ffn (gate and up under SwiGLU), ffn -> h
    windowed, full = attention_layer_counts(model.num_layers, window, full_attention_every)
    s_window = s if window is None else min(window + 1, s)
    layers_forward = (
        model.num_layers * (qkv + projection + mlp) + windowed * attention(s_window) + full * attention(s)
    )
    logits_forward = 2 * h * model.padded_vocab_size

    # backward = 2x forward (gradients w.r.t. inputs and w.r.t. weights)
    flops = 3 * (layers_forward + logits_forward)
    if recompute:
        flops += layers_forward
    return float(flops)


def model_flops_per_step(cfg: MegaConfig) -> float:
    """Model FLOPs of one optimizer step: every token of the global batch, without recompute, with
    the model's own attention pattern (sliding window, full attention every k-th layer)."""
    m = cfg.model
    tokens = cfg.parallelism.global_batch_size * m.seq_length
    return (
        model_flops_per_token(m, window=m.window_size, full_attention_every=m.full_attention_every) * tokens
    )


# Dense (no 2:4 sparsity) peak tensor-core TFLOP/s per GPU, from the vendor datasheets, which print
# the sparse figure: dense = sparse / 2. "fp32" is fp32 training with TF32 tensor-core matmuls
# (what Megatron runs with); the plain fp32 CUDA-core peak (A100 19.5, H100 SXM 67) is far lower.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 datasheet / Hopper whitepaper, H100 SXM5: BF16/FP16 1979 sparse, TF32 989, FP8 3958.
    "H100 SXM": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 494.7},
    # H100 PCIe: BF16/FP16 1513 sparse, TF32 756, FP8 3026.
    "H100 PCIe": {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 378.0},
    # H100 NVL (per GPU, 2024 datasheet): BF16/FP16 1671 sparse, TF32 835, FP8 3341.
    "H100 NVL": {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 417.5},
    # NVIDIA H200 datasheet, H200 SXM: the H100 SXM compute with more, faster memory.
    "H200": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 494.7},
    # H200 NVL: BF16/FP16 1671 sparse, TF32 835, FP8 3341.
    "H200 NVL": {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 417.5},
    # NVIDIA GH200 datasheet: its Hopper GPU has the H100 SXM peaks.
    "GH200": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 494.7},
    # NVIDIA HGX B200 at 1,000 W (Blackwell datasheet; its two dies are one GPU): BF16/FP16 4.5 PF
    # sparse, TF32 2.2 PF, FP8 9 PF (DGX B200: 72 PFLOPS FP8 training in 8 GPUs).
    "B200": {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 1100.0},
    # GB200 (per GPU, at 1,200 W in GB200 NVL72): BF16/FP16 5 PF sparse, TF32 2.5 PF, FP8 10 PF.
    "GB200": {"fp8": 5000.0, "bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 1250.0},
    # NVIDIA A100 datasheet (SXM4 and PCIe, 40 and 80 GB alike): BF16/FP16 624 sparse, TF32 312.
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 156.0},
    # NVIDIA V100 datasheet: FP16 tensor cores only (no BF16, no TF32), fp32 on CUDA cores.
    "V100 SXM2": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
}

# torch.cuda.get_device_name() strings -> PEAK_TFLOPS keys; first match wins, so the specific
# variants (PCIe, NVL) come before the generic name. E.g. "NVIDIA H100 80GB HBM3" is the SXM part.
_DEVICE_PATTERNS: list[tuple[str, str]] = [
    (r"\bh100\b.*\bpcie\b", "H100 PCIe"),
    (r"\bh100\b.*\bnvl\b", "H100 NVL"),
    (r"\bh100\b", "H100 SXM"),
    (r"\bgh200\b", "GH200"),
    (r"\bh200\b.*\bnvl\b", "H200 NVL"),
    (r"\bh200\b", "H200"),
    (r"\bgb200\b", "GB200"),
    (r"\bb200\b", "B200"),
    (r"\ba100\b", "A100"),
    (r"\bv100-sxm2\b", "V100 SXM2"),
    (r"\bv100-pcie\b", "V100 PCIe"),
]

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "tensorfloat32": "tf32",
}


def device_key(device_name: str) -> str | None:
    """The PEAK_TFLOPS key of a ``torch.cuda.get_device_name()`` string, or None if unknown."""
    name = device_name.lower()
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, name):
            return key
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s (not TFLOP/s) of one device for a training dtype; None if not in the table.

    ``dtype`` accepts "bf16"/"bfloat16"/"torch.bfloat16", "fp16", "fp32", "tf32", "fp8".
    """
    key = device_key(device_name)
    if key is None:
        return None
    dt = str(dtype).lower().removeprefix("torch.")
    tflops = PEAK_TFLOPS[key].get(_DTYPE_ALIASES.get(dt, dt))
    return None if tflops is None else tflops * 1e12


WINDOW = 4  # GEMMs per timing window of measure_cpu_gemm_flops


def measure_cpu_gemm_flops(n: int = 512, seconds: float = 0.3, dtype: torch.dtype | None = None) -> float:
    """Measured FLOP/s of n x n GEMMs on this CPU: the MFU denominator where no datasheet applies.

    Runs with torch's current thread count (the caller sets it to what a rank uses); fp32 by default.
    A peak is what the core does when it runs: the rate of the fastest window of ``WINDOW`` GEMMs
    (a window in which another process held the core is slower; the mean would put that time in
    the denominator and an uncontended step could show an MFU above 1).
    """
    import torch

    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(0)  # its own: a measurement never moves training's RNG
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    with torch.no_grad():
        torch.matmul(a, b, out=out)  # warm-up: thread pool start and first-touch of the buffers
        ends = [time.perf_counter()]
        while ends[-1] - ends[0] < seconds or len(ends) <= WINDOW:
            torch.matmul(a, b, out=out)
            ends.append(time.perf_counter())
    return 2.0 * n**3 * WINDOW / fastest_window(ends, WINDOW)


def fastest_window(ends: list[float], window: int) -> float:
    """Shortest time any ``window`` consecutive operations took, from their end times (``ends[0]``:
    when the first started)."""
    return min(ends[i + window] - ends[i] for i in range(len(ends) - window))


def mfu(flops_per_step: float, step_seconds: float, num_devices: int, peak_per_device: float) -> float:
    """Model FLOPs utilization: achieved FLOP/s over the peak FLOP/s of all devices (0..1)."""
    if step_seconds <= 0 or num_devices < 1 or peak_per_device <= 0:
        raise ValueError(
            f"need step_seconds>0, num_devices>=1, peak_per_device>0; got "
            f"{step_seconds}, {num_devices}, {peak_per_device}"
        )
    return flops_per_step / (step_seconds * num_devices * peak_per_device)
