"""A throwaway local ``redis-server`` for tests and single-node runs.

``RedisServer`` binds 127.0.0.1 on a free port, keeps everything in a temporary directory (no RDB
snapshots, no AOF: a rendezvous store is rebuilt by every job attempt, never restored), and returns
from ``start()`` only once the server answers PING. Options, the password included, go through a
config file readable only by its owner, never through the command line (``ps`` would show it).

``parse_redis_url``/``redact_url`` read and print redis:// URLs without importing torch (config
validation uses them) and without ever showing a password.

The binary comes from Debian's ``redis-server`` package (``infra/install.sh`` installs it when
missing); ``find_redis_server`` says how to get it when it is absent.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mega.ports import free_ports

INSTALL_HINT = "install it with `apt-get install redis-server` (infra/install.sh does this when run as root)"


class RedisServerError(RuntimeError):
    """The local redis-server could not be found or started."""


# ---------------------------------------------------------------------------------------------
# URL handling (here, not in redis_store: config validation uses it without importing torch)


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (safe to log or put in an error)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable redis url>"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return parts._replace(netloc=f"{user}:***@{hostport}").geturl()


def parse_redis_url(url: str) -> dict[str, Any]:
    """redis://[user[:password]@]host[:port][/db] (rediss:// = TLS) -> connection fields.

    Raises ValueError naming what is wrong; the message never contains the password.
    """
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a bad port
    except ValueError as err:
        raise ValueError(f"not a redis URL ({err}): {redact_url(url)}") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"scheme must be redis:// or rediss://, got {redact_url(url)}")
    if not parts.hostname:
        raise ValueError(f"no host in {redact_url(url)}")
    db_text = parts.path.lstrip("/") or "0"
    if not db_text.isdigit():
        raise ValueError(f"database must be a number, got {db_text!r} in {redact_url(url)}")
    return {
        "host": parts.hostname,
        "port": port or 6379,
        "db": int(db_text),
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password is not None else None,
        "ssl": parts.scheme == "rediss",
    }


# ---------------------------------------------------------------------------------------------
# Local server


def find_redis_server() -> str:
    """Path of the ``redis-server`` binary (``MEGA_REDIS_SERVER`` overrides PATH lookup)."""
    path = os.environ.get("MEGA_REDIS_SERVER") or shutil.which("redis-server")
    if not path:
        raise RedisServerError(f"redis-server not found on PATH; {INSTALL_HINT}")
    return path


class RedisServer:
    """One local redis-server process; also a context manager (``with RedisServer() as srv``).

    ``password`` turns on ``requirepass`` (the default user); ``port=0`` picks a free one (retried
    when another process takes it between the probe and the bind).
    """

    def __init__(
        self,
        port: int = 0,
        *,
        host: str = "127.0.0.1",
        password: str | None = None,
        maxclients: int = 10000,
        startup_timeout_s: float = 10.0,
        extra_config: dict | None = None,
    ):
        self.host = host
        self.port = port
        self._password = password
        self._maxclients = maxclients
        self._startup_timeout_s = startup_timeout_s
        self._extra = dict(extra_config or {})
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None

    # -- addresses -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """redis://[:password@]host:port/0 -- contains the password: pass it on, never log it."""
        auth = f":{self._password}@" if self._password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def address(self) -> str:
        """host:port, safe to log."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The redis-server process (drills SIGSTOP it: a server that answers nothing)."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer({self.address}, {state}{', password set' if self._password else ''})"

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> RedisServer:
        if self.running:
            return self
        binary = find_redis_server()
        fixed_port = self.port
        last_error = ""
        for _ in range(1 if fixed_port else 5):  # a free port can be taken before redis binds it
            port = fixed_port or free_ports(1, self.host)[0]
            self._dir = Path(tempfile.mkdtemp(prefix="mega-redis-"))
            conf = self._dir / "redis.conf"
            conf.touch(mode=0o600)
            conf.write_text(self._config(port))
            self._proc = subprocess.Popen(
                [binary, str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            # (same process group: a Ctrl-C or a kill of our group stops it too, nothing leaks)
            self.port = port
            try:
                self._wait_ready()
            except RedisServerError as err:
                last_error = str(err)
                self.stop()
                self.port = fixed_port
                if "Address already in use" not in last_error:
                    break
                continue
            _LIVE.add(self)
            return self
        raise RedisServerError(last_error)

    def _config(self, port: int) -> str:
        lines = {
            "bind": self.host,
            "port": str(port),
            "protected-mode": "yes",
            "daemonize": "no",
            "dir": str(self._dir),
            "save": '""',  # no RDB snapshots
            "appendonly": "no",
            "logfile": str(self._dir / "redis.log"),
            "loglevel": "warning",
            "maxclients": str(self._maxclients),
            "tcp-backlog": "511",
        }
        if self._password:
            # quoted: redis.conf takes a double-quoted string with backslash escapes
            lines["requirepass"] = '"' + self._password.replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.update({k: str(v) for k, v in self._extra.items()})
        return "".join(f"{k} {v}\n" for k, v in lines.items())

    def _log_tail(self) -> str:
        try:
            text = (self._dir / "redis.log").read_text(errors="replace") if self._dir else ""
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-3:])

    def _wait_ready(self) -> None:
        import redis

        deadline = time.monotonic() + self._startup_timeout_s
        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self._password,
            socket_connect_timeout=0.5,
            socket_timeout=1.0,
        )
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RedisServerError(
                        f"redis-server on {self.address} exited with code "
                        f"{self._proc.returncode}: {self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"redis-server on {self.address} did not answer PING within "
                        f"{self._startup_timeout_s:g} s: {self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()  # SIGTERM: redis exits at once (nothing to save)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        _LIVE.discard(self)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_LIVE: set[RedisServer] = set()


@atexit.register
def _stop_all() -> None:  # never leave a redis-server behind when the interpreter exits
    for server in list(_LIVE):
        server.stop()
