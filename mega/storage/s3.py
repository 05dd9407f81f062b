"""``s3://bucket/prefix`` checkpoint store on any S3-compatible endpoint.

    <prefix>/iter_0000025/<relpath>          the checkpoint's files (multipart above a threshold)
    <prefix>/iter_0000025/manifest.json      written last: the commit record
    <prefix>/latest                          "iter_0000025" (one PUT of a small object: atomic)

Credentials come only from boto3's standard chain (environment, shared config/credentials
files, profile, instance metadata) and never from options, so they cannot leak into configs,
logs or exception text. The endpoint comes from the ``endpoint_url`` option or
``AWS_ENDPOINT_URL``. Transient failures are retried by botocore a bounded number of times;
then the operation raises StorageUnavailable naming the endpoint, and the caller decides.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from s3transfer.exceptions import RetriesExceededError
from s3transfer.subscribers import BaseSubscriber

from mega.storage import redact
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
from mega.storage.manifest import MANIFEST, FileEntry, HashingReader, Manifest, hash_file, local_files

log = logging.getLogger(__name__)

MiB = 1 << 20
# Error codes that say "the service is struggling", not "your request is wrong".
_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "500",
    "502",
    "503",
    "504",
}
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes


class _Progress(BaseSubscriber):
    """Sums s3transfer's per-future progress into one (done, total) callback."""

    def __init__(self, total: int, fn: ProgressFn | None):
        self.count = ProgressCounter(total, fn)

    def on_progress(self, future, bytes_transferred, **kwargs):
        self.count(bytes_transferred)


