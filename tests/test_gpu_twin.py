"""The CPU twin of a GPU run: h100-8x with only cluster.backend/device swapped (gloo, cpu).

It keeps what a GPU run has -- bf16, the distributed optimizer, asynchronous saves, sequence
parallelism, LAMB, the parallel block, sliding windows -- on TP2 x PP2 (4 processes), and runs
build, steps, an asynchronous save, a killed rank, the restore and the resume, through
``bash infra/gpu-smoke.sh --cpu-dry-run`` (so the GPU smoke script cannot rot unseen either).
One such run is shared by every assertion here; an fp32 one-process run is the step-1 reference.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from mega import megatron_cpu, megatron_fixes
from mega.config import compose, load

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "infra" / "gpu-smoke.sh"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """``infra/gpu-smoke.sh --cpu-dry-run``: its JSON lines by check, exit code and working dir."""
    out = tmp_path_factory.mktemp("gpu-smoke")
    env = {**os.environ, "GPU_SMOKE_DIR": str(out), "PYTHON": os.environ.get("PYTHON", _python())}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # the launchers must put it there themselves
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cpu-dry-run"], capture_output=True, text=True, timeout=600, env=env
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {
        "rc": proc.returncode,
        "checks": {row["check"]: row for row in lines},
        "dir": out,
        "stderr": proc.stderr[-4000:],
    }


def _python() -> str:
    import sys

    return sys.executable


def test_the_smoke_script_passes_on_the_twin(smoke):
    checks = smoke["checks"]
    failed = {name: row for name, row in checks.items() if row.get("ok") is False}
    # the failing checks first: the whole dict and stderr make a message pytest cuts short
    assert smoke["rc"] == 0, (failed, smoke["stderr"][-1500:])
    for name in (
        "versions",
        "save_kill_resume_lamb",
        "warm_memory_resume",
        "dtype_fwd_bwd",
        "rank_env",
        "summary",
    ):
        assert checks[name]["ok"] is True, checks[name]
    # what needs GPUs says so, and is not a failure
    assert {n for n, row in checks.items() if row.get("skipped") == "cpu dry run"} == {
        "layouts",
        "save_kill_resume_adam",
        "tp_overlap",
        "sliding_window",
        "selfcheck",
        "cuda_events",
        "lamb_nccl",
    }


def test_the_twin_is_h100_8x_with_only_backend_and_device_swapped(smoke):
    twin = load(smoke["dir"] / "runs" / "resume-lamb" / "config.json")
    assert (twin.cluster.backend, twin.cluster.device) == ("gloo", "cpu")
    # the smoke's own choices for every run (4 ranks, no Redis), on the GPU preset
    gpu = compose(
        [
            "cluster=h100-8x",
            "cluster.procs_per_node=4",
            "store.start_local_redis=false",
            "parallelism=tp2-pp2-dp2",
            "parallelism.dp=1",
        ]
    )
    for key, value in vars(gpu.cluster).items():
        if key not in ("name", "backend", "device"):
            assert getattr(twin.cluster, key) == value, key
    p, m = twin.parallelism, twin.model
    assert (p.tp, p.pp, p.dp, p.sequence_parallel, p.use_distributed_optimizer) == (2, 2, 1, True, True)
    assert (twin.train.precision, twin.optimizer.name, twin.checkpoint.async_save) == ("bf16", "lamb", True)
    assert (m.block, m.window_size, m.full_attention_every) == ("parallel", 16, 2)


def test_bf16_twin_has_megatrons_dtypes_and_finite_losses(smoke):
    row = smoke["checks"]["dtype_fwd_bwd"]
    assert row["param_dtypes"] == ["torch.bfloat16"]  # every parameter, position embeddings and norms too
    assert row["main_param_dtypes"] == ["torch.float32"]  # the distributed optimizer's main copies
    assert all(math.isfinite(x) for x in row["losses"] + row["grad_norms"])


def test_every_rank_was_launched_with_cuda_device_max_connections(smoke):
    assert smoke["checks"]["rank_env"]["CUDA_DEVICE_MAX_CONNECTIONS_per_rank"] == ["1"] * 4


def test_cpu_adaptations_are_exactly_the_expected_ones(smoke):
    """The twin differs from the GPU path in these CPU adaptations of megatron, and only these;
    the corrections of megatron itself are the ones a GPU rank applies."""
    assert smoke["checks"]["rank_env"]["megatron_patches"] == {
        "megatron_fixes": ["sequence_parallel_norm", "distopt_restore"],
        "megatron_cpu": [
            "cuda_runtime",
            "rng_tracker",
            "cuda_factories",
            "cuda_type_checks",
            "gloo_reduce_scatter",
        ],
    }
    assert list(megatron_fixes.FIXES) == smoke["checks"]["rank_env"]["megatron_patches"]["megatron_fixes"]
    assert list(megatron_cpu.ADAPTATIONS) == smoke["checks"]["rank_env"]["megatron_patches"]["megatron_cpu"]


def test_killed_after_a_save_the_resumed_steps_equal_the_uninterrupted_run(smoke):
    row = smoke["checks"]["save_kill_resume_lamb"]
    assert row["attempts"] == 2 and row["restored"] in ("iter_0000002", "iter_0000004")
    assert row["rerun_steps"] and row["first"] == row["again"]


def test_step_one_loss_is_within_bf16_tolerance_of_fp32(smoke):
    """The fp32 reference: one process (layout-invariant init: the same model), its first step."""
    from mega.launch import run_training

    run = smoke["dir"] / "runs" / "resume-lamb"
    twin = load(run / "config.json")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    bf16_step1 = next(r["loss"] for r in rows if r["step"] == 1)
    fp32 = compose(
        [
            "cluster=h100-8x-cpu-twin",
            "cluster.procs_per_node=1",
            "parallelism=single",
            "features=megascale",
            "model=tiny",
            "model.fused_ops=false",
            "model.window_size=16",
            "train.precision=fp32",
            "train.steps=2",
            "checkpoint.interval=0",
            "train.eval_batches=0",
            "restart.max_restarts=0",
            "train.tensorboard=false",
            "optimizer.warmup_steps=1",
            f"data.source={twin.data.source}",
            f"data.cache_dir={twin.data.cache_dir}",
            f"parallelism.global_batch_size={twin.parallelism.global_batch_size}",
            f"train.run_dir={smoke['dir'] / 'runs' / 'fp32'}",
        ]
    )
    index = next(Path(twin.data.cache_dir).glob("*/index.json"))
    fp32_step1 = run_training(fp32, index, log=lambda m: None).metrics[0]["loss"]
    assert bf16_step1 == pytest.approx(fp32_step1, rel=2e-2)
    assert bf16_step1 != fp32_step1  # bf16 really ran: not bit-identical to fp32


def test_the_smoke_script_is_valid_shell():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    lint = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
