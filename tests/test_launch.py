"""A run is a set of nodes and the driver owns membership (mega/launch): torchrun agents per node
on this machine, optionally in network namespaces; stopping a node kills every rank of it; a
2-node TP2xPP2xDP2 run over namespace nodes gives the one-node losses bit for bit, through a
whole node's ranks being killed; a killed agent is noticed and none of its ranks survive.

The namespace tests need root (CI is root); they are skipped with the reason otherwise."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import ROOT, free_subnet, tiny_run
from waiting import wait_for

from mega.cluster.node import read_processes
from mega.config import compose, from_dict
from mega.launch.backend import JobSpec, agent_argv
from mega.launch.backends import backend_for
from mega.launch.runs import pid_alive
from mega.launch.watch import run_job
from mega.stability.incident import read_incidents

STEPS = 4


# ---------------------------------------------------------------------------------------------
# Argument building (no processes)


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
        [
            "launcher=local-nodes",
            "cluster.nodes=2",
            "cluster.procs_per_node=4",
            "cluster.pg_timeout_s=90",
            "checkpoint.upload_timeout_s=60",  # a restore's wait for the store ends before pg_timeout_s
        ]
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


NODES2 = ["launcher=local-nodes", "cluster.nodes=2", "cluster.procs_per_node=4"]

# ---------------------------------------------------------------------------------------------
# Stopping a node: no rank outlives it


SLEEPER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # in the rank's group
    def late(*_):  # rank 0, stopped: starts one more process, out of every signalled group, and leaves
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        with open(os.path.join(os.environ["SLEEPER_DIR"], "late.pid"), "w") as f:
            f.write(str(p.pid))
        os._exit(0)
    if os.environ["RANK"] == "0":
        signal.signal(signal.SIGTERM, late)
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
    (and what they started) running. stop() finds them by the job's mark and kills their groups,
    and what a rank starts while it stops (rank 0's late process, in a session of its own)."""
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
        late = int((tmp_path / "late.pid").read_text())  # forked after stop() scanned: found by a rescan
        everyone = [p for r in ranks for p in (r["pid"], r["helper"])] + list(agents.values()) + [late]
        assert not [p for p in everyone if pid_alive(p)], "a process outlived stop()"
        assert backend.poll() == {} and backend.processes() == {}
    finally:
        backend.close()
    assert (tmp_path / "nodes" / "1" / "sleep.log").exists()


# ---------------------------------------------------------------------------------------------
# Training on nodes (one shared multi-node run, checked many ways)


def expected_addresses(run_dir: Path, nodes: int) -> list[str]:
    """Node k of a namespace run is host k + 2 of the run's subnet (config.json)."""
    subnet = json.loads((run_dir / "config.json").read_text())["launcher"]["local_nodes"]["subnet"]
    return [str(ipaddress.ip_network(subnet).network_address + k + 2) for k in range(nodes)]


def train(run_dir, data_index, data_cache, overrides, log=print, steps=STEPS):
    return tiny_run(
        run_dir, data_index, data_cache, ["checkpoint.async_save=false", *overrides], steps=steps, log=log
    )


@pytest.fixture(scope="module")
def one_node(one_node_3d_reference):
    """TP2xPP2xDP2 as 8 ranks of one node: the losses every node layout must reproduce bit for bit
    (conftest: shared with tests/test_slurm_cluster.py)."""
    return one_node_3d_reference


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
def test_the_driver_logs_the_last_step_of_the_run_with_its_metrics(two_nodes):
    """train.log_interval (10) steps apart and the last: of 4 steps, the last alone, with the loss
    the logging rank wrote, once (attempt 0 ended at step 2)."""
    last = two_nodes["result"].metrics[-1]
    lines = [m for m in two_nodes["messages"] if m.startswith("step ")]
    assert len(lines) == 1 and lines[0].startswith(f"step {STEPS}/{STEPS} | loss {last['loss']:.5f} |"), lines
    assert "s left" not in lines[0]


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
    the agent's exit within stability.hang_timeout_s, stops every node (the orphan included: checked
    by pid, alive when the failure was seen, dead before the relaunch), and the run finishes.
    The nodes rendezvous over Redis (store.kind=redis), from network namespaces as root: the
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
            f"stability.hang_timeout_s={hang_timeout_s}",
            "store.kind=redis",
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
