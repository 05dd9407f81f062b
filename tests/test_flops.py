"""mega.flops: the model-FLOPs formula, the peak table and the MFU arithmetic."""

import dataclasses
import math
import time

import pytest
import torch  # noqa: F401  mega.flops imports torch only when it times a GEMM: pay the import here

from mega.config import ModelConfig, compose
from mega.flops import measure_cpu_gemm_flops, mfu, model_flops_per_step, model_flops_per_token, peak_flops


@pytest.fixture
def small_gqa_model() -> ModelConfig:
    # 2 heads sharing 1 key/value group (kv = 4), an explicit ffn, and a vocabulary that gets padded
    return ModelConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        ffn_hidden_size=16,
        seq_length=4,
        vocab_size=100,
        make_vocab_size_divisible_by=32,
    )


def test_formula_matches_a_hand_count(small_gqa_model):
    qkv = 2 * 8 * (8 + 2 * 4)  # 256
    attention = 2 * 2 * 4 * 8  # 128: scores and values over all 4 positions
    projection = 2 * 8 * 8  # 128
    mlp = 2 * 2 * 8 * 16  # 512
    layers = 2 * (qkv + attention + projection + mlp)  # 2048
    logits = 2 * 8 * 128  # 2048: the padded vocabulary, 100 -> 128
    assert model_flops_per_token(small_gqa_model) == 3 * (layers + logits) == 12288
    # full recompute runs the layers' forward again, not the logits
    assert model_flops_per_token(small_gqa_model, recompute=True) == 12288 + layers


def test_swiglu_counts_three_mlp_matrices(small_gqa_model):
    """SwiGLU's gate and up projections (h -> ffn each) and down projection (ffn -> h)."""
    gelu = model_flops_per_token(small_gqa_model)
    swiglu = model_flops_per_token(dataclasses.replace(small_gqa_model, activation="swiglu"))
    # one more h x ffn matmul per layer: 2 * 8 * 16 forward, 2 layers, x3 for the backward
    assert swiglu - gelu == 3 * 2 * (2 * 8 * 16)


@pytest.mark.parametrize(
    "preset, layers, released",
    [
        ("llama3-8b", 32, 8_030_261_248),
        ("llama3-70b", 80, 70_553_706_496),
        ("llama3-405b", 126, 405_853_388_800),
    ],
)
def test_llama3_presets_have_the_released_parameter_counts(preset, layers, released):
    """Llama 3's released weights (Llama Team 2024, Table 3: SwiGLU, GQA with 8 KV heads, RMSNorm,
    RoPE, untied 128,256-token embeddings) against the memory model's count, less the linear biases
    mega's layers carry and Llama's do not (QKV, projection, fc1 and fc2: h + 2 kv + h + 2 ffn + h)."""
    from mega.perf.memory import model_params

    m = compose([f"model={preset}", f"model.num_layers={layers}"]).model
    kv = m.hidden_size * m.num_query_groups // m.num_attention_heads
    biases = layers * (3 * m.hidden_size + 2 * kv + 2 * m.ffn)
    assert model_params(m) - biases == released
    assert model_params(dataclasses.replace(m, activation="gelu")) < 0.8 * model_params(m)


def test_sliding_window_counts_only_the_window(small_gqa_model):
    full = model_flops_per_token(small_gqa_model)
    # window 1: each query sees 2 keys instead of 4, in both layers, forward and backward
    assert model_flops_per_token(small_gqa_model, window=1) == full - 3 * 2 * (2 * 2 * (4 - 2) * 8)
    assert model_flops_per_token(small_gqa_model, window=100) == full


def test_reduces_to_megatron_72_bslh2_for_gpt_175b():
    cfg = compose(["model=gpt-175b"])
    B, s = cfg.parallelism.global_batch_size, cfg.model.seq_length
    L, h, V = cfg.model.num_layers, cfg.model.hidden_size, cfg.model.padded_vocab_size
    assert (L, h, s, V) == (96, 12288, 2048, 64000)
    megatron = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert math.isclose(model_flops_per_step(cfg), megatron, rel_tol=1e-12)
    # Megatron's variant with full recompute (Narayanan et al. 2021, eq. 3)
    with_recompute = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    per_step_recompute = model_flops_per_token(cfg.model, recompute=True) * B * s
    assert math.isclose(per_step_recompute, with_recompute, rel_tol=1e-12)


@pytest.mark.parametrize(
    "device_name, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "fp32", 494.7),  # TF32 tensor cores
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA GH200 480GB", "bf16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", 156.0),
        ("NVIDIA A100 80GB PCIe", "torch.bfloat16", 312.0),
        ("NVIDIA A100-PCIE-40GB", "float16", 312.0),
        ("Tesla V100-SXM2-32GB", "fp16", 125.0),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA B200", "fp8", 4500.0),
        ("NVIDIA GB200", "bf16", 2500.0),
    ],
)
def test_peak_lookup_by_device_name(device_name, dtype, tflops):
    assert peak_flops(device_name, dtype) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(
    "device_name, dtype",
    [
        ("Tesla V100-SXM2-16GB", "bf16"),  # no bf16 on Volta
        ("NVIDIA GeForce RTX 4090", "bf16"),  # not in the table
        ("cpu", "fp32"),
        ("NVIDIA H100 80GB HBM3", "int4"),
    ],
)
def test_peak_lookup_unknown_is_none(device_name, dtype):
    assert peak_flops(device_name, dtype) is None


def test_cpu_gemm_measurement_is_plausible():
    start = time.perf_counter()
    flops = measure_cpu_gemm_flops(n=128, seconds=0.05)
    elapsed = time.perf_counter() - start
    assert 1e8 < flops < 1e13  # between 0.1 GFLOP/s and 10 TFLOP/s
    assert 0.05 <= elapsed < 2.0  # runs for about the time asked


def test_the_peak_is_the_fastest_window_not_the_mean():
    from mega.flops import fastest_window

    # eight 1 s operations, one of them preempted for 10 s: the mean would say 2.25 s each
    ends = [0.0, 1, 2, 3, 13, 14, 15, 16, 17]
    assert fastest_window(ends, 4) == 4.0
    assert fastest_window(ends, 8) == 17.0


def test_mfu_arithmetic():
    # 1 PFLOP per step in 2 s on 4 devices of 250 TFLOP/s: 500 of 1000 TFLOP/s
    assert mfu(1e15, 2.0, 4, 250e12) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mfu(1e15, 0.0, 4, 250e12)
