"""Memory per GPU: weights, gradients, optimizer state (sharded by the distributed optimizer), and
the activations of the microbatches the pipeline schedule keeps in flight.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4): per layer and microbatch ``sbh (34 + 5as/h)`` bytes with 16-bit activations
and dropout, of which tensor parallelism splits ``24 + 5as/h`` (``sbh (10 + 24/t + 5as/(ht))``),
sequence parallelism splits the rest (``sbh/t (34 + 5as/h)``), selective recomputation drops the
``5as/h`` attention-score terms and full recomputation keeps only each layer's input (``2sbh``;
with ``model.recompute_num_layers`` only for the first layers of each model chunk). Activation
offloading (``model.offload_layers``, pp=1) keeps one of the offloaded layers' activations on the
device at a time: the one being copied out in the forward, or in for the backward.
The terms are built below from their parts, so GQA, a non-4h MLP, the parallel block, no dropout,
fp32 activations and fused (flash) attention change the right parts. Context parallelism (cp) keeps
``s/cp`` tokens of each sample per rank: every activation term divides by cp (the attention scores
are ``s/cp`` queries x ``s`` keys), and the distributed optimizer shards over ``dp x cp`` ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mega.config import MegaConfig, ModelConfig, ParallelismConfig

GIB = 1024**3


def kv_size(m: ModelConfig) -> int:
    return m.hidden_size * (m.num_query_groups or m.num_attention_heads) // m.num_attention_heads


def layer_params(m: ModelConfig, tp: int) -> float:
    """Parameters of one transformer layer held by one tensor-parallel rank."""
    h, f, kv = m.hidden_size, m.ffn, kv_size(m)
    qkv = h * (h + 2 * kv) / tp + (h + 2 * kv) / tp
    proj = h * h / tp + h
    fc1 = (h + 1) * m.fc1_size / tp
    fc2 = f * h / tp + h
    norms = (1 if m.block == "parallel" else 2) * norm_params(m)
    return qkv + proj + fc1 + fc2 + norms


def norm_params(m: ModelConfig) -> int:
    """One norm's parameters, replicated over TP: a LayerNorm's weight and bias, an RMSNorm's weight."""
    return (2 if m.normalization == "LayerNorm" else 1) * m.hidden_size


def stage_params(m: ModelConfig, p: ParallelismConfig) -> list[float]:
    """Parameters per tensor-parallel rank of each pipeline stage: its layers
    (``ParallelismConfig.stage_layers``); the first stage also holds the word and (learned) position
    embeddings, the last the final norm and the output layer (a copy of the word embeddings when
    they are tied and pp > 1, its own weights otherwise)."""
    tp, pp = p.tp, p.pp
    stages = [n * layer_params(m, tp) for n in p.stage_layers(m.num_layers)]
    embedding = m.padded_vocab_size * m.hidden_size / tp
    stages[0] += embedding + (
        m.seq_length * m.hidden_size if m.position_embedding == "learned_absolute" else 0
    )
    if pp > 1 or not m.tie_embeddings:
        stages[-1] += embedding
    stages[-1] += norm_params(m)
    return stages


def fsdp_units(m: ModelConfig, p: ParallelismConfig) -> list[float]:
    """Parameters per tensor-parallel rank of each unit Megatron FSDP gathers whole, in forward
    order (pp=1): the embedding, every transformer layer, the output layer with the final norm
    (no weights of its own when the word embeddings are tied). They sum to the stage's."""
    embedding = m.padded_vocab_size * m.hidden_size / p.tp
    first = embedding + (m.seq_length * m.hidden_size if m.position_embedding == "learned_absolute" else 0)
    last = (0 if m.tie_embeddings else embedding) + norm_params(m)
    return [first] + [layer_params(m, p.tp)] * m.num_layers + [last]


def model_params(m: ModelConfig) -> float:
    return sum(stage_params(m, ParallelismConfig()))


