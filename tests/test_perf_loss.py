"""The loss on the last pipeline stage in the performance model: each cross-entropy implementation's
traffic over the logits (mega.perf.step.cross_entropy_cost) and what the logits unit charges for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

from mega.perf import device, hardware, published
from mega.perf.configs import Composer
from mega.perf.step import CROSS_ENTROPY, Stack, cross_entropy_cost, logits_unit, microbatch_tokens

HERE = Path(__file__).parent


def test_megatron_cross_entropy_moves_what_megatron_core_runs():
    """megatron-core's vocab_parallel_cross_entropy run op by op on CPU, each op's reads and writes
    of logit-sized tensors counted (tests/cross_entropy_traffic.py): the model's bytes and kernels
    per logit, forward and backward, for bf16 and fp32 logits. Fails if megatron-core's loss
    changes its passes."""
    out = subprocess.run(
        [sys.executable, str(HERE / "cross_entropy_traffic.py"), str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    counted = json.loads(out.stdout.strip().splitlines()[-1])
    for name, dtype in (("bfloat16", 2), ("float32", 4)):
        cost = cross_entropy_cost("megatron", dtype)
        assert counted[name] == {
            "forward": [cost.forward_bytes, cost.forward_kernels],
            "backward": [cost.backward_bytes, cost.backward_kernels],
        }, name


@pytest.fixture(scope="module")
def llama70b():
    with Composer() as c:
        return c.plan(
            ["cluster=h100-8x", "model=llama3-70b", "parallelism.tp=4", "parallelism.pp=8", "cluster.nodes=8"]
        ).cfg


def test_the_logits_unit_charges_each_implementations_traffic(llama70b):
    """Between two implementations the last stage's loss differs by the bytes per logit over the
    memory bandwidth, the kernels' launches and the TP collectives: computed here from the
    logits' count and the hardware's figures. TE's kernels move the least (the 128,256-word
    vocabulary: several milliseconds per microbatch against megatron-core's unfused passes)."""
    cfg = llama70b
    hw = hardware.from_cluster(cfg.cluster, "bf16", True, device.prior("H100 SXM"))
    logits = microbatch_tokens(cfg) * cfg.model.padded_vocab_size / cfg.parallelism.tp
    bandwidth = hw.elementwise_bytes_per_s or hw.memory_bytes_per_s
    units = {impl: logits_unit(cfg, hw, 2, Stack(cross_entropy=impl)) for impl in CROSS_ENTROPY}
    costs = {impl: cross_entropy_cost(impl, 2) for impl in CROSS_ENTROPY}
    tokens, t = microbatch_tokens(cfg), cfg.parallelism.tp

    def collectives(impl):
        return sum(
            hw.collective_s(kind, tokens * b * (t if kind == "all_gather" else 1), t)
            for kind, b in costs[impl].collectives
        )

    base, base_cost = units["megatron"], costs["megatron"]
    for impl in ("fused", "te"):
        u, c = units[impl], costs[impl]
        assert base.forward.elementwise - u.forward.elementwise == pytest.approx(
            (base_cost.forward_bytes - c.forward_bytes) * logits / bandwidth
            + (base_cost.forward_kernels - c.forward_kernels) * hw.kernel_s
        )
        assert base.backward.elementwise - u.backward.elementwise == pytest.approx(
            (base_cost.backward_bytes - c.backward_bytes) * logits / bandwidth
            + (base_cost.backward_kernels - c.backward_kernels) * hw.kernel_s
        )
        assert base.forward.tp_exposed - u.forward.tp_exposed == pytest.approx(
            collectives("megatron") - collectives(impl)
        )
        assert u.forward.gemm == base.forward.gemm and u.backward.gemm == base.backward.gemm
    total = {impl: units[impl].forward.total + units[impl].backward.total for impl in CROSS_ENTROPY}
    assert total["te"] < total["fused"] < total["megatron"]
    assert total["megatron"] - total["te"] > 3e-3


def test_an_unknown_cross_entropy_is_refused_naming_it():
    with pytest.raises(ValueError, match="cross_entropy"):
        Stack(cross_entropy="liger")


def test_fixtures_carry_the_loss_their_released_configs_run():
    """NeMo 24.07's Llama 3 and Nemotron configs set cross_entropy_loss_fusion (its GPT-3 and
    Llama 2 configs do not); Megatron-Bridge's performance scripts set cross_entropy_fusion_impl
    "te"; sources that say nothing run megatron-core's default."""
    by_id = {
        (fx["file"], row["id"]): published.Case(fx, row, plan=None).stack.cross_entropy
        for fx in published.load(HERE / "fixtures" / "published")
        for row in fx["rows"]
    }
    nemo = {i: impl for (f, i), impl in by_id.items() if f == "nemo-2407-h100-fp8.json"}
    assert {i for i, impl in nemo.items() if impl == "fused"} == {
        i for i in nemo if i.startswith(("llama3", "nemotron"))
    }
    assert {i for i, impl in nemo.items() if impl != "fused"} and all(
        impl == "megatron" for i, impl in nemo.items() if not i.startswith(("llama3", "nemotron"))
    )
    bridge = [impl for (f, _), impl in by_id.items() if f.startswith("megatron-bridge-2511")]
    assert bridge == ["te"] * 11
    others = [impl for (f, _), impl in by_id.items() if "nemo-2407" not in f and "bridge" not in f]
    assert others and set(others) == {"megatron"}
