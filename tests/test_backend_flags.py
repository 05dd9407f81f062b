"""The GPU configuration path, exercised on CPU (mega/cluster/backend_flags.py).

Each GPU preset is composed as a user would run it, then only ``cluster.backend`` and
``cluster.device`` are swapped to gloo/cpu. What megatron-core receives -- TransformerConfig,
DistributedDataParallelConfig, OptimizerConfig and mega's own backend flags -- may differ only in
the fields listed below; a new backend-dependent setting anywhere else fails this test. The swapped
config of one preset then trains, saves and restores across real processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from mega.cluster.backend_flags import backend_flags
from mega.config import compose, validate

# preset -> overrides for a layout that fits it (train.precision=auto: bf16 on the GPUs)
GPU_PRESETS = {
    "h100-8x": ["cluster=h100-8x", "parallelism=tp2-pp2-dp2", "train.precision=auto"],
    # two nodes through Slurm: 16 ranks
    "a100-8x": ["cluster=a100-8x", "launcher=slurm", "cluster.nodes=2", "parallelism=tp2-pp2-dp2",
                "parallelism.dp=4", "parallelism.global_batch_size=32", "train.precision=auto"],
    # one node, as many devices as the layout: PP=2 interleaved (the batched-p2p trap) with DP=2
    "gpu-1": ["cluster=gpu-1", "parallelism=pp2-vpp2", "parallelism.dp=2", "train.precision=auto"],
}

# Everything that may differ between a GPU run and its CPU twin, and nothing else.
EXPECTED_DIFFERENCES = {
    "flags.device", "flags.collective_device", "flags.process_group_backend", "flags.use_cpu_initialization",
    "flags.batch_p2p_comm",
    "flags.precision", "flags.params_dtype", "flags.pipeline_dtype", "flags.grad_reduce_in_fp32",
    "flags.grad_reduce_scatter_all_to_all", "flags.megatron_cpu_patches", "flags.limit_cpu_threads", "flags.peak_flops", "flags.env",
    "TransformerConfig.use_cpu_initialization", "TransformerConfig.batch_p2p_comm",
    "TransformerConfig.params_dtype", "TransformerConfig.pipeline_dtype", "TransformerConfig.bf16",
    "TransformerConfig.autocast_dtype",  # megatron derives it from bf16/fp16 (__post_init__)
    "DistributedDataParallelConfig.grad_reduce_in_fp32",
    "DistributedDataParallelConfig.reduce_scatter_with_fp32_accumulation",
    "OptimizerConfig.bf16", "OptimizerConfig.params_dtype",
}


def on_cpu(cfg):
    """The same config with only the backend and the device swapped (and validated again)."""
    return validate(dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, backend="gloo", device="cpu")))


def _comparable(value):
    """Callables compare by what they are (megatron's init methods are fresh closures per config)."""
    if isinstance(value, functools.partial):
        return ("partial", _comparable(value.func), value.args, tuple(sorted(value.keywords.items())))
    if callable(value) and not isinstance(value, type):
        return ("callable", getattr(value, "__module__", None), getattr(value, "__qualname__", type(value).__name__))
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
    assert differ == EXPECTED_DIFFERENCES, (differ ^ EXPECTED_DIFFERENCES)

    # The values, where the reason is the backend's
    flags_gpu, flags_cpu = backend_flags(gpu), backend_flags(cpu)
    assert (flags_gpu.precision, flags_cpu.precision) == ("bf16", "fp32")
    assert (flags_gpu.batch_p2p_comm, flags_cpu.batch_p2p_comm) == (True, False)
    assert flags_gpu.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} and flags_cpu.env == {}
    # gloo side groups and the optimizer's use of them on EVERY backend (the GPU run used to lack them)
    for flags in (flags_gpu, flags_cpu):
        assert flags.create_gloo_process_groups and flags.optimizer_gloo_process_groups


def test_overlapped_p2p_turns_batching_off_on_nccl_too():
    """megatron refuses batch_p2p_comm together with overlap_p2p_comm (interleaved schedule)."""
    gpu = compose([*GPU_PRESETS["h100-8x"], "parallelism=tp2-pp2-vpp2-dp2", "parallelism.overlap_p2p_comm=true"])
    assert backend_flags(gpu).batch_p2p_comm is False


@pytest.mark.slow
def test_the_cpu_twin_of_a_gpu_preset_trains_saves_and_restores(tmp_path, data_index, data_cache):
    """gpu-1's layout (TP1 x PP2 interleaved x DP2, 4 processes) on gloo/cpu, its config otherwise
    the GPU one: two steps, a (synchronous) save at step 2, a rank killed before step 4; the
    driver restarts every rank from the step-2 checkpoint and step 3 is computed again,
    bit-identical to the first time."""
    from mega.launch import run_training
    from mega.metrics import METRICS_FILE

    gpu = compose([*GPU_PRESETS["gpu-1"], "model=tiny", "train.steps=4", f"train.run_dir={tmp_path}",
                   f"data.cache_dir={data_cache}", "train.tensorboard=false", "optimizer.warmup_steps=1",
                   "checkpoint.interval=2", "checkpoint.async_save=false", "checkpoint.restart_backoff_s=0",
                   "fault.kill_rank=1", "fault.kill_at_step=3"])
    cpu = on_cpu(gpu)
    assert cpu.cluster.name == "gpu-1" and cpu.parallelism.world_size == 4

    result = run_training(cpu, data_index)

    assert result.attempts == 2
    assert result.init["restore"]["checkpoint"] == "iter_0000002"
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]  # every attempt's
    assert [(r["attempt"], r["step"]) for r in rows] == [(0, 1), (0, 2), (0, 3), (1, 3), (1, 4)]
    first, again = rows[2], rows[3]
    assert (again["loss"], again["grad_norm"]) == (first["loss"], first["grad_norm"])
    assert all(r["loss"] == r["loss"] for r in rows)  # no NaN


@pytest.mark.parametrize("ngpu", [1, 2, 8])
def test_gpu_smoke_script_is_valid_and_its_configs_compose(ngpu, tmp_path):
    """infra/gpu-smoke.sh cannot run here (no GPU); its shell is checked, and every config it
    would run composes and validates (dry run: the commands, not their execution)."""
    import os
    import shlex
    import subprocess
    from pathlib import Path

    from mega.bench import checkpoint as bench_checkpoint
    from mega.bench import common

    script = Path(__file__).resolve().parent.parent / "infra" / "gpu-smoke.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "GPU_SMOKE_DRY_RUN": "1", "GPU_SMOKE_NGPU": str(ngpu)})
    assert out.returncode == 0, out.stderr
    commands = [shlex.split(line[2:]) for line in out.stdout.splitlines() if line.startswith("+ ")]
    assert [c[3] for c in commands] == ["step", "step"] + (["checkpoint"] if ngpu > 1 else [])
    for argv in commands:
        overrides = [a for a in argv[4:] if "=" in a and not a.startswith("-")]
        if argv[3] == "step":
            cfg = common.compose_run([*overrides, "optimizer.warmup_steps=2"], 6, tmp_path / "run")  # as bench_step
            assert cfg.model.name == "gpt-1.3b" and cfg.train.precision == "bf16"
        else:
            cfg = bench_checkpoint._compose(overrides, 12, tmp_path / "run", "file:///x", 4)
        assert (cfg.cluster.backend, cfg.cluster.device) == ("nccl", "cuda")
        assert cfg.parallelism.world_size in (1, ngpu)
