"""``file://`` checkpoint store: a directory, laid out like ``checkpoint.dir``.

    <root>/iter_0000025/...         the checkpoint's files
    <root>/iter_0000025/manifest.json
    <root>/latest                   "iter_0000025"

Durability follows the local checkpointer: files and directories are fsynced before the
manifest, and the manifest and ``latest`` are replaced atomically (temp + fsync + rename).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from mega.storage.base import (
    LATEST,
    CheckpointStorage,
    CorruptCheckpoint,
    ProgressCounter,
    ProgressFn,
    StorageError,
    StorageUnavailable,
    check_name,
    check_relpath,
    entry_of,
    is_valid_name,
    log_transfer,
)
from mega.storage.manifest import (
    CHUNK,
    MANIFEST,
    FileEntry,
    FileHasher,
    Manifest,
    hash_file,
    local_files,
    sha256_file,
)

log = logging.getLogger(__name__)

# errnos of a store that is there but not answering (a network file system gone away): worth
# retrying later, unlike a missing file or a permission error.
_UNAVAILABLE = {errno.EIO, errno.ENOTCONN, errno.ESTALE, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ETIMEDOUT}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, fsync: bool = True) -> None:
    # A unique temp name: two writers of the same marker must not share (and rename) one file.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if fsync:
        _fsync_dir(path.parent)


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


class FileStorage(CheckpointStorage):
    def __init__(self, root: str | Path, fsync: bool = True):
        super().__init__()
        self.root = Path(root).expanduser().absolute()
        self.fsync = fsync
        self.uri = self.root.as_uri()
        with self._errors("open"):
            self.root.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _errors(self, what: str):
        try:
            yield
        except OSError as e:
            if e.errno in _UNAVAILABLE:
                raise StorageUnavailable(f"{what}: file store {self.root} unavailable: {e.strerror}") from e
            raise

    def _dir(self, name: str) -> Path:
        return self.root / check_name(name)

    # -- write side
    def upload_dir(self, local_dir, name, on_progress: ProgressFn | None = None) -> Manifest:
        local_dir = Path(local_dir)
        dest = self._dir(name)
        t0 = time.monotonic()
        with self._errors(f"upload {name}"):
            in_place = _same_dir(local_dir, dest)
            files = local_files(local_dir, skip_manifest=in_place)
            progress = ProgressCounter(sum(p.stat().st_size for _, p in files), on_progress)

            if in_place:
                # The checkpoint was written in place (local root == store root): copying a file
                # onto itself would truncate it, so only hash and commit. An old manifest stays
                # until the new one replaces it if `latest` names this checkpoint.
                if self.read_latest() != name:
                    (dest / MANIFEST).unlink(missing_ok=True)
                entries = [self._hash_in_place(rel, p, progress) for rel, p in files]
            else:
                if self.read_latest() == name:
                    raise StorageError(f"refusing to overwrite {name}, which {LATEST} names")
                if dest.exists():
                    self.delete(name)  # debris of an earlier attempt: start clean
                entries = [self._copy_in(rel, p, dest, progress) for rel, p in files]
            dest.mkdir(parents=True, exist_ok=True)  # an empty checkpoint still gets its manifest
            if self.fsync:
                for d in sorted({(dest / e.path).parent for e in entries} | {dest}, reverse=True):
                    _fsync_dir(d)
            manifest = Manifest(name=name, files=entries)
            write_atomic(dest / MANIFEST, manifest.to_bytes(), self.fsync)
        log_transfer("uploaded", manifest, self.uri, time.monotonic() - t0)
        return manifest

    def _hash_in_place(self, rel: str, path: Path, progress) -> FileEntry:
        n, h = sha256_file(path)
        progress(n)
        return FileEntry(rel, n, h.hexdigest())

    def _copy_in(self, rel: str, src: Path, dest_root: Path, progress, ranges=None) -> FileEntry:
        dst = dest_root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        h = FileHasher(ranges)
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            while chunk := fi.read(CHUNK):
                h.update(chunk)  # hashed from the very bytes written: one read per byte
                fo.write(chunk)
                progress(len(chunk))
            if self.fsync:
                fo.flush()
                os.fsync(fo.fileno())
        return h.finish(rel, h.pos)

    def upload_files(
        self,
        local_dir,
        name,
        relpaths,
        on_progress: ProgressFn | None = None,
        ranges: dict[str, list[tuple[int, int]]] | None = None,
    ) -> list[FileEntry]:
        local_dir = Path(local_dir)
        ranges = ranges or {}
        dest = self._dir(name)
        with self._errors(f"upload {name}"):
            if self.read_latest() == name:
                raise StorageError(f"refusing to overwrite {name}, which {LATEST} names")
            paths = [(check_relpath(rel), local_dir / rel) for rel in relpaths]
            progress = ProgressCounter(sum(p.stat().st_size for _, p in paths), on_progress)

            return [self._copy_in(rel, p, dest, progress, ranges.get(rel)) for rel, p in paths]

    def commit(self, name: str, entries: list[FileEntry]) -> Manifest:
        dest = self._dir(name)
        with self._errors(f"commit {name}"):
            for e in entries:
                path = dest / check_relpath(e.path)
                if not path.is_file():
                    raise CorruptCheckpoint(name, e.path, "missing from the store at commit")
                if path.stat().st_size != e.size:
                    raise CorruptCheckpoint(name, e.path, f"size {path.stat().st_size} != {e.size} uploaded")
            dest.mkdir(parents=True, exist_ok=True)
            if self.fsync:
                for d in sorted({(dest / e.path).parent for e in entries} | {dest}, reverse=True):
                    _fsync_dir(d)
            manifest = Manifest(name=name, files=sorted(entries, key=lambda e: e.path))
            write_atomic(dest / MANIFEST, manifest.to_bytes(), self.fsync)
        return manifest

    def write_latest(self, name: str) -> None:
        with self._errors(f"write {LATEST}"):
            self.read_manifest(name)  # refuses an incomplete checkpoint
            write_atomic(self.root / LATEST, name.encode(), self.fsync)

    def delete(self, name: str) -> None:
        path = self._dir(name)
        with self._errors(f"delete {name}"):
            if not path.exists():
                return
            (path / MANIFEST).unlink(missing_ok=True)
            if self.fsync:
                _fsync_dir(path)  # the manifest is gone for good before any payload file goes
            shutil.rmtree(path)

    # -- read side
    def read_manifest(self, name: str) -> Manifest:
        path = self._dir(name) / MANIFEST
        with self._errors(f"read manifest of {name}"):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise CorruptCheckpoint(name, None, "no manifest (incomplete upload or absent)") from None
        try:
            return Manifest.from_bytes(data)
        except ValueError as e:
            raise CorruptCheckpoint(name, MANIFEST, str(e)) from None

    def download_dir(self, name, local_dir, verify: bool = True) -> Manifest:
        local_dir = Path(local_dir)
        t0 = time.monotonic()
        with self._errors(f"download {name}"):
            manifest = self.read_manifest(name)
            self._fetch(name, manifest.files, local_dir, verify)
        log_transfer("downloaded", manifest, self.uri, time.monotonic() - t0)
        return manifest

    def download_files(self, name, relpaths, local_dir, verify: bool = True) -> list[FileEntry]:
        with self._errors(f"download {name}"):
            manifest = self.read_manifest(name)
            entries = [entry_of(manifest, rel) for rel in relpaths]
            self._fetch(name, entries, Path(local_dir), verify)
        return entries

    def _fetch(self, name: str, entries: list[FileEntry], local_dir: Path, verify: bool) -> None:
        src_root = self._dir(name)
        in_place = _same_dir(local_dir, src_root)
        for e in entries:
            src = src_root / e.path
            if not src.is_file():
                raise CorruptCheckpoint(name, e.path, "missing from the store")
            if in_place:
                got = hash_file(src, e) if verify else None
                n = got.size if got else src.stat().st_size
            else:
                got = self._copy_out(src, local_dir / e.path, e)
                n = got.size
            self._count_read(n)
            if n != e.size:
                raise CorruptCheckpoint(name, e.path, f"size {n} != {e.size} in the manifest")
            if verify and got.sha256 != e.sha256:
                raise CorruptCheckpoint(name, e.path, "sha256 differs from the manifest")

    def _copy_out(self, src: Path, dst: Path, entry: FileEntry) -> FileEntry:
        """Copy ``src`` to ``dst``, hashed as ``entry`` lists it from the bytes written."""
        dst.parent.mkdir(parents=True, exist_ok=True)
        h = FileHasher([(o, n) for o, n, _ in entry.ranges] if entry.digest == "pieces" else None)
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            while chunk := fi.read(CHUNK):
                h.update(chunk)
                fo.write(chunk)
        return h.finish(entry.path, h.pos)

    def read_bytes(self, name, relpath, offset: int = 0, length: int | None = None) -> bytes:
        path = self._dir(name) / check_relpath(relpath)
        with self._errors(f"read {name}/{relpath}"):
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read() if length is None else f.read(length)
            except FileNotFoundError:
                raise CorruptCheckpoint(name, relpath, "missing from the store") from None
        self._count_read(len(data))
        return data

    def read_latest(self) -> str | None:
        with self._errors(f"read {LATEST}"):
            try:
                return (self.root / LATEST).read_text().strip() or None
            except FileNotFoundError:
                return None

    def _scan(self) -> tuple[list[str], list[str]]:
        complete, incomplete = [], []
        with self._errors("list"):
            for p in self.root.iterdir():
                if p.is_dir() and is_valid_name(p.name):
                    (complete if (p / MANIFEST).is_file() else incomplete).append(p.name)
        return complete, incomplete
