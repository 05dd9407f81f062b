"""A real Slurm cluster on this machine: slurmctld + one slurmd per node, for tests and for trying mega.

``python -m mega.launch.slurm_local up --nodes 3`` / ``status`` / ``down`` (root; Debian's
``slurm-wlm`` and ``munge``, which ``infra/install.sh`` installs)::

    root namespace:  munged (private socket), slurmctld on <bridge address>:<ctl port>
                     bridge mgb-slurm = <subnet>.1
    node k:          network namespace mega-slurm-n<k>, UTS namespace with hostname mega-slurm-n<k>,
                     address <subnet>.(k+2), one slurmd on <slurmd port>

* Each slurmd lives in its own network namespace (mega/launch/netns.py builds the bridge, veth
  pairs and the /etc/hosts every namespace sees) and its own UTS namespace: Slurm takes the node's
  name from the hostname, and a job's ranks see their node's hostname and address, as on a real
  cluster. Every address is private and on the bridge: nothing leaves this machine.
* Everything lives under one scratch directory (``--dir``, default ``/tmp/mega-slurm``): a munge
  key of its own and munged on a private socket (``AuthInfo=socket=...``), slurm.conf, state,
  spool and logs. ``export SLURM_CONF=<dir>/slurm.conf`` points ``sinfo``/``sbatch`` at it
  (``status`` prints it).
* Two partitions: ``debug`` (default, no time limit) and ``short`` (``MaxTime=5`` minutes), where
  time-limit and ``--signal`` drills run; a requeued job runs again after 11 s (``cred_expire=10``
  in ``AuthInfo``; Slurm's default is 120 s).
* ``up`` returns once ``sinfo`` shows every node idle, or fails within ``--timeout`` seconds naming
  what did not come up, with the tail of its log, and removes what it started. ``down`` stops every
  daemon by the pid recorded in ``<dir>/cluster.json`` and deletes the namespaces, bridge and files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mega.launch import netns
from mega.ports import free_ports

NET_ID = "slurm"  # default names: bridge mgb-slurm, namespaces (and node hostnames) mega-slurm-n<k>
DEFAULT_DIR = Path("/tmp/mega-slurm")
DEFAULT_SUBNET = "10.214.0.0/24"
SHORT_MAX_MINUTES = 5
STATE_FILE = "cluster.json"


class SlurmLocalError(RuntimeError):
    """The local cluster could not be started (the message names the daemon and shows its log)."""


@dataclass
class ClusterState:
    root: str
    nodes: int
    subnet: str
    net_id: str
    ctl_port: int
    slurmd_port: int
    hostnames: list[str]
    addresses: list[str]
    pids: dict[str, int] = field(default_factory=dict)  # daemon name -> pid

    @property
    def conf(self) -> Path:
        return Path(self.root) / "slurm.conf"

    def env(self) -> dict[str, str]:
        """What a client (sinfo, sbatch, the driver) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}


def _require_tools() -> None:
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sinfo", "unshare") if shutil.which(t) is None]
    if missing:
        raise SlurmLocalError(
            f"missing {', '.join(missing)}: run infra/install.sh as root "
            "(Debian: apt-get install slurm-wlm munge)"
        )
    netns.require_root()


def render_conf(state: ClusterState, cpus: int, memory_mb: int) -> str:
    """slurm.conf of the local cluster (every path under ``state.root``)."""
    r = Path(state.root)
    nodes = "\n".join(
        f"NodeName={h} NodeAddr={a} NodeHostname={h} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
        for h, a in zip(state.hostnames, state.addresses)
    )
    bridge = netns.plan(state.subnet, state.nodes, state.net_id).bridge_address
    return f"""# mega.launch.slurm_local: {state.nodes} node(s) on this machine, each in its own namespaces
ClusterName=mega-local
SlurmctldHost={socket.gethostname()}({bridge})
SlurmctldPort={state.ctl_port}
SlurmdPort={state.slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long (plus 1 s) before it runs again (Slurm's default: 120 s;
# a step's credential lives as long: ample for a launch on this machine)
AuthInfo=socket={r / "munge" / "munge.socket"},cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r / "slurmctld.log"}
SlurmdLogFile={r}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
# a requeued job, eligible again after cred_expire, starts at the next backfill pass: every 5 s, not 30
SchedulerParameters=bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
# fast fault handling for drills: a silent slurmd is DOWN after 20 s, a step is killed 5 s after SIGTERM
SlurmdTimeout=20
SlurmctldTimeout=20
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=ALL MaxTime={SHORT_MAX_MINUTES} State=UP
"""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def _spawn(argv: list[str], log: Path) -> int:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    return proc.pid


