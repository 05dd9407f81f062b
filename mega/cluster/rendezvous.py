"""How the ranks of one job reach the rendezvous store: the launcher side and the rank side.

* ``rendezvous_env(cfg)`` (launcher side): with ``store.kind=redis`` the launcher passes the
  Redis URL (password split off into ``$MEGA_REDIS_PASSWORD``), a job id and the attempt to the
  ranks through the environment, starting a local redis-server for the job when no URL is
  configured; tcp needs nothing (torchrun's store).
* ``init_process_group(cfg)`` (rank side): ``torch.distributed.init_process_group`` over the
  configured store, optionally recording every store operation (``store.record``).
* ``drop_attempt_keys``: an attempt's Redis namespace, deleted once its ranks are gone.
* ``gloo_side_group(cfg)`` (rank side): a gloo group for one thread's own collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from mega import rank_env
from mega.rank_env import REDIS_PASSWORD_ENV

if TYPE_CHECKING:
    from mega.config import MegaConfig

# What a launcher hands its ranks for store.kind=redis (never the config: it is saved to disk)
REDIS_URL_ENV = "MEGA_REDIS_URL"  # the server's URL, without a password
JOB_ID_ENV = "MEGA_JOB_ID"  # one per launch: the store namespace of this job


def new_job_id(cfg: MegaConfig) -> str:
    """A store namespace unique to one launch (layout name, UTC time, random suffix)."""
    layout = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in cfg.parallelism.name)[:64]
    return f"{layout}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def split_redis_password(url: str) -> tuple[str, str | None]:
    """(the URL without its password, the password or None); the user name stays in the URL."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url, None
    user, _, password = userinfo.partition(":")
    return parts._replace(netloc=f"{user}@{hostport}" if user else hostport).geturl(), unquote(password)


def without_secrets(cfg: MegaConfig) -> MegaConfig:
    """cfg with any password removed from store.redis_url: what may be saved next to a run."""
    if cfg.store.redis_url is None:
        return cfg
    public, _ = split_redis_password(cfg.store.redis_url)
    return dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, redis_url=public))


def public_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the store's password: what may go into a script, a manifest or a pickle."""
    return {k: v for k, v in env.items() if k != REDIS_PASSWORD_ENV}


@contextlib.contextmanager
def rendezvous_env(
    cfg: MegaConfig, job_id: str | None = None, host: str = "127.0.0.1"
) -> Iterator[dict[str, str]]:
    """Environment the ranks of one job need to reach the store (``store.kind``), valid inside the block.

    tcp: nothing (ranks use torchrun's store, ``env://``). redis: ``MEGA_REDIS_URL`` (without a
    password), ``MEGA_REDIS_PASSWORD`` when the URL had one, ``MEGA_JOB_ID``; without
    ``store.redis_url`` a local redis-server runs for the block, listening on ``host`` (the
    launch backend's ``server_host``: the bridge address for network-namespace nodes). The
    launcher adds ``MEGA_ATTEMPT`` per launch. Nothing here is printed: the values may be secret.
    """
    if cfg.store.kind != "redis":
        yield {}
        return
    with redis_server_url(cfg, host=host) as url:
        public, password = split_redis_password(url)
        env = {REDIS_URL_ENV: public, JOB_ID_ENV: job_id or new_job_id(cfg)}
        if password is not None:
            env[REDIS_PASSWORD_ENV] = password
        yield env


@contextlib.contextmanager
def redis_server_url(cfg: MegaConfig, host: str = "127.0.0.1") -> Iterator[str]:
    """``store.redis_url``, or the URL of a local redis-server on ``host`` running for the block."""
    s = cfg.store
    if s.redis_url is not None:
        yield s.redis_url
        return
    if not s.start_local_redis:
        raise ValueError(
            "store.redis_url: store.kind=redis needs store.redis_url or store.start_local_redis=true"
        )
    import ipaddress
    import secrets

    from mega.store import RedisServer

    # Beyond loopback (the bridge of network-namespace nodes) Redis refuses clients without a
    # password (protected mode), rightly: the job gets a random one, passed to ranks by env only.
    local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    server = RedisServer(host=host, password=None if local else secrets.token_urlsafe(24)).start()
    try:
        yield server.url
    finally:
        server.stop()


def drop_attempt_keys(store_env: dict[str, str], attempt: int) -> int | None:
    """After an attempt's ranks are gone: delete its store namespace (Redis), so a shared server
    keeps no dead rendezvous keys; returns how many Redis keys went (None for the tcp store, whose
    server ends with torchrun). A restarted attempt never reads them anyway (its own namespace)."""
    url = store_env.get(REDIS_URL_ENV)
    if not url:
        return None
    from mega.store import RedisStore

    store = RedisStore(
        url, job_id=store_env[JOB_ID_ENV], attempt=attempt, password=store_env.get(REDIS_PASSWORD_ENV)
    )
    try:
        return store.drop_namespace()
    finally:
        store.close()


def init_process_group(cfg: MegaConfig, record: bool | None = None):
    """Rank side: ``torch.distributed.init_process_group`` over the store of ``store.kind``.

    tcp: torchrun's store (``env://``). redis: a ``RedisStore`` on ``$MEGA_REDIS_URL`` in the
    namespace of ``$MEGA_JOB_ID`` and ``$MEGA_ATTEMPT``, rank and world size from torchrun.
    Returns the ``RecordingStore`` every store operation goes through when ``record`` (default:
    ``store.record``) is set (``dump_store_traffic`` writes it), else None.
    """
    import torch.distributed as dist

    from mega.cluster.backend_flags import backend_flags

    kind = cfg.store.kind
    backend = backend_flags(cfg).process_group_backend  # on GPUs gloo too, for host tensors
    record = cfg.store.record if record is None else record
    timeout = timedelta(seconds=cfg.cluster.pg_timeout_s)
    if kind != "redis" and not record:
        dist.init_process_group(backend, timeout=timeout)
        return None
    if kind == "redis":
        from mega.store import RedisStore

        url, job_id = os.environ.get(REDIS_URL_ENV), os.environ.get(JOB_ID_ENV)
        if not url or not job_id:
            raise RuntimeError(
                f"store.kind=redis: ${REDIS_URL_ENV} and ${JOB_ID_ENV} are not set; "
                "launch ranks through mega.launch (run_training) or mega.cluster.bootstrap"
            )
        store = RedisStore(url, job_id=job_id, attempt=rank_env.attempt(), timeout=timeout)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        # what init_process_group(init_method="env://") does inside (torchrun's agent store or
        # MASTER_ADDR:MASTER_PORT, then a "default_pg" prefix), so that the recorder sits in between
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        store = dist.PrefixStore("default_pg", store)
    recorder = None
    if record:
        from mega.store.recording import RecordingStore

        store = recorder = RecordingStore(store, rank=rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return recorder


def gloo_side_group(cfg: MegaConfig):
    """A gloo group of every rank for one thread's own collectives (a save's stage 2, the save
    checks, in-memory copies, the rollback verdicts), failing after ``cluster.pg_timeout_s`` as the
    world group does: torch gives a new group its 30-minute default otherwise. Collective."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.cluster.pg_timeout_s))


def dump_store_traffic(cfg: MegaConfig, recorder, part: str) -> Path | None:
    """Write what ``recorder`` saw so far to ``<train.run_dir>/store-traffic/<part>/rank-<r>.json``
    (``mega.store.recording.load_recordings`` reads a directory back); None without a recorder or
    without ``store.record``."""
    if recorder is None or not cfg.store.record:
        return None
    return recorder.dump(Path(cfg.train.run_dir) / "store-traffic" / part)
