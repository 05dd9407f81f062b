"""Network-namespace nodes (mega/launch/netns.py): the address plan, links between nodes that can
be cut and restored, and cleanup after a killed owner. The namespace tests need root (CI is root);
they are skipped with the reason otherwise."""

from __future__ import annotations

import ipaddress
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import free_subnet, needs_root

from mega.config import ConfigError


def test_netns_plan_addresses_and_names():
    from mega.launch.netns import plan

    p = plan("10.213.7.0/24", 4, net_id="abc123")
    assert (p.bridge, p.bridge_address, p.prefixlen) == ("mgb-abc123", "10.213.7.1", 24)
    assert [n.address for n in p.nodes] == ["10.213.7.2", "10.213.7.3", "10.213.7.4", "10.213.7.5"]
    assert [n.namespace for n in p.nodes] == [f"mega-abc123-n{k}" for k in range(4)]
    assert all(len(n.host_veth) <= 15 for n in p.nodes) and len({n.host_veth for n in p.nodes}) == 4
    assert plan("10.213.7.0/24", 4).net_id != plan("10.213.7.0/24", 4).net_id  # unique per network
    with pytest.raises(ConfigError, match="launcher.local_nodes.subnet: 10.0.0.0/30 has 2 host addresses"):
        plan("10.0.0.0/30", 2)
    with pytest.raises(ConfigError, match="private IPv4"):
        plan("8.8.8.0/24", 2)


def _serve_once(namespace: str, port: int) -> subprocess.Popen:
    code = (
        "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('0.0.0.0', {port})); s.listen(8); print('ready', flush=True)\n"
        "while True:\n    c, _ = s.accept(); c.sendall(b'pong'); c.close()"
    )
    proc = subprocess.Popen(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _connect(namespace: str, address: str, port: int, timeout_s: float = 2.0) -> str:
    code = (
        f"import socket\ntry:\n    s = socket.create_connection(('{address}', {port}), timeout={timeout_s}); "
        "print(s.recv(4).decode())\nexcept OSError as e:\n    print(type(e).__name__)"
    )
    return subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()


def _links() -> str:
    return (
        subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        + subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )


@needs_root
def test_netns_nodes_reach_each_other_and_links_can_be_cut(tmp_path):
    from mega.launch.netns import NetnsNetwork, plan

    net = NetnsNetwork(plan(free_subnet(), 2)).create()
    server = None
    try:
        n0, n1 = net.plan.nodes
        assert n0.address != n1.address and ipaddress.ip_address(n1.address) in ipaddress.ip_network(
            net.plan.subnet
        )
        server = _serve_once(n1.namespace, 7777)
        assert _connect(n0.namespace, n1.address, 7777) == "pong"  # across the bridge
        assert _connect(n0.namespace, "127.0.0.1", 7777) == "ConnectionRefusedError"  # its own loopback
        net.cut(1)
        assert _connect(n0.namespace, n1.address, 7777, timeout_s=1.0) in ("TimeoutError", "OSError")
        net.restore(1)
        assert _connect(n0.namespace, n1.address, 7777) == "pong"
        # a second network on the same subnet is refused, naming the key
        with pytest.raises(ConfigError, match="launcher.local_nodes.subnet: .* already in use"):
            NetnsNetwork(plan(net.plan.subnet, 2)).create()
    finally:
        if server:
            server.kill()
            server.wait()
        net.close()
    assert net.plan.bridge not in _links() and n0.namespace not in _links() and n1.host_veth not in _links()


@needs_root
def test_a_killed_owners_network_is_cleaned_on_the_next_start(tmp_path):
    """A network whose creator was SIGKILLed (a killed test or driver) is deleted by the next create()."""
    code = textwrap.dedent(f"""
        import os, signal
        from mega.launch.netns import NetnsNetwork, plan
        net = NetnsNetwork(plan("{free_subnet()}", 2)).create()
        print(net.plan.net_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    net_id = out.stdout.strip()
    assert out.returncode == -signal.SIGKILL and net_id, out.stderr
    assert f"mgb-{net_id}" in _links()  # left behind

    from mega.launch.netns import NetnsNetwork, plan

    NetnsNetwork(plan(free_subnet(), 1)).create().close()
    assert net_id not in _links()
