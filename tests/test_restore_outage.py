"""A restore while the checkpoint store (the session's real SeaweedFS) does not answer, in one
process (a gloo group of one rank: rank 0 reads and broadcasts, as in a job).

* The store stays down: ``restore`` gives up after ``checkpoint.upload_timeout_s`` with an error
  naming the store and that key, having logged one line per retry round.
* In-memory copies (one rank's, a real MemoryCheckpoints) are used without waiting for the store,
  although `latest` (step 4) is newer than they are (step 1): `latest` is unknown.
* The store comes back while the restore waits: the same read of `latest` (and the list of older
  checkpoints) succeeds and returns what the store holds.

The end-to-end save path under an outage is tests/test_checkpoint.py's; both paths wait through
``mega.checkpoint.common.retry_unavailable``.
"""

from __future__ import annotations

import importlib
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from s3_env import hermetic_s3_env

from mega.config import compose
from mega.storage import StorageUnavailable, open_storage

restore_module = importlib.import_module("mega.checkpoint.restore")  # the package exports `restore`
RETRY_S = 0.5


@pytest.fixture(scope="module")
def world(seaweed, tmp_path_factory):
    """The store's credentials in the environment, one gloo rank, and two checkpoints committed
    under a prefix of this module's; the store is running again afterwards."""
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("restore-outage")
    hermetic_s3_env(mp, seaweed, tmp)
    uri = seaweed.uri(f"restore-outage-{uuid.uuid4().hex[:6]}")
    store = open_storage(uri)
    for step in (2, 4):
        local = tmp / f"iter_{step:07d}"
        local.mkdir()
        (local / "mega.json").write_text(f'{{"step": {step}}}')
        store.upload_dir(local, local.name)
    store.write_latest("iter_0000004")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield {"uri": uri, "tmp": tmp}
    finally:
        dist.destroy_process_group()
        mp.undo()
        seaweed.start()


def _cfg(world, timeout_s: float):
    return compose(
        [
            f"checkpoint.storage_uri={world['uri']}",
            f"checkpoint.upload_retry_s={RETRY_S}",
            f"checkpoint.upload_timeout_s={timeout_s}",
            f"train.run_dir={world['tmp'] / 'run'}",
        ]
    )


@pytest.fixture
def retry_lines(monkeypatch):
    """What the waiting rank logs, line by line (and still printed)."""
    lines: list[tuple[float, str]] = []
    printed = restore_module._rank_log

    def keep(message: str) -> None:
        lines.append((time.monotonic(), message))
        printed(message)

    monkeypatch.setattr(restore_module, "_rank_log", keep)
    return lines


def test_restore_gives_up_after_the_upload_timeout_naming_the_store(world, seaweed, retry_lines):
    seaweed.stop()
    cfg = _cfg(world, timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable) as err:
        restore_module.restore(cfg, [], None, None)
    waited = time.monotonic() - t0
    message = str(err.value)
    assert "restore: read `latest`" in message and world["uri"] in message
    assert "checkpoint.upload_timeout_s=1" in message and "giving up" in message
    assert seaweed.endpoint_url in message  # the endpoint, never the keys
    assert seaweed.env()["AWS_SECRET_ACCESS_KEY"] not in message
    assert waited >= 1
    # one line per round: the rounds are at least upload_retry_s apart
    assert retry_lines and all("retrying in 0.5s" in m for _, m in retry_lines)
    times = [t for t, _ in retry_lines]
    assert all(b - a >= RETRY_S for a, b in zip(times, times[1:]))


def test_in_memory_copies_do_not_wait_for_the_store(world, seaweed, retry_lines, monkeypatch):
    from types import SimpleNamespace

    import torch

    from mega.checkpoint import memory as memory_module

    monkeypatch.setattr(memory_module, "layout", lambda: {"tp": 1})  # no megatron groups here

    seaweed.stop()
    cfg = _cfg(world, timeout_s=60)
    cfg.checkpoint.memory_dir = str(world["tmp"] / "shm")
    model = torch.nn.Linear(8, 8)
    scheduler = SimpleNamespace(state_dict=dict, load_state_dict=lambda state: None)
    # what a copy reads of megatron's DistributedOptimizer (no optimizer shard of its own here)
    optimizer = SimpleNamespace(
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        model_param_group_index_map={},
        state_dict=dict,
        load_state_dict=lambda state: None,
    )
    memory = memory_module.MemoryCheckpoints(cfg, [model], optimizer, scheduler)
    try:
        memory.copy(1)
        memory._idle.wait(10)
        copied = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.zero_()
        t0 = time.monotonic()
        step, info = restore_module.restore(cfg, [model], None, scheduler, memory=memory)
        assert time.monotonic() - t0 < 45  # the store's own quick attempts, not upload_timeout_s
    finally:
        memory.close()
    assert step == 1 and info["source"] == "memory"
    assert torch.equal(model.weight, copied)
    assert not retry_lines  # nothing waited for the store