def _alive(pid: int) -> bool:
    from mega.launch.runs import pid_alive

    return pid_alive(pid)


def _run(argv: list[str], env: dict[str, str], timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env})


def _network(state: ClusterState) -> netns.NetnsNetwork:
    return netns.NetnsNetwork(netns.plan(state.subnet, state.nodes, state.net_id))


def read_state(root: Path = DEFAULT_DIR) -> ClusterState | None:
    try:
        return ClusterState(**json.loads((root / STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_state(state: ClusterState) -> None:
    path = Path(state.root) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, path)


def _check_socket_room(root: Path, host: str) -> None:
    """slurmstepd makes a Unix socket per step in the node's spool directory under ``root``; a path
    longer than the 108 bytes a socket address holds makes every job fail to launch (and be held)."""
    longest = root / "spool" / host / f"{host}_4294967294.4294967294"
    if len(str(longest)) >= 108:
        raise SlurmLocalError(
            f"--dir {root} is too long: slurmstepd's sockets under it ({longest}) would exceed the "
            "108 bytes of a Unix socket path; pick a shorter directory"
        )


def up(
    nodes: int = 3,
    root: Path = DEFAULT_DIR,
    subnet: str = DEFAULT_SUBNET,
    cpus: int | None = None,
    memory_mb: int = 4000,
    timeout_s: float = 120.0,
    net_id: str = NET_ID,
) -> ClusterState:
    """Start the cluster; return once every node is idle. On any failure, everything started is
    stopped and removed again before the error is raised."""
    if nodes < 1:
        raise SlurmLocalError(f"--nodes must be >= 1, got {nodes}")
    _require_tools()
    root = Path(root).absolute()
    _check_socket_room(root, f"mega-{net_id}-n{nodes - 1}")
    if (old := read_state(root)) is not None:
        if any(_alive(p) for p in old.pids.values()):
            raise SlurmLocalError(
                f"a local Slurm cluster already runs from {root} "
                f"(pids {sorted(old.pids.values())}): `python -m mega.launch.slurm_local down` first"
            )
        down(root)
    netns.clean_stale()
    plan = netns.plan(subnet, nodes, net_id)
    ctl_port, slurmd_port = free_ports(2, "127.0.0.1")
    state = ClusterState(
        str(root),
        nodes,
        subnet,
        net_id,
        ctl_port,
        slurmd_port,
        hostnames=[n.namespace for n in plan.nodes],
        addresses=[n.address for n in plan.nodes],
    )
    shutil.rmtree(root, ignore_errors=True)
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    _write_state(state)
    net = netns.NetnsNetwork(plan)
    try:
        net.create()
        _start_munge(state)
        state.conf.write_text(render_conf(state, cpus or os.cpu_count() or 1, memory_mb))
        state.pids["slurmctld"] = _spawn(["slurmctld", "-D", "-f", str(state.conf)], root / "slurmctld.out")
        _write_state(state)
        # the cluster outlives `up` (the CLI exits): its network is slurmctld's, not this process's,
        # else the next network created on this machine deletes it as stale
        net.hand_over(state.pids["slurmctld"])
        for k in range(nodes):
            _start_slurmd(state, net, k)
        wait_idle(state, timeout_s)
    except BaseException:
        down(root)
        raise
    return state


# ``ip netns exec`` mounts a fresh /sys (of the node's network namespace) in a mount namespace of
# its own, without the cgroup filesystems slurmd's cgroup plugin probes: mount them there again
# (the same hierarchies as this machine's; only that mount namespace sees the mounts), set the
# node's hostname, become slurmd.
_SLURMD_SH = """set -e
if ! mountpoint -q /sys/fs/cgroup; then
  if [ "$2" = cgroup2 ]; then mount -t cgroup2 none /sys/fs/cgroup
  else
    mount -t tmpfs cgroup /sys/fs/cgroup
    for c in freezer cpuset memory devices; do mkdir -p "/sys/fs/cgroup/$c"; mount -t cgroup -o "$c" "$c" "/sys/fs/cgroup/$c"; done
    mkdir -p /sys/fs/cgroup/systemd; mount -t cgroup -o none,name=systemd systemd /sys/fs/cgroup/systemd
  fi
fi
hostname "$0"
exec slurmd -D -f "$1"
"""


def _start_slurmd(state: ClusterState, net: netns.NetnsNetwork, k: int) -> None:
    """Node k's slurmd: ip netns exec -> unshare (own UTS namespace) -> sh (cgroups, hostname) ->
    exec slurmd, all one pid, recorded in the state file."""
    host = state.hostnames[k]
    (Path(state.root) / "spool" / host).mkdir(parents=True, exist_ok=True)
    argv = [
        *net.exec_prefix(k),
        "unshare",
        "--uts",
        "sh",
        "-c",
        _SLURMD_SH,
        host,
        str(state.conf),
        _cgroup_mode(),
    ]
    state.pids[f"slurmd-{host}"] = _spawn(argv, Path(state.root) / f"slurmd-{host}.out")
    _write_state(state)


def _cgroup_mode() -> str:
    """cgroup2 on a unified (v2-only) machine, else v1 (legacy or hybrid: slurm uses v1)."""
    with contextlib.suppress(OSError):
        if Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return "cgroup2"
    return "cgroup1"


def _start_munge(state: ClusterState) -> None:
    """munged on a private socket with a key of this cluster (root: ``--force``)."""
    d = Path(state.root) / "munge"
    d.chmod(0o755)  # clients connect to the socket in it
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    log = d / "munged.log"
    proc = subprocess.run(
        [
            "munged",
            "--force",
            f"--socket={d / 'munge.socket'}",
            f"--key-file={key}",
            f"--log-file={log}",
            f"--pid-file={d / 'munged.pid'}",
            f"--seed-file={d / 'munged.seed'}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        raise SlurmLocalError(f"munged did not start: {(proc.stderr or proc.stdout).strip()}\n{_tail(log)}")
    state.pids["munged"] = int((d / "munged.pid").read_text())
    _write_state(state)


def node_states(state: ClusterState) -> dict[str, str]:
    """node -> state as sinfo reports it (idle, alloc, down*, unk*, ...); {} when slurmctld does not answer."""
    proc = _run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t"], state.env())
    if proc.returncode != 0:
        return {}
    return dict(line.split() for line in proc.stdout.splitlines() if line.strip())


def wait_idle(state: ClusterState, timeout_s: float = 120.0, hosts: list[str] | None = None) -> None:
    """Until every node of ``hosts`` (default: all) is idle; SlurmLocalError naming the daemons
    that are not, with log tails. Other nodes' daemons may be down (a drill killed them)."""
    hosts = state.hostnames if hosts is None else hosts
    daemons = {n: p for n, p in state.pids.items() if not n.startswith("slurmd-") or n[7:] in hosts}
    deadline = time.monotonic() + timeout_s
    seen: dict[str, str] = {}
    while time.monotonic() < deadline:
        if any(not _alive(pid) for pid in daemons.values()):
            break
        seen = node_states(state)
        if seen and all(seen.get(h) == "idle" for h in hosts):
            return
        time.sleep(0.5)
    root = Path(state.root)
    dead = [name for name, pid in daemons.items() if not _alive(pid)]
    lines = [
        f"the local Slurm cluster is not up after {timeout_s:g} s: "
        + (
            f"{', '.join(dead)} exited"
            if dead
            else f"sinfo says {seen or 'nothing (slurmctld does not answer)'}"
        )
    ]
    lines += [f"--- slurmctld.log\n{_tail(root / 'slurmctld.log')}\n{_tail(root / 'slurmctld.out', 5)}"]
    for h in hosts:
        if seen.get(h) != "idle":
            lines += [
                f"--- slurmd-{h}.log\n{_tail(root / f'slurmd-{h}.log')}\n{_tail(root / f'slurmd-{h}.out', 5)}"
            ]
    raise SlurmLocalError("\n".join(lines))


def kill_node(state: ClusterState, k: int) -> list[int]:
    """Drill: node k dies -- SIGKILL to every process in its network namespace (its slurmd, its job
    steps, its ranks). The namespace stays, so ``restart_node`` can bring the node back."""
    pids = _namespace_pids(state, k)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def restart_node(state: ClusterState, k: int, timeout_s: float = 120.0) -> None:
    """Start node k's slurmd again and return it to service; returns once that node is idle. The
    node is marked DOWN first: Slurm may not have noticed its loss yet (SlurmdTimeout), and a node
    it still counts as completing a job would wait for that before it returns."""
    host = state.hostnames[k]
    _run(["scontrol", "update", f"nodename={host}", "state=down", "reason=mega-restart"], state.env())
    _start_slurmd(state, _network(state), k)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and node_states(state).get(host) not in ("idle", "down", "down*"):
        time.sleep(0.5)
    _run(["scontrol", "update", f"nodename={host}", "state=resume"], state.env())
    wait_idle(state, max(1.0, deadline - time.monotonic()), hosts=[host])


def _stop(pid: int, timeout_s: float = 15.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # our own child (same process started it): reap it
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _namespace_pids(state: ClusterState, k: int) -> list[int]:
    """Every process in node k's network namespace ([] once the namespace is gone)."""
    ns = netns.plan(state.subnet, state.nodes, state.net_id).nodes[k].namespace
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
    return [int(p) for p in out.split()]


def _job_processes(state: ClusterState) -> list[int]:
    """Processes a cluster's jobs left behind: everything in its nodes' network namespaces, and any
    ``slurmstepd`` holding a file under the cluster's directory (its slurmd log: found also when
    the namespaces are gone). slurmstepd rewrites its command line (``slurmstepd: [1.batch]``), so
    neither the configuration's path nor the node's name is in it."""
    import psutil

    found = {pid for k in range(state.nodes) for pid in _namespace_pids(state, k)}
    root = state.root.rstrip("/") + "/"
    for p in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            if p.info["name"] == "slurmstepd" and any(f.path.startswith(root) for f in p.open_files()):
                found.add(p.pid)
    found.discard(os.getpid())
    return sorted(found)


def _kill_steps(state: ClusterState) -> None:
    import psutil

    procs = []
    for pid in _job_processes(state):
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def down(root: Path = DEFAULT_DIR) -> None:
    """Stop every daemon of the cluster under ``root`` (by pid), its jobs' processes, and delete the
    namespaces, the bridge and the scratch directory. Idempotent."""
    root = Path(root).absolute()
    state = read_state(root)
    if state is not None:
        slurmds = {n: p for n, p in state.pids.items() if n.startswith("slurmd-")}
        for pid in slurmds.values():
            _stop(pid)
        if state.pids.get("slurmctld"):
            _stop(state.pids["slurmctld"])
        _kill_steps(state)  # jobs' steps and processes outlive their slurmd (before the namespaces go)
        if state.pids.get("munged"):
            _stop(state.pids["munged"])
        _network(state).close()
    shutil.rmtree(root, ignore_errors=True)


def status(root: Path = DEFAULT_DIR) -> dict:
    state = read_state(Path(root).absolute())
    if state is None:
        return {"up": False, "dir": str(root)}
    alive = {name: _alive(pid) for name, pid in state.pids.items()}
    return {
        "up": all(alive.values()),
        "dir": state.root,
        "SLURM_CONF": str(state.conf),
        "daemons": alive,
        "nodes": node_states(state) if alive.get("slurmctld") else {},
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mega.launch.slurm_local", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("command", choices=["up", "down", "status"])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="scratch directory (default %(default)s)")
    ap.add_argument(
        "--subnet", default=DEFAULT_SUBNET, help="private IPv4 subnet of the bridge (default %(default)s)"
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds `up` waits for idle nodes")
    return ap


def check_args(argv: list[str]) -> None:
    """Parse ``argv`` as ``main`` does, starting nothing (a bad command or flag exits)."""
    _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.command == "up":
            state = up(a.nodes, a.dir, a.subnet, timeout_s=a.timeout)
            print(f"{a.nodes} node(s) idle: {', '.join(state.hostnames)}\nexport SLURM_CONF={state.conf}")
        elif a.command == "down":
            down(a.dir)
            print(f"stopped; removed {a.dir}")
        else:
            print(json.dumps(status(a.dir), indent=1))
    except (SlurmLocalError, netns.NetnsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
