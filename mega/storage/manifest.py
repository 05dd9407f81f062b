"""The manifest of a stored checkpoint, and hashing that reads each byte once.

``manifest.json`` is the commit record of a checkpoint in a store: it is written last, so a
checkpoint without one is an upload that never finished. It lists every file's relative path,
size and sha256, or for files a restore reads in pieces (dist_checkpointing's shard files) the
sha256 of each piece (``ranges``: one per serialised tensor or object, as the writer laid them
out, and the bytes between) and a digest of those (``digest: pieces``): every byte is hashed
once. A restore checks what it fetched against it, whole files and pieces alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 8 << 20  # read size for hashing and copying: large enough that syscalls don't matter


Range = tuple[int, int, str]  # (offset, length, sha256) of one piece of a file


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, '/'-separated
    size: int
    # "bytes": sha256 of the file's bytes. "pieces": the file was hashed in pieces (``ranges``,
    # which then cover it) and this is ``pieces_digest`` of them: each byte hashed once.
    sha256: str
    ranges: tuple[Range, ...] = ()  # pieces hashed on their own, sorted by offset
    digest: str = "bytes"

    def range_hash(self, offset: int, length: int) -> str | None:
        """The sha256 the manifest lists for exactly bytes [offset, offset+length), or None."""
        if offset == 0 and length == self.size and self.digest == "bytes":
            return self.sha256
        return self._range_index.get((offset, length))

    @cached_property
    def _range_index(self) -> dict[tuple[int, int], str]:
        return {(o, n): h for o, n, h in self.ranges}


def pieces_digest(pieces) -> str:
    """The digest of a file hashed in pieces: sha256 of its (offset, length, sha256) list."""
    return hashlib.sha256("".join(f"{o}:{n}:{h}\n" for o, n, h in pieces).encode()).hexdigest()


@dataclass
class Manifest:
    name: str
    files: list[FileEntry]
    created: float = field(default_factory=time.time)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "name": self.name,
            "created": self.created,
            "total_bytes": self.total_bytes,
            "files": [_entry_doc(f) for f in self.files],
        }
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Raises ValueError on anything that is not a manifest this code wrote."""
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT:
                raise ValueError(f"unknown manifest format {doc.get('format')!r}")
            files = [
                FileEntry(
                    str(f["path"]),
                    int(f["size"]),
                    str(f["sha256"]),
                    tuple((int(o), int(n), str(h)) for o, n, h in f.get("ranges", ())),
                    str(f.get("digest", "bytes")),
                )
                for f in doc["files"]
            ]
            return cls(name=str(doc["name"]), files=files, created=float(doc["created"]))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed manifest: {e}") from None


def _entry_doc(f: FileEntry) -> dict:
    doc = {"path": f.path, "size": f.size, "sha256": f.sha256}
    if f.ranges:
        doc["ranges"] = [list(r) for r in f.ranges]
    if f.digest != "bytes":
        doc["digest"] = f.digest
    return doc


