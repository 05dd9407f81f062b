"""A run is a set of nodes and the driver owns membership (mega/launch): torchrun agents per node
on this machine, optionally in network namespaces; stopping a node kills every rank of it; a
2-node TP2xPP2xDP2 run over namespace nodes gives the one-node losses bit for bit, through a
whole node's ranks being killed; a killed agent is noticed and none of its ranks survive; the
self-check and bootstrap timing per node.

The namespace tests need root (CI is root); they are skipped with the reason otherwise."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from waiting import wait_for

from mega.cluster.node import read_processes
from mega.cluster.selfcheck import (
    cluster_verdict,
    pair_bandwidths,
    pair_rounds,
    selfcheck_floors,
)
from mega.config import ConfigError, compose, from_dict
from mega.launch import run_training
from mega.launch.backend import JobSpec, agent_argv
from mega.launch.backends import backend_for
from mega.launch.node_jobs import run_selfcheck
from mega.launch.runs import pid_alive
from mega.launch.watch import run_job
from mega.stability.incident import read_incidents

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="network namespaces need root (CI runs as root)")
STEPS = 4


def free_subnet() -> str:
    """A /24 no interface here uses (runs of other test sessions may hold theirs)."""
    from mega.launch.netns import addresses_in_use

    for _ in range(50):
        net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/24"
        if not addresses_in_use(net):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet")


# ---------------------------------------------------------------------------------------------
# Argument building, planning, config (no processes)


def test_agent_argv_one_local_node_is_standalone():
    cfg = from_dict({"parallelism": {"dp": 2}, "cluster": {"procs_per_node": 2}})
    argv = agent_argv(cfg, 0, "127.0.0.1", 0, JobSpec("mega.train", ["--config", "c.json"]))
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[3:] == [
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "-m",
        "mega.train",
        "--config",
        "c.json",
    ]


def test_agent_argv_of_node_k_rendezvous_on_node_0():
    cfg = compose(
        ["launcher=local-nodes", "cluster.nodes=2", "cluster.procs_per_node=4", "cluster.pg_timeout_s=90"]
    )
    argv = agent_argv(cfg, 1, "10.1.2.2", 29511, JobSpec("mega.cluster.selfcheck", ["--out", "r.json"]))
    assert argv[3:] == [
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=10.1.2.2",
        "--master-port=29511",
        "--rdzv-conf=timeout=90",
        "--nproc-per-node=4",
        "--max-restarts=0",
        "-m",
        "mega.cluster.selfcheck",
        "--out",
        "r.json",
    ]
    assert "--standalone" not in argv


def test_job_logs_per_node(tmp_path):
    job = JobSpec("mega.train", [], log_dir=tmp_path, name="train-attempt3")
    assert job.log_path(0, 1) == tmp_path / "train-attempt3.log"  # one node: where it always was
    assert job.log_path(1, 2) == tmp_path / "nodes" / "1" / "train-attempt3.log"


class _Scripted:
    """A backend whose agents' exit codes are given: what one poll of the driver sees."""

    def __init__(self, codes):
        self.codes, self.stopped = codes, False

    def start(self, job):
        pass

    def poll(self):
        return dict(self.codes)

    def stop(self):
        self.stopped = True


@pytest.mark.parametrize(
    "codes, cause, first_in_reason",
    [
        ({0: 1, 1: -9}, [1], "node 1: torchrun agent killed by SIGKILL"),  # node 0's ranks lost their peer
        ({0: 1, 1: 1, 2: None}, [0, 1], "node 0: torchrun agent exited with code 1"),  # no telling: both
    ],
)
def test_a_node_killed_outright_is_the_cause_not_the_peers_it_took_down(codes, cause, first_in_reason):
    backend = _Scripted(codes)
    outcome = run_job(backend, JobSpec("mega.train", []), poll_s=0.01)
    assert outcome.failed_nodes == cause and outcome.code == codes[cause[0]]
    assert outcome.reason.startswith(first_in_reason) and outcome.exit_codes == codes
    assert all(f"node {k}:" in outcome.reason for k, c in codes.items() if c)  # every failure is told
    assert backend.stopped


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


