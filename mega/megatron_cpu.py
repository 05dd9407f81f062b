"""Adaptations that let megatron-core 0.16.1 train on CPU processes over gloo.

megatron-core assumes CUDA in a handful of places: tensors created with ``device="cuda"``,
``torch.cuda.current_device()``/``synchronize()``, the CUDA RNG behind its RNG tracker, and
``'torch.cuda.FloatTensor'`` type-string checks in the optimizers. One adaptation is for speed, not
to run at all: gloo implements reduce-scatter as an all-reduce (twice the bytes on the wire at
TP=2), so tensor parallelism's reduce-scatter on gloo groups runs as megatron's own all-to-all
reduce-scatter.

``apply()`` patches exactly those places (``ADAPTATIONS``). The caller decides by the configured
device and backend (``backend_flags(cfg).megatron_cpu_patches``: ``cluster.device=cpu``), never by
the hardware it happens to run on. Corrections of megatron-core that are not about CPUs live in
mega/megatron_fixes.py and apply on every device. Every patch targets a private name of one
release, so ``PATCHED_SOURCES`` records a fingerprint of each patched function;
``tests/test_megatron_cpu.py`` fails when megatron-core changes under us, and each patch has a
test showing it is still needed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch

from mega.megatron_fixes import MEGATRON_VERSION as MEGATRON_VERSION  # re-export
from mega.megatron_fixes import check_version
from mega.megatron_fixes import source_fingerprint as source_fingerprint  # re-export

ADAPTATIONS = ("cuda_runtime", "rng_tracker", "cuda_factories", "cuda_type_checks", "gloo_reduce_scatter")
_applied = False

# Modules whose ``torch.<factory>(..., device="cuda")`` calls must build CPU tensors instead.
CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
)

# "module:qualname" of every megatron-core function a patch depends on, with the sha256 (first 16
# hex digits) of its source in 0.16.1. A mismatch means the patch must be re-verified.
PATCHED_SOURCES = {
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add": "e5e9ab39a7c1e085",
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state": "aa26caaa069c5c4f",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": "b179c9d95438b61c",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__": "3275f640fc1b7377",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__": "1d470dedcf8e2f0e",
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32": "8edb9da5365045a5",
    # reach the reduce-scatter through the module global ``dist_reduce_scatter_func``
    "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim": "7322068fab71d319",
    "megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.backward": "b50b2ea4a1c90270",
    "megatron.core.distributed.reduce_scatter_with_fp32_accumulation:reduce_scatter_with_fp32_accumulation": "ff5a1341cb9a7e75",
}


def apply() -> tuple[str, ...]:
    """Install every CPU adaptation (idempotent). Returns the names of the adaptations installed
    in this process: ``ADAPTATIONS``."""
    global _applied
    if not _applied:
        check_version("CPU adaptations", "tests/test_megatron_cpu.py")
        _patch_cuda_runtime()
        _patch_rng_tracker()
        _patch_cuda_factories()
        _patch_cuda_type_checks()
        _patch_gloo_reduce_scatter()
        _applied = True
    return ADAPTATIONS


# ---------------------------------------------------------------------------------------------


def _patch_cuda_runtime() -> None:
    # Buffers (DDP grad buffers, GlobalMemoryBuffer, p2p shapes) are placed on
    # torch.cuda.current_device(); p2p and checkpoint writers call synchronize() as a fence.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None


def _patch_rng_tracker() -> None:
    """Back the tracker's named RNG states with the CPU generator.

    Dropout inside tensor-parallel regions forks a per-TP-rank state; activation recompute saves
    and restores it. On CPU both live in the one default generator. The caller must still seed
    that generator with ``torch.manual_seed``: megatron seeds it through ``torch.cuda.manual_seed``,
    which is a no-op without CUDA.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device=-1, clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    # On the class, so trackers created later (force_reset) use it too.
    mrandom.CudaRNGStatesTracker.add = add


class _CpuTorch:
    """Stands in for the ``torch`` module inside a megatron module: factory calls asking for
    ``device="cuda"`` get the CPU; everything else is torch itself."""

    _FACTORIES = frozenset(
        {"zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like"}
    )

    def __getattr__(self, name):
        obj = getattr(torch, name)
        if name not in self._FACTORIES:
            return obj

        @functools.wraps(obj)
        def factory(*args, **kwargs):
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
                kwargs.pop("pin_memory", None)
            return obj(*args, **kwargs)

        return factory


def _patch_cuda_factories() -> None:
    shim = _CpuTorch()
    for name in CUDA_FACTORY_MODULES:
        importlib.import_module(name).torch = shim


@contextlib.contextmanager
def _cuda_type_names():
    """Make ``tensor.type()`` answer 'torch.cuda.FloatTensor' for CPU tensors, for the duration of
    the optimizer code that accepts only CUDA type strings."""
    original = torch.Tensor.type

    def cuda_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return name if self.is_cuda else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = cuda_type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


def _patch_cuda_type_checks() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    DistOpt = distrib_optimizer.DistributedOptimizer
    DistOpt.__init__ = _with_cuda_type_names(DistOpt.__init__)
    F16Opt = moptimizer.Float16OptimizerWithFloat16Params
    F16Opt.__init__ = _with_cuda_type_names(F16Opt.__init__)
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    moptimizer.clip_grad_by_total_norm_fp32 = clip  # imported by name there


def _patch_gloo_reduce_scatter() -> None:
    """Sequence parallelism's reduce-scatter on gloo groups as an all-to-all plus a local sum.

    gloo runs ``reduce_scatter_tensor`` as an all-reduce: every rank sends an all-reduce's bytes,
    twice a reduce-scatter's at TP=2 (tests/test_gloo_reduce_scatter.py counts them). megatron's
    ``reduce_scatter_with_fp32_accumulation`` (an all-to-all of the chunks, then each rank sums its
    own) moves a reduce-scatter's bytes; the DDP gradient buffers use it on gloo through megatron's
    flag (backend_flags.grad_reduce_scatter_all_to_all). Tensor parallelism has no such flag: its
    mappings and linear layers call the module global ``dist_reduce_scatter_func`` bound at
    import, rebound here. Other backends (and other reductions than a sum) keep the original.
    """
    import torch.distributed as dist
    from megatron.core.distributed.reduce_scatter_with_fp32_accumulation import (
        reduce_scatter_with_fp32_accumulation as all_to_all_reduce_scatter,
    )
    from megatron.core.tensor_parallel import layers, mappings

    for module in (mappings, layers):
        original = module.dist_reduce_scatter_func

        def reduce_scatter(
            output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, _original=original
        ):
            if op == dist.ReduceOp.SUM and output.is_contiguous() and dist.get_backend(group) == "gloo":
                # flat views: the local sum is copied into the output through its view
                return all_to_all_reduce_scatter(
                    output.view(-1), input.reshape(-1), op, group or dist.group.WORLD, async_op
                )
            return _original(output, input, op=op, group=group, async_op=async_op)

        reduce_scatter.__wrapped__ = original
        module.dist_reduce_scatter_func = reduce_scatter
