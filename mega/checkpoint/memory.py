"""In-memory checkpoints on a peer node (docs/checkpoints.md, "In-memory copies").

Every ``checkpoint.memory_interval`` steps each rank copies its model and optimizer shard into
node-local shared memory (a tmpfs directory, ``checkpoint.memory_dir``), and a background thread
replicates the copy to the rank with the same local rank on the next node, which keeps it in *its*
node's directory. Files in tmpfs belong to no process: a copy outlives the ranks that wrote it,
and the peer's copy outlives the whole node. A restart restores from the newest step every rank
has a complete copy of (its own node's or a peer's), when that is not older than the durable
``latest``; a missing or torn copy (CRC-32 mismatch) sends every rank to the durable checkpoint.

Layout of one node's directory, ``<memory_dir>/<run id>/node<N>/rank<R>/`` for every rank R
whose copies it holds (its own ranks, and the previous node's):

* ``slot0.bin``, ``slot1.bin``: the raw bytes of every tensor of the shard, at fixed offsets
  (two slots: the one being written is never the newest complete one);
* ``slot0.json``, ``slot1.json``: the marker of a complete slot -- step, CRC-32 of the bytes and
  of the small state (optimizer step and hyperparameters, scheduler, RNG; ``torch.save`` bytes
  in the marker), the tensor table. Removed before a slot is overwritten, written (atomically,
  rename) only after its bytes are.

The training thread only hands a copy over (and its RNG state, which the next forward moves on).
The copy thread memcpys each tensor into the slot while the next step's forward and backward
run -- they change none of the shard; the optimizer's step, which does, waits for it (a step
pre-hook: ``fence``) -- then checksums it, writes the marker and exchanges copies with the peer
nodes (point to point on a gloo group of its own). On GPUs the device-to-host copy runs on the
training thread. All of it is counted: ``stats``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import queue
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mega import rank_env
from mega.checkpoint.common import iteration_name, layout, rng_state, set_rng_state, threads, threads_cpu_s
from mega.cluster.rendezvous import gloo_side_group

ALIGN = 64  # bytes: every tensor starts at a multiple (a typed view of the slot needs alignment)
STATS_DIR = "memory-checkpoints"  # <run_dir>/memory-checkpoints/rank<R>.json: what the copies cost
# <memory_dir>/<run id>/run_dir: the run that owns the copies there (the id is a hash of it), for
# whoever looks after the shared tmpfs
OWNER_FILE = "run_dir"


def run_dir_id(cfg) -> str:
    """Names a run in the shared tmpfs: runs in different directories never meet there."""
    return hashlib.sha1(str(Path(cfg.train.run_dir).absolute()).encode()).hexdigest()[:12]


def node_dir(cfg) -> Path:
    """This node's directory (torchrun's GROUP_RANK: nodes that share a machine get one each)."""
    return Path(cfg.checkpoint.memory_dir) / run_dir_id(cfg) / f"node{os.environ.get('GROUP_RANK', '0')}"


def _inner(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _live_tensors(model_chunks, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of this rank's shard, by a name that is the same in every attempt. A main
    parameter that is a view of the model's own storage (fp32 training: the distributed
    optimizer updates the model's parameters in place) is left out: the model's bytes hold it."""
    out: dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(model_chunks):
        for key, value in chunk.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor):
                out[f"model{i}/{key}"] = value
    model_storage = {t.untyped_storage().data_ptr() for t in out.values()}
    for j, opt in enumerate(_inner(optimizer)):
        for n, model_param in enumerate(opt.model_param_group_index_map):
            for key, value in sorted(opt._get_main_param_and_optimizer_states(model_param).items()):
                if key == "param" and value.untyped_storage().data_ptr() in model_storage:
                    continue
                if isinstance(value, torch.Tensor):
                    out[f"optimizer{j}/{n}/{key}"] = value
    return out


def _table(tensors: dict[str, torch.Tensor]) -> tuple[list, int]:
    """[(name, dtype, shape, offset, nbytes)] at aligned offsets, and the slot's size."""
    rows, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        rows.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return rows, offset


def _view(slot: torch.Tensor, dtype: str, shape: list, offset: int, nbytes: int) -> torch.Tensor:
    return slot[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)


