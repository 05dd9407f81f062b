"""Sliding-window attention (model.window_size, model.full_attention_every).

megatron's local DotProductAttention does the banding; what we check is that mega's settings reach
it with our meaning (a query sees itself and `window_size` earlier tokens; every k-th layer is
full), against an explicit float64 softmax(QK^T + mask)V, and that MFU counts it. Megatron runs in
one spawned gloo process so that its CPU patches stay out of pytest's.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch

from mega.config import ConfigError, ModelConfig, from_dict
from mega.flops import model_flops_per_step, model_flops_per_token

SEQ = 16
HEADS, HEAD_DIM = 4, 8


def _config(**model):
    return from_dict(
        {
            "model": {
                "num_layers": 2,
                "hidden_size": HEADS * HEAD_DIM,
                "num_attention_heads": HEADS,
                "seq_length": SEQ,
                "vocab_size": 128,
                **model,
            },
            "parallelism": {
                "tp": 1,
                "pp": 1,
                "vpp": None,
                "dp": 1,
                "micro_batch_size": 2,
                "global_batch_size": 2,
            },
            "cluster": {"procs_per_node": 1},
        }
    )


def reference_attention(q, k, v, window: int | None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + mask) V, spelled out: position i attends to j with
    i - window <= j <= i (any j <= i without a window). [s, b, heads, d] -> [s, b, heads * d]."""
    s, b, heads, d = q.shape
    groups = k.shape[2]
    k, v = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))  # grouped-query K/V
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    allowed = (j <= i) & (j >= i - (window if window is not None else s))
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) / math.sqrt(d)
    scores = scores + torch.zeros(s, s, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    return torch.einsum("bnij,jbnd->ibnd", scores.softmax(-1), v).reshape(s, b, heads * d)


# ---------------------------------------------------------------------------------------------
# The worker (a spawned process)


def _core_attention(cfg, layer_number: int = 1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mega.model import transformer_config

    return DotProductAttention(
        transformer_config(cfg),
        layer_number=layer_number,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
    )


def _attention_vs_reference(window: int | None, groups: int = HEADS) -> dict:
    """Max |megatron - reference| of the output and of dL/dq, dL/dk, dL/dv, in float64."""
    gen = torch.Generator().manual_seed(window or 0)
    q = torch.randn(SEQ, 2, HEADS, HEAD_DIM, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(SEQ, 2, groups, HEAD_DIM, dtype=torch.float64, generator=gen) for _ in range(2))
    upstream = torch.randn(SEQ, 2, HEADS * HEAD_DIM, dtype=torch.float64, generator=gen)
    core = _core_attention(_config(window_size=window, num_query_groups=groups))
    errors = {}
    outputs, grads = [], []
    for attend in (
        lambda *qkv: core(*qkv, attention_mask=None),
        lambda *qkv: reference_attention(*qkv, window),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        (out * upstream).sum().backward()
        outputs.append(out.detach())
        grads.append([t.grad for t in leaves])
    errors["output"] = (outputs[0] - outputs[1]).abs().max().item()
    for name, got, want in zip("qkv", grads[0], grads[1]):
        errors[f"grad_{name}"] = (got - want).abs().max().item()
    errors["output_scale"] = outputs[1].abs().max().item()
    return errors


def _wide_window_equals_full(window: int) -> bool:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(SEQ, 2, HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    windowed = _core_attention(_config(window_size=window))(q, k, v, attention_mask=None)
    full = _core_attention(_config())(q, k, v, attention_mask=None)
    return torch.equal(windowed, full)


def _positions_token0_reaches(**model) -> list[int]:
    """Sequence positions whose logits change when token 0 changes."""
    from mega.model import build_model_chunks, transformer_config

    cfg = _config(**model)
    gpt = build_model_chunks(cfg, transformer_config(cfg))[0].eval()
    tokens = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(5))
    perturbed = tokens.clone()
    perturbed[0, 0] = (tokens[0, 0] + 1) % 128
    positions = torch.arange(SEQ)[None]
    with torch.no_grad():
        a, b = (gpt(t, positions, None) for t in (tokens, perturbed))  # logits [1, s, vocab]
    return [i for i in range(SEQ) if not torch.equal(a[0, i], b[0, i])]


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mega import megatron_cpu, megatron_fixes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    megatron_fixes.apply()
    megatron_cpu.apply()  # among others, megatron builds the band mask with device="cuda"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel()
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)

    every_2 = _config(window_size=4, full_attention_every=2)
    results = {
        "vs_reference": {str(w): _attention_vs_reference(w) for w in (None, 1, 4, 9)},
        "vs_reference_gqa": _attention_vs_reference(4, groups=2),
        "wide_window_equals_full": {str(w): _wide_window_equals_full(w) for w in (SEQ - 1, SEQ, 100)},
        "layer_windows": [_core_attention(every_2, n).scale_mask_softmax.window_size for n in (1, 2, 3, 4)],
        "reach": {
            "full": _positions_token0_reaches(),
            "1 layer, window 4": _positions_token0_reaches(num_layers=1, window_size=4),
            "2 layers, window 4": _positions_token0_reaches(window_size=4),
            "2 layers, window 4, parallel block": _positions_token0_reaches(window_size=4, block="parallel"),
            "2 layers, window 4, every 2nd full": _positions_token0_reaches(
                window_size=4, full_attention_every=2
            ),
        },
    }
    Path(out_dir, "results.json").write_text(json.dumps(results))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("swa")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(out)), nprocs=1, join=True)
    return json.loads((out / "results.json").read_text())


