"""FP8 in the performance model (train.precision=fp8): the linear GEMMs at the FP8 peak, the casts
Transformer Engine does not fuse, the weight cache, the config rules and the FP8 fixture's models."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mega.config import ConfigError, validate
from mega.flops import model_flops_per_token
from mega.perf import device, hardware, published, step
from mega.perf.memory import activation_bytes_per_layer, buckets, layer_params, stage_params
from mega.perf.step import elementwise_seconds, layer_gemms, predict, tp_collective_seconds

H100 = [
    "cluster=h100-8x",
    "model=gpt-175b",
    "parallelism.tp=8",
    "parallelism.pp=8",
    "cluster.nodes=8",
    "parallelism.micro_batch_size=1",
]
NEMO = "nemo-2407-h100-fp8.json"


def _cfg(composer, precision: str, *more: str):
    return composer.plan([*H100, f"train.precision={precision}", *more]).cfg


def _hw(cfg, precision: str, calibration=None):
    return hardware.from_cluster(cfg.cluster, precision, True, calibration or device.prior("H100 SXM"))


def test_linear_gemms_run_at_the_fp8_peak(composer):
    bf16, fp8 = _cfg(composer, "bf16"), _cfg(composer, "fp8")
    # no FP8 efficiency of its own: an FP8 GEMM reaches the bf16 one's fraction of its peak
    tied = device.unfitted("H100 SXM")
    assert tied.fp8_gemm_efficiency is None
    g16, g8 = layer_gemms(bf16, _hw(bf16, "bf16", tied), 2), layer_gemms(fp8, _hw(fp8, "fp8", tied), 2)
    # fc1 of GPT-175B at TP8, one 2048-token microbatch: 2*m*n*k FLOPs at the dense peak (989.4 /
    # 1978.9 TFLOP/s, NVIDIA's H100 SXM datasheet) x the GEMM efficiency x the wave/tile factor,
    # which is the same for both precisions
    flops = 2 * 2048 * (4 * 12288 // 8) * 12288
    for name, peak, g in (("bf16", 989.4e12, g16), ("fp8", 1978.9e12, g8)):
        ideal = flops / (peak * tied.gemm_efficiency)
        assert ideal <= g.fwd["fc1"] <= 1.25 * ideal, name
    k = hardware.GPU_KERNEL_S  # each GEMM's fixed kernel cost
    assert (g8.fwd["fc1"] - k) / (g16.fwd["fc1"] - k) == pytest.approx(0.5, rel=1e-3)
    # the built-in calibration's own FP8 efficiency (fitted on the FP8 rows) takes over
    built_in = device.prior("H100 SXM")
    g8b = layer_gemms(fp8, _hw(fp8, "fp8"), 2)
    ratio = tied.gemm_efficiency / built_in.fp8_gemm_efficiency
    assert (g8b.fwd["fc1"] - k) / (g8.fwd["fc1"] - k) == pytest.approx(ratio, rel=1e-3)


def test_fp8_efficiency_of_a_calibration_applies_to_the_linears_only(composer):
    cfg = _cfg(composer, "fp8")
    cal = device.prior("H100 SXM").replace(fp8_gemm_efficiency=0.4)
    hw = hardware.from_cluster(cfg.cluster, "fp8", True, cal)
    assert hw.linear.gemm_efficiency == 0.4 and hw.gemm_efficiency == cal.gemm_efficiency
    assert hw.linear.peak_flops == pytest.approx(2 * hw.peak_flops, rel=1e-3)
    # the output layer and everything else stay in bf16: the MFU denominator too
    assert hw.peak_flops == pytest.approx(989e12)


def test_unfused_casts_cost_their_bytes(composer):
    """fp8 adds, per layer and microbatch, the casts Transformer Engine runs as kernels of their own:
    forward the projection's input (tokens x h/tp), backward the output gradients of fc2 and of the
    projection (tokens x h each) and of QKV (tokens x (h + 2 kv)/tp), each read in bf16 (2 bytes)
    and written twice in FP8 (1 byte each)."""
    bf16, fp8 = _cfg(composer, "bf16"), _cfg(composer, "fp8")
    hw = _hw(fp8, "fp8")
    (f16, b16), (f8, b8) = elementwise_seconds(bf16, hw, 2), elementwise_seconds(fp8, hw, 2)
    tokens, h, tp = 2048, 12288, 8
    fwd_bytes = tokens * h / tp * (2 + 1 + 1)
    bwd_bytes = tokens * (h + h + 3 * h / tp) * (2 + 1 + 1)  # MHA: kv = h
    bw, kernel = hw.memory_bytes_per_s, hardware.GPU_KERNEL_S
    assert f8 - f16 == pytest.approx(fwd_bytes / bw + 1 * kernel, rel=1e-6)
    assert b8 - b16 == pytest.approx(bwd_bytes / bw + 3 * kernel, rel=1e-6)


def test_tp_all_gathers_carry_fp8_elements(composer):
    """Under fp8 the sequence-parallel all-gathers (the norm outputs before QKV and fc1, the output
    gradients of the projection and fc2, the inputs gathered again for wgrad) move 1-byte elements;
    the reduce-scatters keep the GEMMs' 16-bit outputs. A ring over the 8 NVLink ranks of a node:
    (n - 1) steps of latency + (n - 1)/n of the gathered tensor over the link."""
    more = ("parallelism.sequence_parallel=true",)
    bf16, fp8 = _cfg(composer, "bf16", *more), _cfg(composer, "fp8", *more)
    hw = _hw(fp8, "fp8")
    g = layer_gemms(fp8, hw, 2)
    (f16, b16), (f8, b8) = tp_collective_seconds(bf16, hw, 2, g), tp_collective_seconds(fp8, hw, 2, g)
    n, act = 8, 2048 * 12288

    def ring(nbytes):
        return (n - 1) * hw.intra.latency_s + (n - 1) / n * nbytes / hw.intra.bytes_per_s

    # two column/row pairs per layer: forward 1 all-gather + 1 reduce-scatter each, backward 2 + 1
    assert f16.tp_total == pytest.approx(2 * (ring(2 * act) + ring(2 * act)))
    assert f8.tp_total == pytest.approx(2 * (ring(1 * act) + ring(2 * act)))
    assert b8.tp_total == pytest.approx(2 * (2 * ring(1 * act) + ring(2 * act)))
    assert b16.tp_total - b8.tp_total == pytest.approx(4 * (ring(2 * act) - ring(act)))


def test_fp8_keeps_a_weight_cache_and_fp8_inputs(composer):
    bf16, fp8 = _cfg(composer, "bf16"), _cfg(composer, "fp8")
    m16 = predict(bf16, _hw(bf16, "bf16")).memory
    m8 = predict(fp8, _hw(fp8, "fp8")).memory
    # each layer's weights once more in FP8 and once transposed: 2 bytes per parameter
    layers = 96 // 8
    assert m8.weights - m16.weights == pytest.approx(layers * layer_params(fp8.model, 8) * 2)
    assert m8.activations < m16.activations
    # per layer and microbatch, the linears' saved inputs drop from 2 bytes to 1: the two norm
    # outputs (h each, whole on every TP rank without SP, split with it), the projection's input
    # (h / tp) and fc2's (ffn / tp)
    m, tokens, tp, h, f = fp8.model, 2048, 8, 12288, 4 * 12288
    for sp in (False, True):
        args = (m, 1, tp, sp, None, 2, True)
        saved = activation_bytes_per_layer(*args) - activation_bytes_per_layer(*args, fp8=True)
        assert saved == pytest.approx(tokens * 2 * h / (tp if sp else 1) + tokens * (h + f) / tp)


def test_fp8_primary_weights_drop_the_16_bit_copy_and_gather_in_fp8(composer):
    """parallelism.fp8_param_gather: the layers' linear weights live only as Transformer Engine's two
    FP8 copies (2 bytes a parameter, where the weight cache adds 2 to the 16-bit copy), and the
    distributed optimizer's parameter all-gather moves them in 1 byte: a ring over dp ranks a node
    apart, (dp - 1) steps of the NIC's latency + (dp - 1)/dp of each bucket over the ranks' NICs."""
    dp = ("parallelism.dp=4", "cluster.nodes=32", "parallelism.use_distributed_optimizer=true")
    cache, primary = (
        _cfg(composer, "fp8", *dp),
        _cfg(composer, "fp8", *dp, "parallelism.fp8_param_gather=true"),
    )
    hw = _hw(cache, "fp8")
    a, b = predict(cache, hw), predict(primary, hw)
    layers, linear = 96 // 8, layer_params(cache.model, 8)
    assert a.memory.weights - b.memory.weights == pytest.approx(layers * linear * 2)
    most = max(stage_params(cache.model, cache.parallelism))  # the stage that gathers the most
    assert cache.parallelism.chunks_per_stage == 1
    n = buckets(most, 4)  # megatron-core's default bucket size

    def ring(nbytes):  # n buckets, each a ring over 4 ranks on one NIC share each
        return n * (3 * hw.inter.latency_s + 3 / 4 * nbytes / n / hw.inter.bytes_per_s)

    assert a.breakdown()["dp_param_gather"]["total_s"] == pytest.approx(ring(2 * most), rel=1e-6)
    assert b.breakdown()["dp_param_gather"]["total_s"] == pytest.approx(
        ring(2 * most - layers * linear), rel=1e-6
    )
    bf16 = _cfg(composer, "bf16", *dp)
    with pytest.raises(ConfigError) as err:
        validate(
            dataclasses.replace(
                bf16, parallelism=dataclasses.replace(bf16.parallelism, fp8_param_gather=True)
            ),
            planning=True,
        )
    assert err.value.key == "parallelism.fp8_param_gather"


def test_fp8_is_a_planning_setting(composer):
    cfg = _cfg(composer, "fp8", "parallelism.dp=1")
    validate(cfg, planning=True)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == "train.precision" and "mega.plan" in str(err.value)
    cpu = composer.plan(["cluster=local-cpu", "train.precision=fp8"]).cfg
    with pytest.raises(ConfigError) as err:
        validate(cpu, planning=True)
    assert err.value.key == "train.precision"


def test_a_device_without_fp8_tensor_cores_is_refused(composer):
    cfg = composer.plan(["cluster=a100-8x", "model=gpt-175b", "train.precision=fp8"]).cfg
    with pytest.raises(ConfigError) as err:
        hardware.from_cluster(cfg.cluster, "fp8", True)
    assert err.value.key == "train.precision" and "A100" in str(err.value)


B200 = [
    "cluster=b200-8x",
    "model=gpt-175b",
    "parallelism.tp=8",
    "parallelism.pp=8",
    "cluster.nodes=8",
    "parallelism.micro_batch_size=1",
    "parallelism.sequence_parallel=true",
    "train.precision=fp8",
]


def test_blackwell_casts_once_and_mxfp8_twice_with_block_scales(composer):
    """Per-tensor FP8 on Blackwell: its FP8 GEMMs take any operand layout, so Transformer Engine
    writes a cast once, with no transposed copy (TE 2.9 is_non_tn_fp8_gemm_supported): half
    Hopper's FP8 bytes in the cast kernels and the weight cache. MXFP8 writes a row-wise and a
    column-wise copy, each with one 1-byte scale per 32 elements, and its sequence-parallel
    all-gathers move both (TE 2.9 _all_gather_mxfp8)."""
    cs, mx = (composer.plan([*B200, f"train.fp8_recipe={r}"]).cfg for r in ("tensorwise", "mxfp8"))
    hw = hardware.from_cluster(cs.cluster, "fp8", True, device.prior("B200"))
    assert hw.fp8_non_tn and not _hw(_cfg(composer, "fp8"), "fp8").fp8_non_tn
    bf16 = composer.plan([*B200[:-1], "train.precision=bf16"]).cfg
    tokens, h, tp, kernel = 2048, 12288, 8, hardware.GPU_KERNEL_S
    inputs, grads = tokens * h / tp, tokens * (h + h + 3 * h / tp)  # MHA: kv = h
    (f16, b16), (fc, bc), (fm, bm) = (elementwise_seconds(c, hw, 2) for c in (bf16, cs, mx))
    bw = hw.memory_bytes_per_s
    mx_bytes = 2 * (1 + 1 / 32)
    assert fc - f16 == pytest.approx(inputs * (2 + 1) / bw + kernel, rel=1e-6)
    assert bc - b16 == pytest.approx(grads * (2 + 1) / bw + 3 * kernel, rel=1e-6)
    assert fm - f16 == pytest.approx(inputs * (2 + mx_bytes) / bw + kernel, rel=1e-6)
    assert bm - b16 == pytest.approx(grads * (2 + mx_bytes) / bw + 3 * kernel, rel=1e-6)
    linear = 96 // 8 * layer_params(cs.model, 8)
    m16, mc, mm = (predict(c, hw).memory for c in (bf16, cs, mx))
    assert mc.weights - m16.weights == pytest.approx(linear * 1)
    assert mm.weights - m16.weights == pytest.approx(linear * mx_bytes)
    g = layer_gemms(cs, hw, 2)
    (fwd_c, _), (fwd_m, _) = (tp_collective_seconds(c, hw, 2, g) for c in (cs, mx))

    def ring(nbytes):  # over the 8 NVLink ranks of a node
        return (8 - 1) * hw.intra.latency_s + (8 - 1) / 8 * nbytes / hw.intra.bytes_per_s

    act = tokens * h
    assert fwd_c.tp_total == pytest.approx(2 * (ring(act) + ring(2 * act)))
    assert fwd_m.tp_total == pytest.approx(2 * (ring(mx_bytes * act) + ring(2 * act)))


def test_mxfp8_needs_fp8_and_blackwell_naming_the_key(composer):
    hopper = _cfg(composer, "fp8", "train.fp8_recipe=mxfp8")
    with pytest.raises(ConfigError) as err:
        hardware.from_cluster(hopper.cluster, "fp8", True, fp8_recipe="mxfp8")
    assert err.value.key == "train.fp8_recipe" and "H100" in str(err.value)
    with pytest.raises(ConfigError) as err:
        validate(
            composer.plan(
                [*B200[:-1], "parallelism.dp=1", "train.precision=bf16", "train.fp8_recipe=mxfp8"]
            ).cfg,
            planning=True,
        )
    assert err.value.key == "train.fp8_recipe"
    # megatron-core gathers MXFP8 primary weights in 16 bits through the gradient buffer
    primary = ("parallelism.fp8_param_gather=true", "parallelism.dp=1")
    mx = composer.plan([*B200, "train.fp8_recipe=mxfp8", *primary]).cfg
    cs = composer.plan([*B200, "train.fp8_recipe=tensorwise", *primary]).cfg
    assert not step.fp8_gathers(mx) and step.fp8_gathers(cs)


def test_calibration_with_a_null_fp8_efficiency_loads(tmp_path):
    path = device.save(device.unfitted("H100 SXM"), tmp_path / "cal.json")
    assert json.loads(path.read_text())["calibration"]["fp8_gemm_efficiency"] is None
    # null: the built-in value of the device type (fitted on the published FP8 rows)
    assert device.load(path).fp8_gemm_efficiency == device.prior("H100 SXM").fp8_gemm_efficiency
    path.write_text(json.dumps({"calibration": {"device": "H100 SXM", "fp8_gemm_efficiency": 0.55}}))
    assert device.load(path).fp8_gemm_efficiency == 0.55


def test_nemo_models_match_the_published_flops_per_token():
    """The FP8 fixture's models are transcribed from names (GPT3-5B, LLAMA2-13B, Nemotron-22B...):
    mega.flops' count per token must equal the table's model TFLOP/s over its tokens/s."""
    fixture = next(f for f in published.load() if f["file"] == NEMO)
    cases = published.cases([fixture])
    assert len(cases) == 12
    for case in cases:
        row = case.row
        per_token = row["model_tflops_per_gpu"] * 1e12 / row["tokens_per_s_per_gpu"]
        mega = model_flops_per_token(case.plan.cfg.model)
        assert mega == pytest.approx(per_token, rel=0.002), row["id"]
        assert case.published_mfu == pytest.approx(row["model_tflops_per_gpu"] / 989.4, rel=0.005)


def test_bridge_counts_causal_attention_halved():
    """Megatron-Bridge's model TFLOP/s count the causal attention's scores and weighted sum over half
    the square: mega.flops' count less half its 12 L s h attention FLOPs per token, on every system of
    the table (DGX-H100, DGX-B200, DGX-GB200). The rows are compared by throughput, so their MFU is
    mega.flops' (whole square), above the published TFLOP/s over the device's bf16 peak."""
    fixtures = [f for f in published.load() if f["file"].startswith("megatron-bridge-2511")]
    cases = published.cases(fixtures)
    assert len(cases) == 11 and {c.device for c in cases} == {"H100 SXM", "B200", "GB200"}
    for case in cases:
        m, p, row = case.plan.cfg.model, case.plan.cfg.parallelism, case.row
        layers = m.num_layers
        mega = case.flops / (p.global_batch_size * m.seq_length)
        per_token = row["model_tflops_per_gpu"] * 1e12 / row["tokens_per_s_per_gpu"]
        attention = 12 * layers * m.seq_length * m.hidden_size
        assert mega - attention / 2 == pytest.approx(per_token, rel=0.002), row["id"]
        assert case.published_mfu == pytest.approx(
            row["model_tflops_per_gpu"] * 1e12 / case.peak * mega / per_token, rel=1e-3
        )


def test_fp8_efficiency_is_fitted_on_fp8_rows_only():
    fixtures = published.load()
    nemo = published.cases([f for f in fixtures if f["file"] == NEMO])
    llama = published.cases([f for f in fixtures if f["file"].startswith("llama3")])
    assert published.fit(llama, rounds=2)["H100 SXM"].fp8_gemm_efficiency is None
    fitted = published.fit(nemo, rounds=2)["H100 SXM"].fp8_gemm_efficiency
    assert fitted is not None and 0.3 < fitted < 1.0
