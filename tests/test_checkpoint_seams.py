"""The pieces of a restore that scales, in isolation (end to end: tests/test_checkpoint.py and
tests/test_training.py::test_resume_with_another_layout):

* ``PieceExchange`` among three real gloo processes over a real file store whose manifest hashes
  each piece: every rank gets exactly the bytes it asked for, each piece needed anywhere is read
  from the store once, passed only to the ranks that need it, and a corrupt piece is refused on
  every rank alike, naming the file;
* the megatron-core and torch code the seams in mega/checkpoint/megatron_io.py rely on has not
  changed under them.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
from pathlib import Path

import pytest

from mega.checkpoint import megatron_io, save_group

WORLD = 3
PIECES = [(0, 1000), (1000, 0), (1000, 5000), (6000, 30000), (36000, 4000)]  # the shard file's layout
WANTS = {  # rank -> wanted (path, offset, length); `common.pt` is fetched whole
    0: [("__0_0.distcp", *PIECES[0]), ("__0_0.distcp", *PIECES[2]), ("common.pt", 0, 700)],
    1: [
        ("__0_0.distcp", *PIECES[2]),
        ("__0_0.distcp", *PIECES[3]),
        ("__0_0.distcp", *PIECES[1]),
        ("common.pt", 0, 700),
    ],
    2: [("__0_0.distcp", *PIECES[3]), ("__0_0.distcp", *PIECES[4]), ("common.pt", 100, 50)],
}


RELIED_ON = {
    **{t: (v, "megatron_io.py") for t, v in megatron_io.RELIED_ON_SOURCES.items()},
    **{t: (v, "save_group.py") for t, v in save_group.RELIED_ON_SOURCES.items()},
}


@pytest.mark.parametrize("target", sorted(RELIED_ON))
def test_relied_on_sources_unchanged(target):
    from mega.megatron_fixes import source_fingerprint

    fingerprint, module = RELIED_ON[target]
    assert source_fingerprint(target) == fingerprint, (
        f"{target} changed: re-verify mega/checkpoint/{module} against it"
    )


def _rank(rank: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    from mega.checkpoint.exchange import PieceExchange
    from mega.storage import CorruptCheckpoint, open_storage

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    store = open_storage(Path(root, "store").as_uri())
    result = {}
    for name, share in (("iter_0000001", True), ("iter_0000001", False), ("iter_0000002", True)):
        manifest = store.read_manifest(name)
        ex = PieceExchange(store, manifest, dist.group.WORLD, torch_device(), share=share)
        try:
            ex.fetch(WANTS[rank])
        except CorruptCheckpoint as e:
            result[f"{name}/{share}"] = {"refused": [e.relpath, e.reason]}
            continue
        got = {f"{p}:{o}:{n}": bytes(ex.get(p, o, n)).hex() for p, o, n in WANTS[rank]}
        held_after_fetch = ex.stats.held_bytes
        for piece in WANTS[rank]:
            ex.release(*piece)
        result[f"{name}/{share}"] = {
            "got": got,
            "read": ex.stats.read_bytes,
            "received": ex.stats.received_bytes,
            "sent": ex.stats.sent_bytes,
            "peak": ex.stats.peak_bytes,
            "held_after_fetch": held_after_fetch,
            "held_after_release": ex.stats.held_bytes,
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def torch_device():
    import torch

    return torch.device("cpu")


def _checkpoint(root: Path, name: str, shard: bytes, common: bytes):
    from mega.storage import open_storage

    src = root / f"src-{name}"
    src.mkdir()
    (src / "__0_0.distcp").write_bytes(shard)
    (src / "common.pt").write_bytes(common)
    store = open_storage((root / "store").as_uri())
    entries = store.upload_files(
        src, name, ["__0_0.distcp", "common.pt"], ranges={"__0_0.distcp": [p for p in PIECES]}
    )
    store.commit(name, entries)
    return store


def test_pieces_are_read_once_per_group_and_go_only_where_needed(tmp_path):
    shard, common = os.urandom(40000), os.urandom(700)
    _checkpoint(tmp_path, "iter_0000001", shard, common)
    store = _checkpoint(tmp_path, "iter_0000002", shard, common)
    # iter_0000002 is damaged behind the store's back: one byte of the piece ranks 1 and 2 share
    path = store.root / "iter_0000002" / "__0_0.distcp"
    damaged = bytearray(path.read_bytes())
    damaged[20000] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    # forkserver with torch preloaded: clean processes (not forks of this one), started quickly
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "mega.checkpoint.exchange"])
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), str(out))) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=120)
    finally:
        for proc in procs:
            if proc.is_alive():  # a hung exchange: fail, leave nothing behind
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * WORLD
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]

    files = {"__0_0.distcp": shard, "common.pt": common}
    needed = {
        r: {(p, *((0, len(files[p])) if p == "common.pt" else (o, n))) for p, o, n in WANTS[r]}
        for r in range(WORLD)
    }  # what each rank must hold: common.pt is only hashed whole
    union = set().union(*needed.values())
    for mode in ("iter_0000001/True", "iter_0000001/False"):
        for r, res in enumerate(results):
            got = res[mode]
            assert got["got"] == {f"{p}:{o}:{n}": files[p][o : o + n].hex() for p, o, n in WANTS[r]}
            own = sum(n for _, _, n in needed[r])
            assert got["peak"] == got["held_after_fetch"] == own  # exactly what it needs, at once
            assert got["held_after_release"] == 0
            assert got["read"] + got["received"] == own
    shared = [res["iter_0000001/True"] for res in results]
    assert sum(g["read"] for g in shared) == sum(n for _, _, n in union)  # each piece once
    assert sum(g["sent"] for g in shared) == sum(g["received"] for g in shared) > 0
    naive = [res["iter_0000001/False"] for res in results]
    assert sum(g["read"] for g in naive) == sum(n for r in needed for _, _, n in needed[r])
    assert all(g["received"] == g["sent"] == 0 for g in naive)
    # the damaged piece is needed by ranks 1 and 2 only, and read by one of them: all refuse
    for res in results:
        relpath, reason = res["iter_0000002/True"]["refused"]
        assert relpath == "__0_0.distcp" and reason.startswith("sha256 of bytes [6000, 36000)")


def test_write_results_tap_reports_each_piece_and_passes_results_on():
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    class Queue:
        def __init__(self):
            self.items = []

        def put(self, item):
            self.items.append(item)

    def result(path, offset, length):
        return WriteResult(MetadataIndex("k"), length, _StorageInfo(path, offset, length))

    queue = Queue()
    tap = megatron_io.WriteResultsTap(queue)
    written = {
        0: [result("__3_0.distcp", 0, 10), result("__3_0.distcp", 10, 5)],
        1: [result("__3_1.distcp", 0, 7)],
    }
    tap.put(written)
    assert queue.items == [written]  # megatron's finalisation still gets them
    assert tap.pieces() == {"__3_0.distcp": [(0, 10), (10, 5)], "__3_1.distcp": [(0, 7)]}
    failed = megatron_io.WriteResultsTap(Queue())
    failed.put(RuntimeError("worker died"))
    assert failed.pieces() == {}


def test_the_writers_results_queue_is_in_process_and_starts_no_process(monkeypatch):
    """megatron's writer takes its results queue from ``_get_write_results_queue()``: once mega has
    set it, that is an in-process ``queue.Queue`` (put from the writer's thread, read with
    ``get_nowait`` by the finalisation), and getting it starts no process (megatron's own would
    spawn a Manager server importing the rank's ``__main__``)."""
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    before = set(multiprocessing.active_children())
    megatron_io.use_in_process_results_queue()
    results = filesystem_async._get_write_results_queue()
    assert type(results) is queue.Queue and filesystem_async._get_write_results_queue() is results
    results.put({0: ["written"]})
    assert results.get_nowait() == {0: ["written"]}
    assert set(multiprocessing.active_children()) == before


def test_the_writer_runs_in_the_calling_thread_and_writes_what_megatrons_forking_writer_does(
    tmp_path, monkeypatch
):
    """``write_in_this_thread`` against megatron's own ``write_preloaded_data_multiproc`` (which
    forks a writer per bucket) on the same buckets: the same bytes in each file, the same
    (offset, length) per item; and no process started."""
    import io
    import multiprocessing
    import queue
    from functools import partial
    from types import SimpleNamespace

    import torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    def buckets(d):
        torch.manual_seed(0)
        tensors = [
            (WriteItem(MetadataIndex(f"t{i}"), WriteItemType.TENSOR), torch.randn(1000 + i)) for i in range(3)
        ]
        small = [(WriteItem(MetadataIndex("b"), WriteItemType.BYTE_IO), io.BytesIO(b"common state"))]
        return [
            (str(d / "__0_0.distcp"), "__0_0.distcp", (small, tensors[:2])),
            (str(d / "__0_1.distcp"), "__0_1.distcp", ([], tensors[2:])),
        ]

    def run(d, in_thread):
        d.mkdir()
        fn = partial(
            FileSystemWriterAsync.write_preloaded_data_multiproc, [_StorageWriterTransforms()], False
        )
        results = queue.Queue()
        request = SimpleNamespace(async_fn=fn, async_fn_args=[0, buckets(d), results], async_fn_kwargs={})
        if in_thread:
            megatron_io.write_in_this_thread(request)
        else:
            fn(*request.async_fn_args)
        out = results.get_nowait()
        pieces = {
            k: [(r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length) for r in v]
            for k, v in out.items()
        }
        return pieces, {p.name: p.read_bytes() for p in sorted(d.iterdir())}

    forked = run(tmp_path / "forked", in_thread=False)

    def no_fork(self):
        raise AssertionError("a writer process was started")

    monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", no_fork)
    here = run(tmp_path / "here", in_thread=True)
    assert here == forked and len(here[0]) == 2 and len(here[0][0]) == 3
