"""Checkpoints of a training run: megatron ``dist_checkpointing`` plus a ``latest`` marker.

Layout of ``checkpoint.dir``::

    iter_0000025/            one checkpoint: torch_dist shards of model + optimizer (any layout
                             can load it), ``common.pt``-style metadata written by megatron,
                             ``rng/rank00003.pt`` per-rank RNG states, ``mega.json`` (step, config)
    latest                   "iter_0000025": written atomically, only after every rank's files
                             are complete; a crash mid-save leaves the previous ``latest``.

Model and optimizer are saved in megatron's ``fully_reshardable`` format so a run can resume with
another TP/PP/DP layout. Nothing is unpickled except with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

# megatron-core is imported inside the functions that need it: the flow process reads `latest`
# through this module and should not pay for (or print the warnings of) importing megatron.

LATEST = "latest"
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    # The plain variant moves buffers to CUDA; the memory-efficient one gathers over gloo too.
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


class CheckpointError(RuntimeError):
    pass


def iteration_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def read_latest(root: str | Path) -> Path | None:
    """The directory ``latest`` names, or None when there is no complete checkpoint."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    name = marker.read_text().strip()
    path = Path(root) / name
    if not name.startswith("iter_") or not (path / "mega.json").exists():
        raise CheckpointError(f"{marker} names {name!r}, which is not a complete checkpoint")
    return path


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _sharded_state(model_chunks, optimizer, is_loading: bool) -> dict:
    metadata = dict(SHARDING_METADATA)  # megatron adds its process groups to the dict it is given
    state = {}
    model_sd = {}
    for i, chunk in enumerate(model_chunks):
        sd = chunk.sharded_state_dict(metadata=metadata)
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        state[key] = sd
        model_sd.update(sd)
    state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return state


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {
        "torch": torch.get_rng_state(),
        "tracker": dict(tensor_parallel.get_cuda_rng_tracker().get_states()),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.empty(0, dtype=torch.uint8),
    }


def save(root: str | Path, step: int, model_chunks, optimizer, scheduler, config: dict) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    root = Path(root)
    path = iteration_dir(root, step)
    rank = dist.get_rank()
    if rank == 0:
        # A directory of this step that `latest` does not name is the debris of a save that
        # crashed half-way; dist_checkpointing will not write over it, so start afresh.
        latest = read_latest(root)
        if path.exists() and (latest is None or latest.name != path.name):
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model_chunks, optimizer, is_loading=False), str(path))
    (path / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), path / "rng" / f"rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        meta = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "world_size": dist.get_world_size(),
            "layout": {
                "tp": ps.get_tensor_model_parallel_world_size(),
                "pp": ps.get_pipeline_model_parallel_world_size(),
                "dp": ps.get_data_parallel_world_size(),
            },
            "config": config,
        }
        _write_atomic(path / "mega.json", json.dumps(meta, indent=2, default=str))
        _write_atomic(root / LATEST, path.name)
    dist.barrier()
    return path


def load(path: str | Path, model_chunks, optimizer, scheduler) -> int:
    """Collective: restore model, optimizer, scheduler and (same layout only) RNG; return the step."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    path = Path(path)
    meta = json.loads((path / "mega.json").read_text())
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        # torch Adam allocates state lazily; the distributed optimizer's loader fills it in place.
        # (Megatron's other wrappers allocate it themselves, through init_state_fn.)
        if not opt.optimizer.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()
    state = dist_checkpointing.load(_sharded_state(model_chunks, optimizer, is_loading=True), str(path))
    for i, chunk in enumerate(model_chunks):
        chunk.load_state_dict(state["model" if len(model_chunks) == 1 else f"model{i}"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(meta["scheduler"])

    rng_file = path / "rng" / f"rank{dist.get_rank():05d}.pt"
    same_layout = meta["layout"] == {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }
    if same_layout and rng_file.exists():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if torch.cuda.is_available() and rng["cuda"].numel():
            torch.cuda.set_rng_state(rng["cuda"])
    return int(meta["step"])
