"""The parallel transformer block (model.block=parallel): y = x + Attn(LN x) + MLP(LN x).

It must compute that formula, do one TP reduction per layer instead of two, and stay a drop-in
megatron layer: same numbers at TP=1, TP=2 (+SP), PP/VPP and with full recompute; checkpoints
that reshard across TP. Megatron runs in spawned gloo processes (CPU patches stay out of pytest's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from comm_count import counting_communication
from helpers import tiny_run
from megatron_world import build, loss, perturb, spawn, start_world, stop_world, use_tp

from mega.config import ConfigError, compose, from_dict

# A small model whose every TP split is even: 2 layers, 4 heads of 8, ffn 128, seq 16.
MODEL = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 16,
    "vocab_size": 128,
    "block": "parallel",
}
MICRO_BATCH = 2


def _config(tp: int, seed: int = 1234, sp: bool = False, **model):
    dp = 2 // tp  # the workers' world has 2 processes
    return from_dict(
        {
            "model": {**MODEL, **model},
            "parallelism": {
                "tp": tp,
                "dp": dp,
                "pp": 1,
                "vpp": None,
                "sequence_parallel": sp,
                "micro_batch_size": MICRO_BATCH,
                "global_batch_size": MICRO_BATCH * dp,
            },
            "cluster": {"procs_per_node": 2},
            "train": {"seed": seed},
        }
    )


def _loss(model) -> float:
    return loss(model, MODEL["vocab_size"], MODEL["seq_length"], MICRO_BATCH)


# ---------------------------------------------------------------------------------------------
# Workers (spawned processes)


def _worker(rank: int, port: int, out_dir: str) -> None:
    """One 2-process gloo job (a process costs ~10 s to import megatron here): TP=2 checks, then
    the same processes regrouped as TP=1 x DP=2 for the reference checks."""
    start_world(rank, 2, port)
    use_tp(2)
    tp2 = _tp2_checks(out_dir)
    use_tp(1)
    tp1 = _tp1_checks(out_dir)
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps({"tp2": tp2, "tp1": tp1}))
    stop_world()


def _tp2_checks(out_dir: str) -> dict:
    """TP=2: collectives per decoder forward/backward for each block and SP setting; whole-model
    losses; a dist checkpoint of the parallel model for the TP=1 checks to load."""
    from megatron.core import dist_checkpointing

    from mega.checkpoint import SHARDING_METADATA

    results = {}
    for block in ("sequential", "parallel"):
        for sp in (False, True):
            model = build(_config(2, block=block, sp=sp))
            seq = MODEL["seq_length"] // (2 if sp else 1)  # the residual stream is split under SP
            hidden = torch.randn(seq, MICRO_BATCH, MODEL["hidden_size"], requires_grad=True)
            with counting_communication() as forward:
                out = model.decoder(hidden, attention_mask=None)
            with counting_communication() as backward:
                out.sum().backward()
            results[f"{block},sp={sp}"] = {
                "forward": dict(forward),
                "backward": dict(backward),
                "loss": _loss(model),
            }
    parallel = build(_config(2))
    Path(out_dir, "ckpt").mkdir(exist_ok=True)
    dist_checkpointing.save(parallel.sharded_state_dict(metadata=dict(SHARDING_METADATA)), out_dir + "/ckpt")
    return results


def _reference_layer(layer, x: torch.Tensor) -> torch.Tensor:
    """x + Attn(LN x) + MLP(LN x) from the layer's weights, by hand, in float64 (TP=1, MHA)."""
    p = {name: t.detach().double() for name, t in layer.named_parameters()}
    x = x.double()
    s, b, h = x.shape
    heads = layer.config.num_attention_heads
    d = h // heads
    ln = torch.nn.functional.layer_norm(
        x, (h,), p["input_layernorm.weight"], p["input_layernorm.bias"], eps=layer.config.layernorm_epsilon
    )
    # megatron's fused QKV weight holds, per head, [q | k | v] rows of d each
    qkv = ln @ p["self_attention.linear_qkv.weight"].T + p["self_attention.linear_qkv.bias"]
    q, k, v = qkv.view(s, b, heads, 3, d).unbind(3)
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bnij,jbnd->ibnd", scores.softmax(-1), v).reshape(s, b, h)
    attn = context @ p["self_attention.linear_proj.weight"].T + p["self_attention.linear_proj.bias"]
    fc1 = ln @ p["mlp.linear_fc1.weight"].T + p["mlp.linear_fc1.bias"]
    mlp = torch.nn.functional.gelu(fc1) @ p["mlp.linear_fc2.weight"].T + p["mlp.linear_fc2.bias"]
    return x + attn + mlp


