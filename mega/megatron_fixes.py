"""Corrections of megatron-core 0.16.1 itself, applied on every device before anything is built.

Two places where megatron-core's code is wrong whatever the hardware:

* ``sequence_parallel_norm``: the torch LayerNorm fallback (``WrappedTorchNorm``, taken without
  Apex, on GPUs too) refuses sequence parallelism, although it only needs its weights marked so
  that ``finalize_model_grads`` all-reduces their gradients over TP (as Apex's and TE's norms do).
* ``distopt_restore``: restoring the distributed optimizer's ``fully_reshardable`` state. The
  loader keeps no ``step`` (it is restored once, from the parameter groups), yet
  ``_set_main_param_and_optimizer_states`` copies every key of the live state, and the dummy step
  taken to create that state (torch Adam without Transformer Engine/Apex, and mega's LAMB) wrote
  ``state["step"]``: ``KeyError: 'step'``. torch Adam's restored state also shares one ``step``
  tensor between all parameters, which Adam then increments once per parameter per step: a
  resumed run's bias correction would drift. Both are corrected here.

The adaptations of megatron-core to CPU processes over gloo are another module
(mega/megatron_cpu.py), applied only where the configuration says cpu/gloo. Every patch here
targets a private name of one release: ``PATCHED_SOURCES`` pins the source of each, and
tests/test_megatron_fixes.py fails when megatron-core changes under them and shows each is needed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import inspect

MEGATRON_VERSION = "0.16.1"
FIXES = ("sequence_parallel_norm", "distopt_restore")
_applied: tuple[str, ...] = ()

# "module:qualname" -> sha256 (16 hex digits) of its source in megatron-core 0.16.1.
PATCHED_SOURCES = {
    "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__": "6cb54a06fa41bf78",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states": "93c254228283b2df",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict": "15f257b4c4f9a7ef",
}


def source_fingerprint(target: str) -> str:
    """sha256 (16 hex digits) of the source of ``"module:qualname"`` (unwrapping our patches)."""
    module_name, qualname = target.split(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    obj = getattr(obj, "__wrapped__", obj)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def check_version(what: str, test: str) -> None:
    import megatron.core

    if megatron.core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(
            f"mega's {what} were verified on megatron-core {MEGATRON_VERSION}, found "
            f"{megatron.core.__version__}; re-run {test} and update them"
        )


def apply(only: tuple[str, ...] = FIXES) -> tuple[str, ...]:
    """Install the corrections named in ``only`` (all by default; idempotent). Returns the names
    of all corrections installed in this process."""
    global _applied
    check_version("megatron-core corrections", "tests/test_megatron_fixes.py")
    installers = {
        "sequence_parallel_norm": _fix_sequence_parallel_norm,
        "distopt_restore": _fix_distopt_restore,
    }
    for name in only:
        if name not in _applied:
            installers[name]()
            _applied = (*_applied, name)
    return _applied


def _fix_sequence_parallel_norm() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new.__wrapped__ = original_new
    WrappedTorchNorm.__new__ = new


def _fix_distopt_restore() -> None:
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_load = DistributedOptimizer.load_state_dict

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:  # one tensor per parameter, not one shared by all
                state["step"] = state["step"].detach().clone()

    original_set = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original_set)
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destinations = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, dst in destinations.items():
                if key != "step":  # restored once, from the param groups, by load_state_dict
                    dst.copy_(tensors[key])

    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
