"""Llama's layer pieces: SwiGLU (model.activation=swiglu), RMSNorm (model.normalization=RMSNorm)
and rotary position embeddings (model.position_embedding=rope); Nemotron-4's squared ReLU
(model.activation=squared_relu).

megatron-core computes them; mega must build them from its config and hand every TP rank its share
of SwiGLU's gate and up rows from one full matrix, so TP=2 computes the model TP=1 does and a TP=2
checkpoint loads at TP=1. A layer is checked against a float64 formula written here. Megatron runs
in spawned gloo processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import assert_same_curve, tiny_run
from megatron_world import build, loss, perturb, spawn, start_world, stop_world, use_tp

from mega.config import from_dict

MODEL = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "ffn_hidden_size": 48,
    "seq_length": 16,
    "vocab_size": 128,
    "activation": "swiglu",
    "normalization": "RMSNorm",
    "position_embedding": "rope",
    "rotary_base": 500,
}
MICRO_BATCH = 2


def _config(tp: int, seed: int = 1234, **model):
    dp = 2 // tp
    return from_dict(
        {
            "model": {**MODEL, **model},
            "parallelism": {"tp": tp, "dp": dp, "micro_batch_size": MICRO_BATCH, "global_batch_size": 2 * dp},
            "cluster": {"procs_per_node": 2},
            "train": {"seed": seed},
        }
    )


def _loss(model) -> float:
    return loss(model, MODEL["vocab_size"], MODEL["seq_length"], MICRO_BATCH)


def _rope(t: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of [s, b, heads, d] by position, the half-split convention (GPT-NeoX, Llama)."""
    s, d = t.shape[0], t.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    first, second = t.chunk(2, dim=-1)
    return t * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


def _reference_layer(layer, x: torch.Tensor) -> torch.Tensor:
    """x + Attn(RMSNorm x), then + SwiGLU MLP(RMSNorm ...), from the layer's weights, in float64."""
    p = {name: t.detach().double() for name, t in layer.named_parameters()}
    x = x.double()
    s, b, h = x.shape
    heads, eps = MODEL["num_attention_heads"], layer.config.layernorm_epsilon
    d = h // heads

    def rms(v, weight):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    # megatron's fused QKV weight holds, per head, [q | k | v] rows of d each
    qkv = rms(x, p["input_layernorm.weight"]) @ p["self_attention.linear_qkv.weight"].T
    q, k, v = (qkv + p["self_attention.linear_qkv.bias"]).view(s, b, heads, 3, d).unbind(3)
    q, k = _rope(q, MODEL["rotary_base"]), _rope(k, MODEL["rotary_base"])
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bnij,jbnd->ibnd", scores.softmax(-1), v).reshape(s, b, h)
    x = x + context @ p["self_attention.linear_proj.weight"].T + p["self_attention.linear_proj.bias"]
    fc1 = rms(x, p["pre_mlp_layernorm.weight"]) @ p["mlp.linear_fc1.weight"].T + p["mlp.linear_fc1.bias"]
    gate, up = fc1.chunk(2, dim=-1)
    return x + (torch.nn.functional.silu(gate) * up) @ p["mlp.linear_fc2.weight"].T + p["mlp.linear_fc2.bias"]


