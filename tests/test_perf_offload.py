"""Activation offloading in the performance model (model.offload_layers: megatron-core's
cpu_offloading_num_layers, planning only): the memory it frees and the copies it exposes, against
hand computations from the layer's activation bytes and the host link's bandwidth."""

from __future__ import annotations

import pytest
from helpers import predicted

from mega.config import ConfigError, compose, validate
from mega.perf import published
from mega.perf.hardware import HOST_LINK_EFFICIENCY
from mega.perf.step import MEGA, layer_unit

# GPT 13B on one node of 8 H100s, data parallelism only, micro-batch 1: 2 microbatches a step.
LAYOUT = [
    "model=gpt-13b",
    "cluster=h100-8x",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "parallelism.vpp=null",
    "parallelism.dp=8",
    "parallelism.global_batch_size=16",
    "parallelism.micro_batch_size=1",
    "parallelism.sequence_parallel=false",
    "model.fused_ops=true",
    "model.recompute=null",
    "train.precision=bf16",
]


def _predicted(composer, *extra):
    return predicted(composer, [*LAYOUT, *extra])


def test_memory_keeps_one_offloaded_layer_in_transit(composer):
    """N of the L layers offloaded: the device keeps the other L - N layers' activations and one
    offloaded layer's (being copied out, or in for its backward)."""
    none, cfg, _ = _predicted(composer)
    layers = cfg.model.num_layers
    for n in (1, 10, layers - 1):
        offloaded, _, _ = _predicted(composer, f"model.offload_layers={n}")
        assert offloaded.memory.activations == pytest.approx(
            none.memory.activations * (layers - n + 1) / layers
        )
        assert offloaded.memory.weights == none.memory.weights


@pytest.mark.parametrize("gb_per_s", [1.0, 1000.0])
def test_copies_hide_under_the_next_layer_or_show_beyond_it(composer, gb_per_s):
    """Each offloaded layer's activations go out under the next layer's forward and come back under
    the backward of the layer after it: exposed is each copy's time beyond that compute, per layer,
    direction and microbatch; the term's total is every copy's time."""
    n = 10
    link = f"cluster.host_link_gb_per_s={gb_per_s}"
    none, cfg, hw = _predicted(composer, link)
    offloaded, _, _ = _predicted(composer, link, f"model.offload_layers={n}")
    copy = none.memory.activations / cfg.model.num_layers / (gb_per_s * 1e9 * HOST_LINK_EFFICIENCY)
    layer = layer_unit(cfg, hw, 2, MEGA)
    mb = cfg.parallelism.num_microbatches
    exposed = mb * n * (max(0.0, copy - layer.forward.total) + max(0.0, copy - layer.backward.total))
    term = offloaded.breakdown()["offload"]
    assert term["total_s"] == pytest.approx(mb * 2 * n * copy)
    assert term["seconds"] == pytest.approx(exposed)
    if gb_per_s < 10:  # 1 GB/s: seconds a copy against milliseconds of compute
        assert exposed > 0.9 * term["total_s"] and offloaded.step_s > none.step_s + exposed
    else:
        assert exposed == 0 and offloaded.step_s == pytest.approx(none.step_s)
    assert "offload" not in none.breakdown()


@pytest.mark.parametrize(
    "overrides, key, says",
    [
        (["model.offload_layers=0"], "model.offload_layers", "must be from 1 to num_layers-1"),
        (["model.offload_layers=4"], "model.offload_layers", "must be from 1 to num_layers-1"),
        (["model.recompute=selective", "model.offload_layers=1"], "model.offload_layers", "recomputation"),
        (["parallelism=tp2-pp2-dp2", "model.offload_layers=1"], "model.offload_layers", "pipeline"),
        (["parallelism=dp2", "model.offload_layers=1"], "model.offload_layers", "planning setting"),
        (["cluster.host_memory_gib=-1"], "cluster.host_memory_gib", "must be positive"),
    ],
)
def test_bad_offloading_is_refused_naming_the_key(overrides, key, says):
    """megatron-core's own limits (fewer layers than the model's, no recomputation, no pipeline),
    and training refuses it (a planning setting); the tiny model has 4 layers."""
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert err.value.key == key and says in str(err.value)


def test_planning_accepts_offloading_and_needs_the_host_link(composer):
    validate(compose(["parallelism=dp2", "model.offload_layers=1"], validate_config=False), planning=True)
    with pytest.raises(ConfigError) as err:
        _predicted(composer, "cluster.host_link_gb_per_s=null", "model.offload_layers=1")
    assert err.value.key == "cluster.host_link_gb_per_s"


def test_offloaded_activations_must_fit_the_nodes_host_memory(composer):
    """Each of the node's 8 ranks keeps its N offloaded layers' activations in host memory at the
    end of the forward: the plan fits only while their sum is within cluster.host_memory_gib."""
    n = 20
    roomy = ("cluster.memory_gib=160", "parallelism.use_distributed_optimizer=true")  # room on the device
    none, cfg, hw = _predicted(composer, *roomy)
    per_node = 8 * n * none.memory.activations / cfg.model.num_layers  # no offload: every layer's
    gib = per_node / 2**30
    assert none.fits
    for host_gib, fits in ((gib * 1.01, True), (gib * 0.99, False)):
        offloaded, _, _ = _predicted(
            composer, *roomy, f"model.offload_layers={n}", f"cluster.host_memory_gib={host_gib}"
        )
        assert offloaded.memory.host * 8 == pytest.approx(per_node)
        assert offloaded.memory.total < none.memory.total <= hw.memory_bytes
        assert offloaded.fits is fits
    with pytest.raises(ConfigError) as err:
        _predicted(composer, "cluster.host_memory_gib=null", "model.offload_layers=1")
    assert err.value.key == "cluster.host_memory_gib"


def test_the_gb200_fsdp_row_offloads_under_its_compute():
    """Megatron-Bridge's DGX-GB200 Llama 3 70B (Megatron FSDP over 64 GPUs) offloads 40 layers'
    activations as its recipe does: over NVLink-C2C each copy hides under a layer's compute."""
    fixtures = [f for f in published.load() if f["file"].startswith("megatron-bridge-2511-blackwell")]
    (case,) = [c for c in published.cases(fixtures) if c.row["id"] == "gb200-llama3-70b-64"]
    assert case.plan.cfg.model.offload_layers == 40
    from mega.perf.device import prior
    from mega.perf.step import predict

    hw = published._hardware(case, {case.device: prior(case.device)})
    term = predict(case.plan.cfg, hw, case.peak, stack=case.stack).breakdown()["offload"]
    assert term["seconds"] == 0 and term["total_s"] > 0


def test_the_limits_are_megatron_cores_own():
    """model.offload_layers refuses what megatron-core's TransformerConfig refuses for
    cpu_offloading: this fails if megatron-core lifts (or adds) one of them under mega."""
    import warnings

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "cpu_offloading": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        TransformerConfig(**base, cpu_offloading_num_layers=3)
        refused = [
            {"cpu_offloading_num_layers": 4},
            {
                "cpu_offloading_num_layers": 1,
                "pipeline_model_parallel_size": 2,
                "pipeline_dtype": torch.float32,
            },
            {
                "cpu_offloading_num_layers": 1,
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            },
        ]
        for extra in refused:
            with pytest.raises(ValueError, match="CPU offloading|Pipeline parallelism with CPU offloading"):
                TransformerConfig(**base, **extra)
