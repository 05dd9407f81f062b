"""Checkpoint storage (mega/storage): the file:// store and a real S3 server (local SeaweedFS).

Every behaviour test runs against both backends. The S3 server is one SeaweedFS process for the
session; each test works under its own prefix. The outage test stops and restarts it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import threading
import time
import traceback
import uuid
from pathlib import Path

import pytest
from helpers import needs_root
from s3_env import hermetic_s3_env

from mega.storage import (
    CorruptCheckpoint,
    FileEntry,
    Manifest,
    StorageError,
    StorageUnavailable,
    open_storage,
    step_of,
)
from mega.storage.local import FileStorage
from mega.storage.manifest import MANIFEST, HashingReader
from mega.storage.seaweed import SeaweedS3

MiB = 1 << 20
THRESHOLD = 5 * MiB  # S3's minimum part size: the big file below goes up in 3 parts
BIG = "model/__0_0.distcp"


def _open_s3(server: SeaweedS3, **opts):
    opts = {
        "multipart_threshold": THRESHOLD,
        "multipart_chunksize": THRESHOLD,
        "max_attempts": 2,
        "connect_timeout": 1,
        "read_timeout": 10,
        **opts,
    }
    return open_storage(server.uri(f"t-{uuid.uuid4().hex[:8]}"), **opts)


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path, monkeypatch):
    if request.param == "file":
        return open_storage((tmp_path / "store").as_uri())
    server = request.getfixturevalue("seaweed")
    hermetic_s3_env(monkeypatch, server, tmp_path)
    return _open_s3(server)  # endpoint from AWS_ENDPOINT_URL, credentials from the environment


def make_ckpt(root: Path, big: bool = True, tag: str = "") -> Path:
    """A directory shaped like a megatron checkpoint: nested shards, per-rank RNG, an empty file."""
    files = {
        "common.pt": os.urandom(1000),
        "metadata.json": f'{{"tag": "{tag}"}}'.encode(),
        "rng/rank00000.pt": os.urandom(300),
        "rng/rank00001.pt": os.urandom(300),
        "empty": b"",
        BIG: os.urandom(12 * MiB if big else 4096),
    }
    root.mkdir(parents=True)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def put_raw(store, name: str, relpath: str, data: bytes | None) -> None:
    """Write (or with None delete) one object behind the store's back, as corruption would."""
    if isinstance(store, FileStorage):
        path = store.root / name / relpath
        path.unlink() if data is None else path.write_bytes(data)
    elif data is None:
        store._client.delete_object(Bucket=store.bucket, Key=store._key(name, relpath))
    else:
        store._client.put_object(Bucket=store.bucket, Key=store._key(name, relpath), Body=data)


def test_roundtrip_byte_identical(store, tmp_path):
    src = make_ckpt(tmp_path / "src")
    progress = []
    manifest = store.upload_dir(
        src, "iter_0000010", on_progress=lambda done, total: progress.append((done, total))
    )

    expected = {rel: (len(b), hashlib.sha256(b).hexdigest()) for rel, b in tree(src).items()}
    assert {f.path: (f.size, f.sha256) for f in manifest.files} == expected
    assert [f.path for f in manifest.files] == sorted(expected)
    assert manifest.total_bytes == sum(s for s, _ in expected.values())
    assert progress[-1] == (manifest.total_bytes, manifest.total_bytes)
    assert store.read_manifest("iter_0000010").files == manifest.files
    assert store.list_checkpoints() == ["iter_0000010"]

    got = store.download_dir("iter_0000010", tmp_path / "restored")
    assert got.files == manifest.files
    assert tree(tmp_path / "restored") == tree(src)

    if not isinstance(store, FileStorage):  # the big file really went through multipart upload
        etag = store._client.head_object(Bucket=store.bucket, Key=store._key("iter_0000010", BIG))["ETag"]
        assert etag.strip('"').endswith("-3")


