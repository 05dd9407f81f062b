"""Where heartbeats go: the Redis of the run, its key names and the environment that hands it to
the ranks. Both sides (ranks, driver) use these; neither may ever block on Redis for long.

Keys of one attempt: ``<prefix>:<attempt>:id:<rank>`` (a rank's identity, written once),
``<prefix>:<attempt>:hb:<rank>`` (its latest heartbeat, with expiry) and
``<prefix>:<attempt>:proc:<rank>`` (its process state as its node sees it,
mega.stability.liveness). ``<prefix>`` is unique per driver launch (on Kubernetes: per run), so one
Redis can serve many runs. The other direction, for a watcher that cannot stop the ranks itself
(mega/launch/incluster_watch.py): ``stop_key`` tells every rank of an attempt to exit with
``RESTART_EXIT_CODE``; ``generation_key`` numbers the next.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

URL_ENV = "MEGA_HEARTBEAT_URL"  # redis:// URL without a password (logged nowhere anyway)
PASSWORD_ENV = "MEGA_HEARTBEAT_PASSWORD"
PREFIX_ENV = "MEGA_HEARTBEAT_PREFIX"
INTERVAL_ENV = "MEGA_HEARTBEAT_S"  # stability.heartbeat_s, for the ranks' warm clients (liveness)
TIMEOUT_S = 0.5  # every Redis call of a heartbeat or the watcher: connect and read bounded by this


RESTART_EXIT_CODE = (
    86  # a rank told by the watcher to end a hung attempt; the cluster relaunches from `latest`
)


def stop_key(prefix: str, attempt: int) -> str:
    """The watcher's order to every rank of ``attempt``: exit with ``RESTART_EXIT_CODE`` (JSON: reason, evict)."""
    return f"{prefix}:{attempt}:stop"


def generation_key(prefix: str) -> str:
    """The attempt the next pods start as: one past the last attempt the watcher stopped."""
    return f"{prefix}:generation"


def id_key(prefix: str, attempt: int, rank: int) -> str:
    return f"{prefix}:{attempt}:id:{rank}"


def beat_key(prefix: str, attempt: int, rank: int) -> str:
    return f"{prefix}:{attempt}:hb:{rank}"


def proc_key(prefix: str, attempt: int, rank: int) -> str:
    """A rank's process state as its node's warm client reads it (mega/stability/liveness.py)."""
    return f"{prefix}:{attempt}:proc:{rank}"


def client(url: str, password: str | None = None):
    """A redis-py client whose every call gives up after TIMEOUT_S (no retries): a heartbeat is
    dropped, never waited for."""
    import redis

    from mega.store.redis_server import parse_redis_url

    p = parse_redis_url(url)
    return redis.Redis(
        host=p["host"],
        port=p["port"],
        db=p["db"],
        username=p["username"],
        password=password if password is not None else p["password"],
        ssl=p["ssl"],
        socket_connect_timeout=TIMEOUT_S,
        socket_timeout=TIMEOUT_S,
        retry=None,
        health_check_interval=0,
    )


def client_from_env(env: dict[str, str] | None = None):
    """(client, prefix) from the heartbeat environment, or (None, None) when heartbeats are off."""
    env = os.environ if env is None else env
    if not env.get(URL_ENV):
        return None, None
    return client(env[URL_ENV], env.get(PASSWORD_ENV)), env[PREFIX_ENV]


@contextlib.contextmanager
def heartbeat_env(cfg, store_env: dict[str, str], host: str = "127.0.0.1") -> Iterator[dict[str, str]]:
    """Environment that points the ranks at the heartbeat Redis, valid inside the block.

    ``store.kind=redis``: the store's server (``store_env`` from ``rendezvous_env``). Otherwise
    ``store.redis_url`` when set, else a local redis-server started for the block on ``host``
    (mega.cluster.rendezvous.redis_server_url). Empty when ``stability.enabled`` is off or no
    Redis may be started (``store.start_local_redis=false`` without a URL).
    """
    from mega import rank_env
    from mega.cluster import rendezvous

    s = cfg.store
    prefix = f"mega:hb:{secrets.token_hex(6)}"
    # the ranks' warm clients report their process state (mega.stability.liveness) every heartbeat
    witness = {
        INTERVAL_ENV: str(cfg.stability.heartbeat_s),
        rank_env.CLIENT_HOOK_ENV: "mega.stability.liveness",
    }
    if not cfg.stability.enabled or (s.kind != "redis" and s.redis_url is None and not s.start_local_redis):
        yield {}
        return
    if store_env.get(rendezvous.REDIS_URL_ENV):
        env = {URL_ENV: store_env[rendezvous.REDIS_URL_ENV], PREFIX_ENV: prefix, **witness}
        if store_env.get(rank_env.REDIS_PASSWORD_ENV):
            env[PASSWORD_ENV] = store_env[rank_env.REDIS_PASSWORD_ENV]
        yield env
        return
    with rendezvous.redis_server_url(cfg, host=host) as url:
        public, password = rendezvous.split_redis_password(url)
        env = {URL_ENV: public, PREFIX_ENV: prefix, **witness}
        if password is not None:
            env[PASSWORD_ENV] = password
        yield env
