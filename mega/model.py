"""Build the megatron-core GPT of a MegaConfig: one module per virtual pipeline stage.

The layer comes from a megatron-core ``ModuleSpec`` (``layer_spec``), so co-design variants plug in
by spec rather than by fork. With ``model.init=layout_invariant`` every weight is drawn from a
generator seeded by (seed, its global name) and then sliced for tensor parallelism, so any
TP/PP/VPP/DP layout starts from the same model — the property the layout-equivalence tests check.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch
from megatron.core import parallel_state as ps
from megatron.core.activations import squared_relu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from mega.cluster.backend_flags import backend_flags
from mega.cluster.backend_flags import resolve_precision as resolve_precision  # re-export
from mega.config import MegaConfig
from mega.layers import core_attention_class, fused, parallel_layer_spec
from mega.overlap import pp_dp
from mega.overlap import tp as tp_overlap

# model.activation -> megatron-core's activation_func (SwiGLU: SiLU with gated_linear_unit)
ACTIVATIONS = {
    "gelu": torch.nn.functional.gelu,
    "swiglu": torch.nn.functional.silu,
    "squared_relu": squared_relu,
}


def transformer_config(cfg: MegaConfig) -> TransformerConfig:
    m, p = cfg.model, cfg.parallelism
    flags = backend_flags(cfg)  # everything that differs between GPU and CPU runs
    if m.fused_ops:
        fused.guard_megatron_fusions(flags.device)
    # full recomputation: every layer its own checkpoint (uniform), or only the first
    # recompute_num_layers layers of each model chunk (block; the others keep their activations)
    recompute_method = None
    if m.recompute == "full":
        recompute_method = "uniform" if m.recompute_num_layers is None else "block"
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn,
        normalization=m.normalization,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=ACTIVATIONS[m.activation],
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_size,
        account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split,
        sequence_parallel=p.sequence_parallel,
        cp_comm_type=p.cp_comm_type,  # read only where context_parallel_size > 1 (planning only here)
        pipeline_dtype=flags.torch_dtype(flags.pipeline_dtype),
        params_dtype=flags.torch_dtype(flags.params_dtype),
        bf16=flags.precision == "bf16",
        fp16=flags.precision == "fp16",
        use_cpu_initialization=flags.use_cpu_initialization,
        cuda_graph_scope=[],  # megatron's default "full" is deprecated, warns, and means [] (no CUDA graphs)
        batch_p2p_comm=flags.batch_p2p_comm,  # off on gloo: wrong losses at PP=2 (backend_flags)
        recompute_granularity=m.recompute,
        recompute_method=recompute_method,
        recompute_num_layers=None if m.recompute != "full" else m.recompute_num_layers or 1,
        # Sliding-window attention: a query sees itself and window_size earlier tokens; every
        # full_attention_every-th layer (global 1-based numbering, PP/VPP-proof) attends fully.
        window_size=None if m.window_size is None else (m.window_size, 0),
        window_attn_skip_freq=m.full_attention_every,
        # model.fused_ops: megatron's torch.compile'd bias-GeLU (tanh GeLU) and bias-dropout-add
        # (+ residual); the fused LayerNorm and flash-attn come in by spec (mega/layers/fused.py).
        # CUDA-only kernels stay off.
        masked_softmax_fusion=False,
        bias_activation_fusion=m.fused_ops and m.activation != "squared_relu",  # megatron fuses GeLU, SwiGLU
        bias_dropout_fusion=m.fused_ops,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        # parallelism.tp_overlap=te: megatron's tp_comm_overlap (Transformer Engine userbuffers)
        **tp_overlap.transformer_config_kwargs(cfg),
        # parallelism.overlap_p2p_comm(_warmup_flush) / comm_overlap=auto (mega/overlap/pp_dp.py)
        **pp_dp.transformer_config_kwargs(cfg),
    )


def layer_spec(cfg: MegaConfig) -> ModuleSpec:
    """megatron-core's local GPT layer, with mega's co-design choices plugged in by spec:
    the core attention behind sliding windows, the fused LayerNorm and flash-attn of
    ``model.fused_ops``, and ``model.block=parallel``."""
    spec = get_gpt_layer_local_spec(normalization=cfg.model.normalization)
    attention = spec.submodules.self_attention
    if cfg.model.fused_ops:
        core_attention = fused.core_attention_class(cfg, resolve_precision(cfg))
    else:
        core_attention = core_attention_class(cfg, resolve_precision(cfg))
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=core_attention))
    spec = replace(spec, submodules=replace(spec.submodules, self_attention=attention))
    if fused_norm(cfg):
        norm = fused.layer_norm_class(cfg)
        spec = replace(
            spec, submodules=replace(spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm)
        )
    if cfg.model.block == "parallel":
        spec = parallel_layer_spec(spec)
    # parallelism.tp_overlap: TP/SP collectives overlapped with the GEMMs (docs/overlap.md)
    return tp_overlap.layer_spec(cfg, spec)


def fused_norm(cfg: MegaConfig) -> bool:
    """Whether ``model.fused_ops`` swaps in the fused LayerNorm; an RMSNorm stays megatron's
    (torch's ``RMSNorm``): the fused classes mega can fall back to are LayerNorms."""
    return cfg.model.fused_ops and cfg.model.normalization == "LayerNorm"


def decoder_spec(
    cfg: MegaConfig, tcfg: TransformerConfig, vp_stage: int | None
) -> ModuleSpec | TransformerBlockSubmodules:
    """The layer spec, or with ``model.fused_ops`` the block's submodules, so that the final
    LayerNorm is the fused one too (megatron picks its own for a bare layer spec)."""
    spec = layer_spec(cfg)
    if not fused_norm(cfg):
        return spec
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(tcfg, vp_stage=vp_stage),
        layer_norm=fused.layer_norm_class(cfg),
    )


