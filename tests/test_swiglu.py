"""SwiGLU (model.activation=swiglu, Llama's MLP): fc2(SiLU(x W_gate) * (x W_up)).

megatron-core computes it (gated_linear_unit); mega must hand every TP rank its share of the gate
and of the up rows from one full matrix, so TP=2 computes the model TP=1 does, and a TP=2
checkpoint loads at TP=1. Megatron runs in spawned gloo processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import free_port
from megatron_world import build, loss, start_world, stop_world, use_tp

from mega.config import from_dict

MODEL = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "ffn_hidden_size": 48,
    "seq_length": 16,
    "vocab_size": 128,
    "activation": "swiglu",
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
    results["gelu_loss"] = _loss(build(_config(1, activation="gelu")))
    mlp = tp1.decoder.layers[0].mlp
    with torch.no_grad():  # a non-zero bias, which the init sets to 0
        mlp.linear_fc1.bias.add_(
            0.1 * torch.randn(mlp.linear_fc1.bias.shape, generator=torch.Generator().manual_seed(3))
        )
    x = torch.randn(MODEL["seq_length"], MICRO_BATCH, MODEL["hidden_size"])
    y, bias = mlp(x)
    p = {n: t.detach().double() for n, t in mlp.named_parameters()}
    gate, up = (x.double() @ p["linear_fc1.weight"].T + p["linear_fc1.bias"]).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up) @ p["linear_fc2.weight"].T + p["linear_fc2.bias"]
    results["mlp_max_abs_error"] = ((y + bias).double() - want).abs().max().item()
    results["mlp_scale"] = want.abs().max().item()

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
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("swiglu")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return json.loads((out / "results.json").read_text())


def test_mlp_computes_swiglu(results):
    assert results["mlp_max_abs_error"] < 1e-5 * max(1.0, results["mlp_scale"])


def test_fc1_holds_gate_and_up(results):
    assert results["tp2_fc1_shape"] == [2 * MODEL["ffn_hidden_size"] // 2, MODEL["hidden_size"]]
    assert abs(results["tp1_loss"] - results["gelu_loss"]) > 1e-4  # the setting changes the model


def test_tp2_model_equals_tp1(results):
    assert results["tp2_loss"] == pytest.approx(results["tp1_loss"], rel=1e-5)


def test_tp2_checkpoint_loads_at_tp1(results):
    assert results["checkpoint_max_abs_diff"] == 0.0
