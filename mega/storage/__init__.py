"""Checkpoint storage by URI: where the two-stage checkpointer uploads and restores from.

    store = open_storage("s3://bucket/run-42", endpoint_url="http://127.0.0.1:8333")
    manifest = store.upload_dir("/local/ckpt/iter_0000025", "iter_0000025")
    store.write_latest("iter_0000025")
    store.download_dir(store.read_latest(), "/tmp/restore")

``file:///abs/path`` (or a plain path) is the embedded default; ``s3://bucket/prefix`` is any
S3-compatible endpoint. See docs/storage.md. (The rendezvous key-value stores the ranks meet
through are ``mega.store``, a different thing.)
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from mega.storage.base import (
    LATEST,
    CheckpointStorage,
    CorruptCheckpoint,
    StorageError,
    StorageUnavailable,
    step_of,
)
from mega.storage.manifest import MANIFEST, FileEntry, Manifest

__all__ = [
    "LATEST",
    "MANIFEST",
    "CheckpointStorage",
    "CorruptCheckpoint",
    "FileEntry",
    "Manifest",
    "StorageError",
    "StorageUnavailable",
    "open_storage",
    "step_of",
]


def open_storage(uri: str | Path, **opts) -> CheckpointStorage:
    """The store at ``uri``. Options go to the backend: FileStorage(fsync) or S3Storage(
    endpoint_url, region, profile, max_attempts, connect_timeout, read_timeout,
    multipart_threshold, multipart_chunksize, max_concurrency, addressing_style)."""
    text = str(uri)
    parsed = urlparse(text)
    if parsed.scheme in ("", "file"):
        from mega.storage.local import FileStorage

        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"file URI must be local (file:///abs/path), got {text!r}")
            return FileStorage(unquote(parsed.path), **opts)
        return FileStorage(text, **opts)
    if parsed.scheme == "s3":
        from mega.storage.s3 import S3Storage  # boto3 only when S3 is used

        return S3Storage(parsed.netloc, parsed.path, **opts)
    raise ValueError(f"unsupported checkpoint storage URI {text!r} (file:// or s3://)")