def test_restore_waits_for_the_store_and_reads_latest_once_it_is_back(world, seaweed, retry_lines):
    seaweed.stop()
    cfg = _cfg(world, timeout_s=60)
    store = restore_module.open_store(cfg)
    back: dict = {}

    def bring_back() -> None:
        deadline = time.monotonic() + 60
        while not retry_lines and time.monotonic() < deadline:
            time.sleep(0.05)
        back["waiting_seen"] = bool(retry_lines)
        seaweed.start()
        back["at"] = time.monotonic()

    thread = threading.Thread(target=bring_back)
    thread.start()
    try:
        candidates = restore_module._candidates(store, print, restore_module._waiting(cfg, store))
    finally:
        thread.join()
    assert back["waiting_seen"], "the restore never waited for the store"
    assert candidates == ["iter_0000004", "iter_0000002"]  # `latest`, then the older complete one
    assert all("restore: read `latest`: store unavailable" in m for _, m in retry_lines)


@pytest.fixture
def black_hole():
    """An S3 endpoint that accepts connections and never answers (a hung server, a dead proxy):
    ``url``, and ``held``, the connections it accepted."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{server.getsockname()[1]}", held=held)
    stop.set()
    thread.join()
    for s in [server, *held]:
        s.close()


def test_a_store_that_never_answers_ends_the_wait_within_its_bound(world, black_hole, retry_lines):
    """Each request to the store is bounded (checkpoint.s3_timeout_s per socket wait, s3_attempts
    tries), so the restore gives up within checkpoint.store_wait_bound_s(), as configured."""
    cfg = _cfg(world, timeout_s=1)
    cfg.checkpoint.s3_endpoint_url = black_hole.url
    cfg.checkpoint.s3_timeout_s, cfg.checkpoint.s3_attempts = 1.0, 2
    bound = cfg.checkpoint.store_wait_bound_s()
    assert bound == 1 + 2 * (5 + 1) + 1  # upload_timeout_s + 2 x (connect + socket timeout) + back-off
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable) as err:
        restore_module.restore(cfg, [], None, None)
    waited = time.monotonic() - t0
    assert "ReadTimeout" in str(err.value) and black_hole.url in str(err.value)
    assert 2 <= waited < bound, waited  # two 1 s socket waits at least; botocore's defaults: 300 s


def test_an_s3_request_is_tried_s3_attempts_times_in_all(black_hole, monkeypatch, tmp_path):
    """checkpoint.s3_attempts counts every try of a request, the first included, as the store
    wait's bound (s3_request_bound_s) does: a store that never answers is connected to that many
    times (botocore's own ``max_attempts`` counts retries after the first)."""
    from mega.checkpoint.common import open_store

    hermetic_s3_env(
        monkeypatch,
        SimpleNamespace(env=lambda: {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}),
        tmp_path,
    )
    over = ["checkpoint.storage_uri=s3://bucket/run", f"checkpoint.s3_endpoint_url={black_hole.url}"]
    cfg = compose([*over, "checkpoint.s3_timeout_s=0.5", "checkpoint.s3_attempts=2"])
    with pytest.raises(StorageUnavailable, match="after 2 attempts"):
        open_store(cfg).read_latest()
    assert len(black_hole.held) == 2


def test_a_chain_of_store_operations_waits_one_upload_timeout_in_all(world, black_hole):
    """A checkpoint's store operations (upload, commit, `latest`, retention) share one wait budget
    (``StoreWait``): after the store did not answer for a while during the first, the next one
    waits only what is left of ``checkpoint.upload_timeout_s``, so the chain ends within one bound."""
    import copy

    from mega.checkpoint.common import StoreWait, open_store, retry_unavailable

    cfg = _cfg(world, timeout_s=2)
    cfg.checkpoint.s3_timeout_s, cfg.checkpoint.s3_attempts = 0.2, 1
    silent_cfg = copy.deepcopy(cfg)
    silent_cfg.checkpoint.s3_endpoint_url = black_hole.url
    store, silent = open_store(cfg), open_store(silent_cfg)
    down = [True]
    timer = threading.Timer(1.0, lambda: down.__setitem__(0, False))  # the store answers again at 1 s
    timer.start()
    wait, lines = StoreWait(), []

    def read_latest():
        return (silent if down[0] else store).read_latest()

    assert retry_unavailable(cfg.checkpoint, store, "commit", read_latest, lines.append, wait=wait) == (
        "iter_0000004"
    )
    assert wait.unanswered_s >= 1.0 and lines
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable, match=r"unavailable for (2|3)\.\ds") as err:
        retry_unavailable(cfg.checkpoint, store, "`latest`", silent.read_latest, lines.append, wait=wait)
    waited = time.monotonic() - t0
    assert waited < 1.5, waited  # what was left of the 2 s, not 2 s of its own
    assert "`latest`" in str(err.value) and "checkpoint.upload_timeout_s=2" in str(err.value)


def _rank0_error_worker(rank: int, port: int, out: str) -> None:
    import json
    import os
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    try:
        restore_module._on_rank0(lambda: json.loads("{not json"))
        got = "no error"
    except Exception as e:
        got = f"{type(e).__name__}: {e}"
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(got)
    dist.destroy_process_group()


def test_an_error_of_rank_0_that_is_no_storage_error_reaches_every_rank(tmp_path, free_port):
    """rank 0's own error (here a `latest` that is no JSON) is raised on rank 0 as it is and on
    rank 1 as an error naming it, within the same broadcast: no rank waits for a rank 0 gone."""
    import torch.multiprocessing as mp

    mp.spawn(_rank0_error_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    assert rank0.startswith("JSONDecodeError: Expecting property name")
    assert rank1 == f"RuntimeError: restore: rank 0 failed: {rank0}"
