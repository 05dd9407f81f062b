"""``tp_overlap=te``: megatron's ``tp_comm_overlap`` with Transformer Engine userbuffers (GPU only).

megatron-core's TE linear wrappers (``megatron/core/extensions/transformer_engine.py``) turn
``TransformerConfig.tp_comm_overlap`` and its ``tp_comm_overlap_ag/_rs/_rs_dgrad`` and
``tp_comm_bulk_wgrad/_dgrad`` companions into TE's ``ub_overlap_*``/``ub_bulk_*`` arguments, named by
the layer's buffer (``qkv``, ``proj``, ``fc1``, ``fc2``). What the pip package does not have is the
userbuffer set-up that Megatron-LM's ``megatron/training/initialize.py`` makes before the model is
built: ``transformer_engine.pytorch.module.base.initialize_ub`` with one buffer of
``[seq_length * micro_batch_size / context_parallel, hidden]`` for the TP group.
``initialize_userbuffers`` makes that call (Transformer Engine is imported there, never at module
import).

The layer spec (``te_layer_spec``) uses megatron's own TE modules where the overlap happens, as
megatron's TE spec does: ``TELayerNormColumnParallelLinear`` (LayerNorm fused into the QKV and FC1
GEMMs, whose input all-gather is overlapped; the separate LayerNorms become ``IdentityOp``, so
the parameter names are TE's ``linear_qkv.layer_norm_weight``... rather than
``input_layernorm.weight``) and ``TERowParallelLinear`` (reduce-scatter overlapped). Core attention
stays mega's choice (docs/model.md).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

# TransformerConfig fields megatron's TE wrappers read (their defaults spelled out, so the run
# record says what was on): AG/RS pipelined with the forward GEMMs, bulk overlap of the backward
# all-gather with dgrad and of the dgrad reduce-scatter with wgrad.
TRANSFORMER_CONFIG = {
    "tp_comm_overlap": True,
    "tp_comm_overlap_ag": True,
    "tp_comm_overlap_rs": True,
    "tp_comm_bulk_wgrad": True,
    "tp_comm_bulk_dgrad": True,
    "tp_comm_overlap_rs_dgrad": False,
    "tp_comm_bootstrap_backend": "nccl",
}


def te_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """A local sequential-block layer spec with megatron's TE linears where userbuffers overlap."""
    from megatron.core.extensions import transformer_engine as mte

    if not mte.HAVE_TE:
        raise ImportError(
            "parallelism.tp_overlap=te needs Transformer Engine (pip install "
            "transformer-engine[pytorch]) on the GPU nodes"
        )
    return _with_te_linears(spec, mte.TELayerNormColumnParallelLinear, mte.TERowParallelLinear)


def _with_te_linears(spec: ModuleSpec, column: Any, row: Any) -> ModuleSpec:
    sub = spec.submodules
    attention = sub.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, linear_qkv=column, linear_proj=row)
    )
    mlp = dataclasses.replace(
        sub.mlp, submodules=dataclasses.replace(sub.mlp.submodules, linear_fc1=column, linear_fc2=row)
    )
    return dataclasses.replace(
        spec,
        submodules=dataclasses.replace(
            sub, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp, self_attention=attention, mlp=mlp
        ),
    )


def userbuffer_arguments(cfg, dtype) -> dict:
    """What Megatron-LM passes to ``initialize_ub``: the buffer shape (tokens of one microbatch
    on the TP group, context parallelism 1 in mega), the TP size, no FP8, the bootstrap backend;
    and the buffer dtype, which Megatron-LM leaves at TE's bf16 default and mega takes from the
    model's precision."""
    m, p = cfg.model, cfg.parallelism
    return {
        "shape": [m.seq_length * p.micro_batch_size, m.hidden_size],
        "tp_size": p.tp,
        "dtype": dtype,
        "ub_cfgs": {},  # TE's default method/SM count per GEMM
        "bootstrap_backend": TRANSFORMER_CONFIG["tp_comm_bootstrap_backend"],
    }


def initialize_userbuffers(cfg, dtype, te_base=None) -> dict:
    """Call TE's ``initialize_ub`` as Megatron-LM's ``_initialize_tp_communicators`` does, before
    the model is built (TE's linears assert it). ``te_base`` is
    ``transformer_engine.pytorch.module.base`` (imported here by default). Returns the arguments
    passed. The signature decides the form: TE >= 2.8 takes ``quantization_modes``, TE 1.9-2.7
    ``use_fp8``; older TE bootstraps over MPI only and is refused."""
    if te_base is None:
        from transformer_engine.pytorch.module import base as te_base
    params = inspect.signature(te_base.initialize_ub).parameters
    if "bootstrap_backend" not in params:
        raise RuntimeError(
            "parallelism.tp_overlap=te needs Transformer Engine >= 1.9 (userbuffers "
            "bootstrapped over torch.distributed)"
        )
    kwargs = userbuffer_arguments(cfg, dtype)
    if "quantization_modes" in params:
        kwargs["quantization_modes"] = [te_base.UserBufferQuantizationMode.NONE]
    else:
        kwargs["use_fp8"] = False
    te_base.initialize_ub(**kwargs)
    return kwargs