def _saved_bytes(module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for ``module``'s backward, each storage once, less its
    parameters and its input (counted elsewhere by the memory model)."""
    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    kept = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(kept.values())


def _worker(rank: int, port: int, out_dir: str) -> None:
    from megatron.core import dist_checkpointing

    from mega.checkpoint import SHARDING_METADATA

    start_world(rank, 2, port)
    use_tp(2)
    tp2 = build(_config(2))
    results = {
        "tp2_loss": _loss(tp2),
        "tp2_fc1_shape": list(tp2.decoder.layers[0].mlp.linear_fc1.weight.shape),
    }
    Path(out_dir, "ckpt").mkdir(exist_ok=True)
    dist_checkpointing.save(tp2.sharded_state_dict(metadata=dict(SHARDING_METADATA)), out_dir + "/ckpt")

    use_tp(1)
    tp1 = build(_config(1))
    results["tp1_loss"] = _loss(tp1)
    results["other_losses"] = {
        key: _loss(build(_config(1, **{key: value})))
        for key, value in [
            ("activation", "gelu"),
            ("normalization", "LayerNorm"),
            ("position_embedding", "learned_absolute"),
        ]
    }
    results["parameter_names"] = sorted(n for n, _ in tp1.named_parameters())
    x = torch.randn(MODEL["seq_length"], MICRO_BATCH, MODEL["hidden_size"])
    results["mlp_saved_bytes"] = {
        act: _saved_bytes(build(_config(1, activation=act)).decoder.layers[0].mlp, x)
        for act in ("gelu", "swiglu", "squared_relu")
    }
    fused = build(_config(1, activation="swiglu", fused_ops=True)).decoder.layers[0].mlp
    results["mlp_saved_bytes"]["swiglu_fused"] = _saved_bytes(fused, x)
    mlp = build(_config(1, activation="squared_relu")).decoder.layers[0].mlp
    perturb(mlp)
    p = {n: t.detach().double() for n, t in mlp.named_parameters()}
    want = torch.relu(x.double() @ p["linear_fc1.weight"].T + p["linear_fc1.bias"]).pow(2)
    want = want @ p["linear_fc2.weight"].T + p["linear_fc2.bias"]
    y, bias = mlp(x)
    results["squared_relu_max_abs_error"] = ((y + bias).double() - want).abs().max().item()
    results["squared_relu_scale"] = want.abs().max().item()

    layer = tp1.decoder.layers[0]
    perturb(layer)
    x = torch.randn(MODEL["seq_length"], MICRO_BATCH, MODEL["hidden_size"])
    y, _ = layer(x, attention_mask=None, rotary_pos_emb=tp1.rotary_pos_emb(MODEL["seq_length"]))
    want = _reference_layer(layer, x)
    results["layer_max_abs_error"] = (y.double() - want).abs().max().item()
    results["layer_scale"] = want.abs().max().item()

    target = build(_config(1, seed=99))
    state = dist_checkpointing.load(
        target.sharded_state_dict(metadata=dict(SHARDING_METADATA)), out_dir + "/ckpt"
    )
    target.load_state_dict(state)
    fresh = dict(build(_config(1)).named_parameters())
    results["checkpoint_max_abs_diff"] = max(
        (p - fresh[n]).abs().max().item() for n, p in target.named_parameters()
    )
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    stop_world()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return spawn(_worker, 2, tmp_path_factory.mktemp("llama-layers"))


def test_layer_computes_rmsnorm_rope_and_swiglu(results):
    assert results["layer_max_abs_error"] < 1e-5 * max(1.0, results["layer_scale"])


def test_squared_relu_mlp_computes_its_formula(results):
    assert results["squared_relu_max_abs_error"] < 1e-5 * max(1.0, results["squared_relu_scale"])


def test_each_setting_changes_the_model(results):
    for key, other in results["other_losses"].items():
        assert abs(other - results["tp1_loss"]) > 1e-4, key


def test_parameters_are_llamas(results):
    names = results["parameter_names"]
    assert not any("position_embeddings" in n for n in names)  # RoPE has no weights
    assert not any("layernorm.bias" in n or "final_layernorm.bias" in n for n in names)  # RMSNorm: no bias
    assert results["tp2_fc1_shape"] == [
        2 * MODEL["ffn_hidden_size"] // 2,
        MODEL["hidden_size"],
    ]  # gate and up


def test_memory_model_counts_what_swiglu_keeps_for_its_backward(results):
    """The activation memory model against autograd's saved tensors of megatron's unfused MLP
    (fp32): SwiGLU keeps fc1's 2 ffn output, the product's factors SiLU(gate) and up + 0 (megatron's
    glu_linear_offset) and the product (fc2's input), GeLU its ffn input and output; the rest of
    the layer is the same in both. megatron's fused bias-SwiGLU keeps fc1's output alone."""
    from mega.perf.memory import activation_bytes_per_layer

    model = _config(1).model
    predicted = {
        key: activation_bytes_per_layer(
            dataclasses.replace(model, activation=act, fused_ops=fused), MICRO_BATCH, 1, False, None, 4, False
        )
        for key, act, fused in [
            ("gelu", "gelu", False),
            ("swiglu", "swiglu", False),
            ("swiglu_fused", "swiglu", True),
        ]
    }
    saved = results["mlp_saved_bytes"]
    assert saved["squared_relu"] == saved["gelu"]  # ReLU's output and its square; GeLU's input and output
    assert saved["swiglu"] == 4 * MICRO_BATCH * MODEL["seq_length"] * 5 * MODEL["ffn_hidden_size"]
    assert saved["swiglu"] - saved["gelu"] == predicted["swiglu"] - predicted["gelu"]
    assert saved["swiglu_fused"] == 4 * MICRO_BATCH * MODEL["seq_length"] * 3 * MODEL["ffn_hidden_size"]
    assert saved["swiglu_fused"] - saved["gelu"] == predicted["swiglu_fused"] - predicted["gelu"]


def test_tp2_model_equals_tp1(results):
    assert results["tp2_loss"] == pytest.approx(results["tp1_loss"], rel=1e-5)


def test_tp2_checkpoint_loads_at_tp1(results):
    assert results["checkpoint_max_abs_diff"] == 0.0


@pytest.mark.slow
def test_llama_training_in_every_parallel_dimension_matches_one_process(tmp_path, data_index, data_cache):
    """The tiny model with Llama's layer trained by 8 gloo ranks (TP2 with SP x PP2 with 2 virtual
    stages x DP2) follows the loss, gradient-norm and held-out curve of one process."""
    llama = [
        "model.activation=swiglu",
        "model.normalization=RMSNorm",
        "model.position_embedding=rope",
        "checkpoint.interval=0",
    ]
    one = tiny_run(tmp_path / "one", data_index, data_cache, llama, steps=4)
    layout = ["parallelism=tp2-pp2-vpp2-dp2", "parallelism.sequence_parallel=true"]
    eight = tiny_run(tmp_path / "eight", data_index, data_cache, [*llama, *layout], steps=4)
    assert eight.attempts == 1 and eight.init["world_size"] == 8
    assert_same_curve(eight.metrics, one.metrics, 2e-5, grad_norm_rtol=1e-4, val_loss=True)
