"""Context parallelism (``parallelism.cp``) in the performance model: the ring's bytes, the
attention and activation split, the planner fitting long sequences, and the layout's world size.
Training refuses cp>1 (mega builds megatron-core's local layer spec, whose attention has no CP).

Pure Python: no training processes.
"""

from __future__ import annotations

import dataclasses

import pytest

from mega.config import ConfigError, MegaConfig, ModelConfig, ParallelismConfig, compose, validate
from mega.perf import device
from mega.perf.configs import Composer, for_planning
from mega.perf.memory import activation_bytes_per_layer
from mega.perf.planner import evaluate, hardware_for, settle_precision
from mega.perf.step import DTYPE_BYTES, attention_seconds, cp_comm_seconds, cp_merge_bytes, predict

# Llama 3 8B on one node of 8 H100s: a sequence of 131,072 tokens
LONG = ["model=llama3-8b", "cluster=h100-8x", "model.seq_length=131072", "model.fused_ops=true"]


def _with_cp(cfg: MegaConfig, cp: int, dp: int) -> MegaConfig:
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, cp=cp, dp=dp))


@pytest.fixture(scope="module")
def long_plan():
    """Llama 3 8B at 131,072 tokens, TP2 CP4 over 8 GPUs, one sequence per microbatch."""
    with Composer() as composer:
        plan = composer.plan(
            [
                *LONG,
                "parallelism.tp=2",
                "parallelism.pp=1",
                "parallelism.cp=4",
                "parallelism.dp=1",
                "parallelism.global_batch_size=4",
                "parallelism.micro_batch_size=1",
                "parallelism.sequence_parallel=true",
                "model.recompute=full",
            ]
        )
        settle_precision(plan)
        return plan


