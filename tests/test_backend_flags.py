"""The GPU configuration path, exercised on CPU (mega/cluster/backend_flags.py).

Each GPU preset is composed as a user would run it, then only ``cluster.backend`` and
``cluster.device`` are swapped to gloo/cpu. What megatron-core receives -- TransformerConfig,
DistributedDataParallelConfig, OptimizerConfig and mega's own backend flags -- may differ only in
the fields listed below; a new backend-dependent setting anywhere else fails this test. The swapped
config of h100-8x then trains, saves and restores across real processes (tests/test_gpu_twin.py).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from mega.cluster.backend_flags import backend_flags
from mega.config import compose, validate

# preset -> overrides for a layout that fits it (train.precision=auto: bf16 on the GPUs)
GPU_PRESETS = {
    "h100-8x": ["cluster=h100-8x", "parallelism=tp2-pp2-dp2", "train.precision=auto"],
    # two nodes through Slurm: 16 ranks
    "a100-8x": [
        "cluster=a100-8x",
        "launcher=slurm",
        "cluster.nodes=2",
        "parallelism=tp2-pp2-dp2",
        "parallelism.dp=4",
        "parallelism.global_batch_size=32",
        "train.precision=auto",
    ],
    # one node, as many devices as the layout: PP=2 interleaved (the batched-p2p trap) with DP=2
    "gpu-1": ["cluster=gpu-1", "parallelism=pp2-vpp2", "parallelism.dp=2", "train.precision=auto"],
}

# Everything that may differ between a GPU run and its CPU twin, and nothing else.
EXPECTED_DIFFERENCES = {
    "flags.device",
    "flags.collective_device",
    "flags.process_group_backend",
    "flags.use_cpu_initialization",
    "flags.batch_p2p_comm",
    "flags.precision",
    "flags.params_dtype",
    "flags.pipeline_dtype",
    "flags.grad_reduce_in_fp32",
    "flags.grad_reduce_scatter_all_to_all",
    "flags.megatron_cpu_patches",
    "flags.limit_cpu_threads",
    "flags.peak_flops",
    "flags.env",
    "TransformerConfig.use_cpu_initialization",
    "TransformerConfig.batch_p2p_comm",
    "TransformerConfig.params_dtype",
    "TransformerConfig.pipeline_dtype",
    "TransformerConfig.bf16",
    "TransformerConfig.autocast_dtype",  # megatron derives it from bf16/fp16 (__post_init__)
    "DistributedDataParallelConfig.grad_reduce_in_fp32",
    "DistributedDataParallelConfig.reduce_scatter_with_fp32_accumulation",
    "OptimizerConfig.bf16",
    "OptimizerConfig.params_dtype",
}


def on_cpu(cfg):
    """The same config with only the backend and the device swapped (and validated again)."""
    return validate(
        dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, backend="gloo", device="cpu"))
    )


def _comparable(value):
    """Callables compare by what they are (megatron's init methods are fresh closures per config)."""
    if isinstance(value, functools.partial):
        return ("partial", _comparable(value.func), value.args, tuple(sorted(value.keywords.items())))
    if callable(value) and not isinstance(value, type):
        return (
            "callable",
            getattr(value, "__module__", None),
            getattr(value, "__qualname__", type(value).__name__),
        )
    return value


def what_megatron_sees(cfg) -> dict[str, object]:
    from mega.model import transformer_config
    from mega.optim import optimizer_config
    from mega.train import ddp_config

    seen = {f"flags.{k}": v for k, v in dataclasses.asdict(backend_flags(cfg)).items()}
    for obj in (transformer_config(cfg), ddp_config(cfg), optimizer_config(cfg)):
        name = type(obj).__name__
        for f in dataclasses.fields(obj):
            seen[f"{name}.{f.name}"] = _comparable(getattr(obj, f.name))
    return seen


@pytest.mark.parametrize("preset", list(GPU_PRESETS))
def test_only_the_backend_flags_differ_on_cpu(preset):
    gpu = compose(GPU_PRESETS[preset])
    assert (gpu.cluster.backend, gpu.cluster.device) == ("nccl", "cuda")
    cpu = on_cpu(gpu)
    on_gpu, on_host = what_megatron_sees(gpu), what_megatron_sees(cpu)
    assert on_gpu.keys() == on_host.keys()
    differ = {k for k in on_gpu if on_gpu[k] != on_host[k]}
    assert differ == EXPECTED_DIFFERENCES, differ ^ EXPECTED_DIFFERENCES

    # The values, where the reason is the backend's
    flags_gpu, flags_cpu = backend_flags(gpu), backend_flags(cpu)
    assert (flags_gpu.precision, flags_cpu.precision) == ("bf16", "fp32")
    assert (flags_gpu.batch_p2p_comm, flags_cpu.batch_p2p_comm) == (True, False)
    assert flags_gpu.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} and flags_cpu.env == {}
    # gloo side groups and the optimizer's use of them on EVERY backend (the GPU run needs them too)
    for flags in (flags_gpu, flags_cpu):
        assert flags.create_gloo_process_groups and flags.optimizer_gloo_process_groups


def test_overlapped_p2p_turns_batching_off_on_nccl_too():
    """megatron refuses batch_p2p_comm together with overlap_p2p_comm (interleaved schedule)."""
    gpu = compose(
        [*GPU_PRESETS["h100-8x"], "parallelism=tp2-pp2-vpp2-dp2", "parallelism.overlap_p2p_comm=true"]
    )
    assert backend_flags(gpu).batch_p2p_comm is False
