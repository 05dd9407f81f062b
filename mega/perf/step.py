"""Step time of a training configuration as a sum of explicit terms (docs/perf-model.md).

One microbatch through one transformer layer on one rank costs GEMMs (roofline), attention (two
batched GEMMs + softmax traffic, or one fused kernel), elementwise traffic, the exposed part of its
tensor-parallel collectives and, under recomputation, part of its forward again. A pipeline stage
runs its layers (+ embedding / logits and loss) for every microbatch; the slowest stage sets the
pace and the interleaved 1F1B bubble adds ``(pp - 1) / vpp`` microbatch-times. Data parallelism
adds the exposed part of the gradient reduce-scatter and the parameter all-gather (under
``parallelism.fsdp``, every unit's gathers and reduce-scatter every microbatch); then come the
optimizer step, the tied-embedding gradient sync, data loading and host overheads, and on GPUs the
stragglers (the slowest of the data-parallel replicas sets the step, mega.perf.scale). On a CPU
whose ranks share cores, the step cannot be shorter than all ranks' work divided by the cores.

Context parallelism (``parallelism.cp``, megatron-core's CP with Transformer Engine's attention)
gives each rank ``seq_length / cp`` tokens of every sample: everything per microbatch acts on them,
the attention core does ``1/cp`` of the causal work, and exchanging K and V between the cp ranks
(``parallelism.cp_comm_type``: TE's p2p ring or its all-gather) adds its exposed part
(``cp_comm_seconds``); gradients reduce over dp x cp.

Overlap features are read from the config, not from a preset name: ``parallelism.tp_overlap``
(ring/te: TP collectives chunked with their GEMMs), ``overlap_p2p_comm`` (pipeline send/receive
off the critical path), ``overlap_grad_reduce``, ``overlap_param_gather``, ``align_param_gather``,
``overlap_param_gather_with_optimizer_step``; ``comm_overlap=auto`` is resolved by
mega.overlap.pp_dp.resolve, as training resolves it (``effective_overlap``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass, field

from mega.config import ConfigError, MegaConfig
from mega.flops import attention_layer_counts, model_flops_per_step, model_flops_per_token
from mega.overlap import pp_dp
from mega.perf.hardware import Hardware
from mega.perf.memory import (
    Memory,
    buckets,
    fsdp_units,
    kv_size,
    layer_activation_bytes,
    layer_params,
    memory_per_gpu,
    stage_params,
)
from mega.perf.scale import straggler_s

# Bytes of an activation, gradient or weight element at each training precision. fp8 keeps them in
# bf16: only the linear GEMMs' operands are cast to FP8 (Transformer Engine's recipes).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
FP8_BYTES = 1
MX_BLOCK = 32  # MXFP8: elements sharing one E8M0 scale (OCP Microscaling Formats v1.0)
MXFP8_BYTES = 2 * FP8_BYTES * (1 + 1 / MX_BLOCK)  # its row-wise and column-wise copies, with their scales


CROSS_ENTROPY = ("megatron", "fused", "te")


@dataclass(frozen=True)
class CrossEntropyCost:
    """What one implementation of the vocab-parallel cross entropy moves: bytes per logit and
    kernels of its forward and backward, and its TP collectives as (kind, bytes per token each
    rank contributes)."""

    forward_bytes: int
    forward_kernels: int
    backward_bytes: int
    backward_kernels: int
    collectives: tuple[tuple[str, int], ...]


def cross_entropy_cost(impl: str, dtype: int) -> CrossEntropyCost:
    """The loss over logits of ``dtype`` bytes, as each implementation's source runs it.

    ``megatron`` (megatron-core tensor_parallel/cross_entropy.py): ``.float()`` (a copy unless
    fp32), max, subtract the max in place, exp in place, sum, divide in place into the saved
    softmax; backward: subtract one at the target, multiply by the token's gradient in place,
    autograd's cast back to ``dtype``; all-reduces of the max, the target logit and the sum.
    ``fused`` (fusions/fused_cross_entropy.py): the same functions jit-fused into three forward
    kernels (fp32 logits and their max; shift, exp and sum; the division) and one backward kernel
    that writes ``dtype``; the target logit and the sum share one all-reduce. ``te`` (Transformer
    Engine 2.x pytorch/triton/cross_entropy.py): an online-softmax pass over the logits, an
    all-gather of each rank's max, sum and target logit, a second pass that writes the loss and
    the gradient into the logits' own buffer, and a backward that scales it by the token's
    gradient."""
    f32 = 4
    cast = dtype + f32 if dtype != f32 else 0
    if impl == "megatron":
        return CrossEntropyCost(
            cast + f32 + 2 * f32 + 2 * f32 + f32 + 2 * f32,
            5 + (dtype != f32),
            2 * f32 + cast,
            1 + (dtype != f32),
            (("all_reduce", f32), ("all_reduce", f32), ("all_reduce", f32)),
        )
    if impl == "fused":
        widen = dtype + (f32 if dtype != f32 else 0)
        return CrossEntropyCost(
            widen + 2 * f32 + 2 * f32, 3, f32 + dtype, 1, (("all_reduce", f32), ("all_reduce", 2 * f32))
        )
    if impl == "te":
        return CrossEntropyCost(3 * dtype, 2, 2 * dtype, 1, (("all_gather", 3 * f32),))
    raise ValueError(f"cross_entropy must be one of {sorted(CROSS_ENTROPY)}, not {impl!r}")


@dataclass(frozen=True)
class Stack:
    """What a run's training software does in the ways the step model charges differently:
    ``Stack()`` is Megatron-LM as run since 2022 (and NeMo); the published runs on older stacks
    say how theirs differ (tests/fixtures/published, ``system``).

    ``p2p_scatter_gather``: Megatron-LM's 2021-22 pipeline optimization (Narayanan et al. SC'21
    section 4.1): without sequence parallelism each TP rank sends 1/tp of the activation over its
    NIC and the receiving stage all-gathers it over NVLink; megatron-core sends the whole tensor
    from every TP rank.
    ``grad_accumulation_fusion``: the wgrad GEMM accumulates into the main-gradient buffer in its
    epilogue (Megatron-LM's default since 2022-02, Transformer Engine). Without it the GEMM writes
    a 16-bit gradient that a separate kernel adds into the buffer (Megatron-LM's DDP hook
    ``main_grad.add_(grad)``, autograd's accumulation of ``.grad``): one memory-bound pass over the
    stage's parameters per microbatch.
    ``main_grad_bytes``: the main-gradient buffer's element size, which the data-parallel reduction
    moves: 4 (megatron-core under bf16/fp16, ``grad_reduce_in_fp32``), 2 (Megatron-LM's fp16 runs
    without ``--accumulate-allreduce-grads-in-fp32``, DeepSpeed's fp16 engine).
    ``tp_backward_overlap``: the column-parallel layers' backward all-reduce runs asynchronously
    under the weight-gradient GEMM (Megatron-LM since 2021-09, megatron-core); without it every TP
    collective of the backward is exposed.
    ``p2p_unbatched``: DeepSpeed's pipeline engine (``deepspeed/runtime/pipe``, 0.5.5 of 2021-10 and
    2022's) passes each tensor with its own blocking ``torch.distributed`` send or recv, one after
    the other (schedule.py ``TrainSchedule``: a forward slot receives the activation, then sends the
    previous gradient; a backward slot sends the activation, then receives the gradient): four
    messages per microbatch on a stage's critical path, where megatron's batched isend/irecv pairs
    pay two. Its partitioned activations (``p2p_scatter_gather``) come with partitioned gradients
    and a freed output that the sender gathers again before its backward (engine.py
    ``_exec_backward_pass``): three all-gathers per microbatch, not two.
    ``dp_reduce_per_chunk``: the overlapped gradient reduce-scatter of a model chunk starts after the
    chunk's backward (MegaScale, Jiang et al. NSDI'24 section 3.2: "the last reduce-scatter
    operation cannot be hidden"), not bucket by bucket during it (megatron-core): the last chunk's
    reduce-scatter, 1/vpp of the whole, waits at the end of the step.
    ``dp_bucket_elements``: the data-parallel bucket in elements; None: megatron-core DDP's
    default (``memory.buckets``). Apex's ``distributed_fused_adam`` (NeMo 1.x) makes buckets of
    ``bucket_cap_mb`` MiB of the gradient-sync dtype (apex/contrib/optimizers/distributed_fused_adam.py:
    ``1024 * 1024 * bucket_cap_mb / dtype_size``).
    ``cross_entropy``: the loss's kernels over the vocabulary-parallel logits
    (``cross_entropy_cost``): ``megatron`` (megatron-core's ``vocab_parallel_cross_entropy``, its
    default), ``fused`` (``cross_entropy_loss_fusion``, its jit-fused functions), ``te``
    (``cross_entropy_fusion_impl="te"``, Transformer Engine's Triton kernels)."""

    p2p_scatter_gather: bool = False
    grad_accumulation_fusion: bool = True
    main_grad_bytes: int = 4
    tp_backward_overlap: bool = True
    p2p_unbatched: bool = False
    dp_reduce_per_chunk: bool = False
    dp_bucket_elements: int | None = None
    cross_entropy: str = "megatron"

    def __post_init__(self) -> None:
        if self.main_grad_bytes not in (2, 4):
            raise ValueError(f"main_grad_bytes must be 2 or 4, not {self.main_grad_bytes!r}")
        if self.dp_bucket_elements is not None and self.dp_bucket_elements < 1:
            raise ValueError(f"dp_bucket_elements must be a positive count, not {self.dp_bucket_elements!r}")
        if self.cross_entropy not in CROSS_ENTROPY:
            raise ValueError(
                f"cross_entropy must be one of {sorted(CROSS_ENTROPY)}, not {self.cross_entropy!r}"
            )

    def accumulation_bytes(self, dtype: int) -> int:
        """Bytes moved per parameter and microbatch outside the GEMM: the GEMM's gradient read,
        the main gradient read and written (0 when fused)."""
        return 0 if self.grad_accumulation_fusion else dtype + 2 * self.main_grad_bytes


# mega's own training: megatron-core with gradient_accumulation_fusion off (mega/model.py keeps
# CUDA-only kernels off), fp32 main gradients under bf16/fp16 (grad_reduce_in_fp32)
MEGA = Stack(grad_accumulation_fusion=False)


@dataclass
class Term:
    """One line of the breakdown: ``seconds`` on the step's critical path; for communication
    ``total_s`` is its whole duration before overlap hides part of it."""

    name: str
    seconds: float
    what: str
    total_s: float | None = None

    def to_dict(self) -> dict:
        d = {"seconds": self.seconds, "what": self.what}
        if self.total_s is not None:
            d["total_s"] = self.total_s
        return d


@dataclass
class Prediction:
    step_s: float
    mfu: float
    hfu: float
    tokens_per_s: float
    model_flops_per_step: float
    memory: Memory
    fits: bool
    terms: list[Term]
    stages: dict = field(default_factory=dict)
    busy_s: float = 0.0  # all ranks' busy (non-waiting) seconds in one step: CPU seconds on a CPU
    host_per_node: float | None = None  # offloaded activations in one node's host memory, bytes

    def breakdown(self) -> dict[str, dict]:
        return {t.name: t.to_dict() for t in self.terms}


@dataclass
class Pass:
    """Seconds of one microbatch through one unit (a layer, the embedding, the logits) on one rank."""

    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    tp_exposed: float = 0.0
    tp_total: float = 0.0
    overhead: float = 0.0
    comm_cpu: float = 0.0  # core seconds of its collectives (CPU machines)
    cp_exposed: float = 0.0  # context parallelism's K/V (and dK/dV) transfers not hidden
    cp_total: float = 0.0

    @property
    def total(self) -> float:
        comm = self.tp_exposed + self.cp_exposed
        return self.gemm + self.attention + self.elementwise + comm + self.overhead

    def values(self) -> tuple[float, ...]:
        """The fields in order (``dataclasses.astuple`` deep-copies: the planner adds passes
        hundreds of thousands of times in a validation)."""
        return _pass_values(self)

    def scaled(self, k: float) -> Pass:
        return Pass(*(k * x for x in self.values()))

    def __add__(self, o: Pass) -> Pass:
        return Pass(*(a + b for a, b in zip(self.values(), o.values())))


_pass_values = operator.attrgetter(*(f.name for f in dataclasses.fields(Pass)))


@dataclass
class Unit:
    forward: Pass
    backward: Pass
    recompute: Pass  # extra forward work done in the backward


def fp8_gathers(cfg: MegaConfig) -> bool:
    """Whether the data-parallel (or FSDP) parameter gathers move the layers' linear weights in one
    byte a parameter: FP8 primary weights (``parallelism.fp8_param_gather`` under
    train.precision=fp8; their memory is ``memory.memory_per_gpu``'s). Not under MXFP8:
    megatron-core gathers those in 16 bits into the gradient buffer and casts them after
    (``reuse_grad_buf_for_mxfp8_param_ag``, distributed/param_and_grad_buffer.py)."""
    return cfg.parallelism.fp8_param_gather and precision_of(cfg) == "fp8" and cfg.train.fp8_recipe != "mxfp8"


def fp8_copy_bytes(cfg: MegaConfig, hw: Hardware) -> float:
    """Bytes Transformer Engine writes per element it casts to FP8, and keeps per FP8 weight: the data
    and its transpose where FP8 GEMMs take only K-major operands (Hopper), the data alone where they
    take any layout (``hardware.NON_TN_FP8``: Blackwell); under MXFP8 a row-wise and a column-wise
    copy on any device (blocks of ``MX_BLOCK`` along the GEMM's inner dimension, which differs
    between the forward and the backward GEMMs), each with a 1-byte scale per block."""
    if cfg.train.fp8_recipe == "mxfp8":
        return MXFP8_BYTES
    return FP8_BYTES if hw.fp8_non_tn else 2 * FP8_BYTES


def precision_of(cfg: MegaConfig) -> str:
    if cfg.train.precision == "auto":
        return "bf16" if cfg.cluster.device == "cuda" else "fp32"
    return cfg.train.precision


def microbatch_tokens(cfg: MegaConfig) -> int:
    """Tokens of one microbatch on one rank: context parallelism gives each of its cp ranks
    ``seq_length / cp`` tokens of every sample (config validation: seq_length divides by 2 cp)."""
    p = cfg.parallelism
    return p.micro_batch_size * cfg.model.seq_length // p.cp


def causal_keys(s: int, window: int | None) -> float:
    """Keys a query attends to on average under a causal mask (query i sees keys 0..i, or the last
    ``window + 1`` of them): what a causal flash kernel computes, about half the s x s square."""
    w = s if window is None else min(window + 1, s)
    return (w * (w + 1) / 2 + (s - w) * w) / s


def _exposed(comm: float, gemm: float, tp: int, chunked: bool, async_overlap: bool) -> float:
    """Exposed part of a TP collective next to a GEMM of ``gemm`` seconds. ``chunked`` (tp_overlap):
    a ring of ``tp`` steps overlaps all but the first chunk with the GEMM on the chunk in hand.
    ``async_overlap`` (megatron's async linear backward): overlapped with the GEMM as a whole."""
    if chunked:
        return comm / tp + (tp - 1) / tp * max(0.0, comm - gemm)
    if async_overlap:
        return max(0.0, comm - gemm)
    return comm


@dataclass
class LayerGemms:
    """Seconds of a layer's four GEMMs (QKV, projection, fc1, fc2) on one rank, one microbatch."""

    fwd: dict[str, float]
    dgrad: dict[str, float]
    wgrad: dict[str, float]


def layer_gemms(cfg: MegaConfig, hw: Hardware, dtype: int) -> LayerGemms:
    """(rows, cols, inner) of each forward GEMM; the backward runs a dgrad and a wgrad GEMM each."""
    m, p = cfg.model, cfg.parallelism
    t, h, f, tokens = p.tp, m.hidden_size, m.ffn, microbatch_tokens(cfg)
    kv = kv_size(m)
    shapes = {
        "qkv": (tokens, (h + 2 * kv) // t, h),
        "proj": (tokens, h, h // t),
        "fc1": (tokens, m.fc1_size // t, h),
        "fc2": (tokens, h, f // t),
    }
    if precision_of(cfg) == "fp8":  # FP8 operands at the FP8 peak
        hw, dtype = hw.linear, FP8_BYTES
    return LayerGemms(
        {k: hw.gemm_s(*v, dtype_bytes=dtype) for k, v in shapes.items()},
        {k: hw.gemm_s(r, i, c, dtype_bytes=dtype) for k, (r, c, i) in shapes.items()},
        {k: hw.gemm_s(i, c, r, dtype_bytes=dtype) for k, (r, c, i) in shapes.items()},
    )


def fp8_cast_elements(cfg: MegaConfig) -> tuple[float, float]:
    """(forward, backward) elements one rank casts to FP8 in kernels of their own, per layer and
    microbatch. Transformer Engine writes each FP8 operand in ``fp8_copy_bytes`` an element (on
    Hopper twice, as is and transposed), and fuses the cast into the kernel that produces the tensor
    where it owns that kernel: the norms before QKV and fc1 (LayerNormLinear, LayerNormMLP), the
    activation before fc2 and its backward before fc1's gradient GEMMs. Those writes replace a
    16-bit write, so cost nothing more; the rest is read in 16 bits and written again in FP8: the
    projection's input (the attention kernel's output), and the output gradients of fc2, of the
    projection (the residual stream's gradient) and of QKV (the attention backward's). The weights
    are cast once per step and kept (megatron's ``is_first_microbatch``)."""
    m, p = cfg.model, cfg.parallelism
    t, h, tokens = p.tp, m.hidden_size, microbatch_tokens(cfg)
    return tokens * h / t, tokens * (2 * h + (h + 2 * kv_size(m)) / t)


def cp_merge_bytes(cfg: MegaConfig, dtype: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank moves merging the per-step results of Transformer
    Engine's p2p context parallelism, per layer and microbatch, outside the attention kernels
    (TE 1.8 ``attention.py`` ``AttnFuncWithCP``, TE 2.9 ``context_parallel.py``
    ``AttnFuncWithCPAndKVP2P``). Forward: the first step's output is rescaled into ``out`` (read,
    write), every later step's is merged into it (``flash_attn_fwd_out_correction``: read the
    step's output, read and write ``out``). Backward: each step's ``dq`` and ``dk``, ``dv`` are
    copied (first step) or added (later steps) into the accumulators. Under the causal,
    load-balanced split, rank ``r``'s step ``i >= 1`` covers all its queries and the first half of
    the arriving keys when ``i <= r``, else the second half of its queries and all the keys: the
    merges of such a step touch all or half of ``out``/``dq`` and half or all of ``dk``, ``dv``. The
    ranks meet at every ring step, so the busiest rank (the first or the last) sets the time."""
    m, p = cfg.model, cfg.parallelism
    tokens, later = microbatch_tokens(cfg), p.cp - 1
    queries = tokens * m.hidden_size / p.tp  # out, dq: the rank's queries x heads x head dim
    keys = tokens * 2 * kv_size(m) / p.tp  # dK and dV

    def rank(r: int) -> tuple[float, float]:
        q_side = 2 + 3 * r + 1.5 * (later - r)  # out (forward) and dq (backward), in dtype-units
        kv_side = 2 + 1.5 * r + 3 * (later - r)
        return dtype * queries * q_side, dtype * (queries * q_side + keys * kv_side)

    return max((rank(0), rank(later)), key=sum)


def attention_seconds(cfg: MegaConfig, hw: Hardware, dtype: int) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core. Fused (flash) kernels skip the blocks
    above the causal diagonal and outside a sliding window; the unfused path (megatron's masked
    softmax) computes the whole s x s score matrix whatever the mask. With context parallelism a
    rank's s/cp queries (two chunks of the 2 cp, load-balanced: r and 2cp-1-r) do 1/cp of the
    causal work: in cp ring steps, one kernel each (p2p, whose per-step results are then merged:
    ``cp_merge_bytes``), or one kernel per local chunk against the gathered keys (all_gather)."""
    m, p = cfg.model, cfg.parallelism
    t, b, s, h, a, c = p.tp, p.micro_batch_size, m.seq_length, m.hidden_size, m.num_attention_heads, p.cp
    tokens, heads = b * s, a // t
    if hw.flash_attention:
        windowed, full = attention_layer_counts(m.num_layers, m.window_size, m.full_attention_every)
        keys = (windowed * causal_keys(s, m.window_size) + full * causal_keys(s, None)) / m.num_layers
        flops = 2 * 2 * tokens * keys * h / t / c
        gathered = c > 1 and p.cp_comm_type == "all_gather"
        calls = 2 if gathered else c
        length = s // (2 * c) if gathered else s // c  # the queries of one kernel
        fwd_s = hw.attention_s(flops, kernels=calls, length=length)
        bwd_s = hw.attention_s(2.5 * flops, kernels=2 * calls, length=length)
        if c > 1 and p.cp_comm_type == "p2p":
            merge_f, merge_b = cp_merge_bytes(cfg, dtype)
            fwd_s += hw.elementwise_s(merge_f, 2 * c - 1)
            bwd_s += hw.elementwise_s(merge_b, 3 * c)
        return fwd_s, bwd_s  # bwd recomputes S
    hd, q = h // a, s // c
    scores = b * heads * q * s
    drop = m.attention_dropout > 0
    qk = hw.gemm_s(q, s, hd, batch=b * heads, dtype_bytes=dtype)
    av = hw.gemm_s(q, hd, s, batch=b * heads, dtype_bytes=dtype)
    dropout_bytes, kernels = (2 * dtype + 1, 2) if drop else (0, 1)
    attn_f = qk + av + hw.elementwise_s(scores * (2 * dtype + dropout_bytes), kernels)
    attn_b = 2 * av + 2 * qk + hw.elementwise_s(scores * (3 * dtype + dropout_bytes), kernels)
    return attn_f, attn_b


def elementwise_seconds(cfg: MegaConfig, hw: Hardware, dtype: int) -> tuple[float, float]:
    """(forward, backward) seconds of LayerNorm(s), bias-dropout-add(s), bias-GeLU (SwiGLU), RoPE
    and, under fp8, the casts Transformer Engine does not fuse (``fp8_cast_elements``); the h-sized
    tensors are split by SP, the parallel block has one LayerNorm and one residual add. RoPE
    rotates the rank's queries and keys in place: read and written once."""
    m, p = cfg.model, cfg.parallelism
    t, h, f, tokens = p.tp, m.hidden_size, m.ffn, microbatch_tokens(cfg)
    rows = tokens / t if p.sequence_parallel else tokens
    mask = 1 if m.hidden_dropout > 0 else 0
    if m.block == "parallel":
        h_bytes, kernels = rows * h * (2 * dtype + 4 * dtype + 2 * mask), 3
    else:
        h_bytes, kernels = rows * h * (2 * 2 * dtype + 2 * (3 * dtype + mask)), 5
    elem_bytes = h_bytes + tokens * (m.fc1_size + f) / t * dtype  # the activation reads fc1's output
    if m.position_embedding == "rope":
        elem_bytes += tokens * (h + kv_size(m)) / t * 2 * dtype
        kernels += 2
    fwd_bytes, bwd_bytes, fwd_kernels, bwd_kernels = elem_bytes, 2 * elem_bytes, kernels, 2 * kernels
    if precision_of(cfg) == "fp8":  # the cast-transpose kernels of their own
        inputs, grads = fp8_cast_elements(cfg)
        copies = fp8_copy_bytes(cfg, hw)
        fwd_bytes += inputs * (dtype + copies)
        bwd_bytes += grads * (dtype + copies)
        fwd_kernels, bwd_kernels = fwd_kernels + 1, bwd_kernels + 3
    return hw.elementwise_s(fwd_bytes, fwd_kernels), hw.elementwise_s(bwd_bytes, bwd_kernels)


def tp_collective_seconds(
    cfg: MegaConfig, hw: Hardware, dtype: int, g: LayerGemms, async_backward: bool = True
) -> tuple[Pass, Pass]:
    """Tensor-parallel collectives of a layer over the microbatch's activation: (forward, backward)
    passes holding only their exposed, total and core seconds. ``async_backward``: the column-parallel
    backward collectives run under the dgrad/wgrad GEMMs (``Stack.tp_backward_overlap``)."""
    m, p = cfg.model, cfg.parallelism
    t = p.tp
    if t == 1:
        return Pass(), Pass()
    chunked = p.tp_overlap != "none"
    act = microbatch_tokens(cfg) * m.hidden_size
    # Under FP8 Transformer Engine gathers what its GEMMs read, already cast: the norm's FP8 output
    # (forward, and again from the saved FP8 copy for the wgrad GEMM) and the output gradient cast
    # before its gather (TE 1.8 layernorm_linear.py, base.py grad_output_preprocess; userbuffers'
    # all-gather buffers are FP8 too); under MXFP8 both its row-wise and column-wise copies with
    # their scales (TE 2.9 distributed.py _all_gather_mxfp8). Reduce-scatters and all-reduces carry
    # 16-bit GEMM outputs.
    if precision_of(cfg) != "fp8":
        gathered = act * dtype
    elif cfg.train.fp8_recipe == "mxfp8":
        gathered = act * MXFP8_BYTES
    else:
        gathered = act * FP8_BYTES
    sizes = {"all_gather": gathered, "reduce_scatter": act * dtype, "all_reduce": act * dtype}
    ag, rs, ar = (hw.collective_s(k, n, t) for k, n in sizes.items())
    agc, rsc, arc = (hw.collective_cpu_s(k, n, t) for k, n in sizes.items())
    if m.block == "parallel":  # one column-parallel input (QKV | fc1) and one row-parallel output
        col, row = ("qkv", "fc1"), ("proj", "fc2")
        pairs = [(col, row)]
    else:
        pairs = [(("qkv",), ("proj",)), (("fc1",), ("fc2",))]
    fwd, bwd = Pass(), Pass()
    for col, row in pairs:
        c_f, c_d, c_w = (sum(x[k] for k in col) for x in (g.fwd, g.dgrad, g.wgrad))
        r_f, r_d = (sum(x[k] for k in row) for x in (g.fwd, g.dgrad))
        if p.sequence_parallel:
            # forward: all-gather before the column GEMM, reduce-scatter after the row GEMM;
            # backward: all-gather of the output gradient (row), the input all-gather redone under
            # the dgrad GEMM and the input-gradient reduce-scatter under the wgrad GEMM
            f_exp = _exposed(ag, c_f, t, chunked, False) + _exposed(rs, r_f, t, chunked, False)
            b_exp = (
                _exposed(ag, r_d, t, chunked, False)
                + _exposed(ag, c_d, t, chunked, async_backward)
                + _exposed(rs, c_w, t, chunked, async_backward)
            )
            fwd = fwd + Pass(tp_exposed=f_exp, tp_total=ag + rs, comm_cpu=agc + rsc)
            bwd = bwd + Pass(tp_exposed=b_exp, tp_total=2 * ag + rs, comm_cpu=2 * agc + rsc)
        else:
            fwd = fwd + Pass(tp_exposed=_exposed(ar, r_f, t, chunked, False), tp_total=ar, comm_cpu=arc)
            b_exp = _exposed(ar, c_w, t, chunked, async_backward)
            bwd = bwd + Pass(tp_exposed=b_exp, tp_total=ar, comm_cpu=arc)
    return fwd, bwd


CP_COMM_WHAT = {
    "p2p": "context parallelism over cp={cp} ranks, TE's p2p ring: per layer, {sends} forward sends of a "
    "K,V block (2 x tokens/cp x kv_size/tp x dtype bytes) and the backward's K,V + dK,dV, each hidden "
    "under one step's attention (1/cp of it): exposed max(0, send - step)",
    "all_gather": "context parallelism over cp={cp} ranks, all-gather: per layer, K and V all-gathered "
    "before the attention (forward, and again in the backward) and dK, dV reduce-scattered after its "
    "backward, none of it overlapped",
}


def cp_comm_seconds(
    cfg: MegaConfig, hw: Hardware, dtype: int, attn_f: float, attn_b: float
) -> tuple[Pass, Pass]:
    """Context parallelism's K,V exchange, one layer and microbatch: (forward, backward) passes
    holding its exposed and total seconds. The cp ranks are ``tp`` apart (megatron's
    tp-cp-ep-dp-pp order); a rank's share of K and V is ``tokens/cp x kv_size/tp`` elements each.

    ``cp_comm_type="p2p"``: Transformer Engine's ring. A block is the rank's K and V, sent to the
    next rank while the attention of the block in hand runs (1/cp of the attention core per step:
    the load-balanced split gives every step equal work). Forward: steps 0..cp-2 send K,V (step 0
    computes on the local block). Backward: step 0 sends K,V, steps 1..cp-2 send K,V with the dK,dV
    accumulated so far (2 blocks), the last sends dK,dV home. Exposed per step: max(0, transfer -
    attention step).

    ``cp_comm_type="all_gather"``: Transformer Engine's ``AttnFuncWithCPAndKVAllGather`` (Llama 3's
    method, its section 3.3.2): the forward all-gathers K and V (two collectives) before the local
    queries' attention; the backward all-gathers them again, then reduce-scatters dK and dV. Nothing
    runs beside them: all exposed (megatron-core's ``cp_comm_type`` doc: "not async, and cannot be
    overlapped")."""
    p, c = cfg.parallelism, cfg.parallelism.cp
    if c == 1:
        return Pass(), Pass()
    share = microbatch_tokens(cfg) * kv_size(cfg.model) / p.tp * dtype  # K (or V) of one rank
    if p.cp_comm_type == "all_gather":
        gather = 2 * hw.collective_s("all_gather", c * share, c, stride=p.tp)
        backward = gather + 2 * hw.collective_s("reduce_scatter", c * share, c, stride=p.tp)
        return Pass(cp_exposed=gather, cp_total=gather), Pass(cp_exposed=backward, cp_total=backward)
    one, two = (hw.collective_s("send", k * 2 * share, c, stride=p.tp) for k in (1, 2))
    step_f, step_b = attn_f / c, attn_b / c
    fwd = Pass(cp_exposed=(c - 1) * max(0.0, one - step_f), cp_total=(c - 1) * one)
    bwd_exposed = 2 * max(0.0, one - step_b) + (c - 2) * max(0.0, two - step_b)
    bwd = Pass(cp_exposed=bwd_exposed, cp_total=2 * one + (c - 2) * two)
    return fwd, bwd


def layer_unit(cfg: MegaConfig, hw: Hardware, dtype: int, stack: Stack = MEGA) -> Unit:
    """One transformer layer, one microbatch, one tensor- and context-parallel rank."""
    g = layer_gemms(cfg, hw, dtype)
    attn_f, attn_b = attention_seconds(cfg, hw, dtype)
    elem_f, elem_b = elementwise_seconds(cfg, hw, dtype)
    tp_f, tp_b = tp_collective_seconds(cfg, hw, dtype, g, stack.tp_backward_overlap)
    cp_f, cp_b = cp_comm_seconds(cfg, hw, dtype, attn_f, attn_b)
    ovh = hw.layer_overhead_s + (hw.tp_layer_overhead_s if cfg.parallelism.tp > 1 else 0.0)
    gemm_f, gemm_b = sum(g.fwd.values()), sum(g.dgrad.values()) + sum(g.wgrad.values())
    forward = Pass(gemm_f, attn_f, elem_f, overhead=ovh) + tp_f + cp_f
    backward = Pass(gemm_b, attn_b, elem_b, overhead=2 * ovh) + tp_b + cp_b
    recompute = {"full": forward, "selective": Pass(attention=attn_f) + cp_f}.get(cfg.model.recompute, Pass())
    return Unit(forward, backward, recompute)


def embedding_unit(cfg: MegaConfig, hw: Hardware, dtype: int) -> Unit:
    """Word + position embedding lookup on the first stage, its vocab-parallel reduction."""
    m, p = cfg.model, cfg.parallelism
    tokens, h, t = microbatch_tokens(cfg), m.hidden_size, p.tp
    act = tokens * h * dtype
    kind = "reduce_scatter" if p.sequence_parallel else "all_reduce"
    comm = hw.collective_s(kind, act, t)
    fwd = Pass(
        elementwise=hw.elementwise_s(3 * act, 2),
        tp_exposed=comm,
        tp_total=comm,
        comm_cpu=hw.collective_cpu_s(kind, act, t),
    )
    bwd = Pass(elementwise=hw.elementwise_s(3 * act, 2))
    return Unit(fwd, bwd, Pass())


def logits_unit(cfg: MegaConfig, hw: Hardware, dtype: int, stack: Stack = MEGA) -> Unit:
    """Final LayerNorm, output layer (column-parallel over the vocabulary) and the vocab-parallel
    cross entropy (``stack.cross_entropy``) on the last stage."""
    m, p = cfg.model, cfg.parallelism
    tokens, h, t, vocab = microbatch_tokens(cfg), m.hidden_size, p.tp, m.padded_vocab_size
    gemm_f = hw.gemm_s(tokens, vocab // t, h, dtype_bytes=dtype)
    gemm_b = hw.gemm_s(tokens, h, vocab // t, dtype_bytes=dtype) + hw.gemm_s(
        h, vocab // t, tokens, dtype_bytes=dtype
    )
    logits = tokens * vocab / t
    ce = cross_entropy_cost(stack.cross_entropy, dtype)
    norm = tokens * h * 2 * dtype / (t if p.sequence_parallel else 1)
    act = tokens * h * dtype
    # an all-gather's tensor is every rank's part
    ce_sizes = [(kind, tokens * b * (t if kind == "all_gather" else 1)) for kind, b in ce.collectives]
    ce_reductions = sum(hw.collective_s(kind, n, t) for kind, n in ce_sizes)
    cpu_f = sum(hw.collective_cpu_s(kind, n, t) for kind, n in ce_sizes)
    if p.sequence_parallel:
        c_f, c_b = hw.collective_s("all_gather", act, t), hw.collective_s("reduce_scatter", act, t)
        cpu_f, cpu_b = (
            cpu_f + hw.collective_cpu_s("all_gather", act, t),
            hw.collective_cpu_s("reduce_scatter", act, t),
        )
    else:
        c_f, c_b = 0.0, hw.collective_s("all_reduce", act, t)
        cpu_b = hw.collective_cpu_s("all_reduce", act, t)
    wgrad = hw.gemm_s(h, vocab // t, tokens, dtype_bytes=dtype)
    b_exposed = _exposed(c_b, wgrad, t, False, stack.tp_backward_overlap)
    fwd = Pass(
        gemm=gemm_f,
        elementwise=hw.elementwise_s(norm + ce.forward_bytes * logits, 1 + ce.forward_kernels),
        tp_exposed=c_f + ce_reductions,
        tp_total=c_f + ce_reductions,
        comm_cpu=cpu_f,
    )
    bwd = Pass(
        gemm=gemm_b,
        elementwise=hw.elementwise_s(2 * norm + ce.backward_bytes * logits, 2 + ce.backward_kernels),
        tp_exposed=b_exposed,
        tp_total=c_b,
        comm_cpu=cpu_b,
    )
    return Unit(fwd, bwd, Pass())


@dataclass(frozen=True)
class Message:
    """One pipeline message: a microbatch's activation (or its gradient) to the neighbour stage."""

    transfer_s: float  # the send itself
    gather_s: float  # the receiver's all-gather of a message split over the TP ranks (scatter-gather)
    nbytes: float  # bytes each rank sends

    @property
    def seconds(self) -> float:
        return self.transfer_s + self.gather_s

    def blocking_per_chunk(self, stack: Stack) -> float:
        """Seconds a stage waits on its messages per microbatch and model chunk when they are not
        overlapped: one each way (megatron), or four sends/recvs and three all-gathers in turn
        (``Stack.p2p_unbatched``)."""
        if stack.p2p_unbatched:
            return 4 * self.transfer_s + 3 * self.gather_s
        return 2 * self.seconds


def p2p_message(cfg: MegaConfig, hw: Hardware, dtype: int, scatter_gather: bool) -> Message:
    """One pipeline message to the next stage, whose ranks are tp*cp*dp away (megatron's
    tp-cp-ep-dp-pp rank order); across nodes one rank's NIC."""
    m, p = cfg.model, cfg.parallelism
    if p.pp == 1:
        return Message(0.0, 0.0, 0.0)
    activation = microbatch_tokens(cfg) * m.hidden_size * dtype
    nbytes = activation / (p.tp if (p.sequence_parallel or scatter_gather) else 1)
    stride = p.tp * p.cp * p.dp
    if hw.link(p.pp, stride)[0] is hw.inter:
        seconds = hw.inter.latency_s + nbytes / hw.inter.bytes_per_s
    else:
        seconds = hw.collective_s("send", nbytes, p.pp, stride=stride)
    gather = (
        hw.collective_s("all_gather", activation, p.tp) if scatter_gather and not p.sequence_parallel else 0.0
    )
    return Message(seconds, gather, nbytes)


@dataclass
class Stage:
    """One pipeline stage, one microbatch through all its model chunks."""

    forward: Pass  # its transformer layers
    backward: Pass
    recompute: Pass
    extra: Pass  # embedding (first stage), output layer and loss (last stage)
    overhead: float  # host cost per microbatch and chunk
    p2p: float  # blocking pipeline messages on the critical path
    accumulate: float = 0.0  # adding the microbatch's weight gradients into the main gradients

    @functools.cached_property
    def layers(self) -> Pass:
        return self.forward + self.backward

    @property
    def total(self) -> float:
        return (
            self.layers.total
            + self.recompute.total
            + self.extra.total
            + self.overhead
            + self.p2p
            + self.accumulate
        )

    @property
    def busy(self) -> float:
        """Seconds a core works: everything but waiting on collectives and pipeline messages, plus
        the core time the collectives themselves cost (CPU machines)."""
        parts = (self.layers, self.recompute, self.extra)
        waiting = sum(x.tp_exposed + x.cp_exposed for x in parts)
        return self.total - self.p2p - waiting + sum(x.comm_cpu for x in parts)


def accumulation_seconds(cfg: MegaConfig, hw: Hardware, dtype: int, stack: Stack) -> list[float]:
    """Per stage, seconds per microbatch of adding the weight gradients into the main-gradient
    buffer when the wgrad GEMM does not (``Stack.grad_accumulation_fusion``): one add per parameter
    tensor (each layer's weights and biases), memory-bound."""
    nbytes = stack.accumulation_bytes(dtype)
    if nbytes == 0:
        return [0.0] * cfg.parallelism.pp
    p = cfg.parallelism
    return [
        hw.stream_s(n * nbytes, layers * 12)
        for n, layers in zip(stage_params(cfg.model, p), p.stage_layers(cfg.model.num_layers))
    ]


def recomputed_layers(cfg: MegaConfig) -> list[int]:
    """Layers per stage whose recomputation the backward runs: all of them under selective
    recomputation (the attention core of each), those ``model.recompute_num_layers`` picks under
    full recomputation (``ParallelismConfig.recomputed_layers``)."""
    m, p = cfg.model, cfg.parallelism
    if m.recompute == "full":
        return p.recomputed_layers(m.num_layers, m.recompute_num_layers)
    return p.stage_layers(m.num_layers)


def stages_of(cfg: MegaConfig, hw: Hardware, dtype: int, msg: Message, stack: Stack = MEGA) -> list[Stage]:
    p = cfg.parallelism
    pp, vpp = p.pp, p.chunks_per_stage
    layers = p.stage_layers(cfg.model.num_layers)
    recomputed = recomputed_layers(cfg)
    layer, emb = layer_unit(cfg, hw, dtype, stack), embedding_unit(cfg, hw, dtype)
    head = logits_unit(cfg, hw, dtype, stack)
    blocking = 0.0 if (pp == 1 or p.overlap_p2p_comm) else vpp * msg.blocking_per_chunk(stack)
    accumulate = accumulation_seconds(cfg, hw, dtype, stack)
    out = []
    for stage in range(pp):
        extra = Pass()
        if stage == 0:
            extra = extra + emb.forward + emb.backward
        if stage == pp - 1:
            extra = extra + head.forward + head.backward
        overhead = vpp * hw.microbatch_overhead_s + (hw.tp_microbatch_overhead_s if p.tp > 1 else 0.0)
        n = layers[stage]
        out.append(
            Stage(
                layer.forward.scaled(n),
                layer.backward.scaled(n),
                layer.recompute.scaled(recomputed[stage]),
                extra,
                overhead,
                blocking,
                accumulate[stage],
            )
        )
    return out


def compute_terms(cfg: MegaConfig, hw: Hardware, st: Stage, slowest: int) -> list[Term]:
    """The slowest stage's GEMMs, attention core and elementwise kernels over its microbatches."""
    m, p = cfg.model, cfg.parallelism
    mb = p.num_microbatches
    lay, ext = st.layers, st.extra
    return [
        Term(
            "gemm",
            mb * (lay.gemm + ext.gemm),
            f"{mb} microbatches x stage {slowest}: {p.stage_layers(m.num_layers)[slowest]} layers' QKV/proj/fc1/fc2 GEMMs (fwd + dgrad + "
            f"wgrad) + the embedding/output-layer GEMMs; roofline at {hw.gemm_efficiency:.2f} x "
            f"{hw.peak_flops / 1e12:.1f} TFLOP/s"
            + (
                f" (the layers' linears in FP8 at {hw.linear.gemm_efficiency:.2f} x "
                f"{hw.linear.peak_flops / 1e12:.1f} TFLOP/s)"
                if hw.linear_peak_flops
                else ""
            )
            + ", per-shape efficiency",
        ),
        Term(
            "attention",
            mb * (lay.attention + ext.attention),
            "attention core: "
            + (
                "fused flash kernels over the causal (and windowed) keys only"
                + (
                    f", and the merge of the {cfg.parallelism.cp} ring steps' partial results"
                    if cfg.parallelism.cp > 1 and cfg.parallelism.cp_comm_type == "p2p"
                    else ""
                )
                if hw.flash_attention
                else "QK^T and AV batched GEMMs over the full s x s scores + softmax/dropout traffic"
            ),
        ),
        Term(
            "elementwise",
            mb * (lay.elementwise + ext.elementwise),
            "LayerNorm, bias-dropout-add, bias-GeLU, embedding, cross entropy"
            + (", the FP8 casts Transformer Engine does not fuse" if hw.linear_peak_flops else "")
            + ": bytes / achieved memory bandwidth",
        ),
    ]


def pipeline_terms(cfg: MegaConfig, hw: Hardware, stages: list[Stage], msg: Message) -> list[Term]:
    """The microbatches through the slowest stage, term by term, then the bubble."""
    m, p = cfg.model, cfg.parallelism
    pp, vpp, mb = p.pp, p.chunks_per_stage, p.num_microbatches
    slowest = max(range(pp), key=lambda i: stages[i].total)
    st = stages[slowest]
    lay, ext = st.layers, st.extra
    avg = sum(x.total for x in stages) / pp
    fill = 2 * (pp - 1) * msg.seconds if (pp > 1 and p.overlap_p2p_comm) else 0.0
    partial = f" (the first {m.recompute_num_layers} layers of each chunk)" if m.recompute_num_layers else ""
    return [
        *compute_terms(cfg, hw, st, slowest),
        Term(
            "tp_comm",
            mb * (lay.tp_exposed + ext.tp_exposed),
            f"TP{'+SP' if p.sequence_parallel else ''} collectives over {p.tp} ranks, exposed part "
            f"(tp_overlap={p.tp_overlap}; megatron's async backward hides the column-parallel ones)",
            total_s=mb * (lay.tp_total + ext.tp_total),
        ),
        Term(
            "cp_comm",
            mb * lay.cp_exposed,
            CP_COMM_WHAT[p.cp_comm_type].format(cp=p.cp, sends=p.cp - 1),
            total_s=mb * lay.cp_total,
        ),
        Term(
            "recompute",
            mb * st.recompute.total,
            f"model.recompute={m.recompute}{partial}: forward work redone in the backward",
        ),
        Term(
            "grad_accumulation",
            mb * st.accumulate,
            "adding each microbatch's weight gradients into the main gradients outside the wgrad GEMM: "
            "a memory-bound pass over the stage's parameters per microbatch (0 when fused)",
        ),
        Term(
            "host_overhead",
            mb * (lay.overhead + ext.overhead + st.overhead),
            "host (Python) time the device does not hide: per layer and per microbatch/chunk",
        ),
        Term(
            "pp_p2p",
            mb * st.p2p + fill,
            f"pipeline send/recv of {msg.nbytes / 2**20:.1f} MiB per microbatch and chunk, each way "
            f"(overlap_p2p_comm={p.overlap_p2p_comm}"
            + (
                ": only the fill/drain is exposed)"
                if p.overlap_p2p_comm
                else ": blocking, on the critical path)"
            ),
            total_s=mb * max(st.p2p, 2 * vpp * msg.seconds),
        ),
        Term(
            "pp_bubble",
            (pp - 1) / vpp * avg,
            f"(pp-1)/vpp = {pp - 1}/{vpp} microbatch-times of the average stage "
            f"({avg * 1e3:.2f} ms) for pipeline fill and drain",
        ),
    ]


def optimizer_seconds(cfg: MegaConfig, hw: Hardware, dtype: int, params_rank: float) -> tuple[float, str]:
    """A memory-bound pass over this rank's shard of the optimizer state, the grad-norm
    all-reduces, and (CPU) the per-layer host cost of the per-tensor updates."""
    p = cfg.parallelism
    opt_params = params_rank / (p.dp * p.cp if p.use_distributed_optimizer or p.fsdp else 1)
    state = 8 if cfg.optimizer.name != "sgd" else 4
    # state read + write, fp32 gradient, fp32 master read + write (16-bit weights), weights, norm, zeroing
    per_param = 2 * state + 4 + 2 * (4 if dtype < 4 else 0) + dtype + 4 + 4
    if cfg.optimizer.name == "lamb":
        per_param += 8  # the per-tensor trust ratio reads weights and update once more
    seconds = (
        hw.stream_s(opt_params * per_param, 8)
        + 2 * hw.collective_s("all_reduce", 8, p.world_size)
        + hw.layer_step_overhead_s * max(p.stage_layers(cfg.model.num_layers))
    )
    return seconds, (
        f"{cfg.optimizer.name} step over {opt_params / 1e6:.1f}M parameters x {per_param} B of memory "
        "traffic + grad-norm all-reduces"
    )


def data_parallel_terms(
    cfg: MegaConfig, hw: Hardware, dtype: int, stages: list[Stage], bubble: float, stack: Stack = MEGA
) -> tuple[list[Term], float, float]:
    """Gradient reduction, optimizer step, parameter all-gather; returns the terms, the
    optimizer's seconds and the core seconds of the data-parallel collectives (CPU machines).
    The collectives run over megatron's data-parallel group with context parallel: dp x cp ranks,
    tp apart; the default bucket size follows dp alone (megatron DDP's ``dp_group``)."""
    m, p = cfg.model, cfg.parallelism
    tp, vpp, dp = p.tp, p.chunks_per_stage, p.dp * p.cp
    per_stage = stage_params(m, p)
    params_rank = max(per_stage)
    main_grad_bytes = stack.main_grad_bytes
    grad_bytes = params_rank * main_grad_bytes  # the main-gradient buffer
    param_bytes = params_rank * dtype
    if fp8_gathers(cfg):  # the stage's layers' linear weights gathered in FP8
        layers = p.stage_layers(m.num_layers)[per_stage.index(params_rank)]
        param_bytes -= layers * layer_params(m, tp) * (dtype - FP8_BYTES)
    # chunks after the first: one bucket each
    n_buckets = buckets(params_rank / vpp, p.dp, stack.dp_bucket_elements) + (vpp - 1)
    if p.use_distributed_optimizer:
        rs_total = n_buckets * hw.collective_s("reduce_scatter", grad_bytes / n_buckets, dp, stride=tp)
        ag_total = n_buckets * hw.collective_s("all_gather", param_bytes / n_buckets, dp, stride=tp)
        cpu = n_buckets * (
            hw.collective_cpu_s("reduce_scatter", grad_bytes / n_buckets, dp)
            + hw.collective_cpu_s("all_gather", param_bytes / n_buckets, dp)
        )
    else:
        rs_total = n_buckets * hw.collective_s("all_reduce", grad_bytes / n_buckets, dp, stride=tp)
        ag_total = 0.0
        cpu = n_buckets * hw.collective_cpu_s("all_reduce", grad_bytes / n_buckets, dp)
    first = stages[0]
    if p.overlap_grad_reduce and dp > 1:
        # buckets reduce as the last microbatch's backward produces them (the first stage's first
        # chunk finishes last); with interleaving the chunks done earlier reduce during the drain
        last_backward = (first.backward.total + first.recompute.total) / vpp
        if stack.dp_reduce_per_chunk:  # each chunk's reduce-scatter after its backward: the last one waits
            rs_exposed = max(rs_total / vpp, rs_total - (vpp - 1) / vpp * bubble)
        else:
            rs_exposed = max(rs_total / n_buckets, rs_total - last_backward - (vpp - 1) / vpp * bubble)
    else:
        rs_exposed = rs_total
    opt_s, opt_what = optimizer_seconds(cfg, hw, dtype, params_rank)
    if not p.use_distributed_optimizer or dp == 1:
        ag_exposed = ag_total
    elif p.overlap_param_gather_with_optimizer_step:
        ag_exposed = max(0.0, ag_total / n_buckets - opt_s)
    elif p.overlap_param_gather and p.align_param_gather:
        ag_exposed = ag_total / n_buckets  # the first chunk prefetched: one bucket waits
    elif p.overlap_param_gather:
        first_forward = first.forward.total / vpp
        ag_exposed = max(ag_total / n_buckets, ag_total / vpp - first_forward)
    else:
        ag_exposed = ag_total
    terms = [
        Term(
            "dp_grad_reduce",
            rs_exposed,
            f"{'reduce-scatter' if p.use_distributed_optimizer else 'all-reduce'} of {grad_bytes / 2**30:.2f} GiB "
            f"{8 * main_grad_bytes}-bit gradients over dp x cp={dp} in {n_buckets} buckets (overlap_grad_reduce={p.overlap_grad_reduce})",
            total_s=rs_total,
        ),
        Term("optimizer", opt_s, opt_what),
        Term(
            "dp_param_gather",
            ag_exposed,
            f"all-gather of updated {'FP8 (linear) and 16-bit' if fp8_gathers(cfg) else f'{8 * dtype}-bit'} "
            f"parameters over dp x cp={dp} (overlap_param_gather="
            f"{p.overlap_param_gather}, align_param_gather={p.align_param_gather}, with optimizer step="
            f"{p.overlap_param_gather_with_optimizer_step})",
            total_s=ag_total,
        ),
    ]
    return terms, opt_s, cpu


def fsdp_terms(
    cfg: MegaConfig, hw: Hardware, dtype: int, stack: Stack = MEGA
) -> tuple[list[Term], float, float]:
    """Megatron FSDP (``parallelism.fsdp``, pp=1) over the dp x cp ranks, tp apart: every microbatch
    each unit (``memory.fsdp_units``: the embedding, each layer, the output layer) is all-gathered
    before its forward, gathered again before its backward (but the output layer's, whose backward
    follows its forward) and its gradient reduce-scattered after its backward. A gather is
    prefetched under the forward of the unit before it, or the backward of the unit after it, where
    the reduce-scatter of that unit runs too: exposed is what a unit's neighbours' collectives take
    beyond its compute, plus the first gather of each microbatch (nothing runs before it) and, once
    a step, the embedding's reduce-scatter after the last backward. Returns the terms, the
    optimizer's seconds and the collectives' core seconds (CPU machines)."""
    m, p = cfg.model, cfg.parallelism
    n, mb = p.dp * p.cp, p.num_microbatches
    units = fsdp_units(m, p)
    layer, emb, head = (
        layer_unit(cfg, hw, dtype, stack),
        embedding_unit(cfg, hw, dtype),
        logits_unit(cfg, hw, dtype, stack),
    )
    forward = [emb.forward.total] + [layer.forward.total] * m.num_layers + [head.forward.total]
    redone = recomputed_layers(cfg)[0]  # the first ones recompute (pp=1: one chunk)
    backward = (
        [emb.backward.total]
        + [layer.backward.total + (layer.recompute.total if i < redone else 0.0) for i in range(m.num_layers)]
        + [head.backward.total]
    )
    gathered = [u * dtype for u in units]
    if fp8_gathers(cfg):  # the layers (not the embedding and output units) in FP8
        gathered[1:-1] = [u * FP8_BYTES for u in units[1:-1]]
    ag = [hw.collective_s("all_gather", g, n, stride=p.tp) for g in gathered]
    rs = [hw.collective_s("reduce_scatter", u * stack.main_grad_bytes, n, stride=p.tp) for u in units]
    ag_cpu = [hw.collective_cpu_s("all_gather", g, n) for g in gathered]
    rs_cpu = [hw.collective_cpu_s("reduce_scatter", u * stack.main_grad_bytes, n) for u in units]
    last = len(units) - 1
    exposed = ag[0] + sum(max(0.0, ag[i] - forward[i - 1]) for i in range(1, last + 1))
    exposed += sum(
        max(0.0, (ag[i - 1] if i > 0 else 0.0) + (rs[i + 1] if i < last else 0.0) - backward[i])
        for i in range(last + 1)
    )
    total = sum(ag) + sum(ag[:-1]) + sum(rs)
    cpu = mb * (sum(ag_cpu) + sum(ag_cpu[:-1]) + sum(rs_cpu))  # the collectives counted as in total
    params = sum(units)
    opt_s, opt_what = optimizer_seconds(cfg, hw, dtype, params)
    terms = [
        Term(
            "fsdp_comm",
            mb * exposed + rs[0],
            f"Megatron FSDP over dp x cp={n}: per microbatch {len(units)} units' "
            f"{'FP8 (layers) and 16-bit' if fp8_gathers(cfg) else f'{8 * dtype}-bit'} weights "
            f"gathered for the forward and again for the backward, {8 * stack.main_grad_bytes}-bit "
            f"gradients reduce-scattered ({params * dtype / 2**30:.2f} GiB of weights), each under a "
            "neighbouring unit's compute",
            total_s=mb * total,
        ),
        Term("optimizer", opt_s, opt_what),
    ]
    return terms, opt_s, cpu


def offload_terms(cfg: MegaConfig, hw: Hardware, dtype: int, stack: Stack = MEGA) -> list[Term]:
    """Activation offloading (``model.offload_layers``, pp=1; megatron-core's ``cpu_offloading``):
    each microbatch the first N layers' saved activations are copied to host memory, each while the
    next layer computes its forward, and back, each while the layer after it computes its backward
    (copy engines over the host link, beside the SMs): exposed per layer and direction is the copy's
    time beyond that layer's compute."""
    m, p = cfg.model, cfg.parallelism
    n = m.offload_layers
    if not n:
        return []
    if hw.host_link_bytes_per_s is None:
        raise ConfigError(
            "cluster.host_link_gb_per_s",
            "model.offload_layers copies activations over the device-host link: set its bandwidth for this cluster",
        )
    nbytes = layer_activation_bytes(cfg, None, dtype, hw.flash_attention, precision_of(cfg) == "fp8")
    copy = nbytes / hw.host_link_bytes_per_s
    layer = layer_unit(cfg, hw, dtype, stack)
    forward, backward = layer.forward.total, layer.backward.total
    exposed = n * (max(0.0, copy - forward) + max(0.0, copy - backward))
    mb = p.num_microbatches
    return [
        Term(
            "offload",
            mb * exposed,
            f"activations of {n} layers to host memory and back per microbatch ({nbytes / 2**30:.2f} GiB a "
            f"layer, {copy * 1e3:.1f} ms each way at {hw.host_link_bytes_per_s / 1e9:.0f} GB/s), each copy "
            f"under the next layer's forward ({forward * 1e3:.1f} ms) or backward ({backward * 1e3:.1f} ms)",
            total_s=mb * 2 * n * copy,
        )
    ]


def host_memory_per_node(cfg: MegaConfig, hw: Hardware, memory: Memory) -> float | None:
    """Bytes of offloaded activations in one node's host memory (every rank of the node offloads
    its own); None without offloading. Refused naming the key when the cluster does not say how much
    host memory a node has."""
    if not cfg.model.offload_layers:
        return None
    if hw.host_memory_bytes is None:
        raise ConfigError(
            "cluster.host_memory_gib",
            "model.offload_layers keeps activations in host memory: set a node's host memory for this cluster",
        )
    return memory.host * min(hw.procs_per_node, cfg.parallelism.world_size)


def hardware_flops_per_step(cfg: MegaConfig) -> float:
    """Model FLOPs + the recomputed forward work (HFU's numerator)."""
    m, p = cfg.model, cfg.parallelism
    tokens = p.global_batch_size * m.seq_length
    flops = model_flops_per_step(cfg)
    if m.recompute == "full":  # the recomputed layers' share of the layers' forward once more
        every = model_flops_per_token(
            m, recompute=True, window=m.window_size, full_attention_every=m.full_attention_every
        )
        share = sum(p.recomputed_layers(m.num_layers, m.recompute_num_layers)) / m.num_layers
        return flops + (every * tokens - flops) * share
    if m.recompute == "selective":
        windowed, full = attention_layer_counts(m.num_layers, m.window_size, m.full_attention_every)
        keys = windowed * min((m.window_size or m.seq_length) + 1, m.seq_length) + full * m.seq_length
        flops += 4 * keys * m.hidden_size * tokens
    return flops


def effective_overlap(cfg: MegaConfig) -> MegaConfig:
    """``cfg`` with the PP/DP overlap flags training runs with: ``parallelism.comm_overlap=auto``
    resolved by the function mega.train uses (mega.overlap.pp_dp.resolve)."""
    p = cfg.parallelism
    eff = pp_dp.resolve(p)
    par = dataclasses.replace(
        p,
        overlap_p2p_comm=eff.overlap_p2p_comm,
        overlap_p2p_comm_warmup_flush=eff.overlap_p2p_comm_warmup_flush,
        overlap_param_gather=eff.overlap_param_gather,
        align_param_gather=eff.align_param_gather,
        overlap_param_gather_with_optimizer_step=eff.overlap_param_gather_with_optimizer_step,
    )
    return dataclasses.replace(cfg, parallelism=par)


def per_step_terms(cfg: MegaConfig, hw: Hardware) -> list[Term]:
    """The once-per-step costs outside the pipeline and the data-parallel collectives."""
    m, p = cfg.model, cfg.parallelism
    emb_sync = 0.0
    if p.pp > 1 and m.tie_embeddings:
        emb_sync = hw.collective_s(
            "all_reduce",
            m.padded_vocab_size * m.hidden_size / p.tp * 4,
            2,
            stride=p.tp * p.cp * p.dp * (p.pp - 1),
        )
    data = hw.data_s_per_token * p.num_microbatches * p.micro_batch_size * m.seq_length
    return [
        Term(
            "embedding_sync",
            emb_sync,
            "all-reduce of the tied word-embedding gradient between the first and last stage",
        ),
        Term("data", data, "building the step's microbatches and copying them to the device"),
        Term("step_overhead", hw.step_overhead_s, "per-step host work: zero_grad, scheduler, logging"),
    ]


def stragglers_term(hw: Hardware, dp: int, step_s: float) -> list[Term]:
    """The dp replicas meet once per step, at the gradient reduction; inside a replica the TP ranks
    meet every layer and the stages every microbatch, so a replica's step is one draw."""
    if hw.straggler_sigma <= 0 or dp <= 1:
        return []
    return [
        Term(
            "stragglers",
            straggler_s(step_s, hw.straggler_sigma, dp),
            f"the slowest of {dp} data-parallel replicas sets the step: spread "
            f"{hw.straggler_sigma:.2%} x E[max of {dp} standard normals]",
        )
    ]


def busy_seconds(
    cfg: MegaConfig, hw: Hardware, stages: list[Stage], p2p_bytes: float, per_rank_s: float
) -> float:
    """All ranks' busy (non-waiting) seconds in one step, CPU seconds on a CPU machine: the
    stages' work with the core time of their collectives (each pipeline message: a send and a
    receive each way) and ``per_rank_s`` of once-per-step work on every rank."""
    p = cfg.parallelism
    p2p_cpu = 4 * p.chunks_per_stage * hw.collective_cpu_s("send", p2p_bytes, 2) if p.pp > 1 else 0.0
    mb = p.num_microbatches
    return p.tp * p.cp * p.dp * sum(mb * (x.busy + p2p_cpu) + per_rank_s for x in stages)


def core_sharing_term(hw: Hardware, world: int, busy_s: float, step_s: float) -> list[Term]:
    """Ranks sharing cores (CPU machines): all ranks' busy time must fit into cores x step time."""
    if hw.cores is None or hw.cores >= hw.procs_per_node:
        return []
    floor = busy_s / max(1, world // hw.procs_per_node) / hw.cores
    return [
        Term(
            "core_sharing",
            max(0.0, floor - step_s),
            f"{hw.procs_per_node} ranks share {hw.cores} cores: all ranks' busy time / cores "
            f"= {floor:.3f} s bounds the step from below",
        )
    ]


def memory_of(cfg: MegaConfig, hw: Hardware, stack: Stack = MEGA) -> Memory:
    """Memory per GPU of ``cfg`` as ``predict`` reports it, without the step time."""
    return memory_per_gpu(
        cfg,
        DTYPE_BYTES[precision_of(cfg)],
        hw.flash_attention,
        fp8=precision_of(cfg) == "fp8",
        main_grad_bytes=stack.main_grad_bytes,
        fp8_copy_bytes=fp8_copy_bytes(cfg, hw),
    )


def predict(
    cfg: MegaConfig, hw: Hardware, mfu_peak_flops: float | None = None, stack: Stack = MEGA
) -> Prediction:
    """Step time, MFU and memory of ``cfg`` on ``hw``. ``mfu_peak_flops``: the MFU denominator per
    device (default the cluster's dense bf16 peak, or the calibrated GEMM rate on a CPU).
    ``stack``: the training software as the model charges it (default mega's; published runs: theirs)."""
    cfg = effective_overlap(cfg)
    m, p = cfg.model, cfg.parallelism
    dtype = DTYPE_BYTES[precision_of(cfg)]
    msg = p2p_message(cfg, hw, dtype, stack.p2p_scatter_gather)
    stages = stages_of(cfg, hw, dtype, msg, stack)
    terms = pipeline_terms(cfg, hw, stages, msg)
    if p.fsdp:
        dp_terms, opt_s, dp_cpu = fsdp_terms(cfg, hw, dtype, stack)
    else:
        dp_terms, opt_s, dp_cpu = data_parallel_terms(
            cfg, hw, dtype, stages, bubble=terms[-1].seconds, stack=stack
        )
    once = per_step_terms(cfg, hw)
    terms += dp_terms + offload_terms(cfg, hw, dtype, stack) + once
    terms += stragglers_term(hw, p.dp, sum(t.seconds for t in terms))
    once_s = sum(t.seconds for t in once if t.name != "embedding_sync")
    busy_s = busy_seconds(cfg, hw, stages, msg.nbytes, opt_s + once_s + dp_cpu)
    terms += core_sharing_term(hw, p.world_size, busy_s, sum(t.seconds for t in terms))
    step_s = sum(t.seconds for t in terms)

    peak = mfu_peak_flops or hw.peak_flops
    flops = model_flops_per_step(cfg)
    memory = memory_of(cfg, hw, stack)
    host = host_memory_per_node(cfg, hw, memory)
    return Prediction(
        step_s=step_s,
        mfu=flops / (step_s * p.world_size * peak),
        hfu=hardware_flops_per_step(cfg) / (step_s * p.world_size * peak),
        tokens_per_s=p.global_batch_size * m.seq_length / step_s,
        model_flops_per_step=flops,
        memory=memory,
        fits=memory.total <= hw.memory_bytes and (host is None or host <= hw.host_memory_bytes),
        terms=terms,
        stages={
            "slowest": max(range(p.pp), key=lambda i: stages[i].total),
            "microbatch_s": [x.total for x in stages],
            "pipeline_s": p.num_microbatches * max(x.total for x in stages),
            "microbatches": p.num_microbatches,
        },
        busy_s=busy_s,
        host_per_node=host,
    )