def _tp1_checks(out_dir: str) -> dict:
    """TP=1 (x DP=2, both ranks alike): the layer against the hand formula; whole-model losses;
    the TP=2 checkpoint loaded."""
    from megatron.core import dist_checkpointing

    from mega.checkpoint import SHARDING_METADATA

    results = {}

    model = build(_config(1))
    layer = model.decoder.layers[0]
    perturb(layer)
    x = torch.randn(MODEL["seq_length"], MICRO_BATCH, MODEL["hidden_size"])
    y, _ = layer(x, attention_mask=None)
    results["layer_max_abs_error"] = (y.double() - _reference_layer(layer, x)).abs().max().item()
    results["layer_output_scale"] = y.abs().max().item()
    results["has_pre_mlp_layernorm"] = any("pre_mlp_layernorm" in n for n, _ in layer.named_parameters())

    results["loss"] = {block: _loss(build(_config(1, block=block))) for block in ("sequential", "parallel")}

    # Resharding round trip: the TP=2 parallel model (seed 1234) into a TP=1 one built from another
    # seed must give exactly a TP=1 model built from seed 1234.
    target = build(_config(1, seed=99))
    sharded = target.sharded_state_dict(metadata=dict(SHARDING_METADATA))
    state = dist_checkpointing.load(sharded, out_dir + "/ckpt")
    target.load_state_dict(state)
    want = dict(build(_config(1)).named_parameters())
    results["checkpoint_max_abs_diff"] = max(
        (p - want[n]).abs().max().item() for n, p in target.named_parameters()
    )
    sequential = build(_config(1, block="sequential"))
    results["parallel_keys"] = sorted(k for k in sharded if not k.endswith("_extra_state"))
    results["sequential_keys"] = sorted(
        k
        for k in sequential.sharded_state_dict(metadata=dict(SHARDING_METADATA))
        if not k.endswith("_extra_state")
    )
    return results


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory) -> dict:
    return spawn(_worker, 2, tmp_path_factory.mktemp("parallel-block"))


# ---------------------------------------------------------------------------------------------
# The layer


def test_layer_computes_the_parallel_formula(worker_results):
    r = worker_results["tp1"]
    assert not r["has_pre_mlp_layernorm"], "one LayerNorm feeds both branches"
    assert r["layer_max_abs_error"] < 1e-5 * max(1.0, r["layer_output_scale"]), r


def test_one_tp_reduction_per_layer(worker_results):
    """Forward of the 2-layer decoder at TP=2: the sequential block reduces after attention and
    after the MLP (2 per layer), the parallel block once (1 per layer); under sequence parallelism
    the reductions are reduce-scatters and no all-reduce is left."""
    layers = MODEL["num_layers"]
    counts = {k: v["forward"] for k, v in worker_results["tp2"].items()}
    assert counts["sequential,sp=False"].get("all_reduce") == 2 * layers, counts
    assert counts["parallel,sp=False"].get("all_reduce") == 1 * layers, counts
    assert counts["sequential,sp=True"].get("reduce_scatter") == 2 * layers, counts
    assert counts["parallel,sp=True"].get("reduce_scatter") == 1 * layers, counts
    assert "all_reduce" not in counts["sequential,sp=True"] and "all_reduce" not in counts["parallel,sp=True"]
    # backward: the reduction's transpose is free (identity) or an all-gather; the column-parallel
    # inputs' gradients are reduced as before, so the parallel block never does more.
    backward = {k: v["backward"] for k, v in worker_results["tp2"].items()}
    for sp in (False, True):
        seq, par = backward[f"sequential,sp={sp}"], backward[f"parallel,sp={sp}"]
        assert sum(par.values()) <= sum(seq.values()), backward


def test_tp2_model_equals_tp1(worker_results):
    tp1, tp2 = worker_results["tp1"]["loss"], worker_results["tp2"]
    for block in ("sequential", "parallel"):
        for sp in (False, True):
            assert tp2[f"{block},sp={sp}"]["loss"] == pytest.approx(tp1[block], rel=1e-5)
    assert abs(tp1["parallel"] - tp1["sequential"]) > 1e-4, "the two blocks are different models"