def test_uploaders_share_one_commit(store, tmp_path):
    """Two-stage checkpoints: each rank uploads its own files, rank 0 commits one manifest that
    is checked against the store; a restore fetches a share of the files, verified."""
    src = make_ckpt(tmp_path / "src", big=False)
    files = sorted(tree(src))
    mine, theirs = files[::2], files[1::2]
    entries = store.upload_files(src, "iter_0000003", mine) + store.upload_files(src, "iter_0000003", theirs)
    assert store.list_checkpoints() == []  # nothing is complete before the commit
    with pytest.raises(CorruptCheckpoint) as err:
        store.commit("iter_0000003", [*entries, FileEntry("never/uploaded.pt", 5, "0" * 64)])
    assert err.value.relpath == "never/uploaded.pt" and "missing" in err.value.reason
    wrong = FileEntry(BIG, 1, entries[0].sha256)
    with pytest.raises(CorruptCheckpoint, match="size"):
        store.commit("iter_0000003", [e for e in entries if e.path != BIG] + [wrong])
    manifest = store.commit("iter_0000003", entries)
    expected = {rel: (len(b), hashlib.sha256(b).hexdigest()) for rel, b in tree(src).items()}
    assert {f.path: (f.size, f.sha256) for f in manifest.files} == expected
    store.write_latest("iter_0000003")
    with pytest.raises(StorageError, match="latest"):
        store.upload_files(src, "iter_0000003", mine)

    store.reset_bytes_read()
    got = store.download_files("iter_0000003", theirs, tmp_path / "share")
    assert [e.path for e in got] == theirs
    assert store.bytes_read == sum(expected[rel][0] for rel in theirs)
    assert tree(tmp_path / "share") == {rel: b for rel, b in tree(src).items() if rel in theirs}
    victim = next(rel for rel in theirs if expected[rel][0])
    put_raw(store, "iter_0000003", victim, b"x" * expected[victim][0])
    with pytest.raises(CorruptCheckpoint) as err:
        store.download_files("iter_0000003", theirs, tmp_path / "share2")
    assert err.value.relpath == victim and "sha256" in err.value.reason


def test_pieces_hashed_on_upload_are_fetched_and_verified_one_by_one(store, tmp_path):
    """A restore reads single serialised tensors: upload_files hashes a file in the pieces it is
    told of (each byte once; the bytes between and after them are pieces too), read_pieces
    fetches adjacent ones in one ranged read and checks each; a flipped byte or a truncated file
    is named; a download checks the whole file by its pieces."""
    src = make_ckpt(tmp_path / "src")
    data = (src / BIG).read_bytes()
    pieces = [(0, 100), (100, 0), (100, 6 * MiB), (6 * MiB + 100, len(data) - 6 * MiB - 200)]
    entries = store.upload_files(src, "iter_0000004", [BIG, "common.pt"], ranges={BIG: pieces})
    big = next(e for e in entries if e.path == BIG)
    covered = [*pieces, (len(data) - 100, 100)]  # the last 100 bytes: a piece of their own
    want = tuple((o, n, hashlib.sha256(data[o : o + n]).hexdigest()) for o, n in covered)
    assert big.ranges == want and big.digest == "pieces"
    lines = "".join(f"{o}:{n}:{h}\n" for o, n, h in want)  # pieces_digest, independently
    assert big.sha256 == hashlib.sha256(lines.encode()).hexdigest()
    common = next(e for e in entries if e.path == "common.pt")
    assert common.ranges == () and common.digest == "bytes"
    assert common.sha256 == hashlib.sha256((src / "common.pt").read_bytes()).hexdigest()
    manifest = store.commit("iter_0000004", entries)
    assert store.read_manifest("iter_0000004") == manifest  # the ranges survive the manifest's JSON
    store.download_files("iter_0000004", [BIG], tmp_path / "whole")  # verified by its pieces
    assert (tmp_path / "whole" / BIG).read_bytes() == data

    store.reset_bytes_read()
    wanted = [pieces[3], pieces[0], pieces[1]]
    got = store.read_pieces(manifest, BIG, wanted)
    assert [bytes(g) for g in got] == [data[o : o + n] for o, n in wanted]
    assert store.bytes_read == pieces[0][1] + pieces[3][1]  # only what was asked for
    whole = store.read_pieces(manifest, "common.pt", [(0, 1000)])  # a file: its own sha256
    assert bytes(whole[0]) == (src / "common.pt").read_bytes()
    with pytest.raises(ValueError, match="not hashed"):
        store.read_pieces(manifest, BIG, [(0, 50)])

    put_raw(store, "iter_0000004", BIG, data[:200] + bytes([data[200] ^ 1]) + data[201:])
    assert bytes(store.read_pieces(manifest, BIG, [pieces[0]])[0]) == data[:100]  # untouched piece
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        store.download_files("iter_0000004", [BIG], tmp_path / "flipped")
    with pytest.raises(CorruptCheckpoint) as err:
        store.read_pieces(manifest, BIG, [pieces[0], pieces[2]])
    assert (
        err.value.relpath == BIG
        and err.value.reason == f"sha256 of bytes [100, {6 * MiB + 100}) differs from the manifest"
    )
    put_raw(store, "iter_0000004", BIG, data[: 5 * MiB])
    with pytest.raises(CorruptCheckpoint) as err:
        store.read_pieces(manifest, BIG, [pieces[2]])
    assert err.value.relpath == BIG and err.value.reason.startswith("size")