class S3Storage(CheckpointStorage):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        max_attempts: int = 5,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 32 * MiB,
        max_concurrency: int = 8,
        addressing_style: str | None = None,
    ):
        super().__init__()
        if not bucket:
            raise ValueError("s3 storage needs a bucket: s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.max_attempts = max_attempts
        session = boto3.Session(profile_name=profile)
        creds = session.get_credentials()
        if creds is None:
            raise StorageError(f"no AWS credentials for {self.uri} (environment, shared files or profile)")
        frozen = creds.get_frozen_credentials()
        redact.register(frozen.access_key, frozen.secret_key, frozen.token)
        # A custom endpoint (option, or the variables boto3 reads) means an S3-compatible server:
        # path-style addressing works on all of them; virtual hosts need DNS set up for it.
        custom = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        config = Config(
            # every try counted, the first included (botocore's "max_attempts" counts the retries
            # after it): the bound of one request (CheckpointConfig.s3_request_bound_s) is exact
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(10, max_concurrency + 2),
            # CPU per byte of an upload: botocore would sha256 every payload for its signature
            # (always over http) and CRC32 every part; the sha256 the uploads compute for the
            # manifest (HashingReader) is the integrity check, verified by every restore.
            s3={
                "addressing_style": addressing_style or ("path" if custom else "auto"),
                "payload_signing_enabled": False,
            },
            request_checksum_calculation="when_required",
        )
        self._client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region or session.region_name or "us-east-1",
            config=config,
        )
        self.endpoint = self._client.meta.endpoint_url
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            # A download broken mid-stream fails as one request does (botocore already tried
            # the request max_attempts times): the caller's bounded retry tries again, and one
            # request's bound (connect + read timeouts per attempt) bounds the operation's too.
            num_download_attempts=1,
            preferred_transfer_client="classic",  # the CRT client cannot read through HashingReader
        )

    # -- plumbing
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    @contextmanager
    def _errors(self, what: str):
        """Translate boto exceptions into the storage errors, with no credentials in the text."""
        try:
            yield
        except StorageError:
            raise
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise StorageError(f"{what} on {self.uri}: AWS credentials missing or incomplete") from e
        except (BotoConnectionError, HTTPClientError, IncompleteReadError, RetriesExceededError) as e:
            raise StorageUnavailable(
                f"{what}: S3 endpoint {self.endpoint} ({self.uri}) unavailable after {self.max_attempts} attempts: "
                f"{type(e).__name__}: {redact.redact(str(e))}"
            ) from e
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", "?"))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if status >= 500 or code in _TRANSIENT_CODES:
                raise StorageUnavailable(
                    f"{what}: S3 endpoint {self.endpoint} ({self.uri}) failing after {self.max_attempts} attempts: "
                    f"{code} (HTTP {status})"
                ) from e
            raise StorageError(f"{what} on {self.uri} at {self.endpoint}: {code} (HTTP {status})") from e
        except BotoCoreError as e:
            raise StorageError(f"{what} on {self.uri}: {type(e).__name__}: {redact.redact(str(e))}") from e

    @staticmethod
    def _is_missing(e: ClientError) -> bool:
        return str(e.response.get("Error", {}).get("Code")) in _NOT_FOUND

    def _get(self, key: str, range_: str | None = None) -> bytes | None:
        """An object's bytes, or None when it does not exist."""
        try:
            kw = {"Range": range_} if range_ else {}
            return self._client.get_object(Bucket=self.bucket, Key=key, **kw)["Body"].read()
        except ClientError as e:
            if self._is_missing(e):
                return None
            raise

    def _exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as e:
            if self._is_missing(e):
                return False
            raise

    def _list(self, prefix: str, delimiter: str | None = None):
        """Yields (keys, common prefixes) page by page."""
        kw = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        for page in self._client.get_paginator("list_objects_v2").paginate(**kw):
            yield (
                [o["Key"] for o in page.get("Contents", [])],
                [p["Prefix"] for p in page.get("CommonPrefixes", [])],
            )

    # -- write side
    def upload_dir(self, local_dir, name, on_progress: ProgressFn | None = None) -> Manifest:
        check_name(name)
        files = local_files(local_dir)
        t0 = time.monotonic()
        with self._errors(f"upload {name}"):
            if self.read_latest() == name:
                raise StorageError(f"refusing to overwrite {name}, which {LATEST} names")
            self.delete(name)  # debris of an earlier attempt would otherwise survive under this name
            readers = [(rel, HashingReader(path)) for rel, path in files]
            self._send(name, readers, on_progress)
            try:
                entries = [r.finish(rel) for rel, r in readers]
            except ValueError as e:
                raise StorageError(f"upload {name}: {e}") from None
            manifest = Manifest(name=name, files=entries)
            self._client.put_object(
                Bucket=self.bucket, Key=self._key(name, MANIFEST), Body=manifest.to_bytes()
            )
        log_transfer("uploaded", manifest, self.uri, time.monotonic() - t0)
        return manifest

    def upload_files(
        self,
        local_dir,
        name,
        relpaths,
        on_progress: ProgressFn | None = None,
        ranges: dict[str, list[tuple[int, int]]] | None = None,
    ) -> list[FileEntry]:
        check_name(name)
        local_dir = Path(local_dir)
        ranges = ranges or {}
        with self._errors(f"upload {name}"):
            if self.read_latest() == name:
                raise StorageError(f"refusing to overwrite {name}, which {LATEST} names")
            readers = [
                (check_relpath(rel), HashingReader(local_dir / rel, ranges.get(rel))) for rel in relpaths
            ]
            self._send(name, readers, on_progress)
            try:
                return [r.finish(rel) for rel, r in readers]
            except ValueError as e:
                raise StorageError(f"upload {name}: {e}") from None

    def _send(self, name: str, readers: list, on_progress: ProgressFn | None) -> None:
        progress = _Progress(sum(r.size for _, r in readers), on_progress)
        # One transfer manager for the whole set: small files (per-rank RNG states, metadata)
        # go in parallel, and large ones in parallel parts, within max_concurrency.
        with create_transfer_manager(self._client, self._transfer) as tm:
            futures = [
                tm.upload(r, self.bucket, self._key(name, rel), subscribers=[progress]) for rel, r in readers
            ]
            for f in futures:
                f.result()

    def commit(self, name: str, entries: list[FileEntry]) -> Manifest:
        check_name(name)
        with self._errors(f"commit {name}"):
            stored = {}
            base = self._key(name) + "/"
            for page in self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base
            ):
                stored.update({o["Key"][len(base) :]: o["Size"] for o in page.get("Contents", [])})
            for e in entries:
                if e.path not in stored:
                    raise CorruptCheckpoint(name, e.path, "missing from the store at commit")
                if stored[e.path] != e.size:
                    raise CorruptCheckpoint(name, e.path, f"size {stored[e.path]} != {e.size} uploaded")
            manifest = Manifest(name=name, files=sorted(entries, key=lambda e: e.path))
            self._client.put_object(
                Bucket=self.bucket, Key=self._key(name, MANIFEST), Body=manifest.to_bytes()
            )
        return manifest

    def write_latest(self, name: str) -> None:
        check_name(name)
        with self._errors(f"write {LATEST}"):
            if not self._exists(self._key(name, MANIFEST)):
                raise CorruptCheckpoint(
                    name, None, f"no manifest: {LATEST} may only name a complete checkpoint"
                )
            self._client.put_object(Bucket=self.bucket, Key=self._key(LATEST), Body=name.encode())

    def delete(self, name: str) -> None:
        check_name(name)
        with self._errors(f"delete {name}"):
            # The manifest first: from then on nobody reads this checkpoint as complete.
            self._client.delete_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))
            keys = [k for page, _ in self._list(self._key(name) + "/") for k in page]
            for i in range(0, len(keys), _DELETE_BATCH):
                batch = [{"Key": k} for k in keys[i : i + _DELETE_BATCH]]
                out = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
                if out.get("Errors"):
                    err = out["Errors"][0]
                    n = len(out["Errors"])
                    raise StorageError(
                        f"delete {name}: {err.get('Key')}: {err.get('Code')} ({n} keys failed)"
                    )
            self._abort_multipart(self._key(name) + "/")

    def _abort_multipart(self, prefix: str) -> None:
        # Parts of a multipart upload whose uploader died (SIGKILL: no chance to abort) are
        # invisible to listings but billed until aborted; a bucket lifecycle rule is the backstop.
        for page in self._client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            for u in page.get("Uploads", []):
                try:
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]
                    )
                except ClientError as e:
                    if not self._is_missing(e) and e.response.get("Error", {}).get("Code") != "NoSuchUpload":
                        raise

    # -- read side
    def read_manifest(self, name: str) -> Manifest:
        check_name(name)
        with self._errors(f"read manifest of {name}"):
            data = self._get(self._key(name, MANIFEST))
        if data is None:
            raise CorruptCheckpoint(name, None, "no manifest (incomplete upload or absent)")
        try:
            return Manifest.from_bytes(data)
        except ValueError as e:
            raise CorruptCheckpoint(name, MANIFEST, str(e)) from None

    def download_dir(self, name, local_dir, verify: bool = True) -> Manifest:
        manifest = self.read_manifest(name)
        t0 = time.monotonic()
        self._fetch(name, manifest.files, Path(local_dir), verify)
        log_transfer("downloaded", manifest, self.uri, time.monotonic() - t0)
        return manifest

    def download_files(self, name, relpaths, local_dir, verify: bool = True) -> list[FileEntry]:
        manifest = self.read_manifest(name)
        entries = [entry_of(manifest, rel) for rel in relpaths]
        self._fetch(name, entries, Path(local_dir), verify)
        return entries

    def _fetch(self, name: str, entries: list[FileEntry], local_dir: Path, verify: bool) -> None:
        with self._errors(f"download {name}"):
            for e in entries:
                (local_dir / e.path).parent.mkdir(parents=True, exist_ok=True)
            with create_transfer_manager(self._client, self._transfer) as tm:
                futures = [
                    (e, tm.download(self.bucket, self._key(name, e.path), str(local_dir / e.path)))
                    for e in entries
                ]
                for e, f in futures:
                    try:
                        f.result()
                    except ClientError as err:
                        if self._is_missing(err):
                            raise CorruptCheckpoint(name, e.path, "missing from the store") from None
                        raise
            # Parallel ranged GETs land out of order, so the hash is taken from the written file
            # (still in the page cache) rather than on the wire.
            for e in entries:
                path = local_dir / e.path
                size = path.stat().st_size
                self._count_read(size)
                if size != e.size:
                    raise CorruptCheckpoint(name, e.path, f"size {size} != {e.size} in the manifest")
                if verify and hash_file(path, e).sha256 != e.sha256:
                    raise CorruptCheckpoint(name, e.path, "sha256 differs from the manifest")

    def read_bytes(self, name, relpath, offset: int = 0, length: int | None = None) -> bytes:
        check_name(name)
        check_relpath(relpath)
        if length is not None and length <= 0:
            return b""
        rng = None
        if offset or length is not None:
            rng = f"bytes={offset}-" + ("" if length is None else str(offset + length - 1))
        with self._errors(f"read {name}/{relpath}"):
            try:
                data = self._get(self._key(name, relpath), rng)
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) == "InvalidRange":
                    data = b""  # offset at or past the end, as a local read would give
                else:
                    raise
        if data is None:
            raise CorruptCheckpoint(name, relpath, "missing from the store")
        self._count_read(len(data))
        return data

    def read_latest(self) -> str | None:
        with self._errors(f"read {LATEST}"):
            data = self._get(self._key(LATEST))
        if data is None:
            return None
        return data.decode().strip() or None

    def _scan(self) -> tuple[list[str], list[str]]:
        base = self._key() + "/" if self.prefix else ""
        with self._errors("list"):
            names = [p[len(base) :].rstrip("/") for _, prefixes in self._list(base, "/") for p in prefixes]
            names = [n for n in names if is_valid_name(n)]
            complete = [n for n in names if self._exists(self._key(n, MANIFEST))]
            # Some servers (SeaweedFS) keep listing a "directory" whose objects are all deleted.
            incomplete = [n for n in names if n not in complete and self._has_objects(n)]
        return complete, incomplete

    def _has_objects(self, name: str) -> bool:
        out = self._client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(name) + "/", MaxKeys=1)
        return any(not o["Key"].endswith("/") for o in out.get("Contents", []))
