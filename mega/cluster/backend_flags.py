"""Every setting that depends on the device and the communication backend, decided in one place.

A GPU run (NCCL, CUDA) and a CPU run (gloo, host memory) of the same config must differ ONLY in
the flags below; mega/train.py, mega/model.py, mega/optim and mega/checkpoint/ read them here
instead of testing ``cluster.backend``/``cluster.device`` themselves. tests/test_backend_flags.py
composes each GPU preset, swaps backend and device, and checks that exactly these flags (and the
megatron-core arguments derived from them) change -- so the GPU configuration path is the one the
CPU tests run, minus this list.

Why each one differs:

* ``device``: where parameters, activations and p2p buffers live (``cuda`` on GPUs).
* ``collective_device``: where tensors handed to collectives on the default process group must
  live -- NCCL takes CUDA tensors only, gloo host tensors only.
* ``process_group_backend``: the default group's backend. On GPUs ``"cpu:gloo,cuda:nccl"``: CUDA
  tensors go over NCCL, host tensors (megatron's object collectives in checkpointing, flags) over
  gloo, never through a CUDA staging copy on whatever device the calling thread has current.
* ``use_cpu_initialization``: megatron builds weights on the host; without CUDA it has to.
* ``batch_p2p_comm``: megatron's batched isend/irecv. On gloo with PP=2 (previous stage == next
  stage) gloo matches the two batched sends to the same peer in the wrong order: wrong losses,
  no error (docs/training.md, shared notes on megatron-core on CPU). Plain isend/irecv is correct
  everywhere; NCCL keeps megatron's default (batched), except that megatron requires it off under
  ``overlap_p2p_comm``.
* ``precision`` (and ``params_dtype``, ``pipeline_dtype``, ``grad_reduce_in_fp32``):
  ``train.precision=auto`` is bf16 on GPUs and fp32 on CPUs; ``train.precision=bf16`` runs on CPUs
  too (the CPU twin of a GPU run, tests/test_gpu_twin.py).
* ``grad_reduce_scatter_all_to_all``: the distributed optimizer's gradient reduce-scatter as
  megatron's ``reduce_scatter_with_fp32_accumulation`` (an all-to-all, then a local sum). gloo
  implements reduce-scatter as an all-reduce: each rank sends twice the bytes a reduce-scatter
  needs (at DP=2, 64 MB on the wire for a 32 MB bucket instead of 32; counted in
  tests/test_gloo_reduce_scatter.py). The all-to-all moves the reduce-scatter's bytes; the sum is
  the same at DP=2 (bit for bit) and fp32 either way here. NCCL's reduce-scatter is a ring: kept.
* ``megatron_cpu_patches`` / ``limit_cpu_threads``: the CPU adaptations of megatron-core
  (mega/megatron_cpu.py) and one OpenMP thread pool per core share, CPU only: decided by the
  configured device, never by the hardware. (megatron's corrections, mega/megatron_fixes.py,
  apply on every device.)
* ``peak_flops``: the MFU denominator -- the datasheet peak of the GPU, or a GEMM measured at
  start-up on CPUs.
* ``env``: process environment megatron-core expects on GPUs: ``CUDA_DEVICE_MAX_CONNECTIONS=1``
  keeps one hardware queue per device so that the communication kernels megatron launches to
  overlap with compute are scheduled in launch order (Megatron-LM sets it for TP/SP overlap).
  CUDA reads it when it initialises, so it must be in the rank's environment from the start: the
  GPU presets carry it in ``cluster.env`` (exported by every launcher) and a GPU rank whose TP
  communication overlaps its GEMMs refuses to start without it (``launch_env_problems``).

Identical on every backend (asserted by the same test), because megatron-core needs them there too:
``create_gloo_process_groups`` and the optimizer's ``use_gloo_process_groups`` are True everywhere
-- the distributed optimizer's ``fully_reshardable`` checkpoint gathers over megatron's gloo
data-parallel group, which the background checkpoint stage uses so as not to touch the training
thread's (NCCL) groups. Megatron-LM creates them by default for the same reason.

Torch-free: the dtypes are names (``torch_dtype`` maps them), so launchers and config tools can
read the flags without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mega.overlap import pp_dp  # torch-free

if TYPE_CHECKING:
    import torch

    from mega.config import MegaConfig

DTYPE_OF_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class BackendFlags:
    device: str  # "cpu" | "cuda": parameters, activations, p2p buffers
    collective_device: str  # tensors for collectives on the default group (nccl: cuda, gloo: cpu)
    process_group_backend: str  # init_process_group: "cpu:gloo,cuda:nccl" on NCCL, "gloo" on gloo
    use_cpu_initialization: bool  # TransformerConfig
    batch_p2p_comm: bool  # TransformerConfig (False on gloo: silent corruption at PP=2)
    precision: str  # train.precision resolved: fp32 | bf16 | fp16
    params_dtype: str  # TransformerConfig / OptimizerConfig, a torch dtype name
    pipeline_dtype: str  # TransformerConfig: dtype of the activations sent between stages
    grad_reduce_in_fp32: bool  # DistributedDataParallelConfig: fp32 gradient buckets under bf16/fp16
    grad_reduce_scatter_all_to_all: (
        bool  # DDP reduce_scatter_with_fp32_accumulation (gloo's RS = all-reduce bytes)
    )
    megatron_cpu_patches: bool  # apply mega.megatron_cpu before building anything
    limit_cpu_threads: bool  # torch.set_num_threads(cores // local ranks)
    peak_flops: str  # MFU denominator: "datasheet" (GPU) | "measured" (a GEMM at start-up, CPU)
    create_gloo_process_groups: bool  # initialize_model_parallel: gloo copies of the DP groups
    optimizer_gloo_process_groups: bool  # get_megatron_optimizer(use_gloo_process_groups=...)
    env: dict[str, str] = field(default_factory=dict)  # set in every rank before CUDA starts

    def torch_dtype(self, name: str) -> torch.dtype:
        import torch

        return getattr(torch, name)


def resolve_precision(cfg: MegaConfig) -> str:
    """``train.precision`` with ``auto`` decided: bf16 on GPUs, fp32 on CPUs."""
    if cfg.train.precision == "auto":
        return "bf16" if cfg.cluster.device == "cuda" else "fp32"
    return cfg.train.precision


def backend_flags(cfg: MegaConfig) -> BackendFlags:
    c = cfg.cluster
    cuda = c.device == "cuda"
    precision = resolve_precision(cfg)
    dtype = DTYPE_OF_PRECISION[precision]
    return BackendFlags(
        device="cuda" if cuda else "cpu",
        collective_device="cuda" if c.backend == "nccl" else "cpu",
        process_group_backend="cpu:gloo,cuda:nccl" if c.backend == "nccl" else c.backend,
        use_cpu_initialization=not cuda,
        # megatron: "batch_p2p_comm must be False if overlap_p2p_comm is True"
        batch_p2p_comm=c.backend != "gloo" and not pp_dp.resolve(cfg.parallelism).overlap_p2p_comm,
        precision=precision,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        grad_reduce_in_fp32=precision != "fp32",
        grad_reduce_scatter_all_to_all=c.backend == "gloo",
        megatron_cpu_patches=not cuda,
        limit_cpu_threads=not cuda,
        peak_flops="datasheet" if cuda else "measured",
        create_gloo_process_groups=True,
        optimizer_gloo_process_groups=True,
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if cuda else {},
    )


def launch_env_problems(cfg: MegaConfig, environ: dict[str, str]) -> list[str]:
    """What a rank's launch environment lacks that megatron needs before CUDA starts: on GPUs with
    tensor parallelism (its all-gathers/reduce-scatters overlap the GEMMs in backward) or a
    ``parallelism.tp_overlap``, ``CUDA_DEVICE_MAX_CONNECTIONS=1``. Empty when nothing is missing."""
    p = cfg.parallelism
    if cfg.cluster.device != "cuda" or (p.tp <= 1 and p.tp_overlap == "none"):
        return []
    return [
        f"{key}={value} (got {environ.get(key)!r})"
        for key, value in backend_flags(cfg).env.items()
        if environ.get(key) != value
    ]