def build_model_chunks(cfg: MegaConfig, tcfg: TransformerConfig) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage of this rank (a single one without VPP)."""
    vpp = cfg.parallelism.virtual_pipeline_size
    tp_overlap.before_model_build(cfg, tcfg.params_dtype)  # te: userbuffers precede the layers
    chunks = []
    for vp_stage in range(cfg.parallelism.chunks_per_stage):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=decoder_spec(cfg, tcfg, stage),
            vocab_size=cfg.model.padded_vocab_size,
            max_sequence_length=cfg.model.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=cfg.model.tie_embeddings,
            position_embedding_type=cfg.model.position_embedding,
            rotary_base=cfg.model.rotary_base,
            vp_stage=stage,
        )
        if cfg.model.init == "layout_invariant":
            init_layout_invariant(model, cfg.train.seed, cfg.model.init_method_std)
        if backend_flags(cfg).device == "cuda":
            model.cuda(torch.cuda.current_device())
        chunks.append(to_params_dtype(model, tcfg))
    return chunks


def to_params_dtype(model: GPTModel, tcfg: TransformerConfig) -> GPTModel:
    """Every parameter and buffer in ``params_dtype`` under bf16/fp16, as megatron's
    ``Float16Module`` casts the model before DDP wraps it: megatron builds its linear and
    word-embedding weights in ``params_dtype`` but the position embeddings and the torch LayerNorms
    in fp32, and a GEMM of mixed dtypes fails. The distributed optimizer keeps fp32 main copies.
    (Float16Module's other job, casting the first stage's inputs and the last stage's output, has
    nothing to do here: the inputs are token ids and the output is the fp32 loss of megatron's
    cross-entropy.)"""
    if tcfg.bf16 or tcfg.fp16:
        model.to(tcfg.params_dtype)
    return model


def global_parameter_names(model: MegatronModule) -> dict[str, torch.nn.Parameter]:
    """Name parameters as a one-stage, one-chunk model would: layer indices become global."""
    names = {}
    layer_of = {}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        for local_index, layer in enumerate(decoder.layers):
            layer_of[f"decoder.layers.{local_index}."] = f"decoder.layers.{layer.layer_number - 1}."
    for name, param in model.named_parameters():
        for local, global_ in layer_of.items():
            if name.startswith(local):
                name = global_ + name[len(local) :]
                break
        names[name] = param
    return names


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def init_layout_invariant(model: MegatronModule, seed: int, std: float) -> None:
    """Draw each full weight from a generator seeded by its global name, keep this rank's slice.

    Matrices ~ N(0, std), norms' weights = 1, biases = 0 (megatron's own scheme, minus the
    1/sqrt(2L) output scaling which we leave to the std). The shared output weight of a tied
    embedding reads the embedding's name so both copies agree.
    """
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    gated = model.config.gated_linear_unit
    with torch.no_grad():
        for name, param in global_parameter_names(model).items():
            if name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
                name = "embedding.word_embeddings.weight"
            if name.endswith("bias"):
                param.zero_()
                continue
            if (
                "layernorm" in name or "norm." in name or "layer_norm_weight" in name
            ):  # TE fuses LN into linears
                param.fill_(1.0)
                continue
            full_shape = list(param.shape)
            partitioned = getattr(param, "tensor_model_parallel", False) and tp_size > 1
            if partitioned:
                full_shape[param.partition_dim] *= tp_size
            gen = torch.Generator().manual_seed(_seed_of(seed, name))
            full = torch.randn(full_shape, generator=gen, dtype=torch.float32) * std
            if partitioned and gated and ".mlp.linear_fc1." in name:
                # megatron's SwiGLU fc1 holds [gate; up] rows on every TP rank (its
                # sharded_state_dict splits them so): each half is split on its own
                full = torch.cat([half.chunk(tp_size, dim=0)[tp_rank] for half in full.chunk(2, dim=0)])
            elif partitioned:
                full = full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
            param.copy_(full.to(param.dtype))
