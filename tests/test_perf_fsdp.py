"""Fully sharded data parallelism in the performance model (parallelism.fsdp: megatron-core's
Megatron FSDP, planning only): its memory and its per-unit collectives against hand computations."""

from __future__ import annotations

import pytest
from helpers import predicted

from mega.config import ConfigError, compose, validate
from mega.perf.configs import for_planning
from mega.perf.memory import fsdp_units, layer_params, optimizer_bytes_per_param, stage_params
from mega.perf.planner import evaluate
from mega.perf.step import embedding_unit, layer_unit

# Llama 3 70B on 64 H100s, data parallelism only, micro-batch 1: 2 microbatches a step.
LAYOUT = [
    "model=llama3-70b",
    "cluster=h100-8x",
    "cluster.nodes=8",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "parallelism.vpp=null",
    "parallelism.dp=64",
    "parallelism.global_batch_size=128",
    "parallelism.micro_batch_size=1",
    "parallelism.sequence_parallel=false",
    "model.fused_ops=true",
    "model.recompute=full",
    "train.precision=bf16",
]


def _predicted(composer, *extra):
    return predicted(composer, [*LAYOUT, *extra])


def _ring(hw, kind: str, nbytes: float, n: int) -> float:
    """A ring all-gather or reduce-scatter over n ranks: n - 1 steps of 1/n of the tensor each."""
    link, bw = hw.link(n, 1)
    assert kind in ("all_gather", "reduce_scatter")
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / bw


def test_units_are_the_embedding_each_layer_and_the_output_layer(composer):
    _, cfg, _ = _predicted(composer, "parallelism.fsdp=true")
    m, p = cfg.model, cfg.parallelism
    units = fsdp_units(m, p)
    assert len(units) == m.num_layers + 2 and units[1:-1] == [layer_params(m, 1)] * m.num_layers
    assert units[0] == m.padded_vocab_size * m.hidden_size  # Llama: rotary, no position table
    assert units[-1] == m.padded_vocab_size * m.hidden_size + m.hidden_size  # untied, + final RMSNorm
    assert sum(units) == pytest.approx(stage_params(m, p)[0])


def test_memory_shards_weights_gradients_and_optimizer_over_dp(composer):
    """Each rank keeps 1/dp of the weights (16-bit), main gradients (fp32) and Adam state, plus the
    unit in use and the one prefetched whole, and one unit's unsharded gradient."""
    (fsdp, cfg, _), (ddp, _, _) = (_predicted(composer, f"parallelism.fsdp={on}") for on in ("true", "false"))
    m, p = cfg.model, cfg.parallelism
    n, unit, dp = stage_params(m, p)[0], max(fsdp_units(m, p)), p.dp
    assert fsdp.memory.weights == pytest.approx(n * 2 / dp + 2 * unit * 2)
    assert fsdp.memory.gradients == pytest.approx(n * 4 / dp + unit * 4)
    assert fsdp.memory.optimizer == pytest.approx(n * optimizer_bytes_per_param("adam", 2) / dp)
    assert ddp.memory.weights == pytest.approx(n * 2) and ddp.memory.gradients == pytest.approx(n * 4)
    assert fsdp.memory.activations == ddp.memory.activations
    assert fsdp.fits and not ddp.fits


def test_collectives_per_microbatch_and_what_stays_exposed(composer):
    """Per microbatch: every unit gathered twice (the output layer once: its backward follows its
    forward) and its gradient reduce-scattered, ring collectives over the 64 ranks. A 70B layer's
    compute hides its neighbours' collectives; the embedding's lookup hides nothing: what waits is
    each microbatch's first gather, the first layer's gather (prefetched under the lookup) and its
    reduce-scatter (under the lookup's backward), and once a step the embedding's reduce-scatter
    after the last backward."""
    pr, cfg, hw = _predicted(composer, "parallelism.fsdp=true")
    m, p = cfg.model, cfg.parallelism
    units, mb = fsdp_units(m, p), p.num_microbatches
    ag = [_ring(hw, "all_gather", u * 2, p.dp) for u in units]
    rs = [_ring(hw, "reduce_scatter", u * 4, p.dp) for u in units]
    term = pr.breakdown()["fsdp_comm"]
    assert term["total_s"] == pytest.approx(mb * (2 * sum(ag) - ag[-1] + sum(rs)))
    layer, emb = layer_unit(cfg, hw, 2), embedding_unit(cfg, hw, 2)
    assert layer.forward.total > max(ag) and layer.backward.total > max(ag) + max(rs)
    assert emb.forward.total < ag[1] and emb.backward.total < rs[1]
    lookup = ag[1] - emb.forward.total + rs[1] - emb.backward.total
    assert term["seconds"] == pytest.approx(mb * (ag[0] + lookup) + rs[0])
    assert "dp_grad_reduce" not in pr.breakdown() and "dp_param_gather" not in pr.breakdown()


def test_a_small_microbatch_leaves_the_gathers_exposed(composer):
    """With little compute per unit (a short sequence) the gathers outgrow the layers they hide
    under: more than the first gather waits."""
    pr, cfg, hw = _predicted(composer, "parallelism.fsdp=true", "model.seq_length=128")
    m, p = cfg.model, cfg.parallelism
    first = _ring(hw, "all_gather", fsdp_units(m, p)[0] * 2, p.dp)
    assert pr.breakdown()["fsdp_comm"]["seconds"] > 2 * p.num_microbatches * first


def test_the_planner_fits_with_fsdp_what_ddp_cannot():
    open_knobs = [k for k in LAYOUT if not k.startswith(("model.recompute", "parallelism.micro_batch"))]
    fsdp = evaluate(for_planning([*open_knobs, "parallelism.fsdp=true"]))
    ddp = evaluate(for_planning(open_knobs))
    assert fsdp.prediction.fits and not ddp.prediction.fits
    assert fsdp.to_dict()["breakdown"]["fsdp_comm"]["seconds"] > 0


def test_fsdp_is_refused_with_a_pipeline_and_in_training():
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=tp2-pp2-dp2", "parallelism.fsdp=true"])
    assert err.value.key == "parallelism.fsdp" and "pp=1" in str(err.value)
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=dp2", "parallelism.fsdp=true"])
    assert err.value.key == "parallelism.fsdp" and "planning setting" in str(err.value)
    validate(compose(["parallelism=dp2", "parallelism.fsdp=true"], validate_config=False), planning=True)
