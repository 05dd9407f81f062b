"""The parallel transformer block of MegaScale (and GPT-J): ``y = x + Attn(LN(x)) + MLP(LN(x))``.

Attention and MLP read the same normalised input, so their outputs can be added *before* the
tensor-parallel reduction that both row-parallel output projections (attention ``linear_proj``,
MLP ``linear_fc2``) would otherwise do on their own: each TP rank holds a partial sum of either
branch, the partial sums add up, and one all-reduce (one reduce-scatter under sequence
parallelism) per layer replaces two. The biases of the two projections are added once, after that
reduction, as megatron's bias-dropout-add does for a single branch.

Built by extension: ``parallel_layer_spec`` rewrites an ordinary megatron-core layer spec (swap the
layer class, drop the pre-MLP norm, swap the two output projections); everything else —
attention, core attention (sliding window included), MLP, the parameter names and the inherited
``sharded_state_dict`` — is megatron's own.
"""

from __future__ import annotations

import dataclasses

from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor


class UnreducedRowParallelLinear(RowParallelLinear):
    """A row-parallel linear layer that returns its rank's partial product, *not* reduced over TP.

    The caller owns the reduction (and must do it, or the result is wrong under TP>1). The bias
    is returned separately and never added here: added before a reduction it would count TP times.
    """

    # A subclass may defer its GEMM to the layer (mega/overlap, parallelism.tp_overlap): its
    # forward then returns its input, and this classmethod computes sum_i x_i @ W_i^T of the
    # layer's (input, weight) pairs and reduce-scatters it, overlapping GEMMs and communication.
    fused_gemm_reduce_scatter = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.skip_bias_add:
            raise ValueError(
                "UnreducedRowParallelLinear needs skip_bias_add=True: the bias belongs "
                "after the tensor-parallel reduction, which the caller does"
            )
        if self.explicit_expert_comm:
            raise ValueError("UnreducedRowParallelLinear is for dense layers, not experts")

    def forward(self, input_):
        # input_is_parallel is always true for attention's linear_proj and the MLP's linear_fc2;
        # RowParallelLinear's scatter path for a full input is not needed here.
        assert self.input_is_parallel, "expects the TP-partitioned input of a row-parallel layer"
        partial = self._forward_impl(
            input=input_,
            weight=self.weight,
            bias=None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=None,
            grad_output_buffer=None,
        )
        return partial, self.bias


class ParallelTransformerLayer(TransformerLayer):
    """A megatron ``TransformerLayer`` whose attention and MLP branches run side by side on one
    LayerNorm's output and share one TP reduction. Build it with ``parallel_layer_spec``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._check_built_for_one_reduction()

    def _check_built_for_one_reduction(self) -> None:
        problems = []
        if not isinstance(self.pre_mlp_layernorm, IdentityOp):
            problems.append("pre_mlp_layernorm must be IdentityOp (both branches read input_layernorm)")
        for name, proj in [
            ("self_attention.linear_proj", getattr(self.self_attention, "linear_proj", None)),
            ("mlp.linear_fc2", getattr(self.mlp, "linear_fc2", None)),
        ]:
            if not isinstance(proj, UnreducedRowParallelLinear):
                problems.append(f"{name} must be UnreducedRowParallelLinear, got {type(proj).__name__}")
        projections = {
            type(getattr(self.self_attention, "linear_proj", None)),
            type(getattr(self.mlp, "linear_fc2", None)),
        }
        if len(projections) != 1:
            problems.append(
                "linear_proj and linear_fc2 must be of one class (both deferred to the fused "
                "GEMM->reduce-scatter or neither)"
            )
        elif (
            getattr(projections.pop(), "fused_gemm_reduce_scatter", None)
            and not self.config.sequence_parallel
        ):
            problems.append("projections deferred to a GEMM->reduce-scatter need sequence parallelism")
        if not isinstance(self.cross_attention, IdentityOp):
            problems.append("cross attention is not supported")
        if self.is_moe_layer:
            problems.append("MoE MLPs are not supported")
        if self.recompute_input_layernorm or self.recompute_mlp:
            problems.append(
                "selective recompute of 'layernorm'/'mlp' is not supported "
                "(recompute_granularity=full and 'core_attn' are)"
            )
        if problems:
            raise ValueError("ParallelTransformerLayer: " + "; ".join(problems))

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        context=None,
        context_mask=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        padding_mask=None,  # used by MoE routing only
        **unused,  # e.g. dynamic_inference_decode_only, a CUDA-graph cache key
    ):
        residual = hidden_states
        normed = self.input_layernorm(hidden_states)

        attn_partial, attn_bias = self.self_attention(
            normed,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        mlp_partial, mlp_bias = self.mlp(normed)

        # The one TP collective of the layer: [s, b, h] partial sums -> [s, b, h] (or [s/tp, b, h]
        # under sequence parallelism, the layout the residual stream has there).
        fused = self.self_attention.linear_proj.fused_gemm_reduce_scatter
        if fused is not None:  # the projections returned their inputs: GEMMs and reduction in one
            reduced = fused(
                [
                    (attn_partial, self.self_attention.linear_proj.weight),
                    (mlp_partial, self.mlp.linear_fc2.weight),
                ],
                self.tp_group,
            )
        elif self.config.sequence_parallel:
            reduced = reduce_scatter_to_sequence_parallel_region(
                attn_partial + mlp_partial, group=self.tp_group
            )
        else:
            reduced = reduce_from_tensor_model_parallel_region(
                attn_partial + mlp_partial, group=self.tp_group
            )
        if attn_bias is None or mlp_bias is None:  # add_bias_linear=False: both are None
            bias = mlp_bias if attn_bias is None else attn_bias
        else:
            bias = attn_bias + mlp_bias

        # One bias-dropout-add for both branches: x + dropout(attn + mlp + b_attn + b_mlp).
        with self.bias_dropout_add_exec_handler():
            output = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                (reduced, bias), residual, self.hidden_dropout
            )
        # A viewless tensor, as TransformerLayer returns: activation checkpointing and pipeline
        # send/recv reject views.
        output = make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)
        return output, context


def _with_projection(spec: ModuleSpec, field: str) -> ModuleSpec:
    submodules = dataclasses.replace(spec.submodules, **{field: UnreducedRowParallelLinear})
    return dataclasses.replace(spec, submodules=submodules)


def parallel_layer_spec(sequential: ModuleSpec) -> ModuleSpec:
    """The parallel-block version of a (local, dense) megatron-core ``TransformerLayer`` spec."""
    sub = sequential.submodules
    parallel = dataclasses.replace(
        sub,
        self_attention=_with_projection(sub.self_attention, "linear_proj"),
        mlp=_with_projection(sub.mlp, "linear_fc2"),
        pre_mlp_layernorm=IdentityOp,  # one LayerNorm feeds both branches
        self_attn_bda=IdentityFuncOp,  # unused: the layer adds both branches in mlp_bda
    )
    return dataclasses.replace(sequential, module=ParallelTransformerLayer, submodules=parallel)
