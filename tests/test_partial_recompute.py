"""Partial full recomputation (model.recompute_num_layers: megatron-core's block method): training
recomputes exactly the first N layers of each model chunk, and the performance model charges the
memory and the forward work of that split, checked against hand computations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import predicted
from megatron_world import build, spawn, start_world, stop_world, use_tp

from mega.config import ConfigError, compose, from_dict
from mega.flops import model_flops_per_step, model_flops_per_token
from mega.perf.configs import for_planning
from mega.perf.memory import activation_bytes_per_layer, in_flight
from mega.perf.planner import evaluate, hardware_for
from mega.perf.step import hardware_flops_per_step, layer_unit, memory_of

# --- training: which layers megatron-core recomputes ------------------------------------------

MODEL = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 128}


def _config(recompute, recompute_num_layers=None):
    return from_dict(
        {
            "model": {**MODEL, "recompute": recompute, "recompute_num_layers": recompute_num_layers},
            "parallelism": {"micro_batch_size": 2, "global_batch_size": 2},
        }
    )


def _step(model) -> tuple[list[int], float, dict[str, torch.Tensor]]:
    """One forward and backward of a fixed batch: forward calls per decoder layer, the loss, the
    gradients."""
    calls = [0] * len(model.decoder.layers)
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_length"]), generator=gen)
    positions = torch.arange(MODEL["seq_length"])[None].expand_as(tokens)
    loss = model(tokens, positions, None, labels=tokens).mean()
    loss.backward()
    return calls, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    start_world(rank, 1, port)
    use_tp(1)
    _, want_loss, want_grads = _step(build(_config(None)))
    results = {}
    for name, cfg in [
        ("block1", _config("full", 1)),
        ("block3", _config("full", 3)),
        ("uniform", _config("full")),
    ]:
        calls, got_loss, grads = _step(build(cfg))
        results[name] = {
            "calls": calls,
            "loss_diff": abs(got_loss - want_loss),
            "grad_diff": max((grads[n] - g).abs().max().item() for n, g in want_grads.items()),
        }
    Path(out_dir, "results.json").write_text(json.dumps(results))
    stop_world()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    return spawn(_worker, 1, tmp_path_factory.mktemp("partial-recompute"))


@pytest.mark.parametrize(
    "name, calls", [("block1", [2, 1, 1, 1]), ("block3", [2, 2, 2, 1]), ("uniform", [2, 2, 2, 2])]
)
def test_training_recomputes_the_first_n_layers_and_computes_the_same_gradients(trained, name, calls):
    """A recomputed layer runs its forward twice in one step (again inside the backward); the
    gradients are those of no recomputation."""
    r = trained[name]
    assert r["calls"] == calls
    assert r["loss_diff"] == 0.0 and r["grad_diff"] < 1e-6, r


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["model.recompute_num_layers=1"], "needs model.recompute=full"),
        (["model.recompute=selective", "model.recompute_num_layers=1"], "needs model.recompute=full"),
        (["model.recompute=full", "model.recompute_num_layers=0"], "must be >= 1"),
        (
            ["parallelism=tp2-pp2-vpp2-dp2", "model.recompute=full", "model.recompute_num_layers=2"],
            "more than the 1 layers of a model chunk",
        ),
    ],
)
def test_bad_recompute_num_layers_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert err.value.key == "model.recompute_num_layers" and says in str(err.value)


def test_chunks_and_recomputed_layers_of_llama3_405b_split():
    """Llama 3.1 405B's 126 layers in 128 slots over PP8 x VP8 (the embedding and the loss each
    take a slot): two layers a chunk, one in the first stage's first chunk and the last stage's
    last chunk."""
    p = compose(
        [
            "model=llama3-405b",
            "cluster=h100-8x",
            "cluster.nodes=64",
            "parallelism.tp=8",
            "parallelism.pp=8",
            "parallelism.vpp=8",
            "parallelism.dp=1",
            "parallelism.global_batch_size=64",
            "parallelism.micro_batch_size=1",
            "parallelism.account_for_embedding_in_pipeline_split=true",
            "parallelism.account_for_loss_in_pipeline_split=true",
        ],
        validate_config=False,
    ).parallelism
    chunks = p.chunk_layers(126)
    assert chunks[0] == [1] + [2] * 7 and chunks[-1] == [2] * 7 + [1] and chunks[3] == [2] * 8
    assert [sum(c) for c in chunks] == p.stage_layers(126)
    assert p.recomputed_layers(126, 1) == [8] * 8
    assert p.recomputed_layers(126, 2) == [15] + [16] * 6 + [15]
    assert p.recomputed_layers(126, None) == p.stage_layers(126)


# --- the performance model --------------------------------------------------------------------

# GPT-175B (96 layers, with dropout as Korthikanti et al.'s) on TP8 x PP4 (24 layers a stage),
# no sequence parallelism, micro-batch 1.
LAYOUT = [
    "model=gpt-175b",
    "model.hidden_dropout=0.1",
    "model.attention_dropout=0.1",
    "cluster=a100-8x",
    "cluster.nodes=8",
    "parallelism.tp=8",
    "parallelism.pp=4",
    "parallelism.vpp=null",
    "parallelism.dp=2",
    "parallelism.global_batch_size=64",
    "parallelism.micro_batch_size=1",
    "parallelism.sequence_parallel=false",
    "train.precision=bf16",
]


def _predicted(composer, *extra):
    return predicted(composer, [*LAYOUT, *extra])


def test_memory_keeps_the_inputs_of_the_recomputed_layers_and_everything_of_the_rest(composer):
    """First stage, 1F1B: pp microbatches in flight, each holding the inputs (2sbh, as full
    recomputation keeps) of the N recomputed layers and the whole activations of the other 24 - N
    (Korthikanti et al.'s sbh(10 + 24/t + 5as/(ht)) without sequence parallelism)."""
    (none, cfg, hw), (uniform, _, _), (block, _, _) = (
        _predicted(composer, *r)
        for r in (
            ["model.recompute=null"],
            ["model.recompute=full"],
            ["model.recompute=full", "model.recompute_num_layers=10"],
        )
    )
    m, p = cfg.model, cfg.parallelism
    s, b, h, a, t = m.seq_length, 1, m.hidden_size, m.num_attention_heads, p.tp
    whole = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    kept_input = 2 * s * b * h
    flight = in_flight(p.pp, 1, p.num_microbatches, 0)
    assert flight == p.pp
    assert whole == pytest.approx(activation_bytes_per_layer(m, 1, t, False, None, 2, flash=False))
    assert none.memory.activations == pytest.approx(flight * 24 * whole)
    assert uniform.memory.activations == pytest.approx(flight * 24 * kept_input)
    assert block.memory.activations == pytest.approx(flight * (10 * kept_input + 14 * whole))
    assert block.memory.temporary == uniform.memory.temporary > 0  # the layer being recomputed


def test_recompute_term_and_hfu_count_only_the_recomputed_layers(composer):
    (uniform, cfg_u, hw), (block, cfg_b, _), (none, _, _) = (
        _predicted(composer, *r)
        for r in (
            ["model.recompute=full"],
            ["model.recompute=full", "model.recompute_num_layers=10"],
            ["model.recompute=null"],
        )
    )
    mb, forward = cfg_u.parallelism.num_microbatches, layer_unit(cfg_u, hw, 2).forward.total
    assert uniform.breakdown()["recompute"]["seconds"] == pytest.approx(mb * 24 * forward)
    assert block.breakdown()["recompute"]["seconds"] == pytest.approx(mb * 10 * forward)
    assert "first 10 layers of each chunk" in block.breakdown()["recompute"]["what"]
    assert none.step_s < block.step_s < uniform.step_s
    # HFU's numerator: the model's FLOPs and 40 of the 96 layers' forward once more
    m, tokens = cfg_b.model, cfg_b.parallelism.global_batch_size * cfg_b.model.seq_length
    model = model_flops_per_step(cfg_b)
    every = model_flops_per_token(m, recompute=True) * tokens
    assert hardware_flops_per_step(cfg_b) == pytest.approx(model + (every - model) * 40 / 96)
    assert hardware_flops_per_step(cfg_u) == pytest.approx(every)


def test_the_planner_recomputes_the_fewest_layers_that_fit():
    """Recomputation left open, where neither none nor selective fits: full recomputation of the
    fewest layers a chunk that fit, faster than every layer; one fewer does not fit."""
    plan = for_planning(LAYOUT[:-1])  # precision open too: bf16 on a GPU cluster
    best = evaluate(plan)
    cfg, hw = best.cfg, hardware_for(best.cfg)[0]
    n = cfg.model.recompute_num_layers
    assert cfg.model.recompute == "full" and n is not None and 1 <= n < 24
    assert {"recompute", "recompute_num_layers"} <= set(best.chosen) and best.knobs[
        "recompute_num_layers"
    ] == n
    assert best.prediction.fits
    for other in ("null", "selective"):
        assert not evaluate(for_planning([*LAYOUT, f"model.recompute={other}"])).prediction.fits
    fewer = compose(
        [*LAYOUT, "model.recompute=full", f"model.recompute_num_layers={n - 1}"], validate_config=False
    )
    assert memory_of(fewer, hw).total > hw.memory_bytes
    uniform = evaluate(for_planning([*LAYOUT, "model.recompute=full"]))
    assert uniform.cfg.model.recompute_num_layers is None  # a given full recomputation stays whole
    assert "recompute_num_layers" not in uniform.chosen
    assert best.prediction.mfu > uniform.prediction.mfu
