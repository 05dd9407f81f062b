"""Local backends: ``launcher=local`` (one torchrun agent) and ``launcher=local-nodes`` (one agent
per node on this machine, each with its node rank; optionally each in its own network namespace).

**Killing a node.** torch's elastic agent starts every worker in a session of its own
(``SubprocessHandler``: ``start_new_session=True``), so killing an agent's process group leaves
its ranks running, and an agent that dies (SIGKILL) orphans them. Every process of a job therefore
carries a mark in its environment, ``MEGA_JOB_MARK=<job token>/<node>``, which the agents pass to
their ranks and the ranks to whatever they start (the checkpoint writer's helpers). ``stop()``
finds the marked processes in ``/proc``, signals each one's process group (SIGTERM, then SIGKILL
after a grace period) and returns only when none is left, however the job ended: a rank's own
session, an orphan of a dead agent, a helper of a rank.

**Warm processes** (``launcher.warm_processes``, the default): each node has a zygote
(mega/warm/zygote.py), leased from this process's pool (mega/warm/pool.py) on the first attempt
and held until ``close()``, which gives it back (``launcher.keep_zygotes``: kept for the next
launch); the agents and ranks of every attempt are its forks. A fork's ``/proc/<pid>/environ`` is
the zygote's (no job mark), so ``processes()`` also counts every descendant of the zygotes: a
leased zygote serves this backend's one running job only.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING

from mega import procstat
from mega.cluster.node import NODE_ADDR_ENV, RANKS_ON_HOST_ENV
from mega.launch.backend import JobSpec, agent_argv
from mega.launch.runs import pid_alive
from mega.ports import free_ports
from mega.warm import client as warm_client
from mega.warm import pool as warm_pool

if TYPE_CHECKING:
    from mega.config import MegaConfig
    from mega.launch.netns import NetnsNetwork

MARK_ENV = "MEGA_JOB_MARK"
TERM_GRACE_S = 5.0  # SIGTERM -> SIGKILL
KILL_WAIT_S = 20.0  # after SIGKILL: a process still there by then is stuck in the kernel
NETNS_RDZV_PORT = 29500  # node 0's namespace is empty: any fixed port is free there
# Not in a zygote's environment (its forks get theirs from their client): set per node, launch or
# test, and read by functions at run time, never at import (pytest names the running test).
ZYGOTE_UNSET = (MARK_ENV, NODE_ADDR_ENV, RANKS_ON_HOST_ENV, "PYTEST_CURRENT_TEST")


class StopFailed(RuntimeError):
    """Processes of a job survived SIGKILL (stuck in uninterruptible sleep); names them."""


def marked_processes(token: str) -> dict[int, int]:
    """pid -> node of every live process whose environment carries job ``token``'s mark."""
    needle = f"{MARK_ENV}={token}/".encode()
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes()  # empty for zombies and kernel threads
        except OSError:
            continue
        start = environ.find(needle)
        if start >= 0 and (start == 0 or environ[start - 1] == 0):
            value = environ[start + len(needle) :].split(b"\0", 1)[0]
            found[int(proc.name)] = int(value) if value.isdigit() else -1
    return found