def test_kubernetes_is_rendered_not_driven(tmp_path):
    cfg = compose(["cluster=a100-8x", "launcher=kubernetes"])
    with pytest.raises(ConfigError, match="python -m mega.launch.kubernetes"):
        backend_for(cfg, tmp_path)


NODES2 = ["launcher=local-nodes", "cluster.nodes=2", "cluster.procs_per_node=4"]
TWO_NODES = {
    "launcher": {"name": "local-nodes"},
    "cluster": {"nodes": 2, "procs_per_node": 4},
    "parallelism": {"tp": 2, "pp": 2, "dp": 2},
    "model": {"num_layers": 4},
}
NETNS = {"launcher": {"name": "local-nodes", "local_nodes": {"netns": True}}}


def merged(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.mark.parametrize(
    "data, key, fragment",
    [
        ({"fault": {"kill_node": 2, "kill_at_step": 1}}, "fault.kill_node", "no node 2 in cluster.nodes=2"),
        ({"fault": {"kill_node": 1}}, "fault.kill_at_step", "needed with fault.kill_node"),
        ({"fault": {"kill_node": 1, "kill_rank": 0, "kill_at_step": 1}}, "fault.kill_node", "not both"),
        (
            {"fault": {"mode": "kill_agent", "kill_rank": 0, "kill_at_step": 1}},
            "fault.mode",
            "set fault.kill_node",
        ),
        (
            {"fault": {"mode": "kill_in_upload", "kill_node": 1, "kill_at_step": 1}},
            "fault.mode",
            "use fault.kill_rank",
        ),
        (
            {
                "launcher": {"name": "local", "local_nodes": {"netns": True}},
                "cluster": {"nodes": 1, "procs_per_node": 8},
            },
            "launcher.local_nodes.netns",
            "not launcher=local",
        ),
        (
            {**NETNS, "cluster": {"store": "redis", "redis_url": "redis://127.0.0.1:6379/0"}},
            "cluster.redis_url",
            "unreachable from network-namespace nodes",
        ),
        (
            {**NETNS, "checkpoint": {"s3_endpoint_url": "http://localhost:8333"}},
            "checkpoint.s3_endpoint_url",
            "bridge address",
        ),
        (
            {"cluster": {"selfcheck_gemm_fraction": 1.5}},
            "cluster.selfcheck_gemm_fraction",
            "must be in (0, 1]",
        ),
        ({"cluster": {"selfcheck_nic_fraction": 0}}, "cluster.selfcheck_nic_fraction", "must be in (0, 1]"),
        (
            {"cluster": {"selfcheck_min_inter_node_mb_per_s": -1}},
            "cluster.selfcheck_min_inter_node_mb_per_s",
            ">= 0",
        ),
    ],
)
def test_config_rejections(data, key, fragment):
    with pytest.raises(ConfigError) as info:
        from_dict(merged(TWO_NODES, data))
    assert info.value.key == key and fragment in str(info.value), str(info.value)


def test_netns_nodes_with_non_loopback_servers_are_accepted():
    cfg = from_dict(
        merged(
            TWO_NODES,
            NETNS,
            {
                "cluster": {"store": "redis", "redis_url": "redis://10.213.0.1:6379/0"},
                "checkpoint": {"s3_endpoint_url": "http://10.213.0.1:8333"},
            },
        )
    )
    assert cfg.launcher.local_nodes.netns


# ---------------------------------------------------------------------------------------------
# Self-check verdicts and floors (no processes)


@pytest.mark.parametrize("nodes", range(1, 10))
def test_pair_rounds_meet_every_pair_once_in_disjoint_rounds(nodes):
    rounds = pair_rounds(nodes)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(nodes) for b in range(a + 1, nodes)]
    for r in rounds:
        busy = [k for p in r for k in p]
        assert len(busy) == len(set(busy))  # a node is in at most one pair per round
    assert len(rounds) == (0 if nodes == 1 else nodes - 1 + nodes % 2)


