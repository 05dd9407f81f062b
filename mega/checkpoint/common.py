"""What saving and restoring share: names, where a run's checkpoints live, the state dicts."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# megatron-core is imported inside the functions that need it: the flow process reads `latest`
# through this package and should not pay for (or print the warnings of) importing megatron.

LATEST = "latest"
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    # The plain variant moves buffers to CUDA; the memory-efficient one gathers over gloo too.
    "distrib_optim_fully_reshardable_mem_efficient": True,
}
META_FILE = "mega.json"


class CheckpointError(RuntimeError):
    pass


def iteration_name(step: int) -> str:
    return f"iter_{step:07d}"


def iteration_dir(root: Path, step: int) -> Path:
    return Path(root) / iteration_name(step)


def storage_uri(cfg) -> str:
    """The durable store of a run: ``checkpoint.storage_uri``, else ``checkpoint.dir``."""
    return cfg.checkpoint.storage_uri or str(Path(cfg.checkpoint.dir).absolute())


def open_store(cfg):
    from mega.storage import open_storage

    uri = storage_uri(cfg)
    ck, opts = cfg.checkpoint, {}
    if uri.startswith("s3://"):  # bounded requests: ck.s3_request_bound_s()
        opts = {
            "max_attempts": ck.s3_attempts,
            "connect_timeout": ck.S3_CONNECT_TIMEOUT_S,
            "read_timeout": ck.s3_timeout_s,
        }
        if ck.s3_endpoint_url:
            opts["endpoint_url"] = ck.s3_endpoint_url
    return open_storage(uri, **opts)


@dataclass
class StoreWait:
    """The seconds a chain of store operations has waited for a store that did not answer: the
    operations sharing one (a checkpoint's upload, commit, `latest` and retention) wait at most
    ``checkpoint.upload_timeout_s`` of the store not answering in all, not that much each."""

    unanswered_s: float = 0.0


def retry_unavailable(
    ck,
    store,
    what: str,
    fn: Callable,
    log: Callable[[str], None],
    on_wait: Callable[[Exception, float], None] | None = None,
    stop: threading.Event | None = None,
    then: str = "giving up",
    wait: StoreWait | None = None,
):
    """``fn()`` (an operation on ``store``), tried again every ``checkpoint.upload_retry_s`` while
    the store does not answer (``StorageUnavailable``), for at most ``checkpoint.upload_timeout_s``
    (``ck``: the checkpoint config), counted from when the store stopped answering, so that the
    wait ends within ``ck.store_wait_bound_s()``; then StorageUnavailable naming the store and the
    bound. ``wait``: the chain this operation belongs to (its earlier operations' waits count).
    Other errors go to the caller. One ``log`` line per round; ``on_wait(error, seconds left)``
    before each wait; ``stop`` set ends a wait, re-raising the store's error."""
    from mega.storage import StorageUnavailable

    wait = wait or StoreWait()
    first_failure = None
    while True:
        tried = time.monotonic()
        try:
            result = fn()
        except StorageUnavailable as e:
            now = time.monotonic()
            # A request to a store that stopped answering fails only after its own timeouts: the
            # outage began that long ago at most (and not before this try).
            first_failure = first_failure or max(tried, now - ck.s3_request_bound_s())
            unanswered = wait.unanswered_s + now - first_failure
            left = ck.upload_timeout_s - unanswered
            if left <= 0:
                raise StorageUnavailable(
                    f"{what}: store {store.uri} unavailable for {unanswered:.1f}s "
                    f"(checkpoint.upload_timeout_s={ck.upload_timeout_s:g}), {then}: {e}"
                ) from e
            if on_wait is not None:
                on_wait(e, left)
            log(f"{what}: store unavailable, retrying in {ck.upload_retry_s:g}s: {e}")
            if (stop or threading.Event()).wait(min(ck.upload_retry_s, left)):
                raise
        else:
            if first_failure is not None:
                wait.unanswered_s += tried - first_failure
            return result


def staging_root(cfg) -> Path:
    root = Path(cfg.checkpoint.staging_dir or Path(cfg.train.run_dir) / "checkpoint-staging")
    # Node-local, and each node's local rank 0 clears it: nodes sharing one filesystem
    # (launcher=local-nodes) get a directory each.
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    return root / f"node{os.environ.get('GROUP_RANK', '0')}" if nodes > 1 else root


def latest_durable(cfg) -> str | None:
    """The checkpoint ``latest`` names in the run's durable store (None: there is none yet).

    Raises ``mega.storage.StorageUnavailable`` (naming the endpoint) when the store cannot be
    reached, and ``StorageError`` when it refuses (credentials, missing bucket)."""
    return open_store(cfg).read_latest()


def read_latest(root: str | Path) -> Path | None:
    """The directory ``latest`` names in a file store (or an old local checkpoint directory)."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    name = marker.read_text().strip()
    path = Path(root) / name
    if not name.startswith("iter_") or not (path / META_FILE).exists():
        raise CheckpointError(f"{marker} names {name!r}, which is not a complete checkpoint")
    return path


def model_state(model_chunks, metadata: dict) -> tuple[dict, dict]:
    """(state by chunk key, the same chunks for the optimizer's ``sharded_state_dict``).

    The optimizer gets the chunks nested, as Megatron-LM passes them: virtual pipeline chunks
    name their layers locally (``decoder.layers.0`` in every chunk), so merged into one dict the
    later chunks would hide the earlier ones' parameters."""
    state = {}
    for i, chunk in enumerate(model_chunks):
        state["model" if len(model_chunks) == 1 else f"model{i}"] = chunk.sharded_state_dict(
            metadata=metadata
        )
    return state, dict(state)


def sharded_state(model_chunks, optimizer, is_loading: bool) -> dict:
    metadata = dict(SHARDING_METADATA)  # megatron adds its process groups to the dict it is given
    state, model_sd = model_state(model_chunks, metadata)
    state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return state


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
        "cuda": torch.cuda.get_rng_state()
        if torch.cuda.is_available()
        else torch.empty(0, dtype=torch.uint8),
    }


def threads() -> set[int]:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def threads_cpu_s(tids) -> dict[int, float]:
    """CPU seconds each thread of ``tids`` still alive has run (/proc schedstat: nanoseconds)."""
    out = {}
    for tid in tids:
        try:
            out[tid] = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass  # a thread that has ended
    return out


def set_rng_state(rng: dict) -> None:
    """Put back what ``rng_state`` took."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(rng["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    if torch.cuda.is_available() and rng["cuda"].numel():
        torch.cuda.set_rng_state(rng["cuda"])


def layout() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }
