"""``python -u -m mega.warm.zygote --socket PATH``: a node's fork server. It imports torch,
megatron-core and mega once, then forks every torchrun agent and rank of every attempt on
request, so that a relaunch pays a ``fork()`` (milliseconds) instead of the imports (seconds).

**Design.** The launch backend leases one zygote per node from its process's pool
(mega/launch/local_nodes.py, mega/warm/pool.py) and keeps it across attempts; the pool keeps it for
the process's next run from the same environment. Its stdin is a pipe from the pool: EOF there (the
pool closed it, or the process died) ends the zygote and everything it forked; a line ``log PATH``
sends its output to the log of the run it serves next. A process that should run warm is
started as ``python -u -m mega.warm.client MODULE ARGS`` (the backend does so for the agent,
torchrun for each rank); the client sends argv, environment, working directory and its
stdin/stdout/stderr over a ``SOCK_SEQPACKET`` unix socket (one message each way, fds by
``SCM_RIGHTS``), and the zygote forks a child that becomes ``python -m MODULE ARGS``: it starts a
session of its own (as torchrun's workers do), takes the client's fds, environment and cwd, and
runs the module with ``runpy`` as ``__main__``. The zygote answers the child's pid, then its
exit status; when the client's connection closes first (the client was SIGKILLed), it SIGKILLs
the child's process group. Each child dies with the zygote (``PR_SET_PDEATHSIG``).

``multiprocessing``'s forkserver was the library option: it preloads modules and forks too, but it
is private to the process that started it (its address lives in that process: each new torchrun
worker would start a forkserver of its own, paying the imports again) and it runs a pickled
``Process`` target, not a module with its argv, environment and stdio. This server is a small
standard-library loop with no such coupling, and the client needs no torch import at all.

**Why a fork carries nothing that changes the result.** The zygote only imports (``PRELOAD``): it
runs no torch op, never touches CUDA (``torch.cuda.is_available()`` at import goes through NVML:
``PYTORCH_NVML_BASED_CUDA_CHECK``; functions decorated with ``torch.compile`` while it imports
compile at their first call: ``deferred_compile``), creates no process group, seeds nothing. Before
it serves it checks that it has exactly one native thread (no OpenMP/intra-op pool, no gloo thread:
a fork copies only the forking thread, and a pool's locks would be copied mid-use; numpy's OpenBLAS
pool is shut down by its own fork handler) and that CUDA is not initialised; it refuses to serve
otherwise. Every fork therefore starts from the state a cold process has after the same imports,
and the rank sets up its own RNG seeds, parallel_state, allocator and process groups as a cold one
does. Per-process entropy is renewed in the child: Python's ``random`` reseeds itself at fork,
numpy's global RNG is reseeded from ``os.urandom`` here (a cold process seeds it at import);
torch's default generator still has its fixed import-time seed (no op ran). The rank module itself
runs afresh as ``__main__``. What a fork does share with the zygote: ``PYTHONHASHSEED``'s hash
secret and anything a module read from the environment at import time; the zygote's environment is
therefore the agents' (the backend starts it with the node's environment and ``cluster.env``), and
only the variables set per node, run or attempt (mega.launch.local_nodes.ZYGOTE_UNSET, attempt
number, store, torchrun's ranks) differ, which nothing reads at import. Serving changes nothing a
later fork sees: each fork takes its client's fds, environment and cwd, and the zygote reaps every
child and closes every connection. OpenMP reads ``OMP_NUM_THREADS`` when it loads: the zygote
imports without it and each fork applies its own (``torch.set_num_threads``, torch's rule); numpy's
OpenBLAS keeps the zygote's default pool size. A fork leaves without tearing down the modules
(``_exit``). tests/test_warm.py checks a warm relaunch against a cold one, bit for bit."""

from __future__ import annotations

import argparse
import atexit
import ctypes
import functools
import gc
import importlib
import inspect
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from mega.warm.client import MAX_MESSAGE, failed_path, send

# What every agent and rank imports, eagerly or in its set-up (mega/train.py imports most lazily).
PRELOAD = (
    "mega.train",
    "torch.distributed.run",
    "numpy",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing",
    "mega.model",
    "mega.optim",
    "mega.checkpoint",
    "mega.data.loader",
    "mega.metrics",
    "mega.obs.session",
    "mega.stability.heartbeat",
    "mega.cluster.parallel_groups",
    "mega.cluster.rendezvous",
    "mega.cluster.selfcheck",
    "mega.flops",
    "mega.heldout",
)
PR_SET_PDEATHSIG = 1
# Read once, when OpenMP/MKL load: the zygote imports with the libraries' defaults and each fork
# applies its own value (torch.set_num_threads), as a cold process with that environment has it.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


class NotForkSafe(RuntimeError):
    """The zygote's imports left state a fork must not copy (threads, CUDA)."""


@dataclass
class Request:
    module: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def deferred_compile(real_compile):
    """``torch.compile`` for the zygote's imports: a plain function decorated while importing is
    compiled at its first call (in a fork), by ``real_compile`` with the same arguments.

    Why: megatron-core decorates its fused kernels with ``torch.compile`` at import
    (``megatron.core.jit.jit_fuser``). The decoration alone builds the backend's config, importing
    ``torch._inductor.compile_fx`` and with it ``torch._inductor.runtime.benchmarking``, which on a
    CUDA node (torch 2.11, an H200) starts the CUDA driver: a process whose driver has started
    cannot fork ranks that use CUDA. Compiling is lazy anyway (torch.compile compiles at the first
    call), so the fork runs what a cold process runs. What is not a plain function (a module)
    goes to ``real_compile`` at once. Applied to the default ``PRELOAD`` (the set that imports
    megatron-core); a zygote of other modules imports them as they are."""

    def compile_(model=None, **kwargs):
        if model is None:  # @torch.compile(...) with arguments only
            return lambda fn: compile_(fn, **kwargs)
        if not inspect.isfunction(model):
            return real_compile(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **kwargs)
            return compiled(*args, **kw)

        call.deferred_compile = True
        return call

    return compile_


def preload(modules: tuple[str, ...] = PRELOAD) -> float:
    """Import ``modules``; NotForkSafe if that started a thread or CUDA. Returns the seconds taken."""
    t0 = time.perf_counter()
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # is_available() without initialising CUDA
    for name in THREAD_ENV:
        os.environ.pop(name, None)
    torch = importlib.import_module("torch") if modules == PRELOAD else sys.modules.get("torch")
    real_compile = torch.compile if torch is not None else None
    if torch is not None:
        torch.compile = deferred_compile(real_compile)
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        if torch is not None:
            torch.compile = real_compile
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise NotForkSafe("importing initialised CUDA: a forked rank could not use it")
    # numpy's OpenBLAS starts its pool at import and shuts it down at every fork (pthread_atfork):
    # one throwaway fork, then any thread left belongs to something a fork would copy mid-use
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    if native_threads() != 1:
        raise NotForkSafe(f"importing started {native_threads() - 1} native thread(s): a fork copies one")
    return time.perf_counter() - t0


class Zygote:
    """The serving loop. ``serve()`` returns in a forked child only (its request); in the zygote
    it returns None once its lifeline (stdin) closes, after killing what it forked."""

    def __init__(self, sock_path: str):
        self.sock_path = sock_path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.path.exists(sock_path):
            os.unlink(sock_path)
        self.listener.bind(sock_path)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket | None] = {}  # pid -> its client's connection
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.ending = False
        self.pending = b""  # a lifeline line not yet complete
        self.saved = {s: signal.getsignal(s) for s in (signal.SIGCHLD, signal.SIGTERM)}

    def serve(self) -> Request | None:
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through the wakeup fd
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "ending", True))
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.selector.register(0, selectors.EVENT_READ, "lifeline")
        while not self.ending:
            for key, _ in self.selector.select():
                what = key.data
                if what == "accept":
                    conn, _ = self.listener.accept()
                    self.selector.register(conn, selectors.EVENT_READ, "request")
                elif what == "wake":
                    os.read(self.wake_r, 4096)
                elif what == "lifeline":
                    self._lifeline(os.read(0, 4096))
                elif what == "request":
                    request = self._fork(key.fileobj)
                    if request is not None:
                        return request  # in the child
                else:  # a client's connection after its fork: readable means it closed
                    self._client_gone(what, key.fileobj)
            self._reap()
        self._shutdown()
        return None

    def _lifeline(self, data: bytes) -> None:
        """EOF ends the zygote; a line ``log PATH`` sends its own output to PATH from now on (the
        log of the run it serves next: a process keeps its zygotes between runs, mega/warm/pool.py)."""
        if not data:
            self.ending = True
            return
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            if line.startswith(b"log "):
                try:
                    log = os.open(line[4:], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                except OSError as e:  # serve on, logging where it did
                    print(f"zygote {os.getpid()}: cannot log to {line[4:]!r}: {e}", flush=True)
                    continue
                for fd in (1, 2):
                    os.dup2(log, fd)
                os.close(log)
                print(f"zygote {os.getpid()}: serving again, on {self.sock_path}", flush=True)

    def _fork(self, conn: socket.socket) -> Request | None:
        self.selector.unregister(conn)
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
            msg = json.loads(data)
            request = Request(msg["module"], list(msg["argv"]), dict(msg["env"]), msg["cwd"], fds)
            if len(fds) != 3:
                raise ValueError(f"expected stdin, stdout and stderr, got {len(fds)} fds")
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._refuse(conn, f"bad request: {e}")
            return None
        try:
            pid = os.fork()
        except OSError as e:  # out of memory or processes: this request fails, the zygote serves on
            for fd in fds:
                os.close(fd)
            self._refuse(conn, f"fork failed: {e}")
            return None
        if pid == 0:
            self._become_child(conn)
            return request
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        print(f"zygote: forked {pid}: python -m {request.module}", flush=True)
        try:
            send(conn, {"pid": pid})
            self.selector.register(conn, selectors.EVENT_READ, pid)
        except OSError:  # the client is already gone
            self._client_gone(pid, conn)
        return None

    def _refuse(self, conn: socket.socket, error: str) -> None:
        try:
            send(conn, {"error": error})
        except OSError:
            pass
        conn.close()

    def _client_gone(self, pid: int, conn: socket.socket) -> None:
        """The client died before its child: the child's group goes too (it is a leader: setsid)."""
        self.selector.unregister(conn)
        conn.close()
        self.children[pid] = None
        for kill in (
            os.killpg,
            os.kill,
        ):  # before its setsid the child is in the zygote's group: kill it alone
            try:
                kill(pid, signal.SIGKILL)
                break
            except (ProcessLookupError, PermissionError):
                continue

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                self.selector.unregister(conn)
                try:
                    send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()

    def _shutdown(self) -> None:
        for pid, conn in list(self.children.items()):
            if conn is not None:
                self._client_gone(pid, conn)
        deadline = time.monotonic() + 10
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)
        self.listener.close()
        if os.path.exists(self.sock_path):  # its directory may be gone with the process that owned it
            os.unlink(self.sock_path)

    def _become_child(self, conn: socket.socket) -> None:
        """In the fork: drop everything of the zygote's loop; dies with the zygote."""
        zygote = os.getppid()
        signal.set_wakeup_fd(-1)
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        self.selector.close()
        self.listener.close()
        conn.close()
        for c in self.children.values():
            if c is not None:
                c.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote:  # the zygote died before the prctl took effect
            os._exit(1)


