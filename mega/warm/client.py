"""``python -u -m mega.warm.client MODULE [ARGS...]``: run ``python -m MODULE ARGS`` as a fork of
this node's zygote (mega/warm/zygote.py) and behave, to whoever started this client, as if it
were that process.

torchrun (and the launch backend, for the agent itself) starts this client in place of the real
process. It imports the standard library only (~30 ms), sends the zygote its argv, environment,
working directory and stdin/stdout/stderr (``socket.send_fds``), and then:

* relays the signals a supervisor sends (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT) to
  the forked process, whose pid the zygote answers with;
* exits as the forked process did: its exit code, or killed by the same signal (torchrun and the
  driver read ``-N`` as "killed by signal N");
* when there is no zygote to fork from (it could not start: ``NotForkSafe``; it died; it never
  came within ``MEGA_ZYGOTE_WAIT_S``), becomes the process itself (exec), started cold;
* if the client itself is SIGKILLed, the zygote sees its connection close and SIGKILLs the forked
  process's group: nothing outlives its client;
* runs ``watch(pid, env)`` of the module ``$MEGA_CLIENT_HOOK`` names, if any, for the forked
  process: a run with heartbeats names mega.stability.liveness, which reports a rank's process
  state to the heartbeat Redis (the node's witness of whether a silent rank runs at all).

The forked process gets ``MEGA_AGENT_PID`` (this client's parent: for a rank, its torchrun
agent) since its own parent is the zygote. Drills that strike "the rank" use the pid the rank
records itself (mega.cluster.node.record_process), never this client's.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time

from mega import rank_env

SOCKET_ENV = "MEGA_ZYGOTE_SOCKET"  # the node's zygote's unix socket (set by the launch backend)
PID_ENV = "MEGA_ZYGOTE_PID"  # its pid: a client stops waiting for a zygote that died
WAIT_ENV = "MEGA_ZYGOTE_WAIT_S"  # how long to wait for the zygote to finish its imports
AGENT_PID_ENV = rank_env.AGENT_PID_ENV
DEFAULT_WAIT_S = 300.0
MAX_MESSAGE = 1 << 20
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def failed_path(sock_path: str) -> str:
    """Where a zygote that could not start writes why (the clients waiting for it read it)."""
    return sock_path + ".failed"


def send(conn: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.send(data)


def connect(sock_path: str, wait_s: float, pid: int | None = None) -> socket.socket:
    """Connect to the zygote, waiting while it imports; RuntimeError when it failed, died (``pid``)
    or never came."""
    deadline = time.monotonic() + wait_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(sock_path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
        if os.path.exists(failed_path(sock_path)):
            with open(failed_path(sock_path)) as f:
                raise RuntimeError(f"the zygote at {sock_path} failed to start: {f.read().strip()}")
        if pid is not None and not os.path.exists(f"/proc/{pid}"):
            raise RuntimeError(f"the zygote at {sock_path} (pid {pid}) is not running")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no zygote answered at {sock_path} within {wait_s:g} s ({WAIT_ENV})")
        time.sleep(0.02)


def run_cold(module: str, args: list[str], why: str) -> None:
    """No zygote to fork from (it could not start, died, or never came): become ``python -m module
    args`` in this process (exec: same pid, environment and stdio), as a cold launch would have
    started it. A warm process is only faster; without one the run goes on. Said once per node
    (by the agent's client and local rank 0's), not by every rank."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"mega.warm.client: {why}; starting python -m {module} cold", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-u", "-m", module, *args])


def run(module: str, args: list[str]) -> int:
    """Have the zygote fork ``python -m module args``; return its exit code (-N: signal N)."""
    sock_path = os.environ.get(SOCKET_ENV)
    if not sock_path:
        raise RuntimeError(f"{SOCKET_ENV} is not set: this client runs under a launch backend's zygote")
    pid = os.environ.get(PID_ENV)
    try:
        conn = connect(sock_path, float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S)), int(pid) if pid else None)
    except RuntimeError as e:
        run_cold(module, args, str(e))
    env = {**os.environ, AGENT_PID_ENV: str(os.getppid())}
    # Relayed from the loop, not from a handler: Python runs a handler only between bytecodes, so
    # a signal landing just before a blocking recv() would wait out the recv (the fork's exit, which
    # that signal was to cause). The wakeup fd gets the signal's number the moment it lands.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    for sig in RELAYED:
        signal.signal(sig, lambda *_: None)
    send(conn, {"module": module, "argv": args, "env": env, "cwd": os.getcwd()}, [0, 1, 2])
    waiting = selectors.DefaultSelector()
    waiting.register(conn, selectors.EVENT_READ)
    waiting.register(wake_r, selectors.EVENT_READ)
    child: int | None = None
    pending = bytearray()  # signals not yet relayed: they came before the fork's pid
    while True:
        for key, _ in waiting.select():
            if key.fileobj == wake_r:
                pending += os.read(wake_r, 4096)
                continue
            data = conn.recv(MAX_MESSAGE)
            if not data:
                print(f"mega.warm.client: the zygote at {sock_path} closed the connection", file=sys.stderr)
                return 1
            reply = json.loads(data)
            if "pid" in reply:
                child = reply["pid"]
                _watch(child, env)
            elif "error" in reply:
                print(f"mega.warm.client: {reply['error']}", file=sys.stderr)
                return 1
            elif "exit" in reply:
                return reply["exit"]
        if child is not None:
            for sig in pending:
                try:
                    os.kill(child, sig)
                except ProcessLookupError:
                    pass
            pending.clear()


def _watch(child: int, env: dict[str, str]) -> None:
    """Start ``$MEGA_CLIENT_HOOK``'s witness of the forked process, if one is named."""
    if hook := env.get(rank_env.CLIENT_HOOK_ENV):
        try:
            importlib.import_module(hook).watch(child, env)
        except Exception as e:  # a witness that cannot start costs the run nothing
            print(f"mega.warm.client: {hook}.watch failed: {type(e).__name__}: {e}", file=sys.stderr)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m mega.warm.client MODULE [ARGS...]")
    try:
        code = run(sys.argv[1], sys.argv[2:])
    except RuntimeError as e:
        sys.exit(f"mega.warm.client: {e}")
    if code < 0:  # killed by a signal: so is this client, for whoever waits on it
        sys.stdout.flush()
        if -code in RELAYED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        code = 128 - code  # a signal whose default is not to end a process: the shell's convention
    sys.exit(code)


if __name__ == "__main__":
    main()
