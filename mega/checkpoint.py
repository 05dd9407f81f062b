"""Checkpoints of a training run: two-stage saves to a durable store, restores that read each
byte of a checkpoint once per data-parallel group. See docs/checkpoints.md.

Save (``Checkpointer.save``, collective):

* stage 1, blocking training: megatron builds the model's sharded state dict and every tensor
  in it is copied to host memory (pinned on GPUs); so is this rank's shard of the distributed
  optimizer, behind a frozen view of it (mega/optimizer_snapshot.py); RNG states and the
  scheduler are captured. Training resumes. (Other optimizers, and ``async_save=false``, build
  the whole state dict and plan the save here.)
* stage 2, on one background thread per rank: the optimizer's ``fully_reshardable`` state dict
  is built from the frozen view (its gather onto DP rank 0 runs on megatron's gloo DP group) and
  ``dist_checkpointing.save(..., async_sharded_save=True)`` plans the save (collectives on the
  default group) and returns an ``AsyncRequest``; training uses neither group while a save is in
  flight. The request's write function serialises this rank's shards into the node-local staging
  directory, then the rank uploads its files to the store (``upload_files``, hashed while sent).
  The training thread checks at each step (one small all-reduce on a gloo group of its own)
  whether every rank is done; then it runs megatron's finalisation (collective: the global
  ``.metadata``), gathers every rank's manifest entries on rank 0, and rank 0's thread uploads
  the common files, commits the manifest (sizes checked against the store), moves ``latest`` and
  applies retention.

At most one save is in flight: the next one waits for it (that wait counts as stall). A crash
anywhere before ``latest`` moves leaves the previous ``latest`` in place. A store that is down
makes the uploads retry every ``checkpoint.upload_retry_s`` while training goes on.

Restore (``restore``, collective): rank 0 reads ``latest`` and the complete checkpoints before
it; the ranks of each DP group split the manifest's files, each downloads and verifies (sha256)
its share, and they broadcast the bytes to one another over the DP group, so the store serves
each byte once per DP group instead of once per rank. A corrupt or torn checkpoint is refused
(the error names the file) and the previous complete one is tried.

The data-loader position is the step: ``TokenDataset.microbatch`` is a pure function of (seed,
step, DP rank), so a restored step sees the same data. Nothing is unpickled except with
``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from mega import optimizer_snapshot

# megatron-core is imported inside the functions that need it: the flow process reads `latest`
# through this module and should not pay for (or print the warnings of) importing megatron.

LATEST = "latest"
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    # The plain variant moves buffers to CUDA; the memory-efficient one gathers over gloo too.
    "distrib_optim_fully_reshardable_mem_efficient": True,
}
META_FILE = "mega.json"
SAVE_LOG = "checkpoints.jsonl"  # one line per save and per commit, written by rank 0
SYNC_REFERENCE_ENV = "MEGA_CKPT_SYNC_REFERENCE"  # benchmarks: also time a synchronous save
_EXCHANGE_CHUNK = 64 << 20  # bytes per broadcast when DP peers exchange restored files


class CheckpointError(RuntimeError):
    pass


def iteration_name(step: int) -> str:
    return f"iter_{step:07d}"


def iteration_dir(root: Path, step: int) -> Path:
    return Path(root) / iteration_name(step)


# ---------------------------------------------------------------------------------------------
# Where checkpoints live


def storage_uri(cfg) -> str:
    """The durable store of a run: ``checkpoint.storage_uri``, else ``checkpoint.dir``."""
    return cfg.checkpoint.storage_uri or str(Path(cfg.checkpoint.dir).absolute())


def open_store(cfg):
    from mega.storage import open_storage

    uri = storage_uri(cfg)
    opts = {}
    if uri.startswith("s3://") and cfg.checkpoint.s3_endpoint_url:
        opts["endpoint_url"] = cfg.checkpoint.s3_endpoint_url
    return open_storage(uri, **opts)


def staging_root(cfg) -> Path:
    return Path(cfg.checkpoint.staging_dir or Path(cfg.train.run_dir) / "checkpoint-staging")


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


def _model_state(model_chunks, metadata: dict) -> tuple[dict, dict]:
    """(state by chunk key, the same chunks for the optimizer's ``sharded_state_dict``).

    The optimizer gets the chunks nested, as Megatron-LM passes them: virtual pipeline chunks
    name their layers locally (``decoder.layers.0`` in every chunk), so merged into one dict the
    later chunks would hide the earlier ones' parameters."""
    state = {}
    for i, chunk in enumerate(model_chunks):
        state["model" if len(model_chunks) == 1 else f"model{i}"] = chunk.sharded_state_dict(metadata=metadata)
    return state, dict(state)


def _sharded_state(model_chunks, optimizer, is_loading: bool) -> dict:
    metadata = dict(SHARDING_METADATA)  # megatron adds its process groups to the dict it is given
    state, model_sd = _model_state(model_chunks, metadata)
    state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return state


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.empty(0, dtype=torch.uint8),
    }


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _to_host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # pinned: the D2H copy is a DMA
    return out.copy_(t, non_blocking=True)