# ---------------------------------------------------------------------------------------------
# Numerics


@pytest.mark.parametrize("window", ["None", "1", "4", "9"])
def test_equals_brute_force_reference_outputs_and_gradients(results, window):
    errors = results["vs_reference"][window]
    for what in ("output", "grad_q", "grad_k", "grad_v"):
        assert errors[what] < 1e-12, (window, errors)
    assert errors["output_scale"] > 0.1  # a real signal, not zeros on both sides


def test_equals_brute_force_reference_with_grouped_query_attention(results):
    errors = results["vs_reference_gqa"]
    assert max(errors[k] for k in ("output", "grad_q", "grad_k", "grad_v")) < 1e-12, errors


@pytest.mark.parametrize("window", [str(SEQ - 1), str(SEQ), "100"])
def test_window_covering_the_sequence_is_full_attention(results, window):
    assert results["wide_window_equals_full"][window]


def test_full_attention_every_2nd_layer(results):
    # 1-based layers 2 and 4 attend fully, 1 and 3 use the (left, right) = (4, 0) window
    assert results["layer_windows"] == [[4, 0], None, [4, 0], None]


def test_information_travels_window_tokens_per_layer(results):
    """Perturb token 0: with a window of 4, each windowed layer carries it 4 positions further;
    a full-attention layer carries it to the end."""
    reach = results["reach"]
    everything = list(range(SEQ))
    assert reach["full"] == everything
    assert reach["1 layer, window 4"] == list(range(5))
    assert reach["2 layers, window 4"] == list(range(9))
    assert reach["2 layers, window 4, parallel block"] == list(range(9))
    assert reach["2 layers, window 4, every 2nd full"] == everything


# ---------------------------------------------------------------------------------------------
# Configuration, backend choice, MFU


@pytest.mark.parametrize(
    "model, key",
    [
        ({"window_size": 0}, "model.window_size"),
        ({"window_size": 8, "full_attention_every": 0}, "model.full_attention_every"),
        ({"full_attention_every": 2}, "model.full_attention_every"),  # needs a window
    ],
)
def test_invalid_window_settings_name_the_key(model, key):
    with pytest.raises(ConfigError) as err:
        from_dict({"model": model})
    assert err.value.key == key


def test_transformer_config_gets_megatrons_window_arguments():
    from mega.model import transformer_config

    tcfg = transformer_config(_config(window_size=8, full_attention_every=3))
    assert (tcfg.window_size, tcfg.window_attn_skip_freq) == ((8, 0), 3)
    assert transformer_config(_config()).window_size is None


def test_flash_attention_only_where_it_can_run(monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mega.layers import attention

    gpu = {"cluster": {"device": "cuda", "backend": "nccl"}, "train": {"precision": "bf16"}}
    windowed_gpu = from_dict({"model": {"window_size": 8}, **gpu}, validate_config=False)
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert attention.core_attention_class(windowed_gpu, "bf16") is attention.FlashWindowAttention
    assert attention.core_attention_class(windowed_gpu, "fp32") is DotProductAttention  # no fp32 kernel
    assert attention.core_attention_class(from_dict({}, validate_config=False), "fp32") is DotProductAttention
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    assert attention.core_attention_class(windowed_gpu, "bf16") is DotProductAttention


def test_mfu_counts_windowed_and_full_layers_separately():
    cfg = from_dict(
        {
            "model": {
                "num_layers": 4,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "seq_length": 16,
                "window_size": 3,
                "full_attention_every": 2,
            },
            "parallelism": {
                "tp": 1,
                "pp": 1,
                "vpp": None,
                "dp": 1,
                "micro_batch_size": 2,
                "global_batch_size": 4,
            },
            "cluster": {"procs_per_node": 1},
        }
    )
    m, tokens = cfg.model, 4 * 16
    full = model_flops_per_token(m)  # every layer attends to all 16 positions

    def attention_saving(layers):  # forward + backward (x3) of scores and values, 16 -> 4 keys
        return 3 * layers * 2 * 2 * (16 - 4) * 8

    # layers 1 and 3 windowed, 2 and 4 full
    assert model_flops_per_step(cfg) == (full - attention_saving(2)) * tokens
    cfg.model.full_attention_every = None
    assert model_flops_per_step(cfg) == (full - attention_saving(4)) * tokens
    cfg.model.window_size = None
    assert model_flops_per_step(cfg) == full * tokens
    # the per-token count with explicit arguments agrees; 3 layers with every=2: one full layer
    three = ModelConfig(num_layers=3, hidden_size=8, num_attention_heads=2, seq_length=16)
    assert model_flops_per_token(three, window=3, full_attention_every=2) == (
        model_flops_per_token(three) - attention_saving(2)
    )
