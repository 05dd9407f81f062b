"""megatron's checkpoint save, planned over a process group of the caller's choosing.

megatron-core 0.16.1 plans a save (``TorchDistSaveShardedStrategy.async_save`` ->
``save_state_dict_async_plan(..., process_group=None, ...)``) and validates it
(``determine_global_metadata``: ``all_gather_object``; ``_validate_common_state_dict``:
``broadcast_object_list``; both with no group) on the default process group.
An asynchronous save plans in its stage-2 thread (mega/checkpoint/save.py), and the default group
is the training thread's: two threads must never share a communicator (collectives pair up with
the wrong peers), and on GPUs the default group's NCCL half belongs to the training stream.
``collectives_on(group)`` routes the three, for the calling thread only, to ``group`` (a gloo
group of the checkpointer's own); the finalisation megatron returns keeps using it.

The three names are rebound once, by ``install()``; outside ``collectives_on`` they call megatron's
own functions unchanged. ``RELIED_ON_SOURCES`` pins what they wrap (tests/test_checkpoint_seams.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

RELIED_ON_SOURCES = {
    # async_save calls the module global save_state_dict_async_plan with process_group=None (3rd)
    "megatron.core.dist_checkpointing.strategies.torch:TorchDistSaveShardedStrategy.async_save": "dd6e48d9b9c427fb",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver:save_state_dict_async_plan": "6bbe7c4cc8d39f0b",
    # save_preprocess validates through the name determine_global_metadata it imported
    "megatron.core.dist_checkpointing.state_dict_utils:save_preprocess": "e3fe6678e054cd09",
    "megatron.core.dist_checkpointing.validation:determine_global_metadata": "2a689529280cb5b3",
    # validate_sharding_integrity calls the module global _validate_common_state_dict
    "megatron.core.dist_checkpointing.validation:validate_sharding_integrity": "332bf7c1f9a387d4",
    "megatron.core.dist_checkpointing.validation:_validate_common_state_dict": "b7d8100deaa3e85e",
}

_local = threading.local()
_installed = False


def current_group():
    """The group ``collectives_on`` set for this thread, or None (megatron's default group)."""
    return getattr(_local, "group", None)


@contextmanager
def collectives_on(group):
    """In this thread, megatron's save planning and sharding validation use ``group``."""
    install()
    previous, _local.group = current_group(), group
    try:
        yield
    finally:
        _local.group = previous


def install() -> None:
    global _installed
    if _installed:
        return
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import state_dict_utils, validation
    from megatron.core.dist_checkpointing.dict_utils import diff, nested_values
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    original_plan = torch_strategy.save_state_dict_async_plan

    def save_state_dict_async_plan(state_dict, storage_writer, process_group=None, *args, **kwargs):
        return original_plan(state_dict, storage_writer, process_group or current_group(), *args, **kwargs)

    original_metadata = state_dict_utils.determine_global_metadata

    def determine_global_metadata(sharded_state_dict):
        group = current_group()
        if group is None:
            return original_metadata(sharded_state_dict)
        local = [ten.without_data() for ten in nested_values(sharded_state_dict)]  # as megatron's
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        return local, gathered

    original_common = validation._validate_common_state_dict

    def validate_common_state_dict(common_state_dict):
        group = current_group()
        if group is None:
            return original_common(common_state_dict)
        rank = dist.get_rank()
        rank0 = [common_state_dict if rank == 0 else None]
        dist.broadcast_object_list(rank0, src=0, group=group)
        if rank > 0:  # megatron only warns: the common state is saved by rank 0 alone
            only_rank0, only_here, mismatch = diff(rank0[0], common_state_dict)
            if only_rank0 or only_here or mismatch:
                validation.logger.warning(
                    f"Rank {rank} common state dict differs from rank 0 common state dict. "
                    f"Keys only on rank 0: {only_rank0}, Keys only on {rank}: {only_here}, "
                    f"Mismatched keys: {mismatch}"
                )

    for wrapper, original in [
        (save_state_dict_async_plan, original_plan),
        (determine_global_metadata, original_metadata),
        (validate_common_state_dict, original_common),
    ]:
        wrapper.__wrapped__ = original
    torch_strategy.save_state_dict_async_plan = save_state_dict_async_plan
    state_dict_utils.determine_global_metadata = determine_global_metadata
    validation._validate_common_state_dict = validate_common_state_dict
    _installed = True