def _crc(slot: torch.Tensor, small: bytes) -> int:
    return zlib.crc32(small, zlib.crc32(memoryview(slot.numpy())))  # C, and without the GIL


@dataclass
class _Stats:
    copies: int = 0
    bytes: int = 0
    blocking_s: float = 0.0  # the training thread: handing a copy over, and waiting for it (fence)
    blocking_cpu_s: float = 0.0  # its thread CPU time
    background_cpu_s: float = 0.0  # the copy thread's CPU time: checksum, marker, exchange
    exchange_cpu_s: float = 0.0  # CPU time of the copy group's gloo threads (sending, receiving)
    replicated: int = 0
    errors: int = 0


class MemoryCheckpoints:
    """One rank's in-memory copies (see the module docstring). ``copy`` and ``restore`` are
    collective: every rank calls them at the same steps."""

    def __init__(self, cfg, model_chunks, optimizer, scheduler, log: Callable[[str], None] | None = None):
        self.cfg, self.interval = cfg, cfg.checkpoint.memory_interval
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        nodes = max(1, self.world // self.local)
        # The same local rank on the next node holds my copy; I hold the previous node's.
        self.peer = (self.rank + self.local) % self.world if nodes > 1 else None
        self.source = (self.rank - self.local) % self.world if nodes > 1 else None
        self.dir = node_dir(cfg)
        self._log = log or (lambda m: print(f"[memory-checkpoint] {m}", file=sys.stderr, flush=True))
        before = threads()
        self.group = gloo_side_group(cfg)  # only copies and their restore use it
        self._gloo_threads = threads() - before  # its transport threads: the exchange's CPU runs there
        self.stats = _Stats()
        self._slots: dict[tuple[int, int], torch.Tensor] = {}  # (owner rank, slot) -> mapped file
        self._table: list | None = None
        self._source_size = 0
        self._next = 0  # the slot the next copy goes to
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Event()  # set: no copy in flight
        self._idle.set()
        self._read = threading.Event()  # set: the copy in flight has read the shard
        self._read.set()
        self._thread: threading.Thread | None = None
        self._t_created = time.perf_counter()

    @classmethod
    def create(cls, cfg, model_chunks, optimizer, scheduler) -> MemoryCheckpoints | None:
        """Collective. None when copies are off (``checkpoint.memory_interval=0``) or the optimizer
        is not megatron's distributed optimizer (whose shard the copy reads)."""
        from mega import optimizer_snapshot

        if not cfg.checkpoint.memory_interval or not optimizer_snapshot.supported(optimizer):
            return None
        memory = cls(cfg, model_chunks, optimizer, scheduler)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            if rank_env.attempt() == 0:
                shutil.rmtree(memory.dir, ignore_errors=True)  # a new run: nothing there is of it
            owner = memory.dir.parent / OWNER_FILE
            owner.parent.mkdir(parents=True, exist_ok=True)
            tmp = owner.with_name(f"{OWNER_FILE}.{os.getpid()}")  # nodes sharing a machine write it too
            tmp.write_text(str(Path(cfg.train.run_dir).absolute()))
            os.replace(tmp, owner)
        dist.barrier(group=memory.group)
        return memory

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0  # 0: turned off (no room)

    # -- files
    def _rank_dir(self, owner: int) -> Path:
        return self.dir / f"rank{owner:05d}"

    def _slot(self, owner: int, slot: int, size: int) -> torch.Tensor:
        """The slot file of ``owner`` mapped into memory (created at ``size`` bytes)."""
        key = (owner, slot)
        if key not in self._slots:
            path = self._rank_dir(owner) / f"slot{slot}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._slots[key] = torch.from_file(str(path), shared=True, size=max(size, 1), dtype=torch.uint8)[
                :size
            ]
        return self._slots[key]

    def _marker(self, owner: int, slot: int) -> Path:
        return self._rank_dir(owner) / f"slot{slot}.json"

    @staticmethod
    def _write_marker(path: Path, data: bytes) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a reader sees the old marker or the new one, never half of one

    # -- the training thread's side
    def copy(self, step: int) -> dict:
        """Start the copy of this rank's shard as of ``step`` (between steps); returns what the
        training thread waited (``blocking_s``). The copy thread reads the shard while the next
        step's forward and backward run (they change none of it); the optimizer's step waits for
        it (``fence``). On GPUs the device-to-host copy runs here, before the next step."""
        t0, c0 = time.perf_counter(), time.thread_time()
        self._idle.wait()  # the previous copy is done with the slot before last
        if self._table is None and not self._setup(_live_tensors(self.model_chunks, self.optimizer)):
            self.interval = 0
            return {"blocking_s": time.perf_counter() - t0}
        slot_no, self._next = self._next, 1 - self._next
        self._idle.clear()
        self._read.clear()
        rng = rng_state()  # the RNG moves on in the next forward
        # GPUs: the device-to-host copy on the training thread (its device, its stream)
        filled = self._fill(slot_no, rng) if self._on_device else None
        self._jobs.put((step, slot_no, rng, filled))
        self._count_blocking(t0, c0)
        s = self.stats
        s.copies, s.bytes = s.copies + 1, s.bytes + self._size
        return {"blocking_s": time.perf_counter() - t0}

    def fence(self) -> None:
        """Before anything changes the shard (the optimizer's step, a drill): wait until the copy
        in flight has read it."""
        if not self._read.is_set():
            t0, c0 = time.perf_counter(), time.thread_time()
            self._read.wait()
            self._count_blocking(t0, c0)

    def _count_blocking(self, t0: float, c0: float) -> None:
        self.stats.blocking_s += time.perf_counter() - t0
        self.stats.blocking_cpu_s += time.thread_time() - c0

    def _room(self, sizes: list[int]) -> int:
        """Bytes this node's directory lacks for two slots of each of its ranks' copies and of
        the copies it holds (0: enough). Files already there count as room (a restart)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fs = os.statvfs(self.dir)
        have = fs.f_bavail * fs.f_frsize + sum(f.stat().st_size for f in self.dir.glob("rank*/slot*.bin"))
        need = 2 * max(sizes) * self.local * (2 if self.peer is not None else 1)
        return max(0, need - have)

    def _setup(self, live: dict[str, torch.Tensor]) -> bool:
        """First copy (collective): the tensor table, and the size of the copy this rank holds.
        False (on every rank) when a node's directory has no room for the copies: they are off."""
        # The same tensor objects at every step (the optimizer updates them in place; a restore
        # copies into them before the first copy): looked up once.
        self._live = live
        self._table, self._size = _table(live)
        self._meta = {"layout": layout(), "world_size": self.world, "table": self._table}
        sizes = [None] * self.world
        dist.all_gather_object(sizes, self._size, group=self.group)
        lacking = [None] * self.world
        dist.all_gather_object(lacking, self._room(sizes), group=self.group)
        if any(lacking):
            if self.rank == 0:
                short = max(lacking)
                self._log(
                    f"in-memory copies off: {self.cfg.checkpoint.memory_dir} lacks {short / 1e6:.1f} MB "
                    f"on rank {lacking.index(short)}'s node (checkpoint.memory_dir: a larger tmpfs)"
                )
            return False
        self._source_size = sizes[self.source] if self.source is not None else 0
        if self.rank == 0:
            self._log(
                f"copies of {self._size / 1e6:.1f} MB every {self.interval} steps in {self.dir}"
                + (f", replicated to rank {self.peer}" if self.peer is not None else " (one node: no peer)")
            )
        self._on_device = any(t.device.type != "cpu" for t in live.values())
        # every change of the shard goes through an optimizer's step: it waits for the copy
        self._hooks = [
            opt.optimizer.register_step_pre_hook(lambda *_: self.fence()) for opt in _inner(self.optimizer)
        ]
        self._thread = threading.Thread(target=self._loop, name="memory-checkpoint", daemon=True)
        self._thread.start()
        return True

    def close(self, keep: bool = False) -> dict:
        """Stop the copy thread; write what the copies cost; ``keep=False`` removes this rank's
        copies (the run is over: the durable checkpoint has the last step)."""
        if self._thread is not None:
            self._idle.wait()
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
            for hook in self._hooks:
                hook.remove()
        self.stats.exchange_cpu_s = sum(threads_cpu_s(self._gloo_threads).values())
        row = {
            **self.stats.__dict__,
            "rank": self.rank,
            "interval": self.interval,
            "wall_s": time.perf_counter() - self._t_created,
        }
        out = Path(self.cfg.train.run_dir) / STATS_DIR
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{self.rank:05d}.json").write_text(json.dumps(row))
        self._slots.clear()
        if not keep:
            shutil.rmtree(self._rank_dir(self.rank), ignore_errors=True)
            if self.source is not None:
                shutil.rmtree(self._rank_dir(self.source), ignore_errors=True)
            for empty in (self.dir, self.dir.parent):  # the last rank out removes the run's directories
                try:
                    if empty == self.dir.parent and [p.name for p in empty.iterdir()] == [OWNER_FILE]:
                        (empty / OWNER_FILE).unlink()
                    empty.rmdir()
                except OSError:
                    pass
        return row

    def discard(self) -> None:
        """Forget every copy this rank wrote or holds (a rollback goes back further than them)."""
        self.close(keep=False)

    # -- the copy thread
    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            c0 = time.thread_time()
            try:
                self._complete(*job)
            except Exception as e:
                self.stats.errors += 1
                self._slots.clear()  # its files may be gone (tmpfs cleaned): the next copy maps them anew
                self._log(f"rank {self.rank}: copy of step {job[0]} failed: {type(e).__name__}: {e}")
            finally:
                self.stats.background_cpu_s += time.thread_time() - c0
                self._read.set()
                self._idle.set()

    def _fill(self, slot_no: int, rng: dict) -> tuple[torch.Tensor, bytes]:
        """The shard's bytes into the slot, and the small state; before the optimizer's step."""
        try:
            self._marker(self.rank, slot_no).unlink(missing_ok=True)  # torn until the new marker
            slot = self._slot(self.rank, slot_no, self._size)
            with torch.no_grad():
                for name, dtype, shape, offset, nbytes in self._table:
                    _view(slot, dtype, shape, offset, nbytes).copy_(self._live[name])
            small = io.BytesIO()
            state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
            torch.save({**state, "rng": rng}, small)
            return slot, small.getvalue()
        finally:
            self._read.set()

    def _complete(self, step: int, slot_no: int, rng: dict, filled: tuple | None) -> None:
        """The copy's marker, then the exchange with the peers. A copy that fails here (tmpfs
        full, its files removed) still takes part in the exchange, sending nothing: the peer's
        copy thread waits for it, and its training thread for that thread."""
        slot, marker, failed = None, b"", None
        try:
            slot, small = filled or self._fill(slot_no, rng)
            marker = json.dumps(
                {
                    "step": step,
                    "owner": self.rank,
                    "nbytes": self._size,
                    "crc32": _crc(slot, small),
                    "small": base64.b64encode(small).decode(),
                    **self._meta,
                }
            ).encode()
            self._write_marker(self._marker(self.rank, slot_no), marker)
        except OSError as e:
            slot, marker, failed = None, b"", e
        if self.peer is not None:
            self._exchange(slot_no, slot, marker)
        if failed is not None:
            raise failed

    def _exchange(self, slot_no: int, slot: torch.Tensor | None, marker: bytes) -> None:
        """Send my copy to my peer, receive my source's into its slot here (same slot number). The
        markers' sizes go first: an empty one (a failed copy) is followed by nothing, in either
        direction, so that every send meets its receive."""
        sizes = torch.tensor([len(marker)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        self._pair(sizes[0], sizes[1])
        sending, incoming = bool(marker), int(sizes[1])
        got = torch.empty(incoming, dtype=torch.uint8)
        mine = torch.frombuffer(bytearray(marker), dtype=torch.uint8) if sending else None
        self._pair(mine, got if incoming else None)
        held, kept = self._holding(slot_no) if incoming else (None, False)
        self._pair(slot if sending else None, held)
        if kept:
            self._write_marker(self._marker(self.source, slot_no), got.numpy().tobytes())
            self.stats.replicated += 1

    def _holding(self, slot_no: int) -> tuple[torch.Tensor, bool]:
        """Where my source's copy goes: its slot here (torn until its marker is written), or a
        buffer thrown away when the slot cannot be had (the bytes still have to be received)."""
        try:
            self._marker(self.source, slot_no).unlink(missing_ok=True)
            return self._slot(self.source, slot_no, self._source_size), True
        except OSError as e:
            self._log(f"rank {self.rank}: cannot hold rank {self.source}'s copy: {type(e).__name__}: {e}")
            return torch.empty(self._source_size, dtype=torch.uint8), False

    def _pair(self, send: torch.Tensor | None, recv: torch.Tensor | None) -> None:
        works = [dist.isend(send, self.peer, group=self.group)] if send is not None else []
        works += [dist.irecv(recv, self.source, group=self.group)] if recv is not None else []
        for w in works:
            w.wait()

    # -- restore
    def _listing(self) -> dict[int, list[dict]]:
        """The complete copies in this node's directory: {owner rank: [{step, path}]}."""
        return complete_copies(self.dir, self.world, layout())

    def restore(self, durable_step: int) -> tuple[int | None, dict]:
        """Collective: restore from the newest step every rank has a complete copy of, if not
        older than ``durable_step`` (the durable ``latest``'s). Returns (step or None, what was
        done, with ``reason`` when the durable checkpoint must be used)."""
        t0 = time.perf_counter()
        listings = [None] * self.world
        dist.all_gather_object(listings, self._listing(), group=self.group)
        plan = choose(listings, self.world)
        if plan is None:
            return None, {"used": False, "reason": "no step with a complete in-memory copy of every rank"}
        step, sources = plan
        if step < durable_step:
            return None, {
                "used": False,
                "reason": f"newest complete in-memory copy (step {step}) is older than "
                f"the durable checkpoint (step {durable_step})",
            }
        error = None
        try:
            meta, data = self._fetch(step, sources)
            if _crc(data, meta["small_bytes"]) != meta["crc32"]:
                error = f"rank {self.rank}: in-memory copy of step {step} is torn (CRC-32 mismatch in {meta['path']})"
        except Exception as e:
            error = f"rank {self.rank}: in-memory copy of step {step}: {type(e).__name__}: {e}"
        errors = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        bad = [e for e in errors if e]
        if bad:
            return None, {"used": False, "step": step, "reason": bad[0]}
        self._load(meta, data)
        self._next = 1 - int(Path(meta["path"]).stem[-1]) if sources[self.rank][0] == self.rank else 0
        info = {
            "used": True,
            "step": step,
            "source": f"rank {sources[self.rank][0]}",
            "sources": {owner: holder for owner, (holder, _) in sorted(sources.items())},
            "restore_s": time.perf_counter() - t0,
            "bytes": int(meta["nbytes"]),
        }
        return step, info

    def _fetch(self, step: int, sources: dict) -> tuple[dict, torch.Tensor]:
        """(marker, bytes) of my copy of ``step``: from my node's directory, or sent by the rank
        whose node holds it. Every rank walks the transfers in the same order."""
        mine = None
        for owner in range(self.world):
            holder, path = sources[owner]
            if holder == self.rank and owner == self.rank:
                mine = _read(path)
            elif holder == self.rank:  # send it to its owner
                marker, data = _read(path)
                raw = json.dumps(marker).encode()
                dist.send(torch.tensor([len(raw), data.numel()], dtype=torch.int64), owner, group=self.group)
                dist.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), owner, group=self.group)
                dist.send(data, owner, group=self.group)
            elif owner == self.rank:
                sizes = torch.zeros(2, dtype=torch.int64)
                dist.recv(sizes, holder, group=self.group)
                raw = torch.empty(int(sizes[0]), dtype=torch.uint8)
                dist.recv(raw, holder, group=self.group)
                data = torch.empty(int(sizes[1]), dtype=torch.uint8)
                dist.recv(data, holder, group=self.group)
                mine = (json.loads(raw.numpy().tobytes()), data)
        marker, data = mine
        marker["small_bytes"] = base64.b64decode(marker["small"])
        return marker, data

    def _load(self, meta: dict, data: torch.Tensor) -> None:
        small = torch.load(io.BytesIO(meta["small_bytes"]), weights_only=True)
        for opt in _inner(self.optimizer):  # torch Adam allocates its state lazily: have it now
            if not opt.optimizer.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                opt._init_optimizer_states_with_dummy_values()
        self.optimizer.load_state_dict(small["optimizer"])  # step, hyperparameters (not tensors)
        table = {row[0]: row for row in meta["table"]}
        with torch.no_grad():
            for i, chunk in enumerate(self.model_chunks):
                for key, value in chunk.state_dict(keep_vars=True).items():
                    if isinstance(value, torch.Tensor):
                        value.copy_(_view(data, *table[f"model{i}/{key}"][1:]))
            for j, opt in enumerate(_inner(self.optimizer)):
                for n, model_param in enumerate(opt.model_param_group_index_map):
                    live = opt._get_main_param_and_optimizer_states(model_param)
                    # a main parameter left out of the copy is a view of the model's, loaded above
                    names = {key: f"optimizer{j}/{n}/{key}" for key in live}
                    opt._set_main_param_and_optimizer_states(
                        model_param,
                        {k: _view(data, *table[x][1:]) if x in table else live[k] for k, x in names.items()},
                    )
        self.scheduler.load_state_dict(small["scheduler"])
        set_rng_state(small["rng"])