def test_corruption_is_named(store, tmp_path):
    src = make_ckpt(tmp_path / "src")
    store.upload_dir(src, "iter_0000020")

    put_raw(store, "iter_0000020", BIG, os.urandom(12 * MiB))  # same size, other bytes
    with pytest.raises(CorruptCheckpoint, match="sha256") as e:
        store.download_dir("iter_0000020", tmp_path / "a")
    assert e.value.relpath == BIG and BIG in str(e.value)
    # Without verification the size check still runs, and same-size damage goes unnoticed.
    store.download_dir("iter_0000020", tmp_path / "b", verify=False)

    put_raw(store, "iter_0000020", "common.pt", b"short")
    with pytest.raises(CorruptCheckpoint, match="size") as e:
        store.download_dir("iter_0000020", tmp_path / "c", verify=False)
    assert e.value.relpath == "common.pt"

    put_raw(store, "iter_0000020", "rng/rank00001.pt", None)
    put_raw(store, "iter_0000020", "common.pt", (src / "common.pt").read_bytes())
    put_raw(store, "iter_0000020", BIG, (src / BIG).read_bytes())
    with pytest.raises(CorruptCheckpoint, match="missing") as e:
        store.download_dir("iter_0000020", tmp_path / "d")
    assert e.value.relpath == "rng/rank00001.pt"


def test_truncated_upload_is_not_a_checkpoint(store, tmp_path):
    src = make_ckpt(tmp_path / "src")

    class Killed(Exception):
        pass

    def die(done, total):  # the uploader dies part-way
        if done > 0:
            raise Killed

    with pytest.raises(Killed):
        store.upload_dir(src, "iter_0000030", on_progress=die)
    assert store.list_checkpoints() == []
    with pytest.raises(CorruptCheckpoint, match="no manifest"):
        store.download_dir("iter_0000030", tmp_path / "x")
    with pytest.raises(CorruptCheckpoint):
        store.write_latest("iter_0000030")

    # A complete upload whose manifest is then lost is just as incomplete.
    store.upload_dir(src, "iter_0000040")
    put_raw(store, "iter_0000040", MANIFEST, None)
    assert store.list_checkpoints() == []

    if not isinstance(store, FileStorage):  # parts of a multipart upload whose uploader died
        key = store._key("iter_0000030", BIG)
        upload = store._client.create_multipart_upload(Bucket=store.bucket, Key=key)
        store._client.upload_part(
            Bucket=store.bucket,
            Key=key,
            UploadId=upload["UploadId"],
            PartNumber=1,
            Body=os.urandom(THRESHOLD),
        )
        assert store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)["Uploads"]

    # Retrying the upload under the same name starts clean (stray parts aborted) and completes.
    store.upload_dir(src, "iter_0000030")
    assert store.list_checkpoints() == ["iter_0000030"]
    store.download_dir("iter_0000030", tmp_path / "y")
    assert tree(tmp_path / "y") == tree(src)
    if not isinstance(store, FileStorage):
        assert not store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix).get(
            "Uploads"
        )


