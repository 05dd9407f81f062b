"""What the performance model knows about the machine: rates, bandwidths, latencies, capacities.

Two sources, one shape (``Hardware``):

* a GPU cluster preset (``conf/cluster/*.yaml``): the datasheet facts of ``ClusterConfig`` (dense
  peak, HBM bandwidth and size, NVLink, NICs) times the efficiencies of the device type
  (``mega.perf.device.DeviceCalibration``: built-in, fitted on published runs, or measured);
* a CPU calibration (``python -m mega.plan calibrate``): rates and latencies measured on this
  machine (CPU GEMMs, memory traffic, gloo collectives, the host overheads of megatron's Python).

Efficiencies are per device type: one value for every model, layout and published row of that
device, never per row. docs/perf-model.md says where each comes from and what was fitted, on what.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from mega.config import ClusterConfig, ConfigError
from mega.flops import device_key, peak_flops
from mega.perf.device import DeviceCalibration, prior
from mega.perf.scale import tree_all_reduce_s

GIB = 1024**3

# --- Global constants (docs/perf-model.md, "Constants"); per-device efficiencies: mega/perf/device.py
# Per-shape GEMM efficiency (docs/perf-model.md): output tiles of TILE_M x TILE_N run in waves over
# the streaming multiprocessors (a last, partial wave idles SMs), and each tile pays a fixed
# prologue/epilogue worth GEMM_K_OVERHEAD elements of its inner dimension. 256 x 128 is the usual
# cuBLAS/CUTLASS bf16 tile on A100 and H100; the SM counts are the NVIDIA architecture whitepapers',
# the B200's (74 of each die's 80 SMs enabled) Chips and Cheese's "Nvidia's B200: Keeping the CUDA
# Juggernaut Rolling" (2025). The GB200's count is not published: no per-shape factor there.
TILE_M, TILE_N, GEMM_K_OVERHEAD = 256, 128, 64
SMS = {
    "A100": 108,
    "H100 SXM": 132,
    "H100 PCIe": 114,
    "H100 NVL": 132,
    "H200": 132,
    "H200 NVL": 132,
    "GH200": 132,
    "B200": 148,
    "V100 SXM2": 80,
    "V100 PCIe": 80,
}
# Devices whose FP8 GEMMs take operands in any layout, so Transformer Engine writes a per-tensor FP8
# cast once, without the transposed copy Hopper's K-major-only FP8 GEMMs need (TE 2.9
# utils.is_non_tn_fp8_gemm_supported: compute capability 10.x, 11.x and 13+; csrc/quantizer.cpp
# makes no transpose there). The same devices run block-scaled (MXFP8) GEMMs.
NON_TN_FP8 = frozenset({"B200", "GB200"})
# Fixed cost of one GPU kernel (launch gap and tail), seconds: small kernels cannot go faster.
GPU_KERNEL_S = 5e-6
# Per-hop latency of a collective step (NCCL ring step) over NVLink, seconds; the NIC's is the
# calibration's (DeviceCalibration.nic_latency_us).
NVLINK_LATENCY_S = 5e-6
# Host->device copy of a microbatch's token tensors (PCIe 4 x16, ~25 GB/s achieved).
PCIE_BYTES_PER_S = 25e9
# Payload share of the host link's line rate a large device<->host copy reaches (PCIe DMA after
# packet headers and flow control, ~80-88% on Gen4/Gen5 x16; assumed for NVLink-C2C too).
HOST_LINK_EFFICIENCY = 0.85
# Device memory a run cannot use for the model: CUDA context, NCCL buffers, cuBLAS workspaces,
# allocator fragmentation.
RESERVED_GIB = 2.0
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class Link:
    """A class of interconnect as one rank sees it: bytes/s per direction, a per-step latency."""

    bytes_per_s: float
    latency_s: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Hardware:
    name: str
    source: str  # "datasheet" (cluster preset x constants) or "calibration: <file>"
    peak_flops: float  # dense per device at the training precision
    gemm_efficiency: float  # fraction of peak_flops a large GEMM reaches
    attention_efficiency: float  # fused attention kernels, fraction of peak_flops
    kernel_s: float  # fixed cost of one kernel (GPU launch gap / CPU op dispatch)
    memory_bytes_per_s: float  # achieved streaming bandwidth (efficiency applied)
    memory_bytes: float  # device memory usable by the model (reserve and fragmentation taken off)
    memory_capacity_bytes: float  # the datasheet size
    intra: Link  # between ranks of one NVLink domain (NVLink; CPU: gloo over loopback)
    inter: Link  # between domains (nodes), per rank's share of its node's NICs
    procs_per_node: int
    sms: int | None  # streaming multiprocessors per GPU (wave quantization); None on a CPU
    flash_attention: bool  # fused attention kernels exist (model.fused_ops on a GPU)
    # CPU: the ranks of a node share this many cores; None = one device per rank (GPU)
    cores: int | None = None
    # Host work that the device does not hide (CPU: megatron's Python per layer; GPU: 0)
    layer_overhead_s: float = 0.0  # per layer forward, per microbatch (backward counts 2x)
    microbatch_overhead_s: float = 0.0  # per microbatch and model chunk: schedule, embedding, loss
    step_overhead_s: float = 0.0  # per step: zero_grad, grad-norm, scheduler, logging
    layer_step_overhead_s: float = 0.0  # per layer and step: the optimizer's per-tensor work
    tp_layer_overhead_s: float = (
        0.0  # with tp > 1, per layer forward and microbatch: the TP wrappers and collective calls
    )
    tp_microbatch_overhead_s: float = (
        0.0  # with tp > 1, per microbatch: vocab-parallel embedding and cross entropy
    )
    data_s_per_token: float = 0.0  # building a microbatch's tensors and copying them to the device
    # CPU: the core time a collective call costs its rank (latency per ring step, bytes/s), measured
    # in CPU seconds; None on GPUs (NCCL runs on the device)
    collective_cpu: Link | None = None
    # Activation elementwise ops (GeLU, softmax, LayerNorm...): bytes/s they reach. None = the
    # streaming bandwidth (GPUs: memory-bound); a CPU runs their transcendentals far slower.
    elementwise_bytes_per_s: float | None = None
    # Relative spread of one rank's step time across ranks (the slowest of N sets the step)
    straggler_sigma: float = 0.0
    # Device <-> host memory copies, bytes/s each direction, achieved (activation offloading);
    # None: the preset does not say
    host_link_bytes_per_s: float | None = None
    host_memory_bytes: float | None = None  # one node's host memory; None: the preset does not say
    calibration: DeviceCalibration | None = None  # GPUs: the per-device efficiencies applied
    extra: dict[str, Any] = field(default_factory=dict)  # provenance (measured points, machine)
    # The layers' linear GEMMs where they run at another precision than the rest (fp8: Transformer
    # Engine's FP8 GEMMs, bf16 elsewhere): their dense peak and the fraction of it they reach;
    # None = peak_flops and gemm_efficiency
    linear_peak_flops: float | None = None
    linear_gemm_efficiency: float | None = None
    # ranks on one NVLink fabric; 0 = one node's (procs_per_node). GB200 NVL72: 72 over 18 nodes
    nvlink_domain: int = 0
    fp8_non_tn: bool = False  # FP8 GEMMs take any operand layout (NON_TN_FP8): no transposed FP8 copies

    @property
    def domain(self) -> int:
        """Ranks that reach each other over the intra link."""
        return self.nvlink_domain or self.procs_per_node

    @property
    def linear(self) -> Hardware:
        """The hardware the transformer layers' linear GEMMs run on (their QKV, projection, fc1, fc2)."""
        if self.linear_peak_flops is None:
            return self
        return dataclasses.replace(
            self,
            peak_flops=self.linear_peak_flops,
            gemm_efficiency=self.linear_gemm_efficiency or self.gemm_efficiency,
            linear_peak_flops=None,
            linear_gemm_efficiency=None,
        )

    def gemm_s(self, m: int, n: int, k: int, batch: int = 1, dtype_bytes: int = 2) -> float:
        """Time of ``batch`` GEMMs (m x k) @ (k x n): roofline of compute and memory traffic,
        plus one kernel's fixed cost."""
        flops = 2.0 * m * n * k * batch
        traffic = dtype_bytes * (m * k + k * n + m * n) * batch
        efficiency = self.gemm_efficiency
        if self.sms:
            tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N) * batch
            efficiency *= tiles / (math.ceil(tiles / self.sms) * self.sms) * k / (k + GEMM_K_OVERHEAD)
        return max(flops / (self.peak_flops * efficiency), traffic / self.memory_bytes_per_s) + self.kernel_s

    def stream_s(self, nbytes: float, kernels: int) -> float:
        """Memory-bound kernels moving ``nbytes`` in all (elementwise ops, optimizer)."""
        return nbytes / self.memory_bytes_per_s + kernels * self.kernel_s

    def elementwise_s(self, nbytes: float, kernels: int) -> float:
        """Activation elementwise kernels moving ``nbytes`` in all."""
        return nbytes / (self.elementwise_bytes_per_s or self.memory_bytes_per_s) + kernels * self.kernel_s

    def attention_s(self, flops: float, kernels: int = 1, length: int | None = None) -> float:
        """Fused attention kernels doing ``flops``, each over ``length`` tokens (a measured
        calibration's ``attention_by_length`` charges short kernels their lower efficiency)."""
        factor = self.calibration.attention_length_factor(length) if self.calibration else 1.0
        return flops / (self.peak_flops * self.attention_efficiency * factor) + kernels * self.kernel_s

    def link(self, group_size: int, stride: int) -> tuple[Link, float]:
        """The link a collective over ``group_size`` ranks ``stride`` apart in rank order runs on,
        and the bus bandwidth it gets (bytes/s per rank): within an NVLink domain (a node, or a
        rack-scale fabric of several), the intra link; across domains, the inter link times the
        group's ranks per domain (their NICs work in parallel), capped by the intra link."""
        per_domain = max(1, min(group_size, self.domain // max(1, stride)))
        if group_size <= per_domain:
            return self.intra, self.intra.bytes_per_s
        return self.inter, min(self.intra.bytes_per_s, self.inter.bytes_per_s * per_domain)

    def collective_s(self, kind: str, nbytes: float, group_size: int, stride: int = 1) -> float:
        """Ring collective over ``group_size`` ranks: ``nbytes`` is the full tensor (all-reduce,
        the all-gather's output, the reduce-scatter's input), ``send`` one point-to-point message."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        link, bw = self.link(group_size, stride)
        n = group_size
        if kind == "all_reduce":
            ring = 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / bw
            return min(ring, tree_all_reduce_s(nbytes, n, bw, link.latency_s)) if link is self.inter else ring
        if kind in ("all_gather", "reduce_scatter"):
            return (n - 1) * link.latency_s + (n - 1) / n * nbytes / bw
        if kind == "send":
            return link.latency_s + nbytes / bw
        raise ValueError(f"unknown collective {kind!r}")

    def collective_cpu_s(self, kind: str, nbytes: float, group_size: int) -> float:
        """Core seconds one rank spends in a collective (CPU machines; 0 on GPUs)."""
        if self.collective_cpu is None or group_size <= 1:
            return 0.0
        n, link = group_size, self.collective_cpu
        steps, factor = {
            "all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
            "all_gather": (n - 1, (n - 1) / n),
            "reduce_scatter": (n - 1, (n - 1) / n),
            "send": (1, 1.0),
        }[kind]
        return steps * link.latency_s + factor * nbytes / link.bytes_per_s

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "peak_tflops": self.peak_flops / 1e12,
            "gemm_efficiency": self.gemm_efficiency,
            "attention_efficiency": self.attention_efficiency,
            "memory_tb_per_s_achieved": self.memory_bytes_per_s / 1e12,
            "memory_gib_usable": self.memory_bytes / GIB,
            "intra_gb_per_s": self.intra.bytes_per_s / 1e9,
            "inter_gb_per_s_per_rank": self.inter.bytes_per_s / 1e9,
            "procs_per_node": self.procs_per_node,
            "nvlink_domain": self.domain,
            "cores": self.cores,
            "flash_attention": self.flash_attention,
            "straggler_sigma": self.straggler_sigma,
            "step_overhead_s": self.step_overhead_s,
            **(
                {
                    "linear_peak_tflops": self.linear.peak_flops / 1e12,
                    "linear_gemm_efficiency": self.linear.gemm_efficiency,
                }
                if self.linear_peak_flops
                else {}
            ),
            **(
                {"host_link_gb_per_s_achieved": self.host_link_bytes_per_s / 1e9}
                if self.host_link_bytes_per_s
                else {}
            ),
            **({"host_memory_gib": self.host_memory_bytes / GIB} if self.host_memory_bytes else {}),
            **({"calibration": self.calibration.to_dict()} if self.calibration else {}),
        }


def _need(value: Any, key: str) -> Any:
    if value is None or value == 0:
        raise ConfigError(
            key,
            "the performance model needs this hardware fact (set it in the cluster preset, "
            "or calibrate a CPU machine: python -m mega.plan calibrate)",
        )
    return value


def from_cluster(
    cluster: ClusterConfig,
    precision: str,
    fused_ops: bool,
    calibration: DeviceCalibration | None = None,
    fp8_recipe: str = "delayed",
) -> Hardware:
    """Hardware of a GPU cluster preset at a training precision: datasheet x the per-device
    efficiencies of ``calibration`` (default: the device type's built-in one, mega/perf/device.py).

    ``precision``: bf16/fp16 run at the dense peak of the preset; fp32 means TF32 tensor cores,
    half of it on A100 and H100 (NVIDIA datasheets); fp8 runs the layers' linear GEMMs at the
    device's dense FP8 peak (twice the bf16 one on Hopper, mega.flops.PEAK_TFLOPS) and everything
    else in bf16; ``fp8_recipe`` mxfp8 only where the GEMMs are block-scaled (``NON_TN_FP8``)."""
    peak = _need(cluster.peak_tflops, "cluster.peak_tflops") * 1e12
    if precision == "fp32":
        peak /= 2
    linear_peak = None
    if precision == "fp8":
        fp8, bf16 = (peak_flops(cluster.device_name or "", d) for d in ("fp8", "bf16"))
        if not (fp8 and bf16):
            raise ConfigError(
                "train.precision",
                f"fp8: cluster.device_name={cluster.device_name!r} has no FP8 tensor cores in "
                "mega.flops.PEAK_TFLOPS (Hopper or later)",
            )
        linear_peak = peak * fp8 / bf16  # the preset's peak_tflops is its dense bf16 figure
        if fp8_recipe == "mxfp8" and device_key(cluster.device_name or "") not in NON_TN_FP8:
            raise ConfigError(
                "train.fp8_recipe",
                f"mxfp8: cluster.device_name={cluster.device_name!r} has no block-scaled FP8 GEMMs "
                f"(Blackwell: {', '.join(sorted(NON_TN_FP8))}); use train.fp8_recipe=delayed or tensorwise",
            )
    memory_gib = _need(cluster.memory_gib, "cluster.memory_gib")
    hbm = _need(cluster.memory_tb_per_s, "cluster.memory_tb_per_s") * 1e12
    nvlink = _need(cluster.nvlink_gb_per_s, "cluster.nvlink_gb_per_s") * 1e9 / 2  # per direction
    if cluster.nodes > 1:
        node_nic = _need(cluster.node_nic_gb_per_s, "cluster.nic_gbit_per_s") * 1e9
    else:
        node_nic = cluster.node_nic_gb_per_s * 1e9 if cluster.node_nic_gb_per_s else nvlink
    capacity = memory_gib * GIB
    key = device_key(cluster.device_name or "")
    cal = calibration or prior(key)
    return Hardware(
        name=cluster.device_name or cluster.name,
        source=f"datasheet: conf/cluster/{cluster.name}.yaml x calibration ({cal.source})",
        peak_flops=peak,
        gemm_efficiency=cal.gemm_efficiency,
        attention_efficiency=cal.attention_efficiency,
        kernel_s=GPU_KERNEL_S,
        memory_bytes_per_s=hbm * cal.memory_efficiency,
        memory_bytes=capacity * (1 - FRAGMENTATION) - RESERVED_GIB * GIB,
        memory_capacity_bytes=capacity,
        intra=Link(nvlink * cal.nvlink_efficiency, NVLINK_LATENCY_S),
        inter=Link(node_nic / cluster.procs_per_node * cal.nic_efficiency, cal.nic_latency_us * 1e-6),
        procs_per_node=cluster.procs_per_node,
        nvlink_domain=cluster.nvlink_domain or 0,
        fp8_non_tn=key in NON_TN_FP8,
        sms=SMS.get(key or ""),
        flash_attention=fused_ops,
        data_s_per_token=16 / PCIE_BYTES_PER_S,  # tokens, labels, loss mask, positions (int32/fp32)
        step_overhead_s=cal.step_overhead_s,
        straggler_sigma=cal.straggler_sigma,
        host_link_bytes_per_s=(
            cluster.host_link_gb_per_s * 1e9 * HOST_LINK_EFFICIENCY if cluster.host_link_gb_per_s else None
        ),
        host_memory_bytes=cluster.host_memory_gib * GIB if cluster.host_memory_gib else None,
        calibration=cal,
        linear_peak_flops=linear_peak,
        linear_gemm_efficiency=cal.fp8_gemm_efficiency if linear_peak else None,
    )


def from_calibration(calibration: dict[str, Any], cluster: ClusterConfig, source: str) -> Hardware:
    """Hardware measured on this machine (the ``hardware`` block of a calibration JSON)."""
    hw = from_calibration_block(calibration["hardware"], cluster.procs_per_node, f"calibration: {source}")
    return dataclasses.replace(hw, extra={"machine": calibration.get("machine", {})})


def from_calibration_block(
    block: dict[str, Any], procs_per_node: int, source: str = "calibration"
) -> Hardware:
    """The measured rates of a calibration. Ranks run ``cores // procs_per_node`` threads each (at
    least one: mega.train), so the per-thread GEMM rate scales by that; collectives inside and
    across "nodes" of this machine use the same loopback gloo."""
    link = Link(float(block["gloo_bytes_per_s"]), float(block["gloo_latency_s"]))
    cores = int(block["cores"])
    threads = max(1, cores // max(1, procs_per_node))
    memory = float(block["memory_bytes"])
    return Hardware(
        name=block["name"],
        source=source,
        peak_flops=float(block["gemm_flops_per_s"]) * threads,
        gemm_efficiency=1.0,  # the measured rate is already what GEMMs reach
        attention_efficiency=1.0,
        kernel_s=float(block["kernel_s"]),
        memory_bytes_per_s=float(block["memory_bytes_per_s"]),
        memory_bytes=memory,
        memory_capacity_bytes=memory,
        intra=link,
        inter=link,
        procs_per_node=procs_per_node,
        sms=None,
        flash_attention=False,
        cores=cores,
        layer_overhead_s=float(block.get("layer_overhead_s", 0.0)),
        microbatch_overhead_s=float(block.get("microbatch_overhead_s", 0.0)),
        step_overhead_s=float(block.get("step_overhead_s", 0.0)),
        layer_step_overhead_s=float(block.get("layer_step_overhead_s", 0.0)),
        tp_layer_overhead_s=float(block.get("tp_layer_overhead_s", 0.0)),
        tp_microbatch_overhead_s=float(block.get("tp_microbatch_overhead_s", 0.0)),
        data_s_per_token=float(block["data_s_per_token"]),
        collective_cpu=Link(float(block["gloo_cpu_bytes_per_s"]), float(block["gloo_cpu_latency_s"])),
        elementwise_bytes_per_s=float(block["elementwise_bytes_per_s"])
        if "elementwise_bytes_per_s" in block
        else None,
    )
