"""Co-design layers that plug into megatron-core by ``ModuleSpec`` (see docs/model.md):
the parallel transformer block and the core attention behind sliding-window attention."""

from mega.layers.attention import FlashWindowAttention, core_attention_class
from mega.layers.parallel_block import (
    ParallelTransformerLayer,
    UnreducedRowParallelLinear,
    parallel_layer_spec,
)

__all__ = [
    "FlashWindowAttention",
    "ParallelTransformerLayer",
    "UnreducedRowParallelLinear",
    "core_attention_class",
    "parallel_layer_spec",
]