def test_latest(store, tmp_path):
    assert store.read_latest() is None
    with pytest.raises(CorruptCheckpoint):
        store.write_latest("iter_0000001")  # does not exist
    for step in (1, 2):
        store.upload_dir(make_ckpt(tmp_path / f"s{step}", big=False), f"iter_{step:07d}")
    store.write_latest("iter_0000001")
    assert store.read_latest() == "iter_0000001"
    store.write_latest("iter_0000002")
    assert store.read_latest() == "iter_0000002"
    with pytest.raises(StorageError, match="latest"):
        store.upload_dir(tmp_path / "s1", "iter_0000002")  # never overwrite what latest names
    if isinstance(store, FileStorage):  # temp + rename left nothing behind
        assert sorted(p.name for p in store.root.iterdir()) == ["iter_0000001", "iter_0000002", "latest"]


def test_retention_keeps_last_k_and_latest(store, tmp_path):
    for step in (10, 20, 30, 40, 50):
        store.upload_dir(make_ckpt(tmp_path / str(step), big=False), f"iter_{step:07d}")
    # Incomplete: one older than latest (debris) and one newer (an upload in flight).
    for step in (5, 60):
        store.upload_dir(tmp_path / "10", f"iter_{step:07d}")
        put_raw(store, f"iter_{step:07d}", MANIFEST, None)
    assert store.apply_retention(keep_last=10) == []  # fewer than K complete: all kept
    store.write_latest("iter_0000020")

    deleted = store.apply_retention(keep_last=2)
    assert deleted == ["iter_0000005", "iter_0000010", "iter_0000030"]
    assert store.list_checkpoints() == ["iter_0000020", "iter_0000040", "iter_0000050"]
    assert store.read_latest() == "iter_0000020"
    assert store._scan()[1] == ["iter_0000060"]  # the in-flight one is untouched
    store.download_dir("iter_0000020", tmp_path / "r")  # what latest names is whole

    assert store.apply_retention(keep_last=0) == ["iter_0000040", "iter_0000050"]
    assert store.list_checkpoints() == ["iter_0000020"]


def test_bytes_read_counter_is_exact(store, tmp_path):
    src = make_ckpt(tmp_path / "src")
    manifest = store.upload_dir(src, "iter_0000007")
    store.write_latest("iter_0000007")
    store.list_checkpoints()
    store.read_manifest("iter_0000007")
    assert store.bytes_read == 0  # manifests, listings and the marker are not payload

    big = (src / BIG).read_bytes()
    assert store.read_bytes("iter_0000007", BIG) == big
    assert store.bytes_read == len(big)
    assert store.read_bytes("iter_0000007", BIG, offset=1000, length=4096) == big[1000:5096]
    assert store.bytes_read == len(big) + 4096
    rng = (src / "rng/rank00000.pt").read_bytes()
    assert store.read_bytes("iter_0000007", "rng/rank00000.pt", offset=100) == rng[100:]
    assert store.bytes_read == len(big) + 4096 + 200

    store.reset_bytes_read()
    store.download_dir("iter_0000007", tmp_path / "r")
    assert store.bytes_read == manifest.total_bytes
    with pytest.raises(CorruptCheckpoint, match="missing"):
        store.read_bytes("iter_0000007", "nope.pt")


def test_file_store_in_place(tmp_path):
    """Store root == local checkpoint root: upload only hashes and commits, never copies onto itself."""
    store = open_storage(str(tmp_path / "ckpts"))  # a bare path means file://
    src = make_ckpt(tmp_path / "ckpts" / "iter_0000003")
    before = tree(src)
    manifest = store.upload_dir(src, "iter_0000003")
    assert tree(src) == {**before, MANIFEST: manifest.to_bytes()}
    store.download_dir("iter_0000003", src)  # verifies in place
    assert store.bytes_read == manifest.total_bytes
    store.write_latest("iter_0000003")
    assert store.upload_dir(src, "iter_0000003").files == manifest.files  # again: harmless
    with pytest.raises(ValueError):
        store.read_bytes("iter_0000003", "../latest")


