"""The CPU adaptations of megatron-core (mega/megatron_cpu.py) still fit the installed release.

These fail when megatron-core changes under the patches: a new version, an edited patched
function, or a CUDA assumption that went away (then the patch is dead code and must go).
(megatron's corrections, applied on every device: tests/test_megatron_fixes.py.)
"""

import importlib.util
import re
import subprocess
import sys
import textwrap

import pytest

from mega import megatron_cpu


def test_megatron_core_version_is_the_verified_one():
    import megatron.core

    assert megatron.core.__version__ == megatron_cpu.MEGATRON_VERSION


@pytest.mark.parametrize("target", sorted(megatron_cpu.PATCHED_SOURCES))
def test_patched_function_source_unchanged(target):
    assert megatron_cpu.source_fingerprint(target) == megatron_cpu.PATCHED_SOURCES[target], (
        f"{target} changed in megatron-core: re-verify its patch in mega/megatron_cpu.py"
    )


@pytest.mark.parametrize("module", megatron_cpu.CUDA_FACTORY_MODULES)
def test_factory_modules_still_create_cuda_tensors(module):
    source = open(importlib.util.find_spec(module).origin).read()
    assert re.search(r"device\s*=\s*['\"]cuda['\"]", source), f"{module} no longer hard-codes CUDA"


PROBE = textwrap.dedent(
    """
    import os, sys, warnings, traceback
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
    import torch, torch.distributed as dist
    from megatron.core import parallel_state as ps, tensor_parallel
    from mega import megatron_cpu
    from mega.config import from_dict
    from mega.model import build_model_chunks, transformer_config
    if sys.argv[1] == "patched":
        assert megatron_cpu.apply()
    dist.init_process_group("gloo")
    ps.initialize_model_parallel()
    failures = []
    def attempt(name, fn):
        try:
            fn()
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    attempt("rng_tracker", lambda: tensor_parallel.model_parallel_cuda_manual_seed(1))
    cfg = from_dict({"parallelism": {"global_batch_size": 2, "micro_batch_size": 1}})
    tcfg = transformer_config(cfg)
    def forward():
        model = build_model_chunks(cfg, tcfg)[0]
        tokens = torch.randint(0, 100, (1, cfg.model.seq_length))
        pos = torch.arange(cfg.model.seq_length)[None]
        model(tokens, pos, None, labels=tokens).mean().backward()
    attempt("forward", forward)
    def ddp_and_optimizer():
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        model = build_model_chunks(cfg, tcfg)[0]
        ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
        get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])
    attempt("ddp_and_optimizer", ddp_and_optimizer)
    print("FAILURES", failures)
    ps.destroy_model_parallel(); dist.destroy_process_group()
    """
)


def _probe(mode: str, port: int) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(port)], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return next(line for line in out.stdout.splitlines() if line.startswith("FAILURES"))


def test_patches_are_needed_and_sufficient(free_port):
    unpatched = _probe("plain", free_port())
    # Without the adaptations megatron-core fails on CPU at each of these points...
    for name in ("rng_tracker", "forward", "ddp_and_optimizer"):
        assert name in unpatched, f"{name} works on CPU without a patch now: drop its adaptation"
    # ...and with them it works.
    assert unpatched != (patched := _probe("patched", free_port()))
    assert patched == "FAILURES []", patched


def test_the_configured_device_decides_not_the_hardware(monkeypatch):
    """A GPU config gets no CPU adaptation even on a host without GPUs, a CPU config gets all of
    them on a GPU host: the decision is backend_flags', from cluster.device."""
    from mega.cluster.backend_flags import backend_flags
    from mega.config import compose

    gpu = compose(["cluster=h100-8x", "parallelism=tp2-pp2-dp2"])
    cpu = compose(["cluster=h100-8x-cpu-twin", "parallelism=tp2-pp2-dp2"])
    for available in (False, True):
        monkeypatch.setattr(megatron_cpu.torch.cuda, "is_available", lambda: available)
        assert backend_flags(gpu).megatron_cpu_patches is False
        assert backend_flags(cpu).megatron_cpu_patches is True
