"""``RecordingStore``: a ``torch.distributed.Store`` that forwards every operation to another store
and records it (kind and keys), to measure what process-group creation really asks of the store.

Wrap the store a rank hands to ``init_process_group``; everything torch builds on it (``new_group``'s
``PrefixStore``s, gloo's rendezvous, store-based barriers) then goes through the recorder, because
the C++ side calls back into this Python object for each operation::

    store = RecordingStore(TCPStore(host, port, is_master=False))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ...
    store.dump(directory)          # <directory>/rank-<rank>.json: {"rank", "counts", "ops"}

Keys are recorded as the wrapped store sees them, i.e. with torch's ``PrefixStore`` prefixes
(``"<group name>/cpu/rank_3"``). Training and bootstrap ranks record through it with
``store.record=true`` (``mega.cluster.rendezvous.init_process_group``), writing
``<train.run_dir>/store-traffic/<part>/rank-<r>.json`` once their groups exist.

Blocking operations are recorded when they are issued (before they block), so a recording taken
from a rank that timed out still shows what it waited on. ``busy_s`` is the time spent inside the
wrapped store's operations (a blocking ``wait``/``get`` counts the time it waited for a peer's key):
the store part of a start-up, as the bootstrap timing job reports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["RecordingStore", "load_recordings"]

# every keyed operation of the c10d Store interface that torch's C++ side can forward to Python
OP_KINDS = (
    "set",
    "get",
    "add",
    "compare_set",
    "wait",
    "check",
    "delete_key",
    "num_keys",
    "multi_get",
    "multi_set",
    "append",
    "queue_push",
    "queue_pop",
    "queue_len",
)


_ALIVE: list[RecordingStore] = []


class RecordingStore(dist.Store):
    """Forwards to ``inner`` and appends ``(kind, keys)`` to ``ops`` for every operation."""

    def __init__(self, inner: dist.Store, rank: int | None = None):
        super().__init__()
        self.inner = inner
        self.rank = rank
        self.ops: list[tuple[str, tuple[str, ...]]] = []
        self._busy = [0.0]  # seconds inside the inner store's operations (shared with clones)
        self._lock = threading.Lock()  # gloo may call the store from more than one thread
        # torch keeps only a C++ handle to the store it is given, and a Python store object that
        # only C++ references loses its Python methods (docs/bootstrap.md): keep every one alive
        _ALIVE.append(self)
        try:
            self.set_timeout(inner.timeout)
        except (AttributeError, RuntimeError):
            pass

    @contextlib.contextmanager
    def _note(self, kind: str, *keys: str):
        """Record the operation as issued, then time the inner store's work on it."""
        with self._lock:
            self.ops.append((kind, keys))
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._busy[0] += elapsed

    @property
    def busy_s(self) -> float:
        """Seconds spent inside the wrapped store's operations so far (summed over threads)."""
        with self._lock:
            return self._busy[0]

    @property
    def counts(self) -> dict[str, int]:
        """Operations per kind so far (kinds never used are left out)."""
        with self._lock:
            return dict(Counter(kind for kind, _ in self.ops))

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()
            self._busy[0] = 0.0

    # -- the c10d Store interface --------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        with self._note("set", key):
            self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        with self._note("get", key):
            return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        with self._note("add", key):
            return self.inner.add(key, value)

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        with self._note("compare_set", key):
            return self.inner.compare_set(key, expected_value, desired_value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        with self._note("wait", *keys):
            if timeout is None:
                self.inner.wait(keys)
            else:
                self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        with self._note("check", *keys):
            return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        with self._note("delete_key", key):
            return self.inner.delete_key(key)

    def num_keys(self) -> int:
        with self._note("num_keys"):
            return self.inner.num_keys()

    # the C++ trampoline looks these two up by their C++ names
    getNumKeys = num_keys
    deleteKey = delete_key

    def clone(self) -> RecordingStore:
        """A clone of the inner store whose operations land in this recording (gloo clones the
        store it is given, one connection per process group)."""
        twin = RecordingStore(self.inner.clone(), self.rank)
        twin.ops, twin._busy, twin._lock = self.ops, self._busy, self._lock
        return twin

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self._note("multi_get", *keys):
            return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        with self._note("multi_set", *keys):
            self.inner.multi_set(keys, values)

    def append(self, key: str, value: bytes | str) -> None:
        with self._note("append", key):
            self.inner.append(key, value)

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()

    def queue_push(self, key: str, value: bytes | str) -> None:
        with self._note("queue_push", key):
            self.inner.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        with self._note("queue_pop", key):
            return self.inner.queue_pop(key, block)

    def queue_len(self, key: str) -> int:
        with self._note("queue_len", key):
            return self.inner.queue_len(key)

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        if getattr(self, "inner", None) is not None:
            self.inner.set_timeout(timeout)

    # -- output ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            ops = [[kind, *keys] for kind, keys in self.ops]
        return {"rank": self.rank, "counts": dict(Counter(op[0] for op in ops)), "ops": ops}

    def dump(self, directory: str | Path) -> Path:
        """Write ``<directory>/rank-<rank>.json``; returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank-{self.rank if self.rank is not None else os.getpid()}.json"
        path.write_text(json.dumps(self.to_dict()))
        return path


def load_recordings(directory: str | Path) -> dict[int, dict[str, Any]]:
    """Every ``rank-<r>.json`` under ``directory``, by rank."""
    out = {}
    for path in sorted(Path(directory).glob("rank-*.json")):
        row = json.loads(path.read_text())
        out[int(row["rank"])] = row
    return out