def test_pair_rounds_are_capped_for_many_nodes():
    rounds = pair_rounds(100, max_rounds=16)
    assert len(rounds) == 16 and all(len(r) == 50 for r in rounds)


def _rank(node: int, rank: int) -> dict:
    return {
        "rank": rank,
        "node": node,
        "local_rank": 0,
        "host": "h",
        "address": f"10.0.0.{node + 2}",
        "device": "cpu",
        "error": None,
        "gemm_max_rel_err": 1e-7,
        "gemm_gflops": 10.0,
        "alltoall_ok": True,
        "alltoall_mb_per_s": None,
    }


def _pair(a: int, b: int, seconds: float) -> list[dict]:
    """The exchange rows of node pair (a, b): 1 MB each way per rank, taking ``seconds``."""
    return [
        {
            "round": 0,
            "node": x,
            "partner": y,
            "local_rank": 0,
            "ok": True,
            "bytes": 1_000_000,
            "elapsed_s": seconds,
            "error": None,
        }
        for x, y in ((a, b), (b, a))
    ]


def test_a_node_with_slow_links_is_blamed_not_its_peers():
    floors = selfcheck_floors(from_dict({"cluster": {"selfcheck_min_inter_node_mb_per_s": 10.0}}).cluster)
    # node 2's links run at 1 MB/s, the others' at 100 MB/s
    pairs = pair_bandwidths(_pair(0, 1, 0.01) + _pair(0, 2, 1.0) + _pair(1, 2, 1.0), floors)
    assert [(p["nodes"], round(p["mb_per_s"])) for p in pairs] == [([0, 1], 100), ([0, 2], 1), ([1, 2], 1)]
    verdict = cluster_verdict(
        [_rank(k, k) for k in range(3)], pairs, nodes=3, procs_per_node=1, floors=floors
    )
    assert [n["healthy"] for n in verdict["nodes"]] == [True, True, False]
    assert verdict["reasons"] == [
        "node 2: link to node 0: 1.0 MB/s below 10 (cluster.selfcheck_min_inter_node_mb_per_s=10)",
        "node 2: link to node 1: 1.0 MB/s below 10 (cluster.selfcheck_min_inter_node_mb_per_s=10)",
    ]
    # two nodes alone cannot tell whose link is slow: both fail
    two = cluster_verdict(
        [_rank(0, 0), _rank(1, 1)],
        pair_bandwidths(_pair(0, 1, 1.0), floors),
        nodes=2,
        procs_per_node=1,
        floors=floors,
    )
    assert [n["healthy"] for n in two["nodes"]] == [False, False]


def test_floors_are_fractions_of_the_presets_hardware():
    h100 = selfcheck_floors(compose(["cluster=h100-8x", "cluster.selfcheck_gemm_fraction=0.6"]).cluster)
    assert h100["min_gemm_gflops"] == pytest.approx(0.6 * 989e3)  # bf16 dense TFLOP/s -> GFLOP/s
    assert h100["min_alltoall_mb_per_s"] == pytest.approx(0.3 * 450e3)  # 900 GB/s counts both directions
    assert h100["min_inter_node_mb_per_s"] == pytest.approx(0.3 * 8 * 400 / 8 * 1e3)  # 8 x 400 Gbit/s NICs
    assert "cluster.peak_tflops=989" in h100["gemm_from"]
    cpu = selfcheck_floors(compose().cluster)  # no hardware facts: the measured absolute floors
    assert cpu["gemm_from"].startswith("cluster.selfcheck_min_gemm_gflops=")
    assert cpu["inter_node_from"].startswith("cluster.selfcheck_min_inter_node_mb_per_s=")


# ---------------------------------------------------------------------------------------------
# Stopping a node: no rank outlives it


