"""Two-stage saves of a training run to a durable store (docs/checkpoints.md).

Save (``Checkpointer.save``, collective):

* stage 1, blocking training: megatron builds the model's sharded state dict and every tensor
  in it is copied to host memory (pinned on GPUs); so is this rank's shard of the distributed
  optimizer, behind a frozen view of it (mega/optimizer_snapshot.py); RNG states and the
  scheduler are captured. Training resumes. (Other optimizers, and ``async_save=false``, build
  the whole state dict and plan the save here.)
* stage 2, on one background thread per rank: the optimizer's ``fully_reshardable`` state dict
  is built from the frozen view (its gather onto DP rank 0 runs on megatron's gloo DP group) and
  ``dist_checkpointing.save(..., async_sharded_save=True)`` plans the save (collectives on a gloo
  group only saves use, mega/checkpoint/save_group.py) and returns an ``AsyncRequest``; training
  uses neither group. The thread makes the rank's GPU current before anything else. The request's write function serialises this rank's shards into the node-local staging
  directory, then the rank uploads its files to the store (``upload_files``, hashed while sent,
  each byte once: a shard file in the serialised pieces the writer reported, the others whole).
  The training thread checks at each step (one small all-reduce on a gloo group of its own)
  whether every rank is done; then it runs megatron's finalisation (collective: the global
  ``.metadata``), gathers every rank's manifest entries on rank 0, and rank 0's thread uploads
  the common files, commits the manifest (sizes checked against the store), moves ``latest`` and
  applies retention.

At most one save is in flight: the next one waits for it (that wait counts as stall). A crash
anywhere before ``latest`` moves leaves the previous ``latest`` in place. A store that is down
makes the uploads retry every ``checkpoint.upload_retry_s`` while training goes on, for at most
``checkpoint.upload_timeout_s``: then that checkpoint fails (``latest`` unchanged) and the next
one tries again. A periodic save that comes due while the previous one retries (or while it is
waited for, starts to) is skipped, not queued: every rank learns it from the same all-reduce of
``poll``. The last save of a run and the scheduler's warning save always wait.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mega import faults, optimizer_snapshot
from mega.checkpoint import megatron_io, save_group
from mega.checkpoint.common import (
    META_FILE,
    SHARDING_METADATA,
    StoreWait,
    iteration_name,
    layout,
    model_state,
    open_store,
    retry_unavailable,
    rng_state,
    sharded_state,
    staging_root,
    threads,
    threads_cpu_s,
)
from mega.cluster import node
from mega.cluster.backend_flags import backend_flags
from mega.cluster.rendezvous import gloo_side_group
from mega.storage.save_log import SAVE_LOG

STAGE2_NICE = 10  # scheduling priority of asynchronous stage 2 (0 normal, 19 lowest)


class _StageCpu:
    """CPU seconds stage 2 has used since this was made: the process's (and its finished
    children's: the writer process) less what the threads already running then used meanwhile
    -- the training thread, collectives' transport threads, heartbeats -- except the stage-2
    thread itself. Threads stage 2 starts (uploads) count whole."""

    def __init__(self):
        self._own = threading.get_native_id()
        self._process = self._process_s()
        self._others = threads_cpu_s(threads() - {self._own})

    @staticmethod
    def _process_s() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def spent(self) -> float:
        now = threads_cpu_s(self._others)
        others = sum(now[t] - self._others[t] for t in now)
        return self._process_s() - self._process - others


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
# Two-stage save


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)


class _Worker:
    """One daemon thread running jobs in order. Daemon: a rank that fails while an upload
    retries must still exit (the half-uploaded checkpoint is never committed). ``nice``: the
    thread's scheduling priority (Linux: per thread; the writer processes it forks and the upload
    threads it starts inherit it). ``device``: the rank's GPU, made current in the thread before
    anything else runs there (a new thread starts on GPU 0, and a CUDA call there would create a
    context on another rank's device)."""

    def __init__(self, nice: int = 0, device: torch.device | None = None):
        self._nice = nice
        self._device = device
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
        if self._device is not None:
            torch.cuda.set_device(self._device)
        if self._nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
                pass
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as e:
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
    tap: object = None  # megatron_io.WriteResultsTap: where each serialised piece went
    written: bool = False
    uploaded: bool = False
    error: str | None = None
    entries: list = field(default_factory=list)
    uploaded_bytes: int = 0
    cpu: dict = field(default_factory=dict)  # stage 2's CPU seconds: build, serialise, upload (incl. hashing)
    store_wait: StoreWait = field(default_factory=StoreWait)  # its store operations' one wait budget


class Checkpointer:
    """Saves of one training run (see the module docstring). Every rank makes one; ``save`` and
    ``poll`` are collective and must be called at the same steps on every rank."""

    def __init__(
        self,
        cfg,
        model_chunks,
        optimizer,
        scheduler,
        config_dict: dict,
        log: Callable[[str], None] | None = None,
    ):
        self.cfg = cfg
        self.ck = cfg.checkpoint
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.config_dict = config_dict
        self.rank = dist.get_rank()
        self.me = {**node.identity(), "rank": self.rank}  # who a drill's fault row names
        self.local_leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
        self.store = open_store(cfg)
        self.staging = staging_root(cfg) / "save"
        self.run_dir = Path(cfg.train.run_dir)
        self._log = log or (lambda m: print(f"[checkpoint] {m}", file=sys.stderr, flush=True))
        # One thread: stage 2 of a save and (rank 0) the commit run in order, never two at once.
        # Asynchronous saves run it at a lower priority: where training keeps every core busy
        # (CPU ranks), serialising, hashing and uploading yield to it instead of slowing each
        # step. A synchronous save is what training waits for: normal priority.
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend_flags(cfg).device == "cuda" else None
        )
        self._worker = _Worker(nice=STAGE2_NICE if self.ck.async_save else 0, device=device)
        # megatron plans a save with collectives on the default group; here they run on this gloo
        # group instead (mega/checkpoint/save_group.py), which only saves use: stage 2 plans in its
        # own thread while the training thread goes on, and no communicator serves two threads.
        self._save_group = gloo_side_group(cfg)
        # The training thread's own checks on saves in flight (poll, finish) use this group:
        # stage 2 may be running collectives on the save group at the same time (the save plan
        # of a deferred save), and a communicator must never be shared by two threads.
        # gloo: the flags live in host memory, on GPUs too.
        self._control = gloo_side_group(cfg)
        # Build the optimizer's state dict in stage 2, from a host copy (the gather of the
        # fully_reshardable format off the training thread): distributed optimizer, async saves.
        self._defer_optimizer = self.ck.async_save and optimizer_snapshot.supported(optimizer)
        self._inflight: _InFlight | None = None
        self._commit: Future | None = None  # rank 0: the commit of the last save, on the worker
        # Every rank: the name of the save whose commit rank 0 runs until an all-reduce says it is done.
        self._committing: str | None = None
        # Set by this rank's stage-2 thread while a store operation waits to be tried again.
        self._in_retry = False
        self._stop = threading.Event()
        # One strategy per run, reused: the save plan, which every save of a run shares, is
        # cached and validated by megatron after two saves (megatron's
        # --ckpt-assume-constant-structure); the sharding is validated on the first save only.
        self._strategy = _save_strategy()
        megatron_io.use_in_process_results_queue()
        self._validated = False
        self._durable = self._latest_now()  # what `latest` names: the last durable checkpoint

    def _latest_now(self) -> str | None:
        """Rank 0: `latest` in the store now, for the record of a save that fails (None when
        there is none or the store cannot say)."""
        from mega.storage import StorageError

        if self.rank != 0:
            return None
        try:
            return self.store.read_latest()
        except StorageError:
            return None

    # -- the training thread's side
    def save(self, step: int, skippable: bool = False) -> dict:
        """Stage 1 of a save (collective); returns what it cost: ``stall_s`` (training blocked,
        including waiting for the previous save), ``wait_s``, ``snapshot_bytes``. A ``skippable``
        save (a periodic one) is skipped instead -- ``skipped`` in the result -- when the previous
        save is, or while it is waited for becomes, retrying a store that does not answer: waiting
        for it would block training until the store is back or the upload gives up."""
        t0 = time.perf_counter()
        if skippable and self.poll(blocking=True, until_retrying=True):
            return self._skip(step, time.perf_counter() - t0)
        self.wait()  # at most one save in flight: bounded host memory
        waited = time.perf_counter() - t0
        record = {"event": "save", "step": step, "wait_s": waited}
        name = iteration_name(step)
        path = self.staging / name
        if self.local_leader and self.staging.exists():
            shutil.rmtree(self.staging)  # debris of saves that never finished
        dist.barrier()
        path.mkdir(parents=True, exist_ok=True)
        (path / "rng").mkdir(exist_ok=True)
        t1 = time.perf_counter()
        job = _InFlight(name, step, path, None, rng_state(), [], time.perf_counter())
        if self._defer_optimizer:
            metadata = dict(SHARDING_METADATA)
            state, _ = model_state(self.model_chunks, metadata)
            # a second, live copy: the optimizer's state dict identifies parameters by tensor
            _, live_model_sd = model_state(self.model_chunks, dict(SHARDING_METADATA))
            t2 = time.perf_counter()
            state, copied = _snapshot(state)
            view, optimizer_bytes = optimizer_snapshot.freeze(self.optimizer)
            copied += optimizer_bytes
            job.deferred = (state, view, live_model_sd, metadata)
            record.update(state_dict_s=t2 - t1, snapshot_s=time.perf_counter() - t2, plan_s=0.0)
        else:
            state = sharded_state(self.model_chunks, self.optimizer, is_loading=False)
            t2 = time.perf_counter()
            state, copied = _snapshot(state)
            t3 = time.perf_counter()
            self._plan(job, state)
            record.update(state_dict_s=t2 - t1, snapshot_s=t3 - t2, plan_s=time.perf_counter() - t3)
        del state
        if self.rank == 0:
            # Rank 0 writes the run-level metadata now: the scheduler changes with the next step.
            meta = {
                "step": step,
                "scheduler": self.scheduler.state_dict(),
                "world_size": dist.get_world_size(),
                "layout": layout(),
                "config": self.config_dict,
            }
            (path / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
        self._inflight = job
        self._worker.submit(self._stage2, job)
        record["stage1_s"] = time.perf_counter() - t0 - waited
        if not self.ck.async_save:
            self.wait()  # the synchronous path: serialised, uploaded and `latest` moved
        record.update(stall_s=time.perf_counter() - t0, snapshot_bytes=copied)
        self._record(record)
        return record

    def _skip(self, step: int, waited: float) -> dict:
        """A periodic save not taken: the previous one is retrying (identical on every rank: the
        all-reduce of ``poll`` said so). In-memory copies on a peer keep covering a rank's loss."""
        previous = self._inflight.name if self._inflight is not None else self._committing
        record = {
            "event": "skipped",
            "step": step,
            "reason": f"store unavailable: the previous save ({previous}) is retrying",
            "wait_s": waited,
            "stall_s": waited,
            "skipped": True,
        }
        self._record(record)
        return record

    def _plan(self, job: _InFlight, state: dict) -> None:
        """megatron's save plan (collective on the save group) -> job.request, job.files."""
        from megatron.core import dist_checkpointing

        with save_group.collectives_on(self._save_group):  # also megatron's finalisation, later
            job.request = dist_checkpointing.save(
                state,
                str(job.path),
                sharded_strategy=self._strategy,
                validate_access_integrity=not self._validated,
                async_sharded_save=True,
            )
        self._validated = True
        job.tap = megatron_io.tap_write_results(job.request)
        buckets = job.request.async_fn_args[1] if job.request.async_fn is not None else []
        job.files = [Path(b[0]).relative_to(job.path).as_posix() for b in buckets] + [
            f"rng/rank{self.rank:05d}.pt"
        ]

    def poll(self, blocking: bool = False, until_retrying: bool = False) -> bool:
        """Advance the save in flight (collective): finalise it once every rank has written its
        shards, hand it to rank 0 for the commit once every rank has uploaded, note when the commit
        is done. One small all-reduce per call while a save is in flight or committing (per loop,
        blocking). Returns whether some rank is retrying the store for it (every rank gets the same
        answer); ``until_retrying``: blocking, stop as soon as that is so (else a blocking poll
        returns once rank 0 has the commit: ``wait`` waits for it there)."""
        while self._inflight is not None or (self._committing and (until_retrying or not blocking)):
            job = self._inflight
            flags = torch.tensor(
                [
                    job is None or job.written,
                    job is None or job.uploaded or job.error is not None,
                    job is None or job.error is None,
                    not self._in_retry,
                    self._commit is None or self._commit.done(),
                ],
                dtype=torch.int32,
            )
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self._control)
            all_written, all_finished, all_ok, none_retrying, committed = (bool(x) for x in flags.tolist())
            if job is None:
                self._committing = None if committed else self._committing
            else:
                self._advance(job, all_written, all_finished, all_ok)
                if all_finished and not until_retrying:
                    return False
            if not none_retrying and (until_retrying or not blocking):
                return True
            if not blocking:
                return False
            time.sleep(0.02)
        return False

    def _advance(self, job: _InFlight, all_written: bool, all_finished: bool, all_ok: bool) -> None:
        """The training thread's part of a save in flight, once every rank has written / finished."""
        if all_written and job.request is not None:
            request, job.request = job.request, None  # drops the snapshot once written
            try:
                for fn in request.finalize_fns:  # megatron: gather write results, .metadata
                    fn()
            except Exception as e:
                self._log(f"{job.name}: finalising the shards failed: {e}")
                job.error = job.error or f"finalise: {e}"
                all_ok = False
        if all_finished:
            self._finish(job, all_ok)

    def wait(self) -> None:
        """Block until the save in flight is committed (or failed): collective."""
        self.poll(blocking=True)
        if self._commit is not None:  # rank 0; the others wait for it in the all-reduce below
            self._commit.result()
            self._commit = None
        if self._committing:
            self.poll()  # one all-reduce: every rank learns that the commit is done

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
        self._committing = job.name if ok.item() else None  # poll goes on until rank 0 committed it
        if not ok.item():
            errors = [None] * dist.get_world_size() if self.rank == 0 else None
            dist.gather_object(job.error, errors, dst=0, group=self._control)
            if self.rank == 0:
                first = next(
                    (f"rank {r}: {e}" for r, e in enumerate(errors) if e), "finalising the shards failed"
                )
                self._failed(job, first)
            return
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object((job.entries, job.uploaded_bytes, job.cpu), gathered, dst=0, group=self._control)
        if self.rank == 0:
            entries = [e for part, _, _ in gathered for e in part]
            uploaded = sum(n for _, n, _ in gathered)
            cpu = {
                f"stage2_{k}_cpu_s": sum(c.get(k, 0.0) for _, _, c in gathered)
                for k in ("build", "serialise", "upload")
            }
            self._commit = self._worker.submit(self._commit_job, job, entries, uploaded, cpu)

    # -- stage 2 (background thread; collectives only to build a deferred save, on groups the
    # training thread does not use while a save is in flight: megatron's gloo DP group and the
    # checkpointer's own gloo group -- never the default group)
    def _stage2(self, job: _InFlight) -> None:
        spent = _StageCpu().spent
        try:
            if job.deferred is not None:
                state, view, live_model_sd, metadata = job.deferred
                job.deferred = None
                t0 = time.perf_counter()
                state["optimizer"] = view.sharded_state_dict(
                    live_model_sd, is_loading=False, metadata=metadata
                )
                self._plan(job, state)
                del state, view
                job.build_s = time.perf_counter() - t0
            job.cpu["build"] = spent()
            if job.request.async_fn is not None:
                # megatron's writer (FileSystemWriterAsync): this rank's shards into the staging dir
                megatron_io.write_in_this_thread(job.request)
            torch.save(job.rng, job.path / job.files[-1])
            job.cpu["serialise"] = spent() - job.cpu.get("build", 0.0)
        except BaseException as e:
            job.error = f"writing shards: {type(e).__name__}: {e}"
            return
        finally:
            job.written = True
        pieces = job.tap.pieces() if job.tap is not None else {}
        try:
            job.entries = self._retrying(
                job,
                f"upload of {job.name}",
                lambda: self.store.upload_files(
                    job.path,
                    job.name,
                    job.files,
                    on_progress=faults.during_upload(self.cfg, self.me, job.step),
                    ranges=pieces,
                ),
            )
            job.uploaded_bytes = sum(e.size for e in job.entries)
            for rel in job.files:  # uploaded: the staging copy is no longer needed
                (job.path / rel).unlink(missing_ok=True)
        except BaseException as e:
            job.error = f"upload: {type(e).__name__}: {e}"
        finally:
            job.cpu["upload"] = spent() - job.cpu.get("build", 0.0) - job.cpu.get("serialise", 0.0)
            job.uploaded = True

    def _commit_job(self, job: _InFlight, entries: list, uploaded: int, cpu: dict) -> None:
        """Rank 0: upload the common files, commit the manifest, move `latest`, retention."""
        from mega.storage import StorageError
        from mega.storage.manifest import local_files

        try:
            have = {e.path for e in entries}
            extras = [rel for rel, _ in local_files(job.path) if rel not in have]  # common.pt, .metadata, ...
            entries = entries + self._retrying(
                job, f"upload of {job.name}", lambda: self.store.upload_files(job.path, job.name, extras)
            )
            uploaded += sum(e.size for e in entries if e.path in extras)
            manifest = self._retrying(
                job, f"commit of {job.name}", lambda: self.store.commit(job.name, entries)
            )
            self._retrying(job, f"`latest` -> {job.name}", lambda: self.store.write_latest(job.name))
        except StorageError as e:
            self._failed(job, str(e))
            return
        finally:
            shutil.rmtree(job.path, ignore_errors=True)
        self._durable = job.name
        seconds = time.perf_counter() - job.started
        self._record(
            {
                "event": "committed",
                "step": job.step,
                "name": job.name,
                "files": len(manifest.files),
                "bytes": manifest.total_bytes,
                "stage2_s": seconds,
                "upload_mb_per_s": uploaded / 1e6 / max(seconds, 1e-9),
                # every rank's stage 2 (rank 0's commit not included), summed over ranks
                "stage2_cpu_s": sum(cpu.values()),
                **cpu,
            }
        )
        self._log(
            f"{job.name} is `latest` in {self.store.uri} ({manifest.total_bytes / 1e6:.1f} MB, "
            f"{seconds:.2f}s after stage 1)"
        )
        try:  # `latest` has moved: a retention that fails leaves old checkpoints, nothing worse
            deleted = self._retrying(job, "retention", lambda: self.store.apply_retention(self.ck.keep_last))
        except StorageError as e:
            self._log(f"retention after {job.name} failed, old checkpoints stay until the next save: {e}")
            return
        if deleted:
            self._log(f"retention (keep {self.ck.keep_last}): deleted {deleted}")

    def _failed(self, job: _InFlight, error: str) -> None:
        """Rank 0: record a save that will never be durable; `latest` still names the last one."""
        self._record(
            {"event": "failed", "step": job.step, "name": job.name, "error": error, "latest": self._durable}
        )
        self._log(f"{job.name} not saved, `latest` unchanged ({self._durable or 'none yet'}): {error}")

    def _retrying(self, job: _InFlight, what: str, fn):
        """Run a store operation of ``job`` until the store answers, for at most
        checkpoint.upload_timeout_s of it not answering over all of the job's operations
        (``retry_unavailable``, ``job.store_wait``); other errors go to the caller."""

        def waiting(e: Exception, left: float) -> None:
            self._in_retry = True  # poll tells every rank: a periodic save due is skipped
            self._record(
                {"event": "retry", "what": what, "error": type(e).__name__, "gives_up_at": time.time() + left}
            )

        try:
            return retry_unavailable(
                self.ck,
                self.store,
                what,
                fn,
                self._log,
                waiting,
                self._stop,
                "giving up on this checkpoint",
                job.store_wait,
            )
        finally:
            self._in_retry = False

    # -- bookkeeping
    def _record(self, row: dict) -> None:
        if self.rank == 0:
            with open(self.run_dir / SAVE_LOG, "a") as f:
                f.write(json.dumps({"time": time.time(), **row}) + "\n")