def activation_bytes_per_layer(
    m: ModelConfig,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: str | None,
    dtype_bytes: int,
    flash: bool,
    cp: int = 1,
    fp8: bool = False,
) -> float:
    """Bytes one layer keeps for its backward, per microbatch, on one tensor- and context-parallel rank.
    ``fp8``: Transformer Engine keeps each linear's input for the wgrad GEMM as its FP8 cast (one
    byte an element, ``fp8_wgrad``): the norms' outputs before QKV and fc1, the projection's and
    fc2's inputs."""
    s, h, a, f, kv = m.seq_length, m.hidden_size, m.num_attention_heads, m.ffn, kv_size(m)
    tokens = s * micro_batch / cp
    if recompute == "full":  # only the layer's input is kept
        return dtype_bytes * tokens * h / (tp if sp else 1)
    hidden_mask = 1 if m.hidden_dropout > 0 else 0
    norms = 1 if m.block == "parallel" else 2
    # Kept whole on every TP rank unless sequence-parallel: LayerNorm inputs, the inputs of the
    # column-parallel GEMMs (one shared LayerNorm output in the parallel block), dropout masks.
    gemm_input = 1 if fp8 else dtype_bytes
    replicated = tokens * h * (dtype_bytes * norms + gemm_input * norms + 2 * hidden_mask)
    # Split by TP: Q, K, V, the attention output (projection input), the MLP's inner tensors:
    # fc1's output (gate and up under SwiGLU) and the activation's output, fc2's input; unfused,
    # SwiGLU's product also keeps its two factors, SiLU(gate) and megatron's up + glu_linear_offset
    # (mlp.py), where the fused bias-SwiGLU keeps fc1's output alone.
    silu = 2 * f if m.activation == "swiglu" and not m.fused_ops else 0
    split = tokens * (dtype_bytes * (h + 2 * kv + m.fc1_size + silu) + gemm_input * (h + f))
    # Attention scores: softmax output (+ dropout mask and output); none with fused attention or
    # selective recomputation (recomputed in the backward).
    scores = 0.0
    if not flash and recompute != "selective":
        per_score = dtype_bytes + (1 + dtype_bytes if m.attention_dropout > 0 else 0)
        scores = micro_batch * a * s / cp * s * per_score
    elif flash:
        split += tokens * dtype_bytes * h  # flash-attn keeps its output and row statistics
    return (replicated / (tp if sp else 1)) + (split + scores) / tp


def in_flight(pp: int, vpp: int, microbatches: int, stage: int) -> float:
    """Layers' worth of microbatch activations a stage holds at its peak, in units of one chunk of
    ``num_layers / (pp * vpp)`` layers: 1F1B keeps ``pp - stage`` microbatches in flight; the
    interleaved schedule's warm-up runs ``2 (pp - stage - 1) + (vpp - 1) pp + 1`` chunk-forwards
    (megatron-core schedules.py), capped by the microbatches there are."""
    if vpp == 1:
        return min(pp - stage, microbatches)
    return min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, microbatches * vpp)


@dataclass
class Memory:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    temporary: float  # logits for the loss, one layer's recompute buffers
    stage: int  # the stage with the most memory
    host: float = 0.0  # offloaded activations in host memory (model.offload_layers), not in total

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.temporary

    def to_gib(self) -> dict[str, float]:
        return {
            "weights": self.weights / GIB,
            "gradients": self.gradients / GIB,
            "optimizer": self.optimizer / GIB,
            "activations": self.activations / GIB,
            "temporary": self.temporary / GIB,
            "total": self.total / GIB,
            "stage": self.stage,
            **({"host_offloaded": self.host / GIB} if self.host else {}),
        }


def optimizer_bytes_per_param(optimizer: str, dtype_bytes: int) -> float:
    """fp32 state per parameter: Adam/LAMB two moments (8), SGD a momentum (4); with 16-bit
    weights also an fp32 master copy (4)."""
    moments = 4 if optimizer == "sgd" else 8
    return moments + (4 if dtype_bytes < 4 else 0)


def layer_activation_bytes(
    cfg: MegaConfig, recompute: str | None, dtype_bytes: int, flash: bool, fp8: bool = False
) -> float:
    """``activation_bytes_per_layer`` of one microbatch of ``cfg``'s model in its layout."""
    m, p = cfg.model, cfg.parallelism
    return activation_bytes_per_layer(
        m, p.micro_batch_size, p.tp, p.sequence_parallel, recompute, dtype_bytes, flash, p.cp, fp8
    )


