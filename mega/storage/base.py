"""The interface every checkpoint store implements, its errors, and the policy they share."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from mega.storage.manifest import FileEntry, Manifest

log = logging.getLogger(__name__)

LATEST = "latest"
# Checkpoint names become object keys and directory names: one path component, no dot-files
# (temporaries of the file store start with a dot), never the marker's name.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_STEP = re.compile(r"(\d+)$")

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total); may be called from threads


class ProgressCounter:
    """Sums byte counts reported from any thread into one ``(done, total)`` callback."""

    def __init__(self, total: int, fn: ProgressFn | None):
        self.total, self.done, self.fn = total, 0, fn
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n  # negative when a transfer rewinds for a retry
            done = self.done
        if self.fn:
            self.fn(done, self.total)


class StorageError(RuntimeError):
    """A checkpoint store refused or failed an operation (retrying will not help by itself)."""


class StorageUnavailable(StorageError):
    """The store could not be reached after bounded retries; the caller may try again later."""


class CorruptCheckpoint(StorageError):
    """A stored checkpoint is incomplete or does not match its manifest."""

    def __init__(self, name: str, relpath: str | None, reason: str):
        self.name, self.relpath, self.reason = name, relpath, reason
        where = f"{name}/{relpath}" if relpath else name
        super().__init__(f"checkpoint {where}: {reason}")

    def __reduce__(self):  # picklable: torch's collectives pass it between ranks
        return type(self), (self.name, self.relpath, self.reason)


def is_valid_name(name: str) -> bool:
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and name != LATEST


def check_name(name: str) -> str:
    if not is_valid_name(name):
        raise ValueError(f"invalid checkpoint name {name!r}")
    return name


def check_relpath(relpath: str) -> str:
    """A file's path inside a checkpoint: relative, no '..' (an S3 endpoint may normalize it)."""
    parts = relpath.split("/")
    if not relpath or relpath.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid path inside a checkpoint {relpath!r}")
    return relpath


def entry_of(manifest: Manifest, relpath: str) -> FileEntry:
    """The manifest's entry of ``relpath``; CorruptCheckpoint when it lists no such file."""
    try:
        return manifest.entry(relpath)
    except KeyError:
        raise CorruptCheckpoint(manifest.name, relpath, "not in the manifest") from None


def log_transfer(verb: str, manifest: Manifest, uri: str, seconds: float) -> None:
    mb = manifest.total_bytes / 1e6
    log.info(
        "%s %s: %d files, %.1f MB in %.2fs (%.0f MB/s) %s",
        verb,
        manifest.name,
        len(manifest.files),
        mb,
        seconds,
        mb / max(seconds, 1e-9),
        uri,
    )


def step_of(name: str) -> int:
    """The step a checkpoint name ends with (iter_0000025 -> 25); -1 when it has none."""
    m = _STEP.search(name)
    return int(m.group(1)) if m else -1


MAX_SPAN = 64 << 20  # bytes per ranged read when adjacent pieces are fetched together


def _spans(pieces: list[tuple[int, int]]):
    """Sorted (offset, length) pieces as runs of adjacent ones: (start, [pieces]), each run at
    most MAX_SPAN bytes (a longer piece is a run of its own)."""
    run: list[tuple[int, int]] = []
    for offset, length in pieces:
        if run and (offset != run[-1][0] + run[-1][1] or offset + length - run[0][0] > MAX_SPAN):
            yield run[0][0], run
            run = []
        run.append((offset, length))
    if run:
        yield run[0][0], run


def _order(name: str) -> tuple[int, str]:
    return step_of(name), name