def test_dist_checkpoint_reshards_tp2_to_tp1(worker_results):
    r = worker_results["tp1"]
    assert r["checkpoint_max_abs_diff"] == 0.0
    # The parallel layer's keys are the sequential layer's minus the pre-MLP LayerNorm it drops.
    assert r["parallel_keys"] == [k for k in r["sequential_keys"] if "pre_mlp_layernorm" not in k]


def test_spec_guards_against_a_double_reduction_setup():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    from mega.layers import ParallelTransformerLayer, UnreducedRowParallelLinear, parallel_layer_spec

    spec = parallel_layer_spec(get_gpt_layer_local_spec())
    sub = spec.submodules
    assert spec.module is ParallelTransformerLayer
    assert sub.pre_mlp_layernorm is IdentityOp
    assert sub.self_attention.submodules.linear_proj is UnreducedRowParallelLinear
    assert sub.mlp.submodules.linear_fc2 is UnreducedRowParallelLinear
    assert issubclass(UnreducedRowParallelLinear, RowParallelLinear)
    # the sequential spec is left as it was
    assert get_gpt_layer_local_spec().submodules.mlp.submodules.linear_fc2 is RowParallelLinear


# ---------------------------------------------------------------------------------------------
# Configuration


def test_block_is_validated():
    assert (
        from_dict(
            {"model": {"block": "parallel"}, "parallelism": {"global_batch_size": 2, "micro_batch_size": 2}}
        ).model.block
        == "parallel"
    )
    with pytest.raises(ConfigError) as err:
        from_dict({"model": {"block": "gptj"}})
    assert err.value.key == "model.block"


@pytest.mark.parametrize(
    "preset, block, window, every",
    [
        ("megatron-baseline", "sequential", None, None),
        ("ptb", "parallel", None, None),
        ("ptb-swa", "parallel", 1024, 2),
        ("megascale", "parallel", 1024, 2),
    ],
)
def test_feature_presets(preset, block, window, every):
    m = compose([f"features={preset}"]).model
    assert (m.block, m.window_size, m.full_attention_every) == (block, window, every)
    assert m.name == "tiny", "a feature preset leaves the model size to the model group"


def test_baseline_is_the_default_and_presets_compose_with_any_size():
    cfg = compose([])
    assert (cfg.model.block, cfg.model.window_size, cfg.optimizer.name) == ("sequential", None, "adam")
    big = compose(["features=megascale", "model=gpt-175b"]).model
    assert (big.name, big.block, big.window_size) == ("gpt-175b", "parallel", 1024)


def test_an_explicit_optimizer_choice_beats_the_presets():
    from mega.config import CONF_DIR

    others = sorted(p.stem for p in (CONF_DIR / "optimizer").glob("*.yaml") if p.stem != "adam")
    if not others:
        pytest.fail("conf/optimizer offers only adam")
    for preset in ("megatron-baseline", "megascale"):
        assert compose([f"features={preset}", f"optimizer={others[0]}"]).optimizer.name == others[0]


# ---------------------------------------------------------------------------------------------
# Training: every layout reproduces one process. The model is the parallel block with sliding
# windows (16 of tiny's 64 tokens) and full attention on layers 2 and 4: a stage or virtual chunk
# that numbered its layers locally would pick other layers to window, and its grad norms would
# differ by ~1% (much more than the tolerance).


STEPS = 3


def _train(tmp_path, data_index, data_cache, overrides):
    extra = ["features=ptb-swa", "model.window_size=16", "checkpoint.interval=0", *overrides]
    return tiny_run(tmp_path, data_index, data_cache, extra, steps=STEPS).metrics


@pytest.fixture(scope="module")
def parallel_reference(tmp_path_factory, data_index, data_cache):
    return _train(tmp_path_factory.mktemp("ptb-swa-single"), data_index, data_cache, ["parallelism=single"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallelism=tp2", "parallelism.sequence_parallel=true"],
        ["parallelism=pp2-vpp2", "model.recompute=full"],
    ],
    ids=["tp2-sp", "pp2-vpp2-recompute"],
)
def test_parallel_block_training_matches_single_process(
    overrides, tmp_path, data_index, data_cache, parallel_reference
):
    metrics = _train(tmp_path, data_index, data_cache, overrides)
    assert [m["step"] for m in metrics] == [r["step"] for r in parallel_reference]
    for got, want in zip(metrics, parallel_reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-5), (got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (got, want)