SLEEPER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # in the rank's group
    out = os.path.join(os.environ["SLEEPER_DIR"], os.environ["RANK"] + ".json")
    with open(out + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "helper": helper.pid, "node": int(os.environ["GROUP_RANK"]),
                   "session": os.getsid(0)}, f)
    os.replace(out + ".tmp", out)
    time.sleep(600)
""")


@pytest.mark.slow
def test_stop_kills_every_rank_even_after_its_agent_died(tmp_path):
    """torch starts each rank in a session of its own: killing a node's agent leaves its ranks
    (and what they started) running. stop() finds them by the job's mark and kills their groups."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    cfg = from_dict(
        {
            "parallelism": {"dp": 4},
            "cluster": {"nodes": 2, "procs_per_node": 2},
            "launcher": {"name": "local-nodes"},
        }
    )
    backend = backend_for(cfg, tmp_path)
    env = {
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "SLEEPER_DIR": str(tmp_path),
    }
    try:
        backend.start(JobSpec("sleeper", [], env, tmp_path, "sleep"))
        ranks = wait_for(
            lambda: (
                [json.loads(p.read_text()) for p in sorted(tmp_path.glob("[0-9].json"))]
                if len(list(tmp_path.glob("[0-9].json"))) == 4
                else None
            ),
            120,
            "4 ranks",
        )
        assert sorted(r["node"] for r in ranks) == [0, 0, 1, 1]
        agents = backend.agent_pids()
        agent1 = agents[1]
        assert all(r["session"] == r["pid"] for r in ranks)  # torch starts each rank in a session of its own
        os.kill(agent1, signal.SIGKILL)
        wait_for(lambda: backend.poll()[1] == -signal.SIGKILL, 30, "node 1's agent to die")
        node1 = [p for r in ranks if r["node"] == 1 for p in (r["pid"], r["helper"])]
        time.sleep(1.0)
        assert all(pid_alive(p) for p in node1), "its ranks outlive a killed agent: what stop() is for"
        assert set(backend.processes()) >= set(node1)  # found by the job's mark
        started = time.monotonic()
        backend.stop()
        assert time.monotonic() - started < 30
        everyone = [p for r in ranks for p in (r["pid"], r["helper"])] + list(agents.values())
        assert not [p for p in everyone if pid_alive(p)], "a process outlived stop()"
        assert backend.poll() == {} and backend.processes() == {}
    finally:
        backend.close()
    assert (tmp_path / "nodes" / "1" / "sleep.log").exists()


# ---------------------------------------------------------------------------------------------
# Network-namespace nodes: links, drills, cleanup (no torch)


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


# ---------------------------------------------------------------------------------------------
# Training on nodes (one shared multi-node run, checked many ways)


def expected_addresses(run_dir: Path, nodes: int) -> list[str]:
    """Node k of a namespace run is host k + 2 of the run's subnet (config.json)."""
    subnet = json.loads((run_dir / "config.json").read_text())["launcher"]["local_nodes"]["subnet"]
    return [str(ipaddress.ip_network(subnet).network_address + k + 2) for k in range(nodes)]