def local_files(root: str | Path, skip_manifest: bool = False) -> list[tuple[str, Path]]:
    """Every regular file under ``root`` as (relative posix path, path), sorted by path.

    ``skip_manifest`` leaves out a top-level manifest.json (a directory that is itself a stored
    checkpoint); otherwise one is an error."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            if p.is_file():
                out.append((p.relative_to(root).as_posix(), p))
    out.sort()
    if skip_manifest:
        out = [(rel, p) for rel, p in out if rel != MANIFEST]
    elif any(rel == MANIFEST for rel, _ in out):
        # The store's commit record would be overwritten by (or mistaken for) a payload file.
        raise ValueError(f"{root} contains a top-level {MANIFEST}, a name reserved for the store")
    return out


def sha256_file(path: Path, start: int = 0, h=None) -> tuple[int, hashlib._Hash]:
    """Hash ``path`` from ``start`` to its end into ``h``; returns (bytes hashed, h)."""
    h = h or hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        f.seek(start)
        while chunk := f.read(CHUNK):
            h.update(chunk)
            n += len(chunk)
    return n, h


class FileHasher:
    """The digest of a file fed in order, each byte hashed once: sha256 of the bytes, or with
    ``ranges`` ((offset, length), not overlapping) sha256 of each piece -- the bytes between and
    after them are pieces too, so the pieces cover the file -- and ``pieces_digest`` of them."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None):
        self.pos = 0
        ranges = sorted(ranges or ())
        for (o1, n1), (o2, _) in zip(ranges, ranges[1:]):
            if o1 + n1 > o2:
                raise ValueError(f"overlapping ranges to hash: ({o1}, {n1}) and ({o2}, ...)")
        self._whole = None if ranges else hashlib.sha256()
        self._empty = [(o, 0, hashlib.sha256().hexdigest()) for o, n in ranges if n == 0]
        self._cuts = sorted({x for o, n in ranges if n for x in (o, o + n)} - {0})  # where pieces end
        self._next = 0  # index of the next cut
        self._start = 0  # of the piece being hashed
        self._piece = hashlib.sha256()
        self._done: list[Range] = []

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if self._whole is not None:
            self._whole.update(view)
            self.pos += len(view)
            return
        at = 0
        while at < len(view):
            cut = self._cuts[self._next] if self._next < len(self._cuts) else None
            take = len(view) - at if cut is None else min(cut - self.pos, len(view) - at)
            self._piece.update(view[at : at + take])
            at, self.pos = at + take, self.pos + take
            if self.pos == cut:
                self._close_piece()
                self._next += 1

    def _close_piece(self) -> None:
        if self.pos > self._start:
            self._done.append((self._start, self.pos - self._start, self._piece.hexdigest()))
        self._start, self._piece = self.pos, hashlib.sha256()

    def finish(self, relpath: str, size: int) -> FileEntry:
        """The manifest entry; ValueError when the bytes fed were not ``size`` or a range was
        not covered."""
        if self.pos != size:
            raise ValueError(f"{relpath} changed size during upload ({size} -> {self.pos} bytes)")
        if self._whole is not None:
            return FileEntry(relpath, size, self._whole.hexdigest())
        if self._next != len(self._cuts) or any(o > size for o, _, _ in self._empty):
            raise ValueError(f"{relpath}: a range to hash ends past the file's {size} bytes")
        self._close_piece()
        pieces = tuple(sorted(self._done + self._empty))
        return FileEntry(relpath, size, pieces_digest(pieces), pieces, "pieces")


def hash_file(path: Path, entry: FileEntry | None = None) -> FileEntry:
    """A local file's entry, hashed as ``entry`` lists it (its pieces, or its bytes)."""
    hasher = FileHasher([(o, n) for o, n, _ in entry.ranges] if entry and entry.digest == "pieces" else None)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return hasher.finish(entry.path if entry else Path(path).name, hasher.pos)


class HashingReader:
    """A seekable read-only file object that hashes a file while a transfer manager reads it.

    boto3's transfer manager reads an upload sequentially (multipart parts are cut in order by
    one thread), but it seeks back to retry a request and to compute request checksums. The
    hash therefore follows a high-water mark: only bytes past what was hashed are fed to it, in
    order, so each byte is hashed exactly once. Whatever the transfer did not read in order is
    hashed from disk by ``finish()`` (never in practice; it keeps the manifest right regardless).
    With ``ranges`` the file is hashed in those pieces instead (``FileHasher``).

    The file is opened on the first read and closed at end of file, so a directory of thousands
    of files queued in one transfer manager does not hold thousands of descriptors.
    """

    def __init__(self, path: Path, ranges: list[tuple[int, int]] | None = None):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self._f = None
        self._pos = 0
        self._hasher = FileHasher(ranges)
        self._lock = threading.Lock()  # read/seek may come from different transfer threads

    # -- the file-object protocol s3transfer and botocore use
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        with self._lock:
            base = {0: 0, 1: self._pos, 2: self.size}[whence]
            self._pos = base + offset
            return self._pos

    def read(self, n: int = -1) -> bytes:
        with self._lock:
            if self._f is None:
                self._f = open(self.path, "rb")
            self._f.seek(self._pos)
            data = self._f.read() if n is None or n < 0 else self._f.read(n)
            start, end = self._pos, self._pos + len(data)
            hashed = self._hasher.pos
            if start <= hashed < end:
                self._hasher.update(memoryview(data)[hashed - start :])
            self._pos = end
            if not data or end >= self.size:
                self._f.close()
                self._f = None
            return data

    def close(self) -> None:
        # s3transfer closes the body after a PutObject; a retry may reopen it via read().
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None

    def finish(self, relpath: str) -> FileEntry:
        """The manifest entry of the file; raises ValueError if it changed size while read."""
        self.close()
        with open(self.path, "rb") as f:
            f.seek(self._hasher.pos)
            while chunk := f.read(CHUNK):
                self._hasher.update(chunk)
        return self._hasher.finish(relpath, self.size)
