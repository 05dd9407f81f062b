"""A frozen host-memory view of megatron-core's distributed optimizer, for checkpoint stage 2.

Why: megatron's ``fully_reshardable`` optimizer state dict (the format any TP/PP/DP layout can
load) gathers every DP rank's optimizer shard onto DP rank 0 while it is built. Built on the
training thread, that gather is most of a save's stall (docs/checkpoints.md). Stage 1 instead
copies this rank's optimizer shard to host memory (a plain copy, no communication) and returns
a view of the optimizer that reads the copy; stage 2 builds the state dict from the view on its
background thread while training changes the live optimizer.

The view is a shallow copy of each ``DistributedOptimizer`` whose two readers of live state are
replaced: ``_get_main_param_and_optimizer_states`` (per parameter: main param, exp_avg,
exp_avg_sq) and ``state_dict`` (param groups, step, grad scaler). Everything else it reads is
fixed at construction (buffer layout, parameter ranges, process groups). The gather runs on
megatron's gloo DP group, which training never uses (its gradient and LAMB reductions use the
DP group proper), so the two threads never share a communicator.

``RELIED_ON_SOURCES`` pins the megatron-core functions this depends on; a change fails
``tests/test_optimizer_snapshot.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

# "module:qualname" -> sha256 (16 hex digits) of the source verified with megatron-core 0.16.1.
RELIED_ON_SOURCES = {
    # the only readers of live optimizer state on the fully_reshardable save path
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._get_main_param_and_optimizer_states": "b4a1328a3db8a0b2",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero": "812c52ea4568b0ff",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_param_state_fully_reshardable": "e888c7cccb71525a",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict": "2d70893ff7c08a35",
    "megatron.core.optimizer.optimizer:ChainedOptimizer.sharded_state_dict": "03ff27201c5bf5e4",
}

_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # what get_parameter_state_dp_zero reads


def supported(optimizer) -> bool:
    """True when every optimizer in the chain is a DistributedOptimizer (the only kind the view
    covers; others build their state dict on the training thread)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return bool(inner) and all(isinstance(o, DistributedOptimizer) for o in inner)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def _frozen_distributed(opt) -> tuple[Any, int]:
    states = {}
    copied = 0
    for model_param in opt.model_param_group_index_map:
        live = opt._get_main_param_and_optimizer_states(model_param)
        states[model_param] = {k: _to_host(live[k]) for k in _STATE_KEYS}
        copied += sum(t.numel() * t.element_size() for t in states[model_param].values())
    common = copy.deepcopy(opt.state_dict())  # param groups (lr, step), grad scaler
    view = copy.copy(opt)
    # instance attributes shadow the class's methods for this object only
    view._get_main_param_and_optimizer_states = states.__getitem__
    view.state_dict = lambda: copy.deepcopy(common)
    return view, copied


def freeze(optimizer) -> tuple[Any, int]:
    """(view, bytes copied): the optimizer's checkpoint state as of now, readable from another
    thread. Call on the training thread, between steps."""
    if not supported(optimizer):
        raise TypeError(f"{type(optimizer).__name__}: only megatron's DistributedOptimizer (chained or not)")
    if hasattr(optimizer, "chained_optimizers"):
        if len(optimizer.chained_optimizers) > 1:
            optimizer._synchronize_steps()  # what ChainedOptimizer.sharded_state_dict does first
        frozen = [_frozen_distributed(opt) for opt in optimizer.chained_optimizers]
        view = copy.copy(optimizer)
        view.chained_optimizers = [v for v, _ in frozen]
        view._synchronize_steps = lambda: None  # done above, on the live chain
        copied = sum(n for _, n in frozen)
    else:
        view, copied = _frozen_distributed(optimizer)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the pinned copies are asynchronous
    return view, copied