def run_request(request: Request) -> None:
    """In the child: become ``python -m module argv`` with the client's stdio, environment and cwd."""
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    zygote_path = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(request.env)
    sys.path[:] = _sys_path(request.cwd, zygote_path, request.env.get("PYTHONPATH", ""))
    threads = next((request.env[k] for k in THREAD_ENV if request.env.get(k, "").isdigit()), None)
    if threads and "torch" in sys.modules:  # torch's own rule: OMP_NUM_THREADS, else MKL_NUM_THREADS
        sys.modules["torch"].set_num_threads(int(threads))
    if "numpy" in sys.modules:  # seeded from entropy at import in a cold process; a fork's copy is shared
        sys.modules["numpy"].random.seed(int.from_bytes(os.urandom(4), "little"))
    sys.argv = [request.module, *request.argv]
    sys.modules.pop(request.module, None)  # run afresh, as in a cold process (runpy warns of a preloaded one)
    try:
        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _sys_path(cwd: str, zygote_pythonpath: str, pythonpath: str) -> list[str]:
    """``sys.path`` as a cold ``python -m`` with ``pythonpath`` in ``cwd`` would have it: the
    zygote's, with its PYTHONPATH entries replaced (modules it imported from them stay imported)."""

    def entries(value: str) -> list[str]:
        return [os.path.abspath(p) for p in value.split(os.pathsep) if p]

    old = set(entries(zygote_pythonpath))
    rest = [p for p in sys.path[1:] if os.path.abspath(p) not in old]
    return [cwd, *entries(pythonpath), *rest]


def _exit_code(code: object) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """Leave as the interpreter would (non-daemon threads joined, atexit run, stdio flushed) but
    without tearing down every module: in a fork that touches, so copies, the zygote's whole heap
    (seconds on a loaded machine, for nothing)."""
    threading._shutdown()  # what Py_FinalizeEx does first: wait for the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # KeyboardInterrupt: die by SIGINT, as the interpreter does
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A node's fork server for warm agents and ranks.")
    parser.add_argument(
        "--socket", required=True, help="the unix socket to serve on (the clients' MEGA_ZYGOTE_SOCKET)"
    )
    parser.add_argument("--preload", help="comma-separated modules to import instead of the default set")
    args = parser.parse_args(argv)
    try:
        took = preload(tuple(args.preload.split(",")) if args.preload else PRELOAD)
    except Exception as e:
        traceback.print_exc()
        with open(failed_path(args.socket), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n")
        sys.exit(1)
    gc.freeze()  # the imports' objects: never traversed by a fork's collector, so never copied by it
    zygote = Zygote(args.socket)
    print(
        f"zygote {os.getpid()}: imported {len(sys.modules)} modules in {took:.2f} s; serving on {args.socket}",
        flush=True,
    )
    request = zygote.serve()
    if request is None:
        return
    del zygote
    run_request(request)  # the child: raises SystemExit as the module exits, as a cold process would


if __name__ == "__main__":
    main()