def test_uris_names_and_manifest(tmp_path, seaweed, monkeypatch):
    assert isinstance(open_storage(f"file://{tmp_path}/a"), FileStorage)
    assert open_storage(f"file://{tmp_path}/a").root == tmp_path / "a"
    with pytest.raises(ValueError):
        open_storage("gs://bucket/x")
    with pytest.raises(ValueError):
        open_storage("file://otherhost/x")
    hermetic_s3_env(monkeypatch, seaweed, tmp_path)
    s3 = open_storage("s3://mega-test/runs/a/", endpoint_url=seaweed.endpoint_url)
    assert (s3.bucket, s3.prefix, s3.uri, s3.endpoint) == (
        "mega-test",
        "runs/a",
        "s3://mega-test/runs/a",
        seaweed.endpoint_url,
    )
    for bad in ("", "latest", "../x", "a/b", ".hidden", "iter_1\n"):
        with pytest.raises(ValueError):
            s3.delete(bad)
    assert sorted(["iter_10", "iter_9", "iter_100"], key=step_of) == ["iter_9", "iter_10", "iter_100"]
    m = Manifest("iter_1", [])
    assert Manifest.from_bytes(m.to_bytes()) == m
    with pytest.raises(ValueError):
        Manifest.from_bytes(b'{"format": 99}')


def test_hashing_reader_hashes_each_byte_once(tmp_path):
    data = os.urandom(3 * MiB + 17)
    path = tmp_path / "f"
    path.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    # The access pattern of a retried PutObject: read a bit, rewind, read it all.
    r = HashingReader(path)
    r.read(1000)
    r.seek(0)
    assert r.read() == data
    assert r.finish("f").sha256 == want
    # Multipart: parts in order, then a part re-sent; and one read that skips ahead.
    r = HashingReader(path)
    parts = [r.read(MiB) for _ in range(4)]
    r.seek(MiB)
    r.read(MiB)
    assert b"".join(parts) == data and r.finish("f").sha256 == want
    r = HashingReader(path)
    r.seek(2 * MiB)
    r.read(100)
    assert r.finish("f").sha256 == want  # the gap was hashed from disk
    # Pieces hashed on their own from the same bytes, across part boundaries and a rewind.
    pieces = [(0, 10), (10, 2 * MiB), (2 * MiB + 10, MiB + 7)]
    r = HashingReader(path, pieces)
    parts = [r.read(MiB) for _ in range(2)]
    r.seek(0)
    r.read(MiB)
    r.read(700)
    entry = r.finish("f")
    assert entry.digest == "pieces" and entry.sha256 != want  # the digest of the pieces
    # the pieces cover the file: nothing between or after them
    assert entry.ranges == tuple((o, n, hashlib.sha256(data[o : o + n]).hexdigest()) for o, n in pieces)
    path.write_bytes(data + b"more")
    with pytest.raises(ValueError, match="changed size"):
        r.finish("f")


def _secrets_of(server: SeaweedS3) -> list[str]:
    env = server.env()
    return [env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]]


def _assert_clean(text: str, secrets: list[str]) -> None:
    for s in secrets:
        assert s not in text


def test_credentials_never_logged_or_raised(seaweed, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)  # botocore logs every request's headers at DEBUG
    hermetic_s3_env(monkeypatch, seaweed, tmp_path)
    store = _open_s3(seaweed)
    src = make_ckpt(tmp_path / "src", big=False)
    store.upload_dir(src, "iter_0000001")
    store.download_dir("iter_0000001", tmp_path / "r")
    assert "Sending http request" in caplog.text  # the test saw the request logs it guards

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + seaweed.env()["AWS_SECRET_ACCESS_KEY"][::-1])
    bad = _open_s3(seaweed)
    with pytest.raises(StorageError) as e:
        bad.list_checkpoints()
    assert not isinstance(e.value, StorageUnavailable)  # bad credentials: retrying will not help
    secrets = _secrets_of(seaweed) + [os.environ["AWS_SECRET_ACCESS_KEY"]]
    _assert_clean("".join(traceback.format_exception(e.value)), secrets)
    _assert_clean(caplog.text, secrets)
    _assert_clean(repr(seaweed), secrets)


