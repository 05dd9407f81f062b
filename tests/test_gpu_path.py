"""What a GPU rank does differently, checked on CPU: the asynchronous save's stage-2 thread (its
device, its process groups), the default group's backends, ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in
every launch form, the self-check's batched pair exchange, and the optional GPU packages detected
by importing them. (The CPU twin that trains through all of it: tests/test_gpu_twin.py.)"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from mega.cluster.backend_flags import backend_flags, launch_env_problems
from mega.config import ConfigError, compose

REPO = Path(__file__).resolve().parent.parent
GPU_PRESETS = {  # preset -> the overrides of one valid GPU layout on it
    "h100-8x": ["cluster=h100-8x", "parallelism=tp2-pp2-dp2"],
    "a100-8x": ["cluster=a100-8x", "parallelism=tp2-pp2-dp2"],
    "gpu-1": ["cluster=gpu-1", "parallelism=tp2"],
}


# -- the stage-2 thread of an asynchronous save


def test_stage2_thread_never_issues_a_collective_on_the_default_group(
    tmp_path, data_index, data_cache, free_port
):
    """Two ranks train a step, then save asynchronously with the distributed optimizer (its state
    built and the save planned in stage 2). Every collective called from the stage-2 thread is
    recorded with its group: none is on the default group (NCCL on GPUs, the training thread's),
    and the recorder does see the save's planning (so an empty record cannot pass)."""
    from mega.config import save

    cfg = compose(
        [
            "model=tiny",
            "parallelism=dp2",
            "parallelism.global_batch_size=4",
            "train.precision=bf16",
            f"train.run_dir={tmp_path}",
            f"checkpoint.dir={tmp_path / 'checkpoints'}",
            f"data.cache_dir={data_cache}",
            "train.tensorboard=false",
        ]
    )
    assert cfg.checkpoint.async_save and cfg.parallelism.use_distributed_optimizer
    save(cfg, tmp_path / "config.json")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(REPO / "tests" / "stage2_collectives.py"),
            str(tmp_path / "config.json"),
            str(data_index),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        on_default = [s for s in seen if s["default_group"]]
        assert on_default == [], on_default
        callers = " ".join(s["stack"] for s in seen)
        # the optimizer state's gather (megatron's gloo DP group), the sharding validation and the
        # save plan (the checkpointer's save group) all ran in stage 2
        assert "get_parameter_state_dp_zero" in callers and "determine_global_metadata" in callers, callers
        assert any(s["op"] == "gather_object" for s in seen), seen


def test_stage2_thread_makes_the_rank_gpu_current_before_anything(monkeypatch):
    import torch

    from mega.checkpoint.save import _Worker

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))
    worker = _Worker(device=torch.device("cuda", 3))
    try:
        worker.submit(lambda: calls.append(("job", threading.current_thread().name))).result(timeout=10)
    finally:
        worker.shutdown()
    assert calls == [("set_device", "cuda:3"), ("job", "ckpt-stage2")]
    # CPU ranks: no device call at all
    calls.clear()
    worker = _Worker()
    worker.submit(lambda: calls.append(("job", "cpu"))).result(timeout=10)
    worker.shutdown()
    assert calls == [("job", "cpu")]


@pytest.mark.parametrize("preset", list(GPU_PRESETS))
def test_the_default_group_on_gpus_carries_gloo_for_host_tensors(preset):
    gpu = compose(GPU_PRESETS[preset])
    assert backend_flags(gpu).process_group_backend == "cpu:gloo,cuda:nccl"
    twin = compose([*GPU_PRESETS[preset], "cluster.backend=gloo", "cluster.device=cpu"])
    assert backend_flags(twin).process_group_backend == "gloo"


# -- CUDA_DEVICE_MAX_CONNECTIONS=1 in every rank's environment


@pytest.mark.parametrize("preset", list(GPU_PRESETS))
def test_every_launch_form_exports_cuda_device_max_connections(preset, tmp_path):
    from mega.launch import kubernetes as k8s
    from mega.launch import slurm
    from mega.launch.render import hand_job

    cfg = compose([*GPU_PRESETS[preset], f"train.run_dir={tmp_path}"])
    job = hand_job(cfg, "/data/index.json", "/run/config.json")
    # local and local-nodes: the driver hands the backend this JobSpec; its env is every rank's
    assert job.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    if "slurm" in cfg.cluster.launchers:
        script = slurm.render_sbatch(
            compose([*GPU_PRESETS[preset], f"train.run_dir={tmp_path}", "launcher=slurm"]), job
        )
        assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in script.splitlines()
    if "kubernetes" in cfg.cluster.launchers:
        kcfg = compose(
            [
                *GPU_PRESETS[preset],
                "train.run_dir=/mnt/mega/run",
                "launcher=kubernetes",
                "launcher.kubernetes.volume_claim=mega-shared",
            ]
        )  # the data index is on the shared volume
        manifests = k8s.render_manifests(
            kcfg, hand_job(kcfg, "/mnt/mega/index.json", "/etc/mega/config.json")
        )
        containers = [c for m in manifests for c in _containers(m)]
        assert containers and all(
            {"name": "CUDA_DEVICE_MAX_CONNECTIONS", "value": "1"} in c["env"] for c in containers
        )