def train(run_dir, data_index, data_cache, overrides, log=print, steps=STEPS):
    cfg = compose(
        [
            "model=tiny",
            f"train.steps={steps}",
            f"train.run_dir={run_dir}",
            f"data.cache_dir={data_cache}",
            "train.tensorboard=false",
            "optimizer.warmup_steps=1",
            "checkpoint.restart_backoff_s=0",
            "checkpoint.async_save=false",
            f"checkpoint.dir={run_dir}/checkpoints",
            *overrides,
        ]
    )
    return run_training(cfg, data_index, log=log)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, data_index, data_cache):
    """TP2xPP2xDP2 as 8 ranks of one node: the losses every node layout must reproduce bit for bit."""
    return train(
        tmp_path_factory.mktemp("one-node"),
        data_index,
        data_cache,
        ["parallelism=tp2-pp2-dp2", "checkpoint.interval=0"],
    )


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, data_index, data_cache):
    """The same layout as 2 nodes x 4 ranks, each node in its own network namespace (as root);
    every rank of node 1 is SIGKILLed at step 2, right after the step-2 checkpoint. At each
    relaunch the pids the previous attempt recorded are checked (the driver must have stopped
    them all before launching again)."""
    run_dir = tmp_path_factory.mktemp("two-nodes")
    messages, survivors = [], {}

    def log(message: str) -> None:
        messages.append(message)
        if message.startswith("attempt 1: launching"):
            survivors[0] = [r for r in read_processes(run_dir, 0) if pid_alive(r["pid"])]

    netns = [
        f"launcher.local_nodes.netns={str(ROOT).lower()}",
        f"launcher.local_nodes.subnet={free_subnet()}",
    ]
    result = train(
        run_dir,
        data_index,
        data_cache,
        [
            "parallelism=tp2-pp2-dp2",
            *NODES2,
            *netns,
            "checkpoint.interval=2",
            "fault.kill_node=1",
            "fault.kill_at_step=2",
        ],
        log=log,
    )
    return {"result": result, "messages": messages, "survivors": survivors, "run_dir": run_dir}


@pytest.mark.slow
def test_one_node_reference_learns(one_node):
    """(Also builds the reference on its own, so no single test pays for both runs' time.)"""
    losses = [m["loss"] for m in one_node.metrics]
    assert len(losses) == STEPS and losses[-1] < losses[0] and one_node.attempts == 1
    assert {m["node"] for m in one_node.metrics} == {0}


@pytest.mark.slow
def test_two_nodes_give_the_one_node_losses_bit_for_bit_through_a_node_kill(one_node, two_nodes):
    result = two_nodes["result"]
    assert result.attempts == 2 and result.final_step == STEPS
    assert [m["step"] for m in result.metrics] == [m["step"] for m in one_node.metrics]
    for got, want in zip(result.metrics, one_node.metrics):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"], (got, want)  # bit-exact
    assert [m["attempt"] for m in result.metrics] == [0, 0, 1, 1]
    # the step-2 checkpoint is what both nodes' ranks restored; node 1 failed (node 0's ranks may
    # have failed too by the driver's next look, their peers gone: the driver names the cause)
    assert [(h["attempt"], h["restored"]) for h in result.history] == [(0, None), (1, "iter_0000002")]
    assert 1 in result.history[0]["failed_nodes"] and result.history[1]["failed_nodes"] == []


@pytest.mark.slow
def test_the_node_kill_has_a_whole_ledger_and_a_cut_off_node_is_named(two_nodes, tmp_path):
    """The goodput ledger (mega/goodput) of the node kill: every second attributed, no step lost,
    each sample once; without node 0's records of attempt 0 node 1's carry the attempt (node 0's
    named missing); without any of attempt 0's records it names that attempt's time."""
    from tests.goodput_checks import assert_cut_off_records_are_named, assert_ledger_of_faulted_run

    led = assert_ledger_of_faulted_run(two_nodes["run_dir"], steps=STEPS)
    assert led["lost_steps"] == []  # killed right after the step-2 checkpoint that attempt 1 restored
    assert_cut_off_records_are_named(two_nodes["run_dir"], tmp_path, node_ranks=[0, 1, 2, 3])  # node 0's