def test_s3_server_on_a_full_disk_is_refused_naming_the_space(tmp_path):
    # weed itself would start, mark its volumes read-only and let every write time out.
    free = shutil.disk_usage(tmp_path).free
    server = SeaweedS3(tmp_path / "s3", min_free_bytes=free + (1 << 40))
    t0 = time.monotonic()
    with pytest.raises(OSError, match=r"MiB free under .*s3/data; .*min_free_bytes="):
        server.start(timeout=60)
    assert time.monotonic() - t0 < 5 and not server.running


@needs_root
def test_s3_server_writes_on_a_large_disk_more_than_99_percent_full(tmp_path):
    """An 8 GiB disk (ext4 on a loop device, sparse) with 72 MiB left: below weed's own 1% it
    would mark every volume read-only and time each write out; the server here starts, which needs
    a bucket write and its read-back."""
    if not shutil.which("mkfs.ext4") or not Path("/dev/loop-control").exists():
        pytest.skip("needs mkfs.ext4 and loop devices")
    image, mount = tmp_path / "disk.img", tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["truncate", "-s", "8G", image], check=True, timeout=30)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", image], check=True, timeout=60)
    subprocess.run(["mount", "-o", "loop", image, mount], check=True, timeout=30)
    try:
        left = 72 << 20
        fill = shutil.disk_usage(mount).free - left  # fallocate: blocks taken, nothing written
        subprocess.run(["fallocate", "-l", str(fill), mount / "fill"], check=True, timeout=60)
        usage = shutil.disk_usage(mount)
        assert usage.free < 0.01 * usage.total and usage.free > 64 << 20, usage
        with SeaweedS3(mount / "s3", bucket="mega-full") as server:
            assert server.running
    finally:
        subprocess.run(["umount", "-l", mount], timeout=30)


# Last: it stops the session's server (and restarts it).
def test_storage_down_then_back(seaweed, tmp_path, monkeypatch, caplog):
    hermetic_s3_env(monkeypatch, seaweed, tmp_path)
    store = _open_s3(seaweed)
    src = make_ckpt(tmp_path / "src")
    store.upload_dir(src, "iter_0000100")
    store.write_latest("iter_0000100")
    secrets = _secrets_of(seaweed)

    try:
        # The server dies mid-upload (SIGKILL, from inside the transfer's progress callback).
        killed = threading.Event()

        def crash(done, total):
            if not killed.is_set():
                killed.set()
                seaweed.stop(grace=0)

        t0 = time.monotonic()
        with pytest.raises(StorageUnavailable) as e:
            store.upload_dir(src, "iter_0000200", on_progress=crash)
        assert time.monotonic() - t0 < 30 and seaweed.endpoint_url in str(e.value)

        operations = {
            "list": store.list_checkpoints,
            "latest": store.read_latest,
            "write_latest": lambda: store.write_latest("iter_0000100"),
            "read_bytes": lambda: store.read_bytes("iter_0000100", BIG),
            "download": lambda: store.download_dir("iter_0000100", tmp_path / "down"),
            "upload": lambda: store.upload_dir(src, "iter_0000300"),
            "retention": lambda: store.apply_retention(1),
        }
        for what, op in operations.items():
            t0 = time.monotonic()
            with pytest.raises(StorageUnavailable) as e:
                op()
            elapsed = time.monotonic() - t0
            assert elapsed < 15, f"{what} took {elapsed:.1f}s to give up"
            assert seaweed.endpoint_url in str(e.value)
            _assert_clean("".join(traceback.format_exception(e.value)), secrets)
        _assert_clean(caplog.text, secrets)
    finally:
        seaweed.start(timeout=120)  # same data directory and ports

    assert store.read_latest() == "iter_0000100"
    assert store.list_checkpoints() == ["iter_0000100"]  # the interrupted upload is not complete
    store.download_dir("iter_0000100", tmp_path / "back")
    assert tree(tmp_path / "back") == tree(src)
    store.upload_dir(src, "iter_0000200")
    store.write_latest("iter_0000200")
    assert store.apply_retention(1) == ["iter_0000100"]
    # The server was restarted with the credentials in this process's environment: it must not
    # have picked them up (or logged them).
    _assert_clean(seaweed.log_path.read_text(), secrets)