def test_ring_sends_kv_blocks_cp_minus_one_times_each_way(long_plan):
    """A block is the rank's K and V: 2 x (131,072 / 4 tokens) x (8 of 32 heads x 128 / tp 2) x 2
    bytes. The cp ranks are tp=2 apart and a node holds 8 ranks, so the ring of 4 stays in the node
    (NVLink); forward 3 sends of one block, backward K,V then 2 x (K,V + dK,dV) then dK,dV."""
    cfg = validate(long_plan.cfg, planning=True)
    hw, _ = hardware_for(cfg)
    block = 2 * (131072 // 4) * (1024 // 2) * 2
    assert block == 64 * 2**20
    link = hw.intra  # 4 ranks x stride 2 <= 8 per node
    send = lambda nbytes: link.latency_s + nbytes / link.bytes_per_s  # noqa: E731
    fwd_total = 3 * send(block)
    bwd_total = send(block) + 2 * send(2 * block) + send(block)
    fwd, bwd = cp_comm_seconds(cfg, hw, DTYPE_BYTES["bf16"], attn_f=0.0, attn_b=0.0)
    assert fwd.cp_total == pytest.approx(fwd_total, rel=1e-12)
    assert bwd.cp_total == pytest.approx(bwd_total, rel=1e-12)
    assert (fwd.cp_exposed, bwd.cp_exposed) == (fwd.cp_total, bwd.cp_total)  # nothing to hide under
    # each step's transfer hides under its share of the attention: a long one hides it all
    fwd, bwd = cp_comm_seconds(cfg, hw, 2, attn_f=4 * send(block), attn_b=4 * send(2 * block))
    assert (fwd.cp_exposed, bwd.cp_exposed) == (0.0, 0.0)
    # the breakdown: 32 layers x 4 microbatches, 3 blocks forward + 6 backward in all
    pr = predict(cfg, hw)
    ring = pr.breakdown()["cp_comm"]
    assert ring["total_s"] == pytest.approx(32 * 4 * (fwd_total + bwd_total), rel=1e-9)
    assert 0.0 <= ring["seconds"] <= ring["total_s"]


def test_ring_across_nodes_runs_on_the_nics(long_plan):
    """TP8 CP16 (Llama 3's long-context layout): the 16 cp ranks are 8 apart, one per node, so each
    block crosses a 400 Gb/s NIC: 2 x 8,192 tokens x 128 (one KV head per TP rank) x 2 bytes."""
    cfg = long_plan.cfg
    p = dataclasses.replace(cfg.parallelism, tp=8, cp=16, dp=1, sequence_parallel=True)
    c = dataclasses.replace(cfg.cluster, nodes=16)
    cfg = dataclasses.replace(cfg, parallelism=p, cluster=c)
    hw, _ = hardware_for(cfg)
    block = 2 * 8192 * 128 * 2
    seconds = device.prior("H100 SXM").nic_latency_us * 1e-6 + block / hw.inter.bytes_per_s
    assert hw.inter.bytes_per_s <= 400e9 / 8  # one rank's share of the node's NICs
    fwd, _ = cp_comm_seconds(cfg, hw, 2, 0.0, 0.0)
    assert fwd.cp_total == pytest.approx(15 * seconds, rel=1e-12)


def test_all_gather_cp_gathers_kv_whole_and_exposes_it(long_plan):
    """cp_comm_type=all_gather (Llama 3's CP, TE's AttnFuncWithCPAndKVAllGather): the forward
    all-gathers K and V (each 131,072 tokens x 512 of the rank's KV width x 2 bytes gathered from 4
    ranks 2 apart, NVLink), the backward gathers them again and reduce-scatters dK and dV; all
    exposed, whatever the attention beside them. The attention keeps its work, in 2 kernels."""
    cfg = validate(long_plan.cfg, planning=True)
    cfg = dataclasses.replace(
        cfg, parallelism=dataclasses.replace(cfg.parallelism, cp_comm_type="all_gather")
    )
    hw, _ = hardware_for(cfg)
    whole = 131072 * (1024 // 2) * 2  # one of K, V after the gather
    link = hw.intra
    ring = 3 * link.latency_s + 3 / 4 * whole / link.bytes_per_s  # all-gather or reduce-scatter of 4
    for attn in (0.0, 1.0):  # a long attention hides nothing
        fwd, bwd = cp_comm_seconds(cfg, hw, DTYPE_BYTES["bf16"], attn_f=attn, attn_b=2.5 * attn)
        assert fwd.cp_exposed == fwd.cp_total == pytest.approx(2 * ring, rel=1e-12)
        assert bwd.cp_exposed == bwd.cp_total == pytest.approx(4 * ring, rel=1e-12)
    p2p = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, cp_comm_type="p2p"))
    (fa, ba), (fp, bp) = attention_seconds(cfg, hw, 2), attention_seconds(p2p, hw, 2)
    merge_f, merge_b = _te_ring_merge_bytes(131072 // 4, 4096 // 2, 2 * 1024 // 2, cp=4, dtype=2)
    ring_steps = (  # 4 kernels (not 2) and p2p's merges of the steps' results
        2 * hw.kernel_s + hw.elementwise_s(merge_f, 2 * 4 - 1),
        4 * hw.kernel_s + hw.elementwise_s(merge_b, 3 * 4),
    )
    assert (fp - fa, bp - ba) == pytest.approx(ring_steps, rel=1e-9)
    ag = predict(cfg, hw).breakdown()["cp_comm"]
    assert ag["seconds"] == pytest.approx(32 * 4 * 6 * ring, rel=1e-9) == ag["total_s"]
    assert ag["seconds"] > predict(p2p, hw).breakdown()["cp_comm"]["seconds"]


def _te_ring_merge_bytes(
    tokens: int, q_width: int, kv_width: int, cp: int, dtype: int
) -> tuple[float, float]:
    """Bytes the busiest rank moves merging TE's p2p ring steps, walked step by step as
    AttnFuncWithCPAndKVP2P runs them (TE 2.9 context_parallel.py; causal, load-balanced chunks):
    rank r's step i >= 1 computes all its queries against the first half of rank (r - i)'s keys
    when i <= r, else its second half of queries against all of them. Forward: step 0's output is
    rescaled into ``out`` (read + write), each later step's is merged into the part it covers (read
    the step's output, read and write ``out``). Backward: the step's dq, dk, dv are copied (step 0)
    or added (read, read, write) into their accumulators over the part the step covers."""
    q, kv = tokens * q_width, tokens * kv_width  # out or dq; dK + dV
    busiest = (0.0, 0.0)
    for r in range(cp):
        fwd = dq = dkv = 0.0
        for i in range(cp):
            if i == 0:
                fwd, dq, dkv = 2 * q, 2 * q, 2 * kv
                continue
            q_part, kv_part = (1.0, 0.5) if i <= r else (0.5, 1.0)
            fwd += 3 * q * q_part
            dq += 3 * q * q_part
            dkv += 3 * kv * kv_part
        rank = (dtype * fwd, dtype * (dq + dkv))
        busiest = max(busiest, rank, key=sum)
    return busiest


def test_p2p_ring_merges_its_steps_partial_results_at_the_busiest_ranks_pace(long_plan):
    """TE's p2p context parallelism merges each ring step's partial output (forward) and dq, dk, dv
    (backward) in element-wise kernels beside the attention kernels: charged as memory traffic at
    the busiest rank's pace, which the step-by-step walk of TE's loop above gives. Llama 3 8B
    (GQA: K + V are half the query width) and an MHA model, cp 2 to 16; all_gather CP has no merges."""
    cfg = validate(long_plan.cfg, planning=True)
    for model, kv_width in (
        (cfg.model, 2 * 1024),
        (dataclasses.replace(cfg.model, num_query_groups=None), 2 * 4096),
    ):
        for cp in (2, 4, 8, 16):
            c = dataclasses.replace(cfg, model=model, parallelism=dataclasses.replace(cfg.parallelism, cp=cp))
            want = _te_ring_merge_bytes(131072 // cp, 4096 // 2, kv_width // 2, cp, dtype=2)
            assert cp_merge_bytes(c, 2) == pytest.approx(want, rel=1e-12)
    # Llama 3 8B at cp=2, rank 1 (the busiest): forward 2 + 3 dtype-units a query element (step 1
    # covers all its queries); backward dq the same, dK + dV (half the query width) 2 + 1.5
    c2 = _with_cp(cfg, 2, 2)
    elements = 131072 // 2 * 4096 // 2
    assert cp_merge_bytes(c2, 2) == pytest.approx((2 * 5 * elements, 2 * (5 + 0.5 * 3.5) * elements))
    hw, _ = hardware_for(c2)
    gathered = dataclasses.replace(
        c2, parallelism=dataclasses.replace(c2.parallelism, cp_comm_type="all_gather")
    )
    (fp, bp), (fa, ba) = attention_seconds(c2, hw, 2), attention_seconds(gathered, hw, 2)
    assert fp - fa == pytest.approx(hw.elementwise_s(2 * 5 * elements, 3), rel=1e-9)
    assert bp - ba == pytest.approx(hw.elementwise_s(2 * (5 + 0.5 * 3.5) * elements, 6), rel=1e-9)
    assert "merge of the 2 ring steps" in predict(c2, hw).breakdown()["attention"]["what"]


def test_a_measured_calibration_charges_shorter_cp_kernels_their_lower_efficiency(long_plan):
    """With attention measured by length (``calibrate --device cuda``: the sequence and its CP
    chunks), a kernel over fewer tokens runs at the efficiency interpolated in log(length) between
    the measured ones, relative to the longest; at or above the longest, and without a table, the
    calibration's one efficiency. p2p CP kernels cover a rank's s/cp queries, all-gather CP's one
    local chunk (s/2cp)."""
    table = ((16384, 0.30), (65536, 0.45), (131072, 0.60))
    cal = device.prior("H100 SXM").replace(attention_efficiency=0.6, attention_by_length=table, source="test")
    assert cal.attention_length_factor(131072) == cal.attention_length_factor(262144) == 1.0
    assert cal.attention_length_factor(65536) == pytest.approx(0.75)
    assert cal.attention_length_factor(32768) == pytest.approx((0.30 + 0.5 * 0.15) / 0.60)  # halfway in log
    assert cal.attention_length_factor(8192) == pytest.approx(0.5)  # below the shortest: its share
    assert device.prior("H100 SXM").attention_length_factor(1024) == 1.0  # no table
    base = validate(long_plan.cfg, planning=True)
    s, h, tp = 131072, 4096, 2
    for cp, comm, length in (
        (1, "p2p", s),
        (2, "p2p", s // 2),
        (4, "p2p", s // 4),
        (4, "all_gather", s // 8),
    ):
        cfg = dataclasses.replace(
            base, parallelism=dataclasses.replace(base.parallelism, cp=cp, dp=1, cp_comm_type=comm)
        )
        hw, _ = hardware_for(cfg)
        measured = dataclasses.replace(hw, attention_efficiency=0.6, calibration=cal)
        plain = dataclasses.replace(measured, calibration=cal.replace(attention_by_length=()))
        (fm, bm), (fp, bp) = attention_seconds(cfg, measured, 2), attention_seconds(cfg, plain, 2)
        core = 2 * 2 * s * (s + 1) / 2 * h / tp / cp / (hw.peak_flops * 0.6)  # forward at the one efficiency
        factor = cal.attention_length_factor(length)
        assert fm - fp == pytest.approx(core / factor - core, rel=1e-9)
        assert bm - bp == pytest.approx(2.5 * (core / factor - core), rel=1e-9)


def test_cp2_halves_the_attention_core_and_a_layers_activations(long_plan):
    """The attention core: 2 x 2 x s x (s + 1)/2 x h / tp causal FLOPs forward (2.5x backward), 1/cp
    of it per rank in cp kernels. A layer's activations: Korthikanti et al.'s sbh (34 + 5as/h) with
    s/cp queries per rank, so cp=2 keeps half of cp=1's."""
    cfg1 = _with_cp(long_plan.cfg, 1, 4)
    cfg2 = _with_cp(long_plan.cfg, 2, 2)
    hw, _ = hardware_for(cfg1)
    s, h, tp = 131072, 4096, 2
    rate = hw.peak_flops * hw.attention_efficiency
    flops = 2 * 2 * s * (s + 1) / 2 * h / tp
    merge_f, merge_b = _te_ring_merge_bytes(s // 2, h // tp, 2 * 1024 // tp, cp=2, dtype=2)
    merges = {1: (0.0, 0.0), 2: (hw.elementwise_s(merge_f, 3), hw.elementwise_s(merge_b, 6))}
    for cp, cfg in ((1, cfg1), (2, cfg2)):
        fwd, bwd = attention_seconds(cfg, hw, 2)
        assert fwd == pytest.approx(flops / cp / rate + cp * hw.kernel_s + merges[cp][0], rel=1e-12)
        assert bwd == pytest.approx(2.5 * flops / cp / rate + 2 * cp * hw.kernel_s + merges[cp][1], rel=1e-12)

    m = ModelConfig(
        num_layers=4,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=8192,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    b, t, a = 1, 4, 16

    def korthikanti(s_rank: float) -> float:  # s_rank queries against s keys, TP without SP
        return s_rank * b * m.hidden_size * (10 + 24 / t + 5 * a * m.seq_length / (m.hidden_size * t))

    for cp in (1, 2):
        got = activation_bytes_per_layer(m, b, t, False, None, dtype_bytes=2, flash=False, cp=cp)
        assert got == pytest.approx(korthikanti(m.seq_length / cp), rel=1e-12)
    whole, half = (activation_bytes_per_layer(m, b, t, False, None, 2, False, cp) for cp in (1, 2))
    assert half == pytest.approx(whole / 2, rel=1e-12)


def test_context_parallelism_fits_a_long_sequence_that_cp1_does_not():
    """Llama 3 8B at 131,072 tokens on 8 H100s at TP2: at cp=1 (dp=4) no micro-batch, recomputation
    or SP choice fits in 80 GB (fp32 logits of 131,072 tokens over a 128K vocabulary alone are 67 GB
    at TP2); at cp=4 (dp=1) each rank holds a quarter of the sequence and the planner fits it."""
    common = [*LONG, "parallelism.tp=2", "parallelism.pp=1", "parallelism.global_batch_size=8"]
    cp1 = evaluate(for_planning([*common, "parallelism.cp=1"]))
    cp4 = evaluate(for_planning([*common, "parallelism.cp=4"]))
    assert (cp1.cfg.parallelism.dp, cp4.cfg.parallelism.dp) == (4, 1)
    assert not cp1.prediction.fits
    assert cp4.prediction.fits
    assert cp4.knobs["cp"] == 4 and cp4.to_dict()["layout"]["cp"] == 4
    # per sample of a microbatch, the fp32 logits (and the recomputed layer) are a quarter at cp=4
    per_sample = [ev.prediction.memory.temporary / ev.cfg.parallelism.micro_batch_size for ev in (cp1, cp4)]
    assert cp1.cfg.model.recompute == cp4.cfg.model.recompute == "full"
    assert per_sample[1] == pytest.approx(per_sample[0] / 4, rel=1e-12)


def test_world_size_counts_cp_and_microbatches_do_not():
    p = ParallelismConfig(tp=2, pp=2, cp=2, dp=2, micro_batch_size=1, global_batch_size=8)
    assert p.world_size == 16
    assert p.num_microbatches == 8 // (1 * 2)  # the cp ranks of a replica share its samples
    cfg = compose(["parallelism.cp=2"], validate_config=False)  # local-cpu: one process per rank
    assert cfg.cluster.procs_per_node == cfg.parallelism.world_size == 2 * 2 * 2 * 2


def test_planner_accepts_cp_and_training_refuses_it_naming_the_key():
    """The planner validates cp=2 like any layout; every config composed for a run is refused
    before launch, naming parallelism.cp and what it needs."""
    cfg = compose(["parallelism.cp=2"], validate_config=False)
    assert validate(cfg, planning=True).parallelism.cp == 2
    with pytest.raises(ConfigError) as err:
        compose(["parallelism.cp=2"])
    assert err.value.key == "parallelism.cp"
    assert "planning setting" in str(err.value) and "Transformer Engine" in str(err.value)
    assert compose(["parallelism.cp=1"]).parallelism.cp == 1


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["parallelism.cp=0"], "parallelism.cp", "positive integer"),
        (["parallelism.cp=3", "model.seq_length=200"], "parallelism.cp", "not divisible by 2*cp=6"),
        (
            ["parallelism.cp=2", "parallelism.cp_comm_type=a2a"],
            "parallelism.cp_comm_type",
            "'p2p', 'all_gather'",
        ),
    ],
)
def test_cp_is_validated_naming_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides, validate_config=False), planning=True)
    assert err.value.key == key and fragment in str(err.value)


def test_cp_comm_type_is_megatron_cores_flag():
    """The planner's cp_comm_type is what training hands megatron-core's TransformerConfig (its
    ``cp_comm_type``: "p2p", "all_gather", "a2a", "a2a+p2p"; the first two modelled)."""
    from mega.model import transformer_config

    for kind in ("p2p", "all_gather"):
        assert transformer_config(compose([f"parallelism.cp_comm_type={kind}"])).cp_comm_type == kind
