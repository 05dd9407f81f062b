"""Fused operators (``model.fused_ops=true``): which kernels run LayerNorm, bias-GeLU,
bias-dropout-add and full causal attention. See "Fused operators" in docs/model.md.

* **bias-GeLU** and **bias-dropout-add (+ residual)** are megatron-core's own fusions
  (``TransformerConfig.bias_activation_fusion`` / ``bias_dropout_fusion``), whose functions
  megatron wraps in ``torch.compile`` (Inductor: C++ on CPU, Triton on GPU).
* **LayerNorm**: on a GPU, Transformer Engine's ``TENorm`` or Apex's fused LayerNorm when one
  imports; otherwise ``FusedLayerNorm`` below, ``F.layer_norm`` through ``torch.compile``.
* **flash-attn** for full causal attention, as ``FlashWindowAttention`` already does for windows.

``torch.compile`` is optional: when it cannot build a kernel here (no C++ compiler, no Triton, a
platform without Inductor), the same functions run eagerly, with the same math, and a warning is
logged once. Nothing GPU-only is imported at module import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil

import torch
import torch.nn.functional as F

from mega.config import MegaConfig

log = logging.getLogger(__name__)

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


# ---------------------------------------------------------------------------------------------
# torch.compile: available or not


def compile_unavailable_reason(device: str = "cpu") -> str | None:
    """Why Inductor cannot compile for ``device`` ("cpu" | "cuda") here; None when it can."""
    if os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        return "TORCHDYNAMO_DISABLE=1"
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    try:
        dynamo_config = importlib.import_module("torch._dynamo.config")
        importlib.import_module("torch._inductor.config")
    except Exception as err:
        return f"Inductor does not import ({err})"
    if dynamo_config.disable:
        return "torch._dynamo is disabled"
    if device == "cuda":
        return None if importlib.util.find_spec("triton") is not None else "triton is not installed"
    from torch._inductor import config as inductor_config

    cxx = [c for c in inductor_config.cpp.cxx if c] or ["g++"]
    if not any(shutil.which(c) for c in cxx):
        return f"no C++ compiler found (tried {cxx})"
    return None


def guard_megatron_fusions(device: str) -> None:
    """megatron's fused bias-GeLU and bias-dropout-add are ``torch.compile``'d at import. Where
    Inductor cannot compile, turn dynamo off for this process, so that they run as the plain
    Python functions they wrap (the same math) instead of failing at the first step. (Nothing
    else could compile here either.)"""
    reason = compile_unavailable_reason(device)
    if reason is None:
        return
    import torch._dynamo

    torch._dynamo.config.disable = True
    _warn_once(
        "megatron",
        f"torch.compile unavailable ({reason}): megatron's fused bias-GeLU and "
        "bias-dropout-add run eagerly, same math",
    )


# ---------------------------------------------------------------------------------------------
# LayerNorm


def _layer_norm_eager(x, weight, bias, eps: float):
    return F.layer_norm(x, weight.shape, weight, bias, eps)


_layer_norm_compiled = None  # built on first use
_mode: str | None = None  # None: not tried yet; "compiled" | "eager"


def _use_eager(why: str) -> None:
    global _mode
    _mode = "eager"
    _warn_once(
        "layer_norm",
        f"FusedLayerNorm: torch.compile unavailable ({why}); running F.layer_norm eagerly, same math",
    )


def _probe(x, weight, bias, eps: float) -> None:
    """Compile and run forward *and* backward once on detached copies of the first real inputs:
    a compile error surfaces here (backward graphs are compiled lazily, at the first backward,
    where it could no longer be caught), and the real call then hits the compiled cache."""
    global _layer_norm_compiled, _mode
    reason = compile_unavailable_reason(x.device.type)
    if reason is not None:
        return _use_eager(reason)
    try:
        if _layer_norm_compiled is None:
            _layer_norm_compiled = torch.compile(_layer_norm_eager, fullgraph=True)
        with torch.enable_grad():
            xs, ws, bs = (t.detach().requires_grad_(t.requires_grad) for t in (x, weight, bias))
            out = _layer_norm_compiled(xs, ws, bs, eps)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
    except Exception as err:
        return _use_eager(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    _mode = "compiled"


def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.layer_norm`` over the last dimension, compiled into one Inductor kernel (forward and
    backward) when ``torch.compile`` works here, eager otherwise."""
    if _mode is None:
        _probe(x, weight, bias, eps)
    if _mode == "eager":
        return _layer_norm_eager(x, weight, bias, eps)
    from torch._dynamo.exc import TorchDynamoException

    try:
        return _layer_norm_compiled(x, weight, bias, eps)
    except TorchDynamoException as err:  # e.g. a recompile (new shape or grad mode) that fails
        _use_eager(f"{type(err).__name__} on recompile")
        return _layer_norm_eager(x, weight, bias, eps)


def layer_norm_mode() -> str | None:
    """How ``FusedLayerNorm`` runs in this process: "compiled", "eager", or None before its first call."""
    return _mode


class FusedLayerNorm(torch.nn.Module):
    """A LayerNorm with megatron's norm interface, for layer specs (``input_layernorm``,
    ``pre_mlp_layernorm``) and the block's ``final_layernorm``.

    Parameters ``weight``/``bias`` as ``torch.nn.LayerNorm`` (so checkpoints are interchangeable
    with megatron's ``WrappedTorchNorm``), in fp32 until ``Float16Module`` casts them. Under
    sequence parallelism each rank normalises its own sequence slice with replicated weights;
    they are marked ``sequence_parallel`` so that ``finalize_model_grads`` all-reduces their
    gradients over TP (as Apex's FusedLayerNorm does, and mega's patch of WrappedTorchNorm).
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        super().__init__()
        if config.normalization != "LayerNorm" or normalization != "LayerNorm":
            raise ValueError(f"FusedLayerNorm is a LayerNorm, not {config.normalization}")
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("FusedLayerNorm does not implement zero-centered gamma")
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))
        for param in (self.weight, self.bias):
            param.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def layer_norm_class(cfg: MegaConfig) -> type:
    """The LayerNorm of the fused path: on a GPU, Transformer Engine's, else Apex's, when they
    import (lazily, here); ``FusedLayerNorm`` otherwise, and always on CPU."""
    if cfg.cluster.device == "cuda":
        if _importable("transformer_engine"):
            try:
                from megatron.core.extensions.transformer_engine import TENorm

                return TENorm
            except Exception as err:
                _warn_once("te", f"Transformer Engine does not import ({err}); not using TENorm")
        if _importable("apex"):
            try:
                importlib.import_module("apex")
                from megatron.core.fusions.fused_layer_norm import FusedLayerNorm as ApexFusedLayerNorm

                return ApexFusedLayerNorm
            except Exception as err:
                _warn_once("apex", f"Apex does not import ({err}); not using its fused LayerNorm")
    return FusedLayerNorm


# ---------------------------------------------------------------------------------------------
# Attention


def core_attention_class(cfg: MegaConfig, precision: str) -> type:
    """The core attention with fused ops on: flash-attn for full causal attention as well as for
    windows, where it can run (GPU, installed, fp16/bf16); megatron's otherwise."""
    from mega.layers import attention

    chosen = attention.core_attention_class(cfg, precision)
    if (
        chosen is not attention.FlashWindowAttention
        and cfg.cluster.device == "cuda"
        and precision in ("bf16", "fp16")
        and attention.flash_attn_available()
    ):
        return attention.FlashWindowAttention  # no window: flash_window = (-1, -1), causal
    return chosen