def _containers(manifest: dict) -> list[dict]:
    spec = manifest.get("spec", {})
    if manifest["kind"] == "JobSet":
        spec = spec["replicatedJobs"][0]["template"]["spec"]
    pod = spec.get("template", {}).get("spec", {})
    return pod.get("containers", [])


def test_the_prefect_work_pool_deployment_exports_it_to_the_flow_pod():
    deployments = yaml.safe_load((REPO / "infra" / "prefect-kubernetes.yaml").read_text())["deployments"]
    for d in deployments:
        assert "cluster=h100-8x" in d["parameters"]["overrides"]
        assert d["work_pool"]["job_variables"]["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # the template hands the deployment's env to the pod's container
    template = json.loads((REPO / "infra" / "kubernetes" / "work-pool.json").read_text())
    assert (
        template["job_configuration"]["env"] == "{{ env }}"
    )  # prefect-kubernetes prepends it to the container's


def test_a_gpu_rank_with_tensor_parallelism_refuses_to_start_without_it():
    tp = compose(GPU_PRESETS["h100-8x"])
    assert launch_env_problems(tp, {}) == ["CUDA_DEVICE_MAX_CONNECTIONS=1 (got None)"]
    assert launch_env_problems(tp, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == [
        "CUDA_DEVICE_MAX_CONNECTIONS=1 (got '8')"
    ]
    assert launch_env_problems(tp, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) == []
    # no TP communication to order: nothing needed; CPU ranks never need it
    assert launch_env_problems(compose(["cluster=gpu-1", "parallelism=dp2"]), {}) == []
    assert launch_env_problems(compose(["cluster=h100-8x-cpu-twin", "parallelism=tp2-pp2-dp2"]), {}) == []


def test_train_checks_the_environment_before_building_anything(tmp_path, monkeypatch):
    from mega import train

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    cfg = compose([*GPU_PRESETS["h100-8x"], f"train.run_dir={tmp_path}"])
    monkeypatch.setattr(train, "build", lambda *a: pytest.fail("built before the environment check"))
    with pytest.raises(RuntimeError, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        train.run(cfg, "unused")


def test_tp_overlap_te_validates_on_h100_8x():
    cfg = compose(
        [
            "cluster=h100-8x",
            "parallelism=tp2-pp2-dp2",
            "parallelism.sequence_parallel=true",
            "parallelism.tp_overlap=te",
        ]
    )
    assert cfg.parallelism.tp_overlap == "te"
    with pytest.raises(ConfigError) as info:
        compose(
            [
                "cluster=h100-8x",
                "parallelism=tp2-pp2-dp2",
                "parallelism.sequence_parallel=true",
                "parallelism.tp_overlap=te",
                "~cluster.env.CUDA_DEVICE_MAX_CONNECTIONS",
            ]
        )
    assert info.value.key == "cluster.env.CUDA_DEVICE_MAX_CONNECTIONS"


# -- the self-check's pair exchange


def _pair_rank(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from mega.cluster import selfcheck

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    posted = []
    original_batch = dist.batch_isend_irecv

    def batch(ops):  # (torch checks each P2POp's op is its own isend/irecv: those stay unwrapped)
        posted.append([(op.op.__name__, op.peer) for op in ops])
        return original_batch(ops)

    dist.batch_isend_irecv = batch
    rows = selfcheck._pair_checks(
        torch.device("cpu"), node=rank, nodes=2, procs=1, local_rank=0, nbytes=1 << 12
    )
    queue.put((rank, rows, posted))
    dist.destroy_process_group()


def test_the_pair_exchange_posts_its_send_and_receive_as_one_batch(free_port):
    from mega.cluster import selfcheck

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_pair_rank, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict((r, (rows, posted)) for r, rows, posted in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    for rank, (rows, posted) in results.items():
        assert rows and all(row["ok"] and row["error"] is None for row in rows), rows
        peer = 1 - rank
        # every exchange (the warm-up and each timed one) is one batch: a send and a receive
        assert posted == [[("isend", peer), ("irecv", peer)]] * (1 + selfcheck.PAIR_ITERS), posted


# -- optional GPU packages: importing them is the test


def test_flash_attn_that_fails_at_import_is_not_available(tmp_path, monkeypatch):
    from mega.layers import attention

    broken = tmp_path / "flash_attn"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        "raise ImportError('undefined symbol: _ZN3c10 (built for another torch)')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert attention.flash_attn_available() is False
    (broken / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert attention.flash_attn_available() is True


def test_symmetric_memory_is_enabled_only_where_torch_still_wants_it():
    import types

    from torch.distributed import _symmetric_memory as sm

    from mega.overlap import symm_mem

    assert symm_mem.needs_enable(sm) is (not hasattr(sm.enable_symm_mem_for_group, "__deprecated__"))
    assert symm_mem.needs_enable(types.SimpleNamespace(enable_symm_mem_for_group=lambda name: None))
    assert not symm_mem.needs_enable(types.SimpleNamespace())
