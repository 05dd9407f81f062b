"""megatron's Column/RowParallelLinear with the sequence-parallel collectives overlapped with
their GEMMs, plugged into a layer spec by ``overlap_layer_spec`` (``parallelism.tp_overlap``).

The subclasses keep megatron's parameters, their TP attributes, initialisation and
``sharded_state_dict`` (checkpoints move freely between ``tp_overlap=none`` and the overlapped
backends) and replace only ``forward``: the all-gather + GEMM of a column-parallel layer and the
GEMM + reduce-scatter of a row-parallel one become one overlapped kernel of the chosen backend
(``ring``: ``mega.overlap.tp_ring``; ``symm_mem``: ``mega.overlap.symm_mem``).

In the parallel transformer block the two row-parallel projections defer their GEMMs
(``Deferred*``): the block hands both (input, weight) pairs to one overlapped
GEMM->reduce-scatter, keeping its single TP reduction per layer.
"""

from __future__ import annotations

import dataclasses

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from mega.layers.parallel_block import UnreducedRowParallelLinear
from mega.overlap import symm_mem, tp_ring

BACKENDS = {
    "ring": (tp_ring.all_gather_linear, tp_ring.linear_reduce_scatter),
    "symm_mem": (symm_mem.all_gather_linear, symm_mem.linear_reduce_scatter),
}


def _check_overlappable(layer, kind: str) -> None:
    problems = []
    if not layer.sequence_parallel:
        problems.append("needs sequence parallelism with tensor parallelism > 1")
    if layer.explicit_expert_comm:
        problems.append("is for dense layers, not experts")
    if layer.gradient_accumulation_fusion:
        problems.append("does not implement gradient_accumulation_fusion")
    if layer.config.defer_embedding_wgrad_compute:
        problems.append("does not implement defer_embedding_wgrad_compute")
    if problems:
        raise ValueError(
            f"{type(layer).__name__} ({kind}, tp_overlap={layer.backend}): " + "; ".join(problems)
        )


class OverlappedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel linear whose sequence-parallel input all-gather is overlapped with the GEMM."""

    backend = "ring"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_overlappable(self, "column-parallel")
        if self.gather_output:
            raise ValueError(f"{type(self).__name__}: gather_output=True is not supported")

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is not None or runtime_gather_output or not self.weight.requires_grad:
            raise ValueError(
                f"{type(self).__name__}: an explicit weight, runtime_gather_output and "
                "frozen weights are not supported"
            )
        all_gather_linear, _ = BACKENDS[self.backend]
        bias = None if self.skip_bias_add else self.bias
        output = all_gather_linear(input_, self.weight, bias, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class OverlappedRowParallelLinear(RowParallelLinear):
    """Row-parallel linear whose sequence-parallel output reduce-scatter is overlapped with the GEMM."""

    backend = "ring"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_overlappable(self, "row-parallel")

    def forward(self, input_):
        assert self.input_is_parallel, "sequence parallelism needs a TP-partitioned input"
        _, linear_reduce_scatter = BACKENDS[self.backend]
        output = linear_reduce_scatter([(input_, self.weight)], self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class DeferredRowParallelLinear(UnreducedRowParallelLinear):
    """The parallel block's row-parallel projection with its GEMM deferred: ``forward`` returns
    its input, and the block computes both branches' products in one overlapped
    GEMM->reduce-scatter (``fused_gemm_reduce_scatter``)."""

    backend = "ring"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_overlappable(self, "row-parallel")

    def forward(self, input_):
        return input_, self.bias

    @classmethod
    def fused_gemm_reduce_scatter(cls, pairs, group):
        return BACKENDS[cls.backend][1](pairs, group)


class SymmMemColumnParallelLinear(OverlappedColumnParallelLinear):
    backend = "symm_mem"


class SymmMemRowParallelLinear(OverlappedRowParallelLinear):
    backend = "symm_mem"


class SymmMemDeferredRowParallelLinear(DeferredRowParallelLinear):
    backend = "symm_mem"


_CLASSES = {  # (ring class, backend) -> the class of that backend
    (OverlappedColumnParallelLinear, "ring"): OverlappedColumnParallelLinear,
    (OverlappedRowParallelLinear, "ring"): OverlappedRowParallelLinear,
    (DeferredRowParallelLinear, "ring"): DeferredRowParallelLinear,
    (OverlappedColumnParallelLinear, "symm_mem"): SymmMemColumnParallelLinear,
    (OverlappedRowParallelLinear, "symm_mem"): SymmMemRowParallelLinear,
    (DeferredRowParallelLinear, "symm_mem"): SymmMemDeferredRowParallelLinear,
}


def overlap_layer_spec(spec: ModuleSpec, backend: str) -> ModuleSpec:
    """Swap the four TP linears of a local (sequential or parallel-block) layer spec for their
    overlapped versions of ``backend``."""
    column = _CLASSES[(OverlappedColumnParallelLinear, backend)]

    def row_for(current: type) -> type:
        if issubclass(current, UnreducedRowParallelLinear):
            return _CLASSES[(DeferredRowParallelLinear, backend)]
        if issubclass(current, RowParallelLinear):
            return _CLASSES[(OverlappedRowParallelLinear, backend)]
        raise ValueError(f"tp_overlap={backend}: cannot overlap a {current.__name__} output projection")

    def swap(module_spec: ModuleSpec, **fields) -> ModuleSpec:
        sub = module_spec.submodules
        for name in fields:
            current = getattr(sub, name)
            if not (
                isinstance(current, type) and issubclass(current, (ColumnParallelLinear, RowParallelLinear))
            ):
                raise ValueError(f"tp_overlap={backend}: {name} is {current!r}, not a megatron TP linear")
        return dataclasses.replace(module_spec, submodules=dataclasses.replace(sub, **fields))

    sub = spec.submodules
    attention = swap(
        sub.self_attention, linear_qkv=column, linear_proj=row_for(sub.self_attention.submodules.linear_proj)
    )
    mlp = swap(sub.mlp, linear_fc1=column, linear_fc2=row_for(sub.mlp.submodules.linear_fc2))
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, self_attention=attention, mlp=mlp))