def descendants(roots: list[int]) -> set[int]:
    """Every live process below ``roots`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        stat = procstat.read(int(proc.name))
        if stat is not None and stat.state != "Z":  # a zombie is gone; its parent reaps it
            children.setdefault(stat.ppid, []).append(int(proc.name))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for pid in children.get(todo.pop(), []):
            if pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def _signal_groups(pids: list[int], sig: signal.Signals) -> None:
    """Signal each process's group (ranks lead their own), and the process itself. SIGTERM is
    followed by SIGCONT: a stopped process (a SIGSTOPped rank) acts on it now, not after the grace."""
    own = os.getpgid(0)
    for pid in pids:
        for s in (sig, signal.SIGCONT) if sig == signal.SIGTERM else (sig,):
            try:
                pgid = os.getpgid(pid)
                if pgid != own:
                    os.killpg(pgid, s)
                os.kill(pid, s)
            except (ProcessLookupError, PermissionError):
                pass


class LocalNodesBackend:
    """``cluster.nodes`` torchrun agents on this machine; node 0 hosts the rendezvous store."""

    def __init__(self, cfg: MegaConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.nodes = cfg.cluster.nodes
        self.network: NetnsNetwork | None = None
        if cfg.launcher.name == "local-nodes" and cfg.launcher.local_nodes.netns:
            from mega.launch import netns

            ln = cfg.launcher.local_nodes
            self.network = netns.NetnsNetwork(netns.plan(ln.subnet, self.nodes)).create()
            try:
                if ln.link_mbit is not None:
                    for k in range(self.nodes):
                        self.network.shape(k, ln.link_mbit)
            except BaseException:
                self.network.close()
                raise
        # servers the nodes need listen here (a namespace's loopback is its own)
        self.server_host = self.network.bridge_address if self.network else cfg.cluster.master_addr
        self.token: str | None = None
        # a command each agent runs under (the pod entry, mega.launch.pod, as a cluster's pods do)
        self.agent_prefix: list[str] = []
        self._agents: dict[int, subprocess.Popen] = {}
        self._logs: list[IO[bytes]] = []
        self.warm = cfg.launcher.warm_processes
        self._zygotes: dict[int, warm_pool.Lease] = {}

    # -- addresses -------------------------------------------------------------------------------

    def node_address(self, node: int) -> str:
        return self.network.address(node) if self.network else self.cfg.cluster.master_addr

    def _master(self) -> tuple[str, int]:
        if self.network:
            return self.network.address(0), self.cfg.launcher.rdzv_port or NETNS_RDZV_PORT
        addr = self.cfg.cluster.master_addr
        return addr, self.cfg.launcher.rdzv_port or free_ports(1, addr)[0]

    # -- Backend ---------------------------------------------------------------------------------

    def start(self, job: JobSpec) -> None:
        if self._agents:
            raise RuntimeError("a job is still running on these nodes: stop() it first")
        self.token = uuid.uuid4().hex[:12]
        addr, port = self._master()
        try:
            for k in range(self.nodes):
                self._start_agent(k, addr, port, job)
        except BaseException:
            self.stop()
            raise

    def _node_env(self, k: int) -> dict[str, str]:
        """What every process of node k has in its environment, whatever the job."""
        env = {
            **os.environ,
            NODE_ADDR_ENV: self.node_address(k),
            RANKS_ON_HOST_ENV: str(self.cfg.cluster.world_size),
        }  # local nodes share this machine's cores
        env.pop(MARK_ENV, None)
        return {**env, **(self.network.env(k) if self.network else {})}

    def _start_agent(self, k: int, addr: str, port: int, job: JobSpec) -> None:
        log_path = job.log_path(k, self.nodes)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**self._node_env(k), **job.env, MARK_ENV: f"{self.token}/{k}"}
        if self.warm and self._zygote_failed(k):
            # its clients started cold and said why (the attempt's log): every later attempt of
            # this launch starts cold at once, not after another zygote's imports fail again
            self.warm = False
            self._release_zygotes(keep=False)
        if self.warm:
            env[warm_client.SOCKET_ENV] = self._zygote(k)
            env[warm_client.PID_ENV] = str(self._zygotes[k].proc.pid)
        argv = self.agent_prefix + agent_argv(self.cfg, k, addr, port, job, warm=self.warm)
        if self.network:
            argv = self.network.exec_prefix(k) + argv
        log = open(log_path, "ab")
        self._logs.append(log)
        # own session: a Ctrl-C of the driver's terminal does not reach the agents half-way
        self._agents[k] = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def poll(self) -> dict[int, int | None]:
        return {k: p.poll() for k, p in self._agents.items()}

    def wait_exit(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, returning at once when an agent of the job exits (pidfds)."""
        poller, fds = select.poll(), []
        try:
            for p in self._agents.values():
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        fds.append(os.pidfd_open(p.pid))
                        poller.register(fds[-1], select.POLLIN)
            if fds:
                poller.poll(timeout_s * 1000)
            else:
                time.sleep(timeout_s)
        finally:
            for fd in fds:
                os.close(fd)

    def agent_pids(self) -> dict[int, int]:
        """Node -> pid of its torchrun agent (the running job's)."""
        return {k: p.pid for k, p in self._agents.items()}

    def processes(self) -> dict[int, int]:
        """pid -> node of every live process of the running job (agents, ranks, their helpers)."""
        found = marked_processes(self.token) if self.token else {}
        for k, zygote in self._zygotes.items():  # a fork's environ is its zygote's: no mark
            found.update(dict.fromkeys(descendants([zygote.proc.pid]) - set(found), k))
        return found

    # -- warm processes --------------------------------------------------------------------------

    def _zygote(self, k: int) -> str:
        """Node k's zygote socket; leases one from this process's pool (mega/warm/pool.py) unless
        node k holds a live one. The first clients of a new one wait for its imports
        (mega.warm.client.WAIT_ENV)."""
        lease = self._zygotes.get(k)
        if lease is not None and lease.proc.poll() is None:
            return lease.sock
        if lease is not None:
            warm_pool.POOL.give_back([self._zygotes.pop(k)], keep=False)
        log_path = (self.run_dir / "nodes" / str(k) if self.nodes > 1 else self.run_dir) / "zygote.log"
        prefix = self.network.exec_prefix(k) if self.network else []
        self._zygotes[k] = warm_pool.POOL.lease(self._zygote_env(k), log_path, prefix)
        return self._zygotes[k].sock

    def _zygote_failed(self, k: int) -> bool:
        """Node k's zygote could not start (``NotForkSafe``: it wrote why and exited)."""
        lease = self._zygotes.get(k)
        return lease is not None and os.path.exists(warm_client.failed_path(lease.sock))

    def _zygote_env(self, k: int) -> dict[str, str]:
        """The node's environment with ``cluster.env``, less what varies per node, launch or test
        and is read at run time only (ZYGOTE_UNSET): one zygote serves any node and run of this
        process with the same environment; its forks get their own values."""
        env = {**self._node_env(k), **self.cfg.cluster.env, "PYTHONUNBUFFERED": "1"}
        for name in ZYGOTE_UNSET:
            env.pop(name, None)
        return env

    def _release_zygotes(self, keep: bool) -> None:
        """Give the nodes' zygotes back to the pool: kept for the next launch if ``keep`` (every
        fork stopped, no network namespace to outlive, ``launcher.keep_zygotes``), else ended."""
        keep = keep and self.network is None and self.cfg.launcher.keep_zygotes
        warm_pool.POOL.give_back(list(self._zygotes.values()), keep)
        self._zygotes.clear()

    def stop(self) -> None:
        """SIGTERM every process group of the job, SIGKILL what is left after TERM_GRACE_S; on
        return no agent, rank or helper of any node is alive (StopFailed names any that is)."""
        try:
            for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
                left = self._signal_until_gone(sig, time.monotonic() + wait_s)
                if not left:
                    break
            if left:
                raise StopFailed(f"processes of job {self.token} survived SIGKILL: {sorted(left)}")
            for p in self._agents.values():
                p.wait(timeout=KILL_WAIT_S)
        finally:
            for log in self._logs:
                log.close()
            self._logs.clear()
            self._agents.clear()

    def _signal_until_gone(self, sig: signal.Signals, deadline: float) -> set[int]:
        """Signal every process of the job with ``sig`` until none is left or ``deadline``; the
        pids left. The wait polls the signalled pids only: a scan of /proc (every process's
        environ and stat) costs ~0.1 s on a busy machine, so it runs only to find what forked
        since the last one, when every signalled pid is gone (an empty scan ends it)."""
        pids = set(self.processes()) | {p.pid for p in self._agents.values() if p.poll() is None}
        while pids:
            _signal_groups(sorted(pids), sig)
            while pids and time.monotonic() < deadline:
                for p in self._agents.values():
                    p.poll()  # reap exited agents (ours): a zombie is not "gone" to kill(0)
                pids = {pid for pid in pids if pid_alive(pid)}
                if pids:
                    time.sleep(0.02)
            if pids:  # past the deadline
                return pids
            pids = set(self.processes())  # forked since the last scan
        return pids

    def close(self) -> None:
        stopped = False
        try:
            self.stop()
            stopped = True
        finally:
            self._release_zygotes(keep=stopped)
            if self.network is not None:
                self.network.close()
                self.network = None

    def __repr__(self) -> str:
        where = f"netns {self.network.plan.subnet}" if self.network else self.cfg.cluster.master_addr
        return f"LocalNodesBackend({self.nodes} nodes x {self.cfg.cluster.procs_per_node}, {where})"