class CheckpointStorage(ABC):
    """Checkpoints stored by name: a set of files plus ``manifest.json``, and a ``latest`` marker.

    Thread-safe for concurrent calls on different checkpoints. ``bytes_read`` counts payload
    bytes of checkpoint files fetched (``download_dir``, ``read_bytes``), not manifests or the
    marker, so a restore can prove how much of a checkpoint each rank read.
    """

    uri: str

    def __init__(self) -> None:
        self._read_lock = threading.Lock()
        self._bytes_read = 0

    @property
    def bytes_read(self) -> int:
        return self._bytes_read

    def reset_bytes_read(self) -> None:
        with self._read_lock:
            self._bytes_read = 0

    def _count_read(self, n: int) -> None:
        with self._read_lock:
            self._bytes_read += n

    # -- operations each backend implements
    @abstractmethod
    def upload_dir(self, local_dir: str | Path, name: str, on_progress: ProgressFn | None = None) -> Manifest:
        """Store every file under ``local_dir`` as checkpoint ``name``; the manifest goes last."""

    @abstractmethod
    def upload_files(
        self,
        local_dir: str | Path,
        name: str,
        relpaths: list[str],
        on_progress: ProgressFn | None = None,
        ranges: dict[str, list[tuple[int, int]]] | None = None,
    ) -> list[FileEntry]:
        """Store some files of a checkpoint that several uploaders write (one per rank), without
        a manifest; returns their entries (size, sha256 of the bytes sent) for ``commit``.
        ``ranges[relpath]``: pieces (offset, length) of that file hashed on their own too, so a
        restore can fetch and verify them one by one (``read_pieces``)."""

    @abstractmethod
    def commit(self, name: str, entries: list[FileEntry]) -> Manifest:
        """Check that every entry is stored with its size, then write the manifest (the commit
        record). CorruptCheckpoint names the first file missing or of the wrong size."""

    @abstractmethod
    def download_dir(self, name: str, local_dir: str | Path, verify: bool = True) -> Manifest:
        """Fetch checkpoint ``name`` into ``local_dir``; CorruptCheckpoint on any mismatch."""

    @abstractmethod
    def download_files(
        self, name: str, relpaths: list[str], local_dir: str | Path, verify: bool = True
    ) -> list[FileEntry]:
        """Fetch some files of complete checkpoint ``name``, checked against its manifest like
        ``download_dir`` (a restore where each rank fetches its share)."""

    @abstractmethod
    def read_manifest(self, name: str) -> Manifest:
        """The manifest of ``name``; CorruptCheckpoint when it has none (incomplete or absent)."""

    @abstractmethod
    def read_bytes(self, name: str, relpath: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) of one file of a checkpoint (to its end if no length)."""

    def read_pieces(
        self, manifest: Manifest, relpath: str, pieces: list[tuple[int, int]]
    ) -> list[memoryview]:
        """Pieces (offset, length) of one file of the complete checkpoint ``manifest`` names,
        each verified against the manifest: a piece is the whole file or a range it hashed
        (``FileEntry.range_hash``). Adjacent pieces are fetched in one ranged read of at most
        ``MAX_SPAN`` bytes. CorruptCheckpoint names the file when the store holds fewer bytes than
        the manifest says or a piece's sha256 differs; ValueError for a piece that was not hashed."""
        entry = entry_of(manifest, relpath)
        wanted = {}
        for offset, length in pieces:
            digest = entry.range_hash(offset, length)
            if digest is None:
                raise ValueError(
                    f"{manifest.name}/{relpath}: bytes [{offset}, {offset + length}) were not hashed "
                    f"on their own: read the whole file"
                )
            wanted[(offset, length)] = digest
        got: dict[tuple[int, int], memoryview] = {}
        for start, group in _spans(sorted(wanted)):
            size = sum(n for _, n in group)
            data = memoryview(self.read_bytes(manifest.name, relpath, start, size))
            if len(data) < size:
                raise CorruptCheckpoint(
                    manifest.name,
                    relpath,
                    f"size: the store holds {start + len(data)} bytes, the manifest {entry.size}",
                )
            for offset, length in group:
                piece = data[offset - start : offset - start + length]
                if hashlib.sha256(piece).hexdigest() != wanted[(offset, length)]:
                    raise CorruptCheckpoint(
                        manifest.name,
                        relpath,
                        f"sha256 of bytes [{offset}, {offset + length}) differs from the manifest",
                    )
                got[(offset, length)] = piece
        return [got[p] for p in pieces]

    @abstractmethod
    def write_latest(self, name: str) -> None:
        """Atomically point ``latest`` at ``name``, which must be complete."""

    @abstractmethod
    def read_latest(self) -> str | None:
        """The name ``latest`` points at, or None."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove a checkpoint, manifest first, so a half-deleted one is never seen complete."""

    @abstractmethod
    def _scan(self) -> tuple[list[str], list[str]]:
        """(complete, incomplete) checkpoint names, in any order."""

    # -- shared policy
    def list_checkpoints(self) -> list[str]:
        """Names of complete checkpoints (with a manifest), oldest step first."""
        complete, _ = self._scan()
        return sorted(complete, key=_order)

    def apply_retention(self, keep_last: int) -> list[str]:
        """Keep the last ``keep_last`` complete checkpoints and the one ``latest`` names.

        Incomplete checkpoints older than ``latest`` are debris of failed uploads and go too;
        newer ones may be uploads in flight and stay. Returns the names deleted.
        """
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        latest = self.read_latest()
        complete, incomplete = self._scan()
        complete.sort(key=_order)
        keep = set(complete[max(0, len(complete) - keep_last) :] if keep_last else [])
        if latest is not None:
            keep.add(latest)
        doomed = [n for n in complete if n not in keep]
        if latest is not None:
            doomed += [n for n in incomplete if n != latest and _order(n) < _order(latest)]
        for name in sorted(doomed, key=_order):
            self.delete(name)
        if doomed:
            log.info("retention on %s: kept %s, deleted %s", self.uri, sorted(keep, key=_order), doomed)
        return sorted(doomed, key=_order)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
