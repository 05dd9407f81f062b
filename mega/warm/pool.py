"""The zygotes (mega/warm/zygote.py) of this process, kept between launches: a launch backend
leases one per node and gives it back when it closes, and the next launch from the same
environment (a flow's self-check then its training, a test session's runs) forks from it instead
of paying the imports again (~5 CPU-s per node).

**Why a kept zygote is as good as a new one.** A zygote's state is its imports, made once from
what it was started with: the python executable, the working directory, its environment and the
source files as they were. A zygote is reused only for a launch whose all of these are the same
(``Lease.key``; the source as the newest modification time under ``mega/``), and serving forks
changes nothing a later fork could see: each child's fds, environment and cwd are the client's, the
zygote reaps every child and closes every client connection it accepted. Its output goes to the log
of the run it serves (``log PATH`` on its lifeline).

**Exclusive leases.** A leased zygote serves one backend, so that backend's processes are exactly
its zygotes' descendants (``LocalNodesBackend.processes``); two backends alive at once (the run's
and a self-check beside it) lease two zygotes. An idle zygote belongs to no run: it has no child.
At most ``IDLE_MAX`` wait idle (the least recently used ends first); they end when this process
exits (atexit), or, if it dies, on EOF of their lifeline.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from mega.warm.client import failed_path

IDLE_MAX = 4  # idle zygotes kept (~0.3 GB each): both nodes of two 2-node set-ups
STOP_GRACE_S = 5.0  # lifeline closed -> SIGKILL
KILL_WAIT_S = 20.0


@dataclass
class Lease:
    """A zygote leased to one backend: ``sock`` is its clients' MEGA_ZYGOTE_SOCKET."""

    proc: subprocess.Popen
    sock: str
    key: tuple


def source_stamp() -> int:
    """The newest modification time (ns) of mega's source files: an edit between launches starts
    a new zygote, which imports the edited code as a cold process would."""
    root = Path(__file__).resolve().parents[1]
    return max((p.stat().st_mtime_ns for p in root.rglob("*.py")), default=0)


class ZygotePool:
    def __init__(self, idle_max: int = IDLE_MAX, preload: str | None = None):
        """``preload``: the zygotes' ``--preload`` (default: mega.warm.zygote.PRELOAD)."""
        self.idle_max = idle_max
        self.preload = preload
        self.idle: list[Lease] = []  # least recently used first
        self.leased = 0  # leased and not given back: their sockets live in ``dir``
        self.lock = threading.Lock()
        self.names = itertools.count()
        self.dir: str | None = None  # short: a unix socket path has at most 107 bytes

    def lease(self, env: dict[str, str], log_path: Path, prefix: list[str] | None = None) -> Lease:
        """A zygote started with ``env`` (under ``prefix``, e.g. a network namespace's exec): an idle
        one of the same key, its output now to ``log_path``, else a new one logging there."""
        key = (tuple(prefix or ()), sys.executable, os.getcwd(), tuple(sorted(env.items())), source_stamp())
        with self.lock:
            kept = self._take(key)
            if kept is not None and _move_log(kept, log_path):
                self.leased += 1
                return kept
            if self.dir is None:
                self.dir = tempfile.mkdtemp(prefix="mega-zygote-")
            sock = os.path.join(self.dir, f"{next(self.names)}.sock")
            self.leased += 1
        argv = [*(prefix or []), sys.executable, "-u", "-m", "mega.warm.zygote", "--socket", sock]
        if self.preload:
            argv += ["--preload", self.preload]
        try:
            return Lease(_start(argv, sock, env, log_path), sock, key)
        except BaseException:
            with self.lock:
                self.leased -= 1
            raise

    def _take(self, key: tuple) -> Lease | None:
        """The idle zygote of ``key``, out of the pool (ending the idle ones that died)."""
        dead = [lease for lease in self.idle if lease.proc.poll() is not None]
        self.idle = [lease for lease in self.idle if lease not in dead]
        _stop(dead)  # removes their sockets
        kept = next((lease for lease in self.idle if lease.key == key), None)
        if kept is not None:
            self.idle.remove(kept)
        return kept

    def give_back(self, leases: list[Lease], keep: bool) -> None:
        """The zygotes a backend is done with (it stopped every fork): kept idle if ``keep`` (and
        alive), else ended."""
        with self.lock:
            self.leased -= len(leases)
            alive = [lease for lease in leases if keep and lease.proc.poll() is None]
            self.idle += alive
            surplus = self.idle[: max(0, len(self.idle) - self.idle_max)]
            del self.idle[: len(surplus)]
        _stop([lease for lease in leases if lease not in alive] + surplus)

    def close(self, exiting: bool = False) -> None:
        """End every idle zygote (leased ones end with their backend, or with this process:
        ``exiting`` removes their sockets' directory too; else it stays while one is leased, which
        may not have bound its socket yet)."""
        with self.lock:
            idle, self.idle = self.idle, []
        _stop(idle)
        with self.lock:
            if self.dir is not None and (exiting or not self.leased):
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None


def _start(argv: list[str], sock: str, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    for stale in (sock, failed_path(sock)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        # stdin: its lifeline (EOF when the pool closes it or this process dies); own session: no Ctrl-C
        return subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _move_log(lease: Lease, log_path: Path) -> bool:
    """Send the zygote's output to ``log_path`` from now on; False (and ended) if it died."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lease.proc.stdin.write(f"log {log_path}\n".encode())
        lease.proc.stdin.flush()
        return True
    except OSError:
        _stop([lease])
        return False


def _stop(leases: list[Lease]) -> None:
    """EOF on each zygote's lifeline ends it and its forks; SIGKILL after STOP_GRACE_S."""
    for lease in leases:
        with contextlib.suppress(OSError):
            lease.proc.stdin.close()
    for lease in leases:
        try:
            lease.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            lease.proc.kill()
            lease.proc.wait(timeout=KILL_WAIT_S)
        for stale in (lease.sock, failed_path(lease.sock)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)


POOL = ZygotePool()
atexit.register(POOL.close, exiting=True)