def memory_per_gpu(
    cfg: MegaConfig,
    dtype_bytes: int,
    flash: bool,
    fp8: bool = False,
    main_grad_bytes: int = 4,
    fp8_copy_bytes: float = 2.0,
) -> Memory:
    """The most-loaded pipeline stage's memory per GPU. ``fp8``: the layers' linear weights are also
    kept in FP8 for the step (Transformer Engine's weight cache: ``fp8_copy_bytes`` a parameter,
    ``step.fp8_copy_bytes``: as is and transposed on Hopper), and the linears' saved inputs are FP8
    (``activation_bytes_per_layer``); with FP8 primary weights (``parallelism.fp8_param_gather``)
    those FP8 copies are the weights, with no 16-bit one.
    ``main_grad_bytes``: the main-gradient buffer's element size (``step.Stack.main_grad_bytes``)."""
    m, p = cfg.model, cfg.parallelism
    tp, pp, vpp, dp = p.tp, p.pp, p.chunks_per_stage, p.dp
    fp8_params = fp8 and p.fp8_param_gather
    params = stage_params(m, p)
    layers = p.stage_layers(m.num_layers)
    per_layer = layer_activation_bytes(cfg, m.recompute, dtype_bytes, flash, fp8)
    tokens = m.seq_length * p.micro_batch_size / p.cp
    full_layer = layer_activation_bytes(cfg, None, dtype_bytes, flash, fp8)
    best: Memory | None = None
    for stage in range(pp):
        n = params[stage]
        linear = layers[stage] * layer_params(m, tp)  # the weights Transformer Engine keeps in FP8
        weights = n * dtype_bytes
        if fp8:  # the FP8 copies; FP8 primary weights have no 16-bit one besides
            weights += linear * (fp8_copy_bytes - (dtype_bytes if fp8_params else 0))
        gradients = n * main_grad_bytes  # megatron's main-grad buffer (fp32 by default)
        optimizer = n * optimizer_bytes_per_param(cfg.optimizer.name, dtype_bytes)
        # sharded over the data-parallel group with context parallel
        if p.use_distributed_optimizer or p.fsdp:
            optimizer /= dp * p.cp
        if p.fsdp:  # a shard of everything, and whole only the unit in use and the one prefetched
            unit = max(fsdp_units(m, p))
            weights = n * dtype_bytes / (dp * p.cp) + 2 * unit * dtype_bytes
            if fp8_params:  # an FP8 shard; the gathered layers' FP8 copies take the 16-bit copy's place
                weights -= linear * (dtype_bytes - 1) / (dp * p.cp)
                weights += 2 * layer_params(m, tp) * (fp8_copy_bytes - dtype_bytes)
            elif fp8:  # Transformer Engine's FP8 copies of the two gathered layers
                weights += 2 * layer_params(m, tp) * fp8_copy_bytes
            gradients = n * main_grad_bytes / (dp * p.cp) + unit * main_grad_bytes
        # in units of the stage's mean chunk (one layer short on a stage that accounts for the
        # embedding or the loss); under block recomputation a chunk's first recompute_num_layers
        # layers keep their input alone, the rest everything
        chunk = layers[stage] / vpp
        kept = chunk * per_layer
        if m.recompute == "full" and m.recompute_num_layers is not None:
            redone = min(m.recompute_num_layers, chunk)
            kept = redone * per_layer + (chunk - redone) * full_layer
        host = 0.0
        if m.offload_layers:  # pp=1: the offloaded layers leave one layer's on the device, in transit
            kept -= (m.offload_layers - 1) * per_layer
            host = m.offload_layers * per_layer  # all of them there at the end of the forward
        activations = in_flight(pp, vpp, p.num_microbatches, stage) * kept
        temporary = 0.0
        if m.recompute == "full":
            temporary += full_layer  # the layer being recomputed
        if stage == pp - 1:  # fp32 logits and their gradient for the vocab-parallel cross entropy
            temporary += 2 * 4 * tokens * m.padded_vocab_size / tp
        candidate = Memory(weights, gradients, optimizer, activations, temporary, stage, host)
        if best is None or candidate.total > best.total:
            best = candidate
    assert best is not None
    return best


def buckets(params: float, dp: int, size: int | None = None) -> int:
    """Gradient buckets of ``size`` elements; None: megatron-core DDP's default bucket_size,
    max(4e7, 1e6 * dp) elements."""
    return max(1, math.ceil(params / (size or max(40_000_000, 1_000_000 * dp))))