def _read(marker_path: str) -> tuple[dict, torch.Tensor]:
    marker = json.loads(Path(marker_path).read_text())
    data = torch.empty(marker["nbytes"], dtype=torch.uint8)
    with open(Path(marker_path).with_suffix(".bin"), "rb") as f:
        f.readinto(memoryview(data.numpy()))
    marker["path"] = marker_path
    return marker, data


def complete_copies(directory: Path, world: int, want_layout: dict | None = None) -> dict[int, list[dict]]:
    """The complete copies in one node's directory of a run of ``world`` ranks (and of layout
    ``want_layout``, when given): {owner rank: [{step, path}]}."""
    found: dict[int, list[dict]] = {}
    for marker in sorted(Path(directory).glob("rank*/slot*.json")):
        try:
            meta = json.loads(marker.read_text())
            if marker.with_suffix(".bin").stat().st_size < meta["nbytes"]:
                continue
        except (OSError, ValueError, KeyError):
            continue  # a marker being replaced, or a slot without its bytes: not complete
        if meta["world_size"] == world and (want_layout is None or meta["layout"] == want_layout):
            found.setdefault(int(meta["owner"]), []).append({"step": meta["step"], "path": str(marker)})
    return found


def newest_copy_step(cfg) -> int | None:
    """The newest step every rank of ``cfg`` has a complete in-memory copy of, over every node
    directory of the run this machine holds (with the local-nodes launcher: all of them), or
    None. A restart restores it unless a copy is torn (only the restore reads the bytes)."""
    if not cfg.checkpoint.memory_interval:
        return None
    run = Path(cfg.checkpoint.memory_dir) / run_dir_id(cfg)
    world = cfg.parallelism.world_size
    plan = choose([complete_copies(d, world) for d in sorted(run.glob("node*"))], world)
    return plan[0] if plan else None


def choose(listings: list[dict], world: int) -> tuple[int, dict] | None:
    """The newest step with a complete copy of every rank, and who supplies each rank's:
    (step, {owner: (holder rank, marker path)}) -- the owner itself when its node holds it, else
    the lowest rank whose node does. None when no step is complete for every rank."""
    where: dict[int, dict[int, list]] = {}  # step -> owner -> [(holder, path)]
    for holder, listing in enumerate(listings):
        for owner, copies in listing.items():
            for c in copies:
                where.setdefault(c["step"], {}).setdefault(int(owner), []).append((holder, c["path"]))
    for step in sorted(where, reverse=True):
        if len(where[step]) == world:
            sources = {}
            for owner, holders in where[step].items():
                own = [h for h in holders if h[0] == owner]
                sources[owner] = own[0] if own else min(holders)
            return step, sources
    return None


def describe(info: dict) -> str:
    if info.get("used"):
        return f"restored {iteration_name(info['step'])} from memory ({info['source']})"
    return f"in-memory copies not used: {info['reason']}"
