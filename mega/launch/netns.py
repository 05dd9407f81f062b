"""Network-namespace nodes on one machine: a bridge, and per node a namespace and a veth pair.

``launcher=local-nodes launcher.local_nodes.netns=true`` (root only) gives every local node its own
network stack, so the rendezvous and every collective cross a real interface instead of loopback::

    root namespace:  bridge mgb-<id> = <subnet>.1 ── veth mgv-<id>-<k> ──┐
    namespace mega-<id>-n<k>:                        mega0 = <subnet>.(k+2)  (+ lo)

* Node k's agent runs under ``ip netns exec``; the master address is node 0's address, and the
  ranks' gloo/NCCL sockets use ``mega0`` (``GLOO_SOCKET_IFNAME``), never loopback.
* Servers in the root namespace that the nodes need (Redis) bind the bridge address.
* ``shape(k, mbit)``: a ``tc tbf`` rate on both ends of node k's link (``netem`` is not available
  on every kernel, tbf is); ``cut(k)``/``restore(k)``: ``ip link set ... down/up`` for drills.
* Names carry a per-network id, so two runs never clash on names; their subnets must differ (an
  address of the subnet already on an interface here is refused). Everything is deleted by
  ``close()``, and on a failure while creating. A state file per network
  (``/run/mega-netns/<id>.json``, with the owner's pid) lets the next ``create()`` delete what a
  killed owner left behind.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mega.cluster.node import NODE_ADDR_ENV
from mega.config import ConfigError

NODE_IFNAME = "mega0"  # the node's interface inside its namespace (same name in every namespace)
STATE_DIR = Path(os.environ.get("MEGA_NETNS_STATE_DIR", "/run/mega-netns"))
ETC_NETNS = Path("/etc/netns")  # per-namespace files `ip netns exec` mounts over /etc
SUBNET_KEY = "launcher.local_nodes.subnet"
NETNS_KEY = "launcher.local_nodes.netns"
CMD_TIMEOUT_S = 30.0


class NetnsError(RuntimeError):
    """An ip/tc command failed; the message names the command and its error."""


@dataclass(frozen=True)
class NodeNet:
    node: int
    namespace: str  # mega-<id>-n<k>
    host_veth: str  # the root-namespace end, enslaved to the bridge
    address: str  # mega0's address inside the namespace


@dataclass(frozen=True)
class NetPlan:
    net_id: str
    subnet: str
    prefixlen: int
    bridge: str
    bridge_address: str
    nodes: tuple[NodeNet, ...] = field(default_factory=tuple)


def plan(subnet: str, nodes: int, net_id: str | None = None) -> NetPlan:
    """Names and addresses of one network: bridge = first host address (.1), node k = .(k + 2).

    Pure (creates nothing). Interface names stay within Linux's 15 characters."""
    net = ipaddress.ip_network(subnet)
    if net.version != 4 or not net.is_private:
        raise ConfigError(SUBNET_KEY, f"needs a private IPv4 network, got {net}")
    hosts = net.num_addresses - 2  # network and broadcast addresses are not hosts
    if nodes + 1 > hosts:
        raise ConfigError(
            SUBNET_KEY, f"{net} has {hosts} host addresses: not enough for a bridge and {nodes} nodes"
        )
    net_id = net_id or uuid.uuid4().hex[:6]
    if len(f"mgv-{net_id}-{nodes - 1}") > 15:
        raise ValueError(f"network id {net_id!r} too long for interface names")
    base = net.network_address
    return NetPlan(
        net_id=net_id,
        subnet=str(net),
        prefixlen=net.prefixlen,
        bridge=f"mgb-{net_id}",
        bridge_address=str(base + 1),
        nodes=tuple(
            NodeNet(k, f"mega-{net_id}-n{k}", f"mgv-{net_id}-{k}", str(base + k + 2)) for k in range(nodes)
        ),
    )


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(cmd)}` did not finish in {CMD_TIMEOUT_S:g} s") from None
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def require_root() -> None:
    """ConfigError naming launcher.local_nodes.netns unless namespaces can be made here."""
    if os.geteuid() != 0:
        raise ConfigError(
            NETNS_KEY,
            "network-namespace nodes need root (namespaces, a bridge, veth pairs); "
            "run as root or set launcher.local_nodes.netns=false",
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ConfigError(NETNS_KEY, f"needs the `{tool}` command (Debian: apt-get install iproute2)")


def addresses_in_use(subnet: str) -> dict[str, str]:
    """Interfaces of this (root) namespace holding an address inside ``subnet``: address -> interface."""
    net = ipaddress.ip_network(subnet)
    out = json.loads(_run("ip", "-j", "-4", "addr", "show").stdout or "[]")
    return {
        a["local"]: link["ifname"]
        for link in out
        for a in link.get("addr_info", [])
        if ipaddress.ip_address(a["local"]) in net
    }


class NetnsNetwork:
    """One network of namespace nodes; ``create()`` builds it, ``close()`` deletes it."""

    def __init__(self, net_plan: NetPlan):
        self.plan = net_plan
        self.created = False
        self._state = STATE_DIR / f"{net_plan.net_id}.json"

    @property
    def bridge_address(self) -> str:
        return self.plan.bridge_address

    def address(self, node: int) -> str:
        return self.plan.nodes[node].address

    def exec_prefix(self, node: int) -> list[str]:
        """Prepended to a command to run it inside node's namespace (``ip`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.plan.nodes[node].namespace]

    def env(self, node: int) -> dict[str, str]:
        """What a rank in node's namespace needs: its sockets on mega0, its address."""
        return {
            "GLOO_SOCKET_IFNAME": NODE_IFNAME,
            "NCCL_SOCKET_IFNAME": NODE_IFNAME,
            NODE_ADDR_ENV: self.address(node),
        }

    # -- lifecycle -----------------------------------------------------------------------------

    def create(self) -> NetnsNetwork:
        require_root()
        clean_stale()
        busy = addresses_in_use(self.plan.subnet)
        if busy:
            raise ConfigError(
                SUBNET_KEY,
                f"{self.plan.subnet} is already in use here ("
                + ", ".join(f"{a} on {i}" for a, i in sorted(busy.items()))
                + "): another run's nodes? give this run another subnet",
            )
        self._write_state()  # first: a crash from here on leaves a record for clean_stale
        try:
            p = self.plan
            _run("ip", "link", "add", p.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{p.bridge_address}/{p.prefixlen}", "dev", p.bridge)
            _run("ip", "link", "set", p.bridge, "up")
            for n in p.nodes:
                _run("ip", "netns", "add", n.namespace)
                peer = f"mgp-{p.net_id}-{n.node}"
                _run("ip", "link", "add", n.host_veth, "type", "veth", "peer", "name", peer)
                _run("ip", "link", "set", n.host_veth, "master", p.bridge, "up")
                _run("ip", "link", "set", peer, "netns", n.namespace)
                _run("ip", "-n", n.namespace, "link", "set", peer, "name", NODE_IFNAME)
                _run("ip", "-n", n.namespace, "addr", "add", f"{n.address}/{p.prefixlen}", "dev", NODE_IFNAME)
                _run("ip", "-n", n.namespace, "link", "set", NODE_IFNAME, "up")
                _run("ip", "-n", n.namespace, "link", "set", "lo", "up")
                self._write_hosts(n)
        except BaseException:
            self.close()
            raise
        self.created = True
        return self

    def close(self) -> None:
        """Delete every namespace, veth and the bridge of this network (idempotent)."""
        _delete(self.plan)
        self._state.unlink(missing_ok=True)
        self.created = False

    def _write_hosts(self, n: NodeNet) -> None:
        """/etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts: this machine's
        entries plus every node's name, so the nodes' addresses resolve both ways (torch's store
        looks up the peer's name, and warns when it cannot)."""
        etc = ETC_NETNS / n.namespace
        etc.mkdir(parents=True, exist_ok=True)
        base = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
        # also as IPv4-mapped IPv6: torch's store listens dual-stack and sees peers that way
        names = [(self.plan.bridge_address, self.plan.bridge)] + [
            (m.address, m.namespace) for m in self.plan.nodes
        ]
        own = "".join(f"{a} {name}\n::ffff:{a} {name}\n" for a, name in names)
        (etc / "hosts").write_text(base.rstrip("\n") + f"\n# mega network {self.plan.net_id}\n" + own)

    def hand_over(self, pid: int) -> None:
        """Make process ``pid`` the network's owner: it outlives this process (a daemon), and
        ``clean_stale`` deletes the network only once that process is gone."""
        self._write_state(pid)

    def _write_state(self, pid: int | None = None) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        record = {"pid": pid or os.getpid(), "host": socket.gethostname(), "plan": asdict(self.plan)}
        tmp = self._state.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self._state)

    # -- link drills -----------------------------------------------------------------------------

    def shape(self, node: int, mbit: float) -> None:
        """Limit node's link to ``mbit`` Mbit/s each way (tc tbf on both ends of its veth pair)."""
        rate_bytes = mbit * 1e6 / 8
        burst = max(4096, int(rate_bytes * 0.01))  # 10 ms at the rate, at least a few packets
        tbf = ["root", "tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "200ms"]
        n = self.plan.nodes[node]
        _run("tc", "qdisc", "replace", "dev", n.host_veth, *tbf)
        _run("tc", "-n", n.namespace, "qdisc", "replace", "dev", NODE_IFNAME, *tbf)

    def unshape(self, node: int) -> None:
        n = self.plan.nodes[node]
        _run("tc", "qdisc", "del", "dev", n.host_veth, "root", check=False)
        _run("tc", "-n", n.namespace, "qdisc", "del", "dev", NODE_IFNAME, "root", check=False)

    def cut(self, node: int) -> None:
        """Take node's link down: its packets go nowhere until ``restore``."""
        _run("ip", "link", "set", self.plan.nodes[node].host_veth, "down")

    def restore(self, node: int) -> None:
        _run("ip", "link", "set", self.plan.nodes[node].host_veth, "up")


def _delete(p: NetPlan) -> None:
    for n in p.nodes:
        # deleting one end of a veth pair deletes both; a namespace goes with its last process
        _run("ip", "link", "del", n.host_veth, check=False)
        _run("ip", "netns", "del", n.namespace, check=False)
        shutil.rmtree(ETC_NETNS / n.namespace, ignore_errors=True)
    _run("ip", "link", "del", p.bridge, check=False)


def clean_stale() -> list[str]:
    """Delete the networks whose owner process is gone (a killed test or launcher); their ids."""
    from mega.launch.runs import pid_alive

    cleaned = []
    if not STATE_DIR.is_dir():
        return cleaned
    for state in STATE_DIR.glob("*.json"):
        try:
            record = json.loads(state.read_text())
            if record["host"] == socket.gethostname() and pid_alive(record["pid"]):
                continue
            raw = record["plan"]
            p = NetPlan(**{**raw, "nodes": tuple(NodeNet(**n) for n in raw["nodes"])})
        except (OSError, ValueError, KeyError, TypeError):
            continue  # another writer's file in flight, or not ours: leave it
        _delete(p)
        state.unlink(missing_ok=True)
        cleaned.append(p.net_id)
    return cleaned
