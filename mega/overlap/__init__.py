"""Communication overlap (docs/overlap.md).

``parallelism.tp_overlap`` picks how the tensor-parallel collectives of sequence parallelism meet
the GEMMs: ``ring`` (``tp_ring``: chunked p2p ring all-gather->GEMM and GEMM->reduce-scatter in
pure torch, gloo and NCCL), ``symm_mem`` (``symm_mem``: torch's fused symmetric-memory ops,
CUDA only), ``te`` (``te``: megatron's ``tp_comm_overlap`` with Transformer Engine userbuffers).
``checks`` validates the choice without importing torch; ``tp`` plugs it into the model.
"""