def _snapshot(state: dict) -> tuple[dict, int]:
    """Replace every tensor of a sharded state dict by a host copy: training may change the
    originals while stage 2 writes. Returns the state and the bytes copied."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    copied = 0

    def snap(x):
        nonlocal copied
        if isinstance(x, (ShardedTensor, ShardedTensorFactory)) and isinstance(x.data, torch.Tensor):
            x.data = _to_host(x.data)
            copied += x.data.numel() * x.data.element_size()
        return x

    dict_list_map_inplace(snap, state)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return state, copied


# ---------------------------------------------------------------------------------------------
# Loading a checkpoint directory on local disk (restore fetches it there first)


def load(path: str | Path, model_chunks, optimizer, scheduler) -> int:
    """Collective: restore model, optimizer, scheduler and (same layout only) RNG from a local
    checkpoint directory; return the step."""
    from megatron.core import dist_checkpointing
    from megatron.core import tensor_parallel

    path = Path(path)
    meta = json.loads((path / META_FILE).read_text())
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
    if meta["layout"] == _layout() and rng_file.exists():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if torch.cuda.is_available() and rng["cuda"].numel():
            torch.cuda.set_rng_state(rng["cuda"])
    return int(meta["step"])


# ---------------------------------------------------------------------------------------------
# Two-stage save


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)


class _Worker:
    """One daemon thread running jobs in order. Daemon: a rank that fails while an upload
    retries must still exit (the half-uploaded checkpoint is never committed)."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="ckpt-stage2", daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)


@dataclass
class _InFlight:
    """One save between stage 1 and its commit; flags are set by this rank's stage-2 thread."""

    name: str
    step: int
    path: Path
    request: object  # megatron AsyncRequest: write function + collective finalisation
    rng: dict
    files: list[str]  # this rank's files, relative to path
    started: float
    # Deferred optimizer state (mega/optimizer_snapshot.py): the snapshot state without its
    # "optimizer" entry, the frozen optimizer view, the live model state dict its parameters are
    # identified by, and megatron's metadata. Stage 2 builds and plans the save from them.
    deferred: tuple | None = None
    build_s: float = 0.0  # stage 2: building the deferred state and planning the save
    written: bool = False
    uploaded: bool = False
    error: str | None = None
    entries: list = field(default_factory=list)
    uploaded_bytes: int = 0