@pytest.mark.slow
def test_a_killed_nodes_ranks_and_its_peers_are_gone_before_the_relaunch(two_nodes):
    faults = [json.loads(line) for line in (two_nodes["run_dir"] / "faults.jsonl").read_text().splitlines()]
    assert sorted(f["rank"] for f in faults) == [4, 5, 6, 7] and {f["node"] for f in faults} == {1}
    assert any(
        m.startswith("attempt 0:")
        and "node 1: torchrun agent exited with code 1" in m
        and m.endswith("stopping every node")
        for m in two_nodes["messages"]
    )
    assert (
        "attempt 1: launching 8 ranks on 2 nodes (4 per node); `latest` is iter_0000002"
        in two_nodes["messages"]
    )
    attempt0 = read_processes(two_nodes["run_dir"], 0)
    assert sorted(r["rank"] for r in attempt0) == list(range(8))
    assert two_nodes["survivors"] == {0: []}, "ranks of attempt 0 were alive when attempt 1 launched"
    # the incident names node 1's SIGKILLed ranks (not node 0's ranks that lost their peers), the
    # first with its coordinates (rank = tp + 2 dp + 4 pp)
    [inc] = [i for i in read_incidents(two_nodes["run_dir"]) if i["kind"] != "straggler"]
    c = inc["culprit"]
    assert (inc["kind"], c["ranks"], c["node"], c["coords"]) == (
        "rank-exit",
        [4, 5, 6, 7],
        1,
        {"tp": 0, "pp": 1, "dp": 0},
    )
    assert "rank 4 killed by SIGKILL" in inc["diagnosis"] and inc["time_to_recover_s"] > 0


@pytest.mark.slow
def test_nodes_are_named_in_init_metrics_and_logs(two_nodes):
    result, run_dir = two_nodes["result"], two_nodes["run_dir"]
    nodes = result.init["nodes"]
    assert [(n["node"], n["ranks"]) for n in nodes] == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
    if ROOT:  # network-namespace nodes: a distinct address each, on the run's subnet
        assert [n["address"] for n in nodes] == expected_addresses(run_dir, 2)
    # the logging rank (last stage, TP 0, DP 0) is global rank 6 of 8: node 1
    assert {m["node"] for m in result.metrics} == {1}
    for k in (0, 1):
        assert (run_dir / "nodes" / str(k) / "train-attempt0.log").stat().st_size > 0
        assert (run_dir / "nodes" / str(k) / "train-attempt1.log").stat().st_size > 0
    assert not list(run_dir.glob("train-attempt*.log"))


@pytest.mark.slow
def test_a_killed_agent_is_noticed_and_its_orphaned_ranks_are_stopped(tmp_path, data_index, data_cache):
    """Node 1's torchrun agent is SIGKILLed at step 2; its rank trains on, orphaned. The driver sees
    the agent's exit within cluster.hang_timeout_s, stops every node (the orphan included: checked
    by pid, alive when the failure was seen, dead before the relaunch), and the run finishes.
    The nodes rendezvous over Redis (cluster.store=redis), from network namespaces as root: the
    driver's redis-server listens on the bridge address, with a password of the job's."""
    seen, alive_at_failure, alive_at_relaunch, messages = {}, [], [], []

    def log(message: str) -> None:
        messages.append(message)
        if message.startswith("attempt 0:") and "stopping every node" in message:
            seen["time"], seen["message"] = time.time(), message
            alive_at_failure.extend(
                r["pid"] for r in read_processes(tmp_path, 0, node=1) if pid_alive(r["pid"])
            )
        if message.startswith("attempt 1: launching"):
            alive_at_relaunch.extend(r["pid"] for r in read_processes(tmp_path, 0) if pid_alive(r["pid"]))

    # 22 steps after the kill (~2 s on an idle machine) to see the orphan training: the driver
    # polls its agents every 0.5 s
    hang_timeout_s, steps = 60, 24
    result = train(
        tmp_path,
        data_index,
        data_cache,
        [
            "parallelism=dp2",
            "launcher=local-nodes",
            "cluster.nodes=2",
            "cluster.procs_per_node=1",
            "checkpoint.interval=0",
            f"cluster.hang_timeout_s={hang_timeout_s}",
            "cluster.store=redis",
            f"launcher.local_nodes.netns={str(ROOT).lower()}",
            f"launcher.local_nodes.subnet={free_subnet()}",
            "fault.kill_node=1",
            "fault.mode=kill_agent",
            "fault.kill_at_step=2",
        ],
        log=log,
        steps=steps,
    )
    fault = json.loads((tmp_path / "faults.jsonl").read_text())
    assert fault["kind"] == "kill_agent" and fault["node"] == 1
    assert "node 1: torchrun agent killed by SIGKILL" in seen["message"]
    assert seen["time"] - fault["time"] < hang_timeout_s
    assert alive_at_failure, (
        "the orphaned rank should still have been training when the driver saw the failure"
    )
    assert alive_at_relaunch == []
    assert result.final_step == steps and result.attempts == 2
    assert result.history[0]["failed_nodes"] == [1]
    assert (
        sum(m.startswith(("attempt 0: dropped its", "attempt 1: dropped its")) for m in messages) == 2
    )  # Redis keys
    if ROOT:
        assert [n["address"] for n in result.init["nodes"]] == expected_addresses(tmp_path, 2)


