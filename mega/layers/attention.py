"""Core attention for sliding-window attention (SWA): which kernel computes softmax(QK^T + mask)V.

megatron-core's local ``DotProductAttention`` already honours ``TransformerConfig.window_size`` and
``window_attn_skip_freq`` (it builds a banded causal mask per layer), on CPU and GPU alike, but it
materialises the full ``s x s`` score matrix. On a GPU with flash-attn installed and a 16-bit
model, ``FlashWindowAttention`` runs flash-attn's banded kernel instead, which skips the blocks
outside the window. flash-attn is imported only when that module is built, never at import time:
it is a GPU-only package. (Not exercised by the CPU test suite; see docs/model.md.)
"""

from __future__ import annotations

import importlib.util

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention

from mega.config import MegaConfig


def flash_attn_available() -> bool:
    """flash-attn imports here: a wheel built for another torch or CUDA is installed (found) but
    fails at import, so only importing it tells (lazily, never at module import)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def core_attention_class(cfg: MegaConfig, precision: str) -> type:
    """The core-attention module of the layer spec: flash-attn's sliding window on a GPU when it
    can run (installed, fp16/bf16 inputs), megatron's DotProductAttention otherwise."""
    use_flash = (
        cfg.model.window_size is not None
        and cfg.cluster.device == "cuda"
        and precision in ("bf16", "fp16")  # flash-attn has no fp32 kernels
        and flash_attn_available()
    )
    return FlashWindowAttention if use_flash else DotProductAttention


class FlashWindowAttention(DotProductAttention):
    """DotProductAttention's interface and per-layer window choice, flash-attn's kernel.

    ``DotProductAttention.__init__`` decides per layer (``window_attn_skip_freq``) whether this
    layer is windowed and hands the window to its softmax; we read it from there, so both backends
    agree on which layers attend fully. Like the torch path with a window, this ignores
    ``attention_mask`` (causal + window only; mega passes None).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from flash_attn import flash_attn_func  # GPU-only package: imported here, lazily

        self._flash_attn_func = flash_attn_func
        window = self.scale_mask_softmax.window_size
        # flash-attn's (left, right) window; -1 = unbounded. causal=True already forbids right.
        self.flash_window = (-1, -1) if window is None else (int(window[0]), 0)
        # DotProductAttention splits the scale between softmax_scale and the softmax's coefficient
        # under apply_query_key_layer_scaling; the kernel takes the product.
        self.flash_scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        assert packed_seq_params is None and attention_bias is None, "not supported by this backend"
        # megatron: [s, b, heads, d]; flash-attn: [b, s, heads, d]. Grouped-query K/V (fewer
        # heads) are accepted by the kernel as they are.
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0

        def attend():
            return self._flash_attn_func(
                q,
                k,
                v,
                dropout_p=dropout,
                softmax_scale=self.flash_scale,
                causal=True,
                window_size=self.flash_window,
            )

        if dropout and not self.config.sequence_parallel:
            # Per-TP-rank dropout stream, as DotProductAttention does.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, s, heads, d] -> [s, b, heads * d]
        context = context.transpose(0, 1).contiguous()
        return context.view(context.size(0), context.size(1), self.hidden_size_per_partition)