class Checkpointer:
    """Saves of one training run (see the module docstring). Every rank makes one; ``save`` and
    ``poll`` are collective and must be called at the same steps on every rank."""

    def __init__(self, cfg, model_chunks, optimizer, scheduler, config_dict: dict,
                 log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.ck = cfg.checkpoint
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.config_dict = config_dict
        self.rank = dist.get_rank()
        self.local_leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
        self.store = open_store(cfg)
        self.staging = staging_root(cfg) / "save"
        self.run_dir = Path(cfg.train.run_dir)
        self._log = log or (lambda m: print(f"[checkpoint] {m}", file=sys.stderr, flush=True))
        # One thread: stage 2 of a save and (rank 0) the commit run in order, never two at once.
        self._worker = _Worker()
        # The training thread's own checks on saves in flight (poll, finish) use this group:
        # stage 2 may be running collectives on the default group at the same time (the save
        # plan of a deferred save), and a communicator must never be shared by two threads.
        # gloo: the flags live in host memory, on GPUs too.
        self._control = dist.new_group(backend="gloo")
        # Build the optimizer's state dict in stage 2, from a host copy (the gather of the
        # fully_reshardable format off the training thread): distributed optimizer, async saves.
        self._defer_optimizer = self.ck.async_save and optimizer_snapshot.supported(optimizer)
        self._inflight: _InFlight | None = None
        self._commit: Future | None = None
        self._stop = threading.Event()
        # One strategy per run, reused: the save plan, which every save of a run shares, is
        # cached and validated by megatron after two saves (megatron's
        # --ckpt-assume-constant-structure); the sharding is validated on the first save only.
        self._strategy = _save_strategy()
        self._reference_strategy = _save_strategy()  # the benchmark's synchronous reference
        self._validated = False
        self._reference_validated = False

    # -- the training thread's side
    def save(self, step: int) -> dict:
        """Stage 1 of a save (collective); returns what it cost: ``stall_s`` (training blocked,
        including waiting for the previous save), ``wait_s``, ``snapshot_bytes``."""
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight: bounded host memory
        waited = time.perf_counter() - t0
        record = {"event": "save", "step": step, "wait_s": waited}
        if os.environ.get(SYNC_REFERENCE_ENV):
            record["sync_save_s"] = self._time_sync_save(step)
            t0 = time.perf_counter() - waited  # the reference is not part of this save's stall

        name = iteration_name(step)
        path = self.staging / name
        if self.local_leader and self.staging.exists():
            shutil.rmtree(self.staging)  # debris of saves that never finished
        dist.barrier()
        path.mkdir(parents=True, exist_ok=True)
        (path / "rng").mkdir(exist_ok=True)
        t1 = time.perf_counter()
        job = _InFlight(name, step, path, None, _rng_state(), [], time.perf_counter())
        if self._defer_optimizer:
            metadata = dict(SHARDING_METADATA)
            state, _ = _model_state(self.model_chunks, metadata)
            # a second, live copy: the optimizer's state dict identifies parameters by tensor
            _, live_model_sd = _model_state(self.model_chunks, dict(SHARDING_METADATA))
            t2 = time.perf_counter()
            state, copied = _snapshot(state)
            view, optimizer_bytes = optimizer_snapshot.freeze(self.optimizer)
            copied += optimizer_bytes
            job.deferred = (state, view, live_model_sd, metadata)
            record.update(state_dict_s=t2 - t1, snapshot_s=time.perf_counter() - t2, plan_s=0.0)
        else:
            state = _sharded_state(self.model_chunks, self.optimizer, is_loading=False)
            t2 = time.perf_counter()
            state, copied = _snapshot(state)
            t3 = time.perf_counter()
            self._plan(job, state)
            record.update(state_dict_s=t2 - t1, snapshot_s=t3 - t2, plan_s=time.perf_counter() - t3)
        del state
        if self.rank == 0:
            # Rank 0 writes the run-level metadata now: the scheduler changes with the next step.
            meta = {"step": step, "scheduler": self.scheduler.state_dict(), "world_size": dist.get_world_size(),
                    "layout": _layout(), "config": self.config_dict}
            (path / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
        self._inflight = job
        self._worker.submit(self._stage2, job)
        record["stage1_s"] = time.perf_counter() - t0 - waited
        if not self.ck.async_save:
            self.wait()  # the synchronous path: serialised, uploaded and `latest` moved
        record.update(stall_s=time.perf_counter() - t0, snapshot_bytes=copied)
        self._record(record)
        return record

    def _plan(self, job: _InFlight, state: dict) -> None:
        """megatron's save plan (collective on the default group) -> job.request, job.files."""
        from megatron.core import dist_checkpointing

        job.request = dist_checkpointing.save(state, str(job.path), sharded_strategy=self._strategy,
                                              validate_access_integrity=not self._validated,
                                              async_sharded_save=True)
        self._validated = True
        buckets = job.request.async_fn_args[1] if job.request.async_fn is not None else []
        job.files = [Path(b[0]).relative_to(job.path).as_posix() for b in buckets] + [f"rng/rank{self.rank:05d}.pt"]

    def poll(self, blocking: bool = False) -> None:
        """Advance the save in flight (collective): finalise it once every rank has written its
        shards, hand it to rank 0 for the commit once every rank has uploaded."""
        while self._inflight is not None:
            job = self._inflight
            flags = torch.tensor([job.written, job.uploaded or job.error is not None, job.error is None],
                                 dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self._control)
            all_written, all_finished, all_ok = (bool(x) for x in flags.tolist())
            if all_written and job.request is not None:
                request, job.request = job.request, None  # drops the snapshot once written
                try:
                    for fn in request.finalize_fns:  # megatron: gather write results, .metadata
                        fn()
                except Exception as e:  # noqa: BLE001 - raised on every rank alike by megatron
                    self._log(f"{job.name}: finalising the shards failed: {e}")
                    job.error = job.error or f"finalise: {e}"
                    all_ok = False
            if all_finished:
                self._finish(job, all_ok)
                return
            if not blocking:
                return
            time.sleep(0.02)

    def wait(self) -> None:
        """Block until the save in flight is committed (or failed): collective."""
        self.poll(blocking=True)
        if self._commit is not None:
            self._commit.result()
            self._commit = None

    def close(self) -> None:
        """Finish the last save and stop the stage-2 thread (collective)."""
        try:
            self.wait()
            dist.barrier()
        finally:
            self._worker.shutdown()

    # -- collective end of a save
    def _finish(self, job: _InFlight, all_ok: bool) -> None:
        ok = torch.tensor([int(all_ok and job.error is None)], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self._control)
        self._inflight = None
        if not ok.item():
            if job.error:
                self._log(f"{job.name}: rank {self.rank}: {job.error}")
            if self.rank == 0:
                self._record({"event": "failed", "step": job.step, "name": job.name})
                self._log(f"{job.name} not saved; `latest` is unchanged")
            return
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object((job.entries, job.uploaded_bytes), gathered, dst=0, group=self._control)
        if self.rank == 0:
            entries = [e for part, _ in gathered for e in part]
            uploaded = sum(n for _, n in gathered)
            self._commit = self._worker.submit(self._commit_job, job, entries, uploaded)

    # -- stage 2 (background thread; collectives only to build a deferred save, on groups the
    # training thread does not use while a save is in flight: megatron's gloo DP group, default)
    def _stage2(self, job: _InFlight) -> None:
        try:
            if job.deferred is not None:
                state, view, live_model_sd, metadata = job.deferred
                job.deferred = None
                t0 = time.perf_counter()
                state["optimizer"] = view.sharded_state_dict(live_model_sd, is_loading=False, metadata=metadata)
                self._plan(job, state)
                del state, view
                job.build_s = time.perf_counter() - t0
            if job.request.async_fn is not None:
                # megatron's writer (FileSystemWriterAsync): this rank's shards into the staging dir
                job.request.async_fn(*job.request.async_fn_args, **job.request.async_fn_kwargs)
            torch.save(job.rng, job.path / job.files[-1])
        except BaseException as e:  # noqa: BLE001 - reported to every rank through poll()
            job.error = f"writing shards: {type(e).__name__}: {e}"
            return
        finally:
            job.written = True
        try:
            job.entries = self._retrying(f"upload of {job.name}", lambda: self.store.upload_files(
                job.path, job.name, job.files, on_progress=self._fault_hook(job.step)))
            job.uploaded_bytes = sum(e.size for e in job.entries)
            for rel in job.files:  # uploaded: the staging copy is no longer needed
                (job.path / rel).unlink(missing_ok=True)
        except BaseException as e:  # noqa: BLE001
            job.error = f"upload: {type(e).__name__}: {e}"
        finally:
            job.uploaded = True

    def _commit_job(self, job: _InFlight, entries: list, uploaded: int) -> None:
        """Rank 0: upload the common files, commit the manifest, move `latest`, retention."""
        from mega.storage import StorageError
        from mega.storage.manifest import local_files

        try:
            have = {e.path for e in entries}
            extras = [rel for rel, _ in local_files(job.path) if rel not in have]  # common.pt, .metadata, ...
            entries = entries + self._retrying(f"upload of {job.name}",
                                               lambda: self.store.upload_files(job.path, job.name, extras))
            uploaded += sum(e.size for e in entries if e.path in extras)
            manifest = self._retrying(f"commit of {job.name}", lambda: self.store.commit(job.name, entries))
            self._retrying(f"`latest` -> {job.name}", lambda: self.store.write_latest(job.name))
            seconds = time.perf_counter() - job.started
            self._record({"event": "committed", "step": job.step, "name": job.name, "files": len(manifest.files),
                          "bytes": manifest.total_bytes, "stage2_s": seconds,
                          "upload_mb_per_s": uploaded / 1e6 / max(seconds, 1e-9)})
            self._log(f"{job.name} is `latest` in {self.store.uri} ({manifest.total_bytes / 1e6:.1f} MB, "
                      f"{seconds:.2f}s after stage 1)")
            deleted = self._retrying("retention", lambda: self.store.apply_retention(self.ck.keep_last))
            if deleted:
                self._log(f"retention (keep {self.ck.keep_last}): deleted {deleted}")
        except StorageError as e:
            self._record({"event": "failed", "step": job.step, "name": job.name, "error": str(e)})
            self._log(f"{job.name} not committed, `latest` unchanged: {e}")
        finally:
            shutil.rmtree(job.path, ignore_errors=True)

    def _retrying(self, what: str, fn):
        """Run a store operation until the store answers; other errors go to the caller."""
        from mega.storage import StorageUnavailable

        while True:
            try:
                return fn()
            except StorageUnavailable as e:
                self._log(f"{what}: store unavailable, retrying in {self.ck.upload_retry_s:g}s: {e}")
                self._record({"event": "retry", "what": what, "error": type(e).__name__})
                if self._stop.wait(self.ck.upload_retry_s):
                    raise

    def _fault_hook(self, step: int):
        f = self.cfg.fault
        if not (f.mode == "kill_in_upload" and f.kill_rank == self.rank and f.kill_at_step == step
                and int(os.environ.get("MEGA_ATTEMPT", "0")) == 0):
            return None

        def kill(done: int, total: int) -> None:
            if done > 0:  # part of the upload is in the store, the rest never will be
                print(f"[fault] kill_in_upload: rank {self.rank} during stage 2 of step {step} "
                      f"({done}/{total} bytes sent)", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        return kill

    # -- bookkeeping
    def _time_sync_save(self, step: int) -> float:
        """Benchmarks: a synchronous dist_checkpointing save of the same state, timed (max over
        ranks), into a scratch directory that is removed afterwards."""
        from megatron.core import dist_checkpointing

        scratch = staging_root(self.cfg) / "sync-reference" / iteration_name(step)
        if self.local_leader:
            shutil.rmtree(scratch.parent, ignore_errors=True)
        dist.barrier()
        scratch.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        dist_checkpointing.save(_sharded_state(self.model_chunks, self.optimizer, is_loading=False), str(scratch),
                                sharded_strategy=self._reference_strategy,
                                validate_access_integrity=not self._reference_validated)
        self._reference_validated = True
        torch.save(_rng_state(), scratch / f"rng{self.rank:05d}.pt")
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        dist.barrier()
        if self.local_leader:
            shutil.rmtree(scratch.parent, ignore_errors=True)
        return seconds.item()

    def _record(self, row: dict) -> None:
        if self.rank == 0:
            with open(self.run_dir / SAVE_LOG, "a") as f:
                f.write(json.dumps({"time": time.time(), **row}) + "\n")


def read_save_log(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / SAVE_LOG
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------------------------
# Restore


def _split(files: list, parts: int) -> list[list]:
    """Files (manifest entries) into ``parts`` shares of about equal bytes, deterministically."""
    shares: list[list] = [[] for _ in range(parts)]
    load = [0] * parts
    for e in sorted(files, key=lambda e: (-e.size, e.path)):
        i = min(range(parts), key=lambda j: (load[j], j))
        shares[i].append(e)
        load[i] += e.size
    return shares


def _exchange(manifest, shares: list[list], local_dir: Path, group, group_ranks: list[int], device) -> None:
    """Every file a DP peer downloaded is broadcast (in chunks) from it to the rest of the group."""
    me = dist.get_rank()
    if len(group_ranks) == 1:
        return  # the only rank downloaded everything itself
    for owner, share in zip(group_ranks, shares):
        for e in share:
            path = local_dir / e.path
            if owner != me:
                path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb" if owner == me else "wb") as f:
                for offset in range(0, e.size, _EXCHANGE_CHUNK):
                    n = min(_EXCHANGE_CHUNK, e.size - offset)
                    if owner == me:
                        buf = torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8).to(device)
                    else:
                        buf = torch.empty(n, dtype=torch.uint8, device=device)
                    dist.broadcast(buf, src=owner, group=group)
                    if owner != me:
                        f.write(buf.cpu().numpy().tobytes())


def _fetch(store, name: str, local_dir: Path, device) -> tuple[int, int]:
    """Download checkpoint ``name`` onto every rank, one store read per DP group; raises
    CorruptCheckpoint (the same decision on every rank). Returns (bytes this DP group read from
    the store, bytes the naive path -- every rank reading everything -- would have read)."""
    from megatron.core import parallel_state as ps

    from mega.storage import CorruptCheckpoint, StorageError

    group = ps.get_data_parallel_group()
    dp = ps.get_data_parallel_world_size()
    group_ranks = dist.get_process_group_ranks(group)
    error: tuple | None = None
    manifest = None
    store.reset_bytes_read()
    try:
        manifest = store.read_manifest(name)
        shares = _split(manifest.files, dp)
        mine = shares[group_ranks.index(dist.get_rank())]
        store.download_files(name, [e.path for e in mine], local_dir)  # sha256-verified
    except CorruptCheckpoint as e:
        error = ("corrupt", e.name, e.relpath, e.reason)
    except StorageError as e:
        error = ("storage", name, None, str(e))
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # every rank takes the same decision
    bad = [e for e in errors if e is not None]
    if bad:
        kind, cname, relpath, reason = bad[0]
        if kind == "corrupt":
            raise CorruptCheckpoint(cname, relpath, reason)
        raise StorageError(reason)
    _exchange(manifest, shares, local_dir, group, group_ranks, device)
    read = torch.tensor([store.bytes_read], dtype=torch.int64)
    dist.all_reduce(read, group=group)
    return int(read.item()), dp * manifest.total_bytes


def restore(cfg, model_chunks, optimizer, scheduler, log: Callable[[str], None] | None = None) -> tuple[int, dict]:
    """Collective: load ``latest`` from the durable store, falling back to the previous complete
    checkpoint when it is refused. Returns (step to start from, what was done)."""
    from mega.storage import CorruptCheckpoint, step_of

    if log is None:
        def log(message: str) -> None:  # every rank takes the same decisions: rank 0 tells them
            if dist.get_rank() == 0:
                print(f"[checkpoint] {message}", file=sys.stderr, flush=True)
    store = open_store(cfg)
    t0 = time.perf_counter()
    candidates = [None]
    if dist.get_rank() == 0:
        latest = store.read_latest()
        names = []
        if latest is not None:
            complete = store.list_checkpoints()
            names = [latest] + [n for n in reversed(complete) if step_of(n) < step_of(latest)]
            for n in complete:
                if step_of(n) > step_of(latest):
                    # Committed but never made `latest` (a crash in between): not durable by the
                    # protocol, and this run will save that step again.
                    log(f"removing {n}: newer than `latest` ({latest}), never made durable")
                    store.delete(n)
        candidates = [names]
    dist.broadcast_object_list(candidates, src=0)
    from mega.cluster.backend_flags import backend_flags

    device = torch.device("cuda", torch.cuda.current_device()) if backend_flags(cfg).collective_device == "cuda" \
        else torch.device("cpu")  # the DP peers exchange restored files by broadcast on the default group
    info: dict = {"refused": []}
    for name in candidates[0]:
        local_dir = staging_root(cfg) / "restore" / name / f"rank{dist.get_rank():05d}"
        shutil.rmtree(local_dir, ignore_errors=True)
        local_dir.mkdir(parents=True)
        try:
            try:
                read, naive = _fetch(store, name, local_dir, device)
            except CorruptCheckpoint as e:
                log(f"refusing {name}: {e}; falling back to the previous complete checkpoint")
                info["refused"].append({"name": name, "file": e.relpath, "reason": e.reason})
                continue
            step = load(local_dir, model_chunks, optimizer, scheduler)
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
        if info["refused"] and dist.get_rank() == 0:
            # The refused ones are newer than this; this run saves their steps again, and the
            # store must not keep pointing at a checkpoint that cannot be read.
            store.write_latest(name)
            log(f"`latest` moved back to {name}")
        info.update(checkpoint=name, step=step, restore_bytes_read=read, naive_restore_bytes=naive,
                    restore_s=time.perf_counter() - t0)
        log(f"restored {name} (step {step}) from {store.uri}: {read} bytes read per DP group "
            f"(naive: {naive})")
        return step, info
    if info["refused"]:
        raise CheckpointError(f"no usable checkpoint in {store.uri}: refused {info['refused']}")
    return 0, info