# ---------------------------------------------------------------------------------------------
# Self-check and bootstrap timing on every node


@pytest.mark.slow
@needs_root
def test_selfcheck_on_three_namespace_nodes_fails_the_one_with_a_slow_link(tmp_path):
    """3 nodes x 2 ranks; node 2's link is slowed to 8 Mbit/s (tc tbf): the pair exchanges name
    node 2, nodes 0 and 1 stay healthy, the intra-node all-to-all runs per node."""
    from mega.launch.local_nodes import LocalNodesBackend

    cfg = from_dict(
        {
            "parallelism": {"dp": 6, "global_batch_size": 12},
            "cluster": {"nodes": 3, "procs_per_node": 2, "selfcheck_min_inter_node_mb_per_s": 20.0},
            "launcher": {"name": "local-nodes", "local_nodes": {"netns": True, "subnet": free_subnet()}},
        }
    )
    backend = LocalNodesBackend(cfg, tmp_path)
    try:
        backend.network.shape(2, 8)  # 1 MB/s each way
        result = run_selfcheck(cfg, tmp_path, backend=backend)
    finally:
        backend.close()
    assert [n["healthy"] for n in result["nodes"]] == [True, True, False], result["reasons"]
    subnet = ipaddress.ip_network(cfg.launcher.local_nodes.subnet)
    assert [n["address"] for n in result["nodes"]] == [str(subnet.network_address + k + 2) for k in range(3)]
    assert all(
        "link to node" in r and "cluster.selfcheck_min_inter_node_mb_per_s=20" in r
        for r in result["nodes"][2]["reasons"]
    )
    pairs = {tuple(p["nodes"]): p for p in result["pairs"]}
    assert set(pairs) == {(0, 1), (0, 2), (1, 2)} and all(p["data_ok"] for p in pairs.values())
    assert pairs[(0, 1)]["mb_per_s"] > 20 and pairs[(0, 2)]["mb_per_s"] < 2 and pairs[(1, 2)]["mb_per_s"] < 2
    assert sorted((r["node"], r["rank"]) for r in result["ranks"]) == [(k // 2, k) for k in range(6)]
    assert all(r["alltoall_ok"] and r["alltoall_mb_per_s"] > 0 for r in result["ranks"])  # within each node
    assert (tmp_path / "nodes" / "2" / "selfcheck.log").exists()


@pytest.mark.slow
def test_bootstrap_timing_reports_per_node(tmp_path):
    from mega.launch.node_jobs import time_process_groups

    cfg = from_dict(
        {
            "parallelism": {"dp": 2},
            "cluster": {"nodes": 2, "procs_per_node": 1},
            "launcher": {"name": "local-nodes"},
            "train": {"run_dir": str(tmp_path)},
        }
    )
    result = time_process_groups(cfg)
    assert result["world_size"] == 2 and [r["node"] for r in result["ranks"]] == [0, 1]
    assert [n["node"] for n in result["nodes"]] == [0, 1]
    assert result["pg_init_s"] == max(n["pg_init_s"] for n in result["nodes"]) > 0
    assert (tmp_path / "bootstrap" / "nodes" / "1" / "bootstrap.log").exists()
