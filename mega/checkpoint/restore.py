"""Restore: `latest` of the durable store, each rank fetching and holding only what its shards need.

``restore`` (collective, at start-up) walks the candidates -- `latest`, then each older complete
checkpoint -- and loads the first one that verifies:

1. The small files every rank needs (dist_checkpointing's ``.metadata``, ``common.pt``,
   ``metadata.json``, our ``mega.json``) and, when the layout is the saving one, the rank's own
   RNG file are fetched through a ``PieceExchange`` (one read per DP group, verified, passed on
   to the peers) into the rank's staging directory.
2. The rank builds its load request: the model's shards of its TP/PP coordinates and the
   optimizer state of its DP slice only (``megatron_io.optimizer_load_request``).
3. ``dist_checkpointing.load`` plans it against ``.metadata`` (which tensor chunk lives at which
   file offset) and reads through ``megatron_io.ExchangeReader``: the pieces of the plan are read
   once per DP group with ranged reads, verified (sha256 of each piece, from the manifest), and
   sent to the DP peers that need them.

A corrupt or torn checkpoint is refused naming the file (every rank takes the same decision) and
the next candidate is tried. A store that does not answer is waited for, bounded as saves wait
for it (``_waiting``); the in-memory copies do not wait for it (``_memory_first``). Nothing is
unpickled except with ``weights_only=True`` (RNG files, the shards) and by torch's own reader of
dist_checkpointing's ``.metadata``, after that file's sha256 matched the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from mega.checkpoint import megatron_io
from mega.checkpoint.common import (
    META_FILE,
    SHARDING_METADATA,
    CheckpointError,
    iteration_name,
    layout,
    model_state,
    open_store,
    retry_unavailable,
    set_rng_state,
    staging_root,
)
from mega.checkpoint.exchange import PieceExchange

COMMON_FILES = (".metadata", "common.pt", "metadata.json", META_FILE)  # every rank reads these
# Benchmarks: after the restore, load the same checkpoint again the naive way (every rank reads
# all it needs itself) and report the bytes that took (`naive_restore_bytes`).
NAIVE_REFERENCE_ENV = "MEGA_CKPT_NAIVE_RESTORE_REFERENCE"
# Tests and audits: each rank writes what it asked to load and what it held to <dir>/rankNNNNN.json.
AUDIT_ENV = "MEGA_CKPT_RESTORE_AUDIT"


def _rng_file(rank: int) -> str:
    return f"rng/rank{rank:05d}.pt"


def load(
    path: str | Path,
    model_chunks,
    optimizer,
    scheduler,
    exchange: PieceExchange | None = None,
    requests: list | None = None,
) -> tuple[int, int]:
    """Collective: restore model, optimizer, scheduler and (same layout only) RNG from checkpoint
    ``path``; return (step, bytes of load buffers allocated). With an ``exchange`` the shards come
    from the store through it and ``path`` holds only the small files; without, all from ``path``."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta = json.loads((path / META_FILE).read_text())
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        # torch Adam allocates state lazily; the distributed optimizer's loader fills it in place.
        # (Megatron's other wrappers allocate it themselves, through init_state_fn.)
        if not opt.optimizer.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()
    metadata = dict(SHARDING_METADATA)
    state, model_sd = model_state(model_chunks, metadata)
    state["optimizer"], buffer_bytes = megatron_io.optimizer_load_request(optimizer, model_sd, metadata)
    if exchange is not None:
        exchange.stats.hold(buffer_bytes)
    strategy = megatron_io.load_strategy(exchange, requests) if exchange is not None else None
    # The DP-slice request leaves other ranks' optimizer shards unrequested on purpose: megatron's
    # check that every shard is loaded exactly once does not apply (and would gather every
    # rank's shard metadata).
    state = dist_checkpointing.load(
        state, str(path), sharded_strategy=strategy, validate_access_integrity=False
    )
    for i, chunk in enumerate(model_chunks):
        chunk.load_state_dict(state["model" if len(model_chunks) == 1 else f"model{i}"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(meta["scheduler"])

    rng_file = path / _rng_file(dist.get_rank())
    if meta["layout"] == layout() and rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return int(meta["step"]), buffer_bytes


def _stage_files(exchange: PieceExchange, paths: list[str], local_dir: Path) -> None:
    """Collective: fetch whole files (verified) into ``local_dir``. They stay counted as held."""
    wanted = [(p, 0, exchange.manifest.entry(p).size) for p in paths]
    exchange.fetch(wanted)
    for piece in wanted:
        dest = local_dir / piece[0]
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(exchange.get(*piece))
        exchange.release(*piece)
        exchange.stats.hold(piece[2])  # on disk now, still held by this rank


def _on_rank0(fn: Callable):
    """Collective: rank 0 runs ``fn`` (store reads), every rank gets its result or the same error:
    all ranks go on, or all fail. Any other error of rank 0 is raised there as it is and on the
    other ranks as a RuntimeError naming it (not as a broken collective once rank 0 is gone)."""
    from mega.storage import CorruptCheckpoint, StorageError, StorageUnavailable

    box, error = [None], None
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except CorruptCheckpoint as e:
            box = [("corrupt", (e.name, e.relpath, e.reason))]
        except StorageError as e:
            box = [("unavailable" if isinstance(e, StorageUnavailable) else "storage", str(e))]
        except Exception as e:
            box, error = [("other", f"{type(e).__name__}: {e}")], e
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "corrupt":
        raise CorruptCheckpoint(*value)
    if kind in ("unavailable", "storage"):
        raise (StorageUnavailable if kind == "unavailable" else StorageError)(value)
    if kind == "other":
        if error is not None:
            raise error
        raise RuntimeError(f"restore: rank 0 failed: {value}")
    return value


def _unwrap(e: BaseException) -> BaseException:
    """torch DCP wraps what read_data raised in a CheckpointException: our verdict is inside."""
    from mega.storage import StorageError

    for failure in getattr(e, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, StorageError):
            return inner
    return e


def _restore_from(
    cfg,
    store,
    name: str,
    local_dir: Path,
    model_chunks,
    optimizer,
    scheduler,
    device,
    share: bool,
    audit: dict | None,
) -> tuple[int, PieceExchange]:
    """Collective: load checkpoint ``name`` through a PieceExchange; (step, the exchange).
    Every store access waits for a store that does not answer (``_waiting``)."""
    from megatron.core import parallel_state as ps

    from mega.storage import CorruptCheckpoint

    retry = _waiting(cfg, store)
    manifest = _on_rank0(lambda: retry(f"restore: manifest of {name}", lambda: store.read_manifest(name)))
    group = ps.get_data_parallel_group()
    exchange = PieceExchange(store, manifest, group, device, share=share, retry=retry)
    listed = {e.path for e in manifest.files}
    if META_FILE not in listed:  # the same manifest on every rank: the same decision
        raise CorruptCheckpoint(name, META_FILE, "not in the manifest")
    _stage_files(exchange, [p for p in COMMON_FILES if p in listed], local_dir)
    saved_layout = json.loads((local_dir / META_FILE).read_text())["layout"]
    own_rng = _rng_file(dist.get_rank())
    _stage_files(exchange, [own_rng] if saved_layout == layout() and own_rng in listed else [], local_dir)
    requests = [] if audit is not None else None
    try:
        step, buffers = load(local_dir, model_chunks, optimizer, scheduler, exchange, requests)
    except BaseException as e:
        inner = _unwrap(e)
        if inner is e:
            raise
        raise inner from None
    finally:
        exchange.drop()
    if audit is not None:
        audit.update(
            requests=requests,
            buffer_bytes=buffers,
            pieces=[[*p, src] for p, src in sorted(exchange.stats.sources.items())],
        )
    return step, exchange


def _totals(stats) -> dict:
    """Every rank's counters (collective): the sums over the job, the largest footprint of one
    rank, and the per-rank rows."""
    mine = {
        "read_bytes": stats.read_bytes,
        "received_bytes": stats.received_bytes,
        "sent_bytes": stats.sent_bytes,
        "peak_bytes": stats.peak_bytes,
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return {
        "read": sum(r["read_bytes"] for r in rows),
        "sent": sum(r["sent_bytes"] for r in rows),
        "peak": max(r["peak_bytes"] for r in rows),
        "per_rank": rows,
    }


def _rank0_log(message: str) -> None:  # every rank takes the same decisions: rank 0 tells them
    if dist.get_rank() == 0:
        print(f"[checkpoint] {message}", file=sys.stderr, flush=True)


def _rank_log(message: str) -> None:  # a rank waiting for the store on its own reads
    print(f"[checkpoint] rank {dist.get_rank()}: {message}", file=sys.stderr, flush=True)


def _waiting(cfg, store) -> Callable:
    """``retry(what, fn)`` for every durable-store read of a restore: tried again while the store
    does not answer, the way saves wait for it (``retry_unavailable``: every
    checkpoint.upload_retry_s, at most checkpoint.upload_timeout_s). A rank that waits holds its
    peers in the next collective, which fails after cluster.pg_timeout_s: the config keeps
    ``store_wait_bound_s`` below it. One line per round from each waiting rank."""
    return partial(retry_unavailable, cfg.checkpoint, store, log=_rank_log)


def _once(what: str, fn: Callable):
    return fn()


def _list_candidates(store, log: Callable[[str], None]) -> list[str]:
    """Rank 0: `latest`, then each older complete checkpoint; a complete checkpoint newer than
    `latest` is removed."""
    from mega.storage import step_of

    latest = store.read_latest()
    if latest is None:
        return []
    complete = store.list_checkpoints()
    for n in complete:
        if step_of(n) > step_of(latest):
            # Committed but never made `latest` (a crash in between): not durable by the
            # protocol, and this run will save that step again.
            log(f"removing {n}: newer than `latest` ({latest}), never made durable")
            store.delete(n)
    return [latest] + [n for n in reversed(complete) if step_of(n) < step_of(latest)]


def _candidates(store, log: Callable[[str], None], retry: Callable = _once) -> list[str]:
    """Collective: ``_list_candidates`` (rank 0 reads the store through ``retry``, every rank gets
    the list or the same error)."""
    return _on_rank0(lambda: retry("restore: read `latest`", lambda: _list_candidates(store, log)))


def _memory_first(memory, store, t0: float, log) -> tuple[int | None, dict, list[str] | None]:
    """Collective: the in-memory copies when usable: (step or None, record, the durable candidates,
    None when the store did not answer). They are used when not older than `latest`. A store that
    does not answer one request (with its own retries: ``s3_request_bound_s``) is not waited for:
    `latest` is unknown and the newest complete copies are used whatever their step (one older
    than `latest` redoes the steps since, on the same curve); only when they are unusable does the
    restore wait for the store."""
    from mega.storage import StorageUnavailable

    try:
        candidates = _candidates(store, log)
    except StorageUnavailable as e:
        log(f"`latest` unknown, trying the in-memory copies first: {e}")
        candidates = None
    step, info = _from_memory(memory, candidates, t0, log)
    return step, info, candidates


def _from_memory(memory, candidates: list[str] | None, t0: float, log) -> tuple[int | None, dict]:
    """Collective: the in-memory copies when usable; (step, restore record) or (None, why not)."""
    from mega.storage import step_of

    step, info = memory.restore(step_of(candidates[0]) if candidates else 0)
    if step is None:
        log(f"in-memory copies not used: {info['reason']}")
        return None, info
    info["restore_s"] = time.perf_counter() - t0
    log(
        f"restored {iteration_name(step)} from the in-memory copies ({info['source']} supplied "
        f"rank 0's, {info['bytes']} bytes per rank)"
    )
    record = {"checkpoint": iteration_name(step), "step": step, "source": "memory", "refused": []}
    return step, {**record, "restore_s": info["restore_s"], "memory": info}


def _restore_device(cfg) -> torch.device:
    """Where the DP peers exchange restored pieces (point to point on the default group)."""
    from mega.cluster.backend_flags import backend_flags

    if backend_flags(cfg).collective_device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _try_candidate(cfg, store, name, model_chunks, optimizer, scheduler, info, log, t0: float):
    """Collective: load checkpoint ``name``; its PieceExchange, or None when it was refused
    (recorded in ``info["refused"]``). ``t0``: when the restore began."""
    from mega.storage import CorruptCheckpoint

    local_dir = staging_root(cfg) / "restore" / name / f"rank{dist.get_rank():05d}"
    shutil.rmtree(local_dir, ignore_errors=True)
    local_dir.mkdir(parents=True)
    audit = {} if os.environ.get(AUDIT_ENV) else None
    device = _restore_device(cfg)
    try:
        step, exchange = _restore_from(
            cfg, store, name, local_dir, model_chunks, optimizer, scheduler, device, True, audit
        )
    except CorruptCheckpoint as e:
        log(f"refusing {name}: {e}; falling back to the previous complete checkpoint")
        info["refused"].append({"name": name, "file": e.relpath, "reason": e.reason})
        return None
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    info.update(checkpoint=name, step=step, restore_s=time.perf_counter() - t0)
    if audit is not None:
        _write_audit(audit, name, exchange.stats)
    if os.environ.get(NAIVE_REFERENCE_ENV):
        info["naive_restore_bytes"] = _naive_reference(
            cfg, store, name, model_chunks, optimizer, scheduler, device
        )
    return exchange


def _write_audit(audit: dict, name: str, stats) -> None:
    audit.update(
        rank=dist.get_rank(),
        checkpoint=name,
        layout=layout(),
        read_bytes=stats.read_bytes,
        received_bytes=stats.received_bytes,
        peak_bytes=stats.peak_bytes,
    )
    audit_dir = Path(os.environ[AUDIT_ENV])
    audit_dir.mkdir(parents=True, exist_ok=True)
    (audit_dir / f"rank{dist.get_rank():05d}.json").write_text(json.dumps(audit))


def restore(
    cfg, model_chunks, optimizer, scheduler, log: Callable[[str], None] | None = None, memory=None
) -> tuple[int, dict]:
    """Collective: load the newest complete in-memory copy (``memory``, a MemoryCheckpoints) when
    it is not older than ``latest`` (``_memory_first``); else ``latest`` from the durable store,
    falling back to the previous complete checkpoint when it is refused. A store that does not
    answer is waited for, bounded (``_waiting``). Returns (step to start from, what was done;
    ``memory``: why the in-memory copies were or were not used)."""
    log = log or _rank0_log
    store = open_store(cfg)
    t0 = time.perf_counter()
    candidates = memory_info = None
    if memory is not None:
        step, memory_info, candidates = _memory_first(memory, store, t0, log)
        if step is not None:
            return step, memory_info
    if candidates is None:
        candidates = _candidates(store, log, _waiting(cfg, store))
    info: dict = {"refused": [], "source": "durable", **({"memory": memory_info} if memory_info else {})}
    for name in candidates:
        exchange = _try_candidate(cfg, store, name, model_chunks, optimizer, scheduler, info, log, t0)
        if exchange is None:
            continue
        totals = _totals(exchange.stats)
        if info["refused"]:
            # The refused ones are newer than this; this run saves their steps again, and the
            # store must not keep pointing at a checkpoint that cannot be read.
            retry = _waiting(cfg, store)
            _on_rank0(lambda: retry(f"restore: `latest` -> {name}", lambda: store.write_latest(name)))
            log(f"`latest` moved back to {name}")
        info.update(
            checkpoint_bytes=exchange.manifest.total_bytes,
            restore_bytes_read=totals["read"],
            restore_bytes_exchanged=totals["sent"],
            restore_peak_bytes_per_rank=totals["peak"],
            per_rank=totals["per_rank"],
        )
        log(
            f"restored {name} (step {info['step']}) from {store.uri}: {totals['read']} bytes read from the "
            f"store by {dist.get_world_size()} ranks, {totals['sent']} passed between DP peers; at most "
            f"{totals['peak']} bytes held by one rank"
        )
        return info["step"], info
    if info["refused"]:
        raise CheckpointError(f"no usable checkpoint in {store.uri}: refused {info['refused']}")
    return 0, info


def _naive_reference(cfg, store, name, model_chunks, optimizer, scheduler, device) -> int:
    """Benchmarks: load ``name`` again with every rank reading all it needs itself; the bytes
    that took from the store, summed over the job. (The state loaded is the same.)"""
    local_dir = staging_root(cfg) / "restore-naive" / name / f"rank{dist.get_rank():05d}"
    shutil.rmtree(local_dir, ignore_errors=True)
    local_dir.mkdir(parents=True)
    try:
        _, exchange = _restore_from(
            cfg, store, name, local_dir, model_chunks, optimizer, scheduler, device, False, None
        )
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    return _totals(exchange.stats)["read"]


def restore_source(info: dict) -> str | None:
    """Where a restore (``restore``'s record) came from: ``memory-own`` (every rank's own node's
    in-memory copy), ``memory-peer`` (some rank's copy from a peer node), ``durable`` (the store),
    None (nothing to restore: a fresh start)."""
    if info.get("source") == "memory":
        sources = info["memory"]["sources"]
        return "memory-own" if all(int(o) == int(h) for o, h in sources.items()) else "memory-peer"
    return "durable" if info.get("checkpoint") else None


def describe_source(info: dict) -> str:
    """``restore_source`` in words, for the driver's log."""
    source = restore_source(info)
    if source == "memory-peer":
        moved = sum(int(o) != int(h) for o, h in info["memory"]["sources"].items())
        return f"in-memory copies ({moved} rank(s) from a peer node's copy)"
    return {"memory-own": "in-memory copies (each node's own)", "durable": "the durable store"}.get(
        source, "nothing (a fresh start)"
    )
