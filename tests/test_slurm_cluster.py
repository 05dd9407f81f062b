"""launcher=slurm against a real Slurm cluster on this machine (tests/slurm_cluster.py): three nodes,
each slurmd in its own network and UTS namespace, runs submitted by the driver with sbatch.

One file, one cluster (a session fixture); every run is the tiny model for a few steps."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from slurm_cluster import host, needs_slurm, slurm_cluster  # noqa: F401 - the fixture
from test_flow import flow_run_records

from mega.cluster.node import read_processes
from mega.config import compose
from mega.launch import slurm, slurm_local
from mega.launch.driver import run_training
from mega.launch.nodes import Nodes
from mega.metrics import read_metrics
from mega.stability.incident import read_incidents

pytestmark = [needs_slurm, pytest.mark.slow]

S3_SECRET = "s3-secret-never-in-slurm-4c1d"
LAYOUT = [
    "model=tiny",
    "model.num_layers=4",
    "parallelism=tp2-pp2-dp2",
    "optimizer.warmup_steps=1",
    "cluster.pg_timeout_s=120",
    "checkpoint.upload_timeout_s=30",  # a restore's wait for the store ends before pg_timeout_s
]
ON_SLURM = [
    "launcher=slurm",
    "cluster.launchers=[local,local-nodes,slurm]",
    "cluster.nodes=2",
    "launcher.slurm.exclusive=false",
    "launcher.slurm.mem=null",
]
# The drills test Slurm's side (signals, requeue, exclusion), not a layout: one rank per node.
DRILL = [
    "model=tiny",
    "parallelism=dp2",
    "optimizer.warmup_steps=1",
    "cluster.pg_timeout_s=120",
    "checkpoint.upload_timeout_s=30",  # a restore's wait for the store ends before pg_timeout_s
    "cluster.procs_per_node=1",
    "launcher.slurm.selfcheck=false",  # the flow's test checks the nodes in the allocation
]


def _cfg(run_dir: Path, *extra: str):
    return compose([*LAYOUT, *ON_SLURM, "cluster.procs_per_node=4", f"train.run_dir={run_dir}", *extra])


def _drill_cfg(run_dir: Path, *extra: str):
    return compose([*DRILL, *ON_SLURM, f"train.run_dir={run_dir}", *extra])


class _Watch(threading.Thread):
    """While a run goes on (every second): the job names squeue shows running, and the run's
    secrets file (its mode and the values in it)."""

    def __init__(self, secrets: Path, state_dir: Path):
        super().__init__(daemon=True)
        self.secrets_file, self.state_dir = secrets, state_dir
        self.stored = ""  # what slurmctld holds of the running jobs: its record, script, environment
        self.names: set[str] = set()
        self.secrets: dict[str, str] = {}
        self.modes: set[int] = set()
        self.halt = threading.Event()

    def run(self):
        while not self.halt.is_set():
            out = subprocess.run(
                ["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, timeout=30
            ).stdout
            running = [line.split() for line in out.splitlines() if "RUNNING" in line]
            self.names |= {name for _, name, _ in running}
            for job_id, _, _ in running:
                self.stored += subprocess.run(
                    ["scontrol", "show", "job", "-dd", job_id], capture_output=True, text=True, timeout=30
                ).stdout
            for f in self.state_dir.glob("hash.*/job.*/*"):  # environment, script (while the job lives)
                with contextlib.suppress(OSError):
                    self.stored += f.read_bytes().decode(errors="replace")
            try:
                self.modes.add(self.secrets_file.stat().st_mode & 0o777)
                text = self.secrets_file.read_text()
            except OSError:
                text = ""
            self.secrets.update(line.split("=", 1) for line in text.splitlines() if "=" in line)
            self.halt.wait(1.0)


def _lose_node(cluster, k: int) -> list[int]:
    """Node k dies (every process in its namespace killed) and is marked DOWN at once, as a node
    health check would: Slurm's own notice of a silent slurmd takes 30-40 s here (SlurmdTimeout and
    its retries), which the driver only waits out. (Drills that strike without it: the first loss
    of the lost-node drill and ``allocation_run``.)"""
    pids = slurm_local.kill_node(cluster, k)
    subprocess.run(
        ["scontrol", "update", f"nodename={cluster.hostnames[k]}", "state=down", "reason=mega-drill"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return pids


def _job_ids(run_dir: Path) -> list[str]:
    return [p.read_text() for p in sorted((run_dir / "slurm").glob("*/job_id"))]


@pytest.fixture(scope="module")
def local_losses(one_node_3d_reference):
    """The same layout on one node under launcher=local: the reference curve (conftest: shared with
    tests/test_launch.py)."""
    return [m["loss"] for m in one_node_3d_reference.metrics]


def test_the_flow_on_two_slurm_nodes_trains_as_one_local_node_and_keeps_secrets_out_of_slurm(
    slurm_cluster, tmp_path, data_cache, local_losses, prefect_harness, monkeypatch
):
    """flows.pretrain with launcher=slurm (the driver in the run's job), tp2-pp2-dp2 on 2 Slurm nodes
    x 4 ranks and a spare: one Slurm job (squeue) whose first step self-checks its three hosts; node 1
    fails (fault.bad_node), its host is excluded and the spare trains in its place, and the flow
    publishes that verdict as its self-check artifact. The losses equal launcher=local's, every
    rank's heartbeats reach the driver's Redis on the first node, and neither the Redis password
    nor an S3 secret is in anything Slurm stores or the scripts."""
    from flows.pretrain import pretrain
    from mega.launch import slurm_steps

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    run_dir = tmp_path / "run"
    overrides = [
        *LAYOUT,
        *ON_SLURM,
        "cluster.procs_per_node=4",
        f"train.run_dir={run_dir}",
        "train.steps=4",
        f"data.cache_dir={data_cache}",
        "store.kind=redis",  # a local Redis, with a password, on the bridge
        "restart.spare_nodes=1",
        "fault.bad_node=1",  # its self-check's GEMM check reports a fault
    ]
    watch = _Watch(run_dir / "slurm" / "secrets.env", Path(slurm_cluster.root) / "state")
    watch.start()
    try:
        state = pretrain(overrides=overrides, return_state=True)
    finally:
        watch.halt.set()
        watch.join(10)
    assert state.is_completed(), state
    summary = state.result()
    assert summary["training"]["attempts"] == 1 and summary["training"]["final_step"] == 4
    assert watch.names == {"mega-run-driver"}  # one job: no self-check job, no job per attempt
    check = summary["selfcheck"]  # the job's first step, on each of its hosts
    verdicts = {(n["node"], n["address"], n["healthy"]) for n in check["nodes"]}
    assert verdicts == {(0, host(0), True), (1, host(1), False), (2, host(2), True)}, check
    assert check["excluded_hosts"] == [host(1)] and not check["healthy"], check
    step = (run_dir / "slurm" / "selfcheck" / "srun.sh").read_text()
    assert f"--nodelist={host(0)},{host(1)},{host(2)}" in step and "--nodes=3" in step, step
    _, artifacts = flow_run_records(state.state_details.flow_run_id)
    [published] = [a for a in artifacts if a.key == "node-selfcheck"]
    assert "UNHEALTHY" in published.description and f"{host(1)} excluded" in published.description
    record = json.loads((run_dir / "run.json").read_text())
    assert [(e["node"], e["host"]) for e in record["evicted_nodes"]] == [(1, host(1))], record

    losses = [m["loss"] for m in read_metrics(run_dir)]
    assert max(abs(a - b) for a, b in zip(losses, local_losses, strict=True)) <= 1e-6, (losses, local_losses)

    procs = [
        json.loads(line)
        for p in sorted(run_dir.glob("nodes/*/procs-attempt0.jsonl"))
        for line in p.read_text().splitlines()
    ]
    assert {(p["node"], p["host"]) for p in procs} == {(0, host(0)), (1, host(2))}  # the spare
    beats = json.loads((run_dir / "heartbeats-attempt0.json").read_text())
    assert sorted(int(r) for r, b in beats["ranks"].items() if b["sent"] > 0) == list(range(8))

    stored = watch.stored
    script = "".join(
        (run_dir / "slurm" / name).read_text()
        for name in ("driver/job.sbatch", "selfcheck/srun.sh", "train-attempt0/srun.sh")
    )
    assert watch.modes == {0o600}
    assert watch.secrets["AWS_SECRET_ACCESS_KEY"] == repr(S3_SECRET).strip("'")
    assert {"MEGA_REDIS_PASSWORD", "MEGA_HEARTBEAT_PASSWORD"} <= set(
        watch.secrets
    )  # the ranks read them there
    assert f"export {slurm_steps.INSIDE_ENV}=1" in stored  # the driver job's script is in Slurm ...
    for value in [S3_SECRET, *(v.strip("'") for v in watch.secrets.values())]:
        assert value not in stored and value not in script  # ... its secrets are not
    assert not (run_dir / "slurm" / "secrets.env").exists()  # gone once the run ended


def _when_started(run_dir: Path, action, attempt: int, timeout_s: float = 300.0) -> threading.Thread:
    """A thread that calls ``action()`` once a rank of ``attempt`` recorded its process."""

    def wait():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(run_dir.glob(f"nodes/*/procs-attempt{attempt}.jsonl")):
                action()
                return
            time.sleep(0.2)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def _when_step(
    run_dir: Path, step: int, action, attempt: int | None = 0, timeout_s: float = 300.0
) -> threading.Thread:
    """A thread that calls ``action()`` once ``attempt`` (None: any) has logged ``step`` (gives up
    after ``timeout_s``)."""

    def wait():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").exists() and any(
                r["step"] >= step and attempt in (None, r.get("attempt")) for r in read_metrics(run_dir)
            ):
                action()
                return
            time.sleep(0.1)  # the tiny model's next step and its save can take less than half a second

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def test_a_hung_rank_on_node_1_is_named_with_its_host_its_job_cancelled_and_a_new_attempt_finishes(
    slurm_cluster, tmp_path, data_index
):
    """SIGSTOP rank 1 (node 1's only rank) after step 3: the watcher's hang incident names that rank,
    node 1 and its host; the driver (in the run's job) cancels the attempt's step and a new step of
    the same job resumes from the in-memory copies (or step 2's save) and finishes."""
    from mega.bench.faults import stop_rank_when

    run_dir = tmp_path / "run"
    cfg = _drill_cfg(
        run_dir,
        "train.steps=4",
        "checkpoint.interval=2",
        "checkpoint.async_save=false",
        "restart.backoff_s=0",
        "stability.hang_timeout_s=120",
        "checkpoint.upload_timeout_s=10",
        "stability.heartbeat_s=1",
        "stability.min_hang_s=20",
        "stability.progress_factor=10",
    )
    stopped: dict = {}
    stopper = threading.Thread(target=stop_rank_when, args=(run_dir, 1, 3, stopped), daemon=True)
    stopper.start()
    try:
        result = run_training(cfg, data_index, log=lambda _: None)
    finally:
        stopper.join(10)
    assert stopped.get("node") == 1, "rank 1 was never stopped"
    assert result.final_step == 4 and result.attempts == 2, result.history
    assert result.history[0]["reason"].startswith("hung: ")
    # the in-memory copies of step 3 (2: the rank stopped before its copy of step 3 was complete)
    assert result.restored.endswith(("iter_0000002", "iter_0000003")), result.history
    [inc] = read_incidents(run_dir)
    assert inc["kind"] == "hang" and inc["action"] == "relaunch from latest"
    c = inc["culprit"]
    assert (c["rank"], c["node"], c["host"], c["reason"]) == (1, 1, host(1), "silent"), c
    [job_id] = _job_ids(run_dir)
    assert slurm.job_info(job_id)["JobState"] == "COMPLETED"
    steps = [(run_dir / "slurm" / f"train-attempt{h['attempt']}" / "srun.log") for h in result.history]
    assert all(p.exists() for p in steps), result.history  # one srun step per attempt


@pytest.mark.parametrize("driver", ["host", "allocation"])
def test_slurms_time_limit_warning_requeues_from_the_save_with_no_step_lost(
    slurm_cluster, tmp_path, data_index, driver
):
    """The short partition, a 3-minute limit and ``--signal=B:USR1@150``: slurmctld's own timer sends
    the warning. It checks limits every 30 s and sends a warning due before the next check at once,
    so here it comes within about 30 s of the job's start (Slurm's documented "up to 60 s early"),
    possibly before the ranks run. Standing in for a long first step, rank 0 is frozen (SIGSTOP) from
    its start until the warning has come (the batch shell's file), so the warning comes before step 1
    ends whatever the machine's load. The ranks finish step 1, save it and exit; the driver resubmits
    from that save without spending a restart (max_restarts=0) -- in its allocation, it requeues its
    own job, which runs again under the same id -- and the next run does step 2 (warned too, it
    saves and ends, or ends before its warning)."""
    from mega.launch import slurm_steps

    run_dir = tmp_path / "run"
    cfg = _drill_cfg(
        run_dir,
        "train.steps=2",
        "launcher.slurm.partition=short",
        "launcher.slurm.time=3",  # 150 s after the warning: the driver's start, the ranks' and their save
        "launcher.slurm.signal_grace_s=150",
        "checkpoint.interval=100",
        "restart.max_restarts=0",
        "stability.min_hang_s=120",
        f"launcher.slurm.driver={driver}",
    )
    if driver == "host":
        warned = run_dir / "slurm" / "train-attempt0" / "exit" / "signalled"
    else:  # the driver job's file (removed when the requeued job starts again: seen is enough)
        warned = slurm_steps.warning_file(run_dir)
    frozen: dict = {}

    def freeze_rank0_until_warned():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not warned.exists():
            procs = {p["rank"]: p["pid"] for p in read_processes(run_dir, 0)}
            if 0 in procs and not frozen:
                os.kill(procs[0], signal.SIGSTOP)
                frozen["pid"] = procs[0]
            time.sleep(0.2)
        frozen["warned"] = warned.exists()
        if "pid" in frozen:
            # the node tasks see the warning file and pass SIGUSR1 on (resent every 2 s): let it
            # reach every rank before rank 0 runs on, or two quick steps finish the run first
            time.sleep(3)
            os.kill(frozen["pid"], signal.SIGCONT)

    freezer = threading.Thread(target=freeze_rank0_until_warned, daemon=True)
    freezer.start()
    try:
        result = run_training(cfg, data_index, log=lambda _: None)
    finally:
        freezer.join(30)
    assert frozen.get("warned"), "slurmctld never sent the warning"
    first_job = slurm.job_info(_job_ids(run_dir)[0])
    assert first_job["Partition"] == "short" and first_job["TimeLimit"] == "00:03:00"
    if driver == "allocation":  # one job, requeued once by its driver, completed in its second run
        assert (len(_job_ids(run_dir)), first_job["Restarts"], first_job["JobState"]) == (1, "1", "COMPLETED")
    assert result.final_step == 2
    first, second = result.history
    assert first.get("requeued") and first["final_step"] == 1, result.history
    assert second["code"] in (0, slurm.PREEMPTED), (
        result.history
    )  # done, or warned at its last step: no failure
    assert second["restored"].endswith("iter_0000001"), result.history
    rows = read_metrics(run_dir)
    assert [(r["step"], r["attempt"]) for r in rows] == [
        (1, first["attempt"]),
        (2, second["attempt"]),
    ]  # none lost


def test_a_lost_node_goes_to_the_spare_and_with_no_spare_left_dp_shrinks(slurm_cluster, tmp_path, data_index):
    """driver=host: node 1 dies mid-run (every process in its namespace killed): the driver
    relaunches with ``--exclude`` of its host and Slurm gives the third node (the spare). Then the
    spare dies too (marked DOWN at once: ``_lose_node``): no usable node is left beyond the first,
    so with ``restart.min_nodes=1`` the run goes on on one node (DP 2 -> 1, global batch kept) with
    both lost hosts excluded, and finishes. (In the allocation: ``allocation_run`` below.)"""
    run_dir = tmp_path / "run"
    cfg = _drill_cfg(
        run_dir,
        "launcher.slurm.driver=host",
        "train.steps=6",
        "checkpoint.interval=2",
        "launcher.slurm.stop_timeout_s=5",
        "restart.backoff_s=0",
        "restart.min_nodes=1",
    )
    killed: dict[int, list[int]] = {}

    def kill(k: int) -> None:
        # node 2 (the spare) dies in the attempt after the one node 1 died in, whatever the numbers
        # (an attempt that failed on its own before the kills adds one)
        attempt = max((r.get("attempt", 0) for r in read_metrics(run_dir)), default=0)
        killed[k] = (slurm_local.kill_node if k == 1 else _lose_node)(slurm_cluster, k)
        if k == 1:  # as soon as the next attempt's ranks run: its steps after the resume take < 1 s
            killers.append(_when_started(run_dir, lambda: kill(2), attempt + 1))

    killers = [_when_step(run_dir, 2, lambda: kill(1), None)]
    said: list[str] = []
    try:
        result = run_training(cfg, data_index, log=said.append)
    finally:
        for thread in list(killers):
            thread.join(10)
        for k in (1, 2):
            if k in killed:
                slurm_local.restart_node(slurm_cluster, k)
    assert killed.get(1) and killed.get(2), f"nodes killed: {sorted(killed)}"
    assert result.final_step == 6, result.history
    assert [h.get("excluded_hosts") for h in result.history[-3:]] == [
        [host(1)],
        [host(2)],
        None,
    ]
    spare, shrunk = (slurm.job_info(j) for j in _job_ids(run_dir)[-2:])
    assert spare["ExcNodeList"] == host(1)
    assert slurm.hostnames(spare["NodeList"]) == [host(0), host(2)]
    assert slurm.hostnames(shrunk["ExcNodeList"]) == [host(1), host(2)]
    assert slurm.hostnames(shrunk["NodeList"]) == [host(0)] and shrunk["NumNodes"] == "1"
    # Slurm held the spare down before the attempt ended (its hosts excluded at once), or the
    # diagnosis's self-check could not start on it and evicted it: either way the run says so
    assert any(
        "continuing on 1 node(s), dp 1" in line or "continuing on 1 nodes: dp 2 -> 1" in line for line in said
    ), said
    last = json.loads((run_dir / "config.json").read_text())
    assert (last["cluster"]["nodes"], last["parallelism"]["dp"]) == (1, 1)
    assert [r["step"] for r in read_metrics(run_dir) if r.get("attempt") == result.history[-1]["attempt"]][
        -1
    ] == 6


def test_a_recovery_cancels_the_runs_live_job_before_it_submits_and_no_other(
    slurm_cluster, tmp_path, data_index
):
    """A recovery (``run_training(recovery=True)``) while the run's old job still runs: that job
    (found by its script under the run's slurm/) is cancelled and has ended before the new job is
    submitted -- never two jobs of one run -- while another run's job runs on. Each old job holds a
    whole node, so the new 2-node job could not start beside the run's old one either."""
    jobs = {}
    for run in ("run", "other"):
        script = tmp_path / run / "slurm" / "train-attempt0" / "job.sbatch"
        script.parent.mkdir(parents=True)
        script.write_text(
            "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --exclusive\n#SBATCH --output=/dev/null\nsleep 600\n"
        )
        jobs[run] = subprocess.run(
            ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
    deadline = time.monotonic() + 60
    while any(slurm.job_info(j).get("JobState") != "RUNNING" for j in jobs.values()):
        assert time.monotonic() < deadline, {r: slurm.job_info(j).get("JobState") for r, j in jobs.items()}
        time.sleep(0.5)
    said: list[str] = []
    cfg = _drill_cfg(tmp_path / "run", "train.steps=2", "launcher.slurm.stop_timeout_s=60")
    try:
        result = run_training(cfg, data_index, log=said.append, recovery=True)
        old, new = slurm.job_info(jobs["run"]), slurm.job_info(_job_ids(tmp_path / "run")[-1])
        assert result.final_step == 2 and new["JobState"] == "COMPLETED"
        assert old["JobState"] == "CANCELLED" and old["EndTime"] <= new["SubmitTime"], (old, new)
        assert any(f"cancelled this run's Slurm job(s) {jobs['run']} " in line for line in said), said
        assert slurm.job_info(jobs["other"])["JobState"] == "RUNNING"
    finally:
        subprocess.run(["scancel", *jobs.values()], timeout=30)


IN_ALLOCATION = ["launcher.slurm.driver=allocation"]
# 2 nodes and a spare in one job; checkpoints every 2 steps
ALLOCATION_RUN = ["train.steps=4", "checkpoint.interval=2", "restart.backoff_s=0"]


@pytest.fixture(scope="module")
def allocation_run(slurm_cluster, tmp_path_factory, data_index):
    """One run with launcher.slurm.driver=allocation (2 nodes + 1 spare, dp2) in which node 1 dies
    at step 2 (every process in its namespace), and the jobs squeue showed meanwhile."""
    run_dir = tmp_path_factory.mktemp("slurm-alloc") / "run"
    cfg = _drill_cfg(
        run_dir,
        *ALLOCATION_RUN,
        "launcher.slurm.stop_timeout_s=5",
        "restart.spare_nodes=1",
        *IN_ALLOCATION,
    )
    killed: dict[int, list[int]] = {}
    killer = _when_step(run_dir, 2, lambda: killed.update({1: slurm_local.kill_node(slurm_cluster, 1)}), None)
    watch = _Watch(run_dir / "slurm" / "secrets.env", Path(slurm_cluster.root) / "state")
    watch.start()
    said: list[str] = []
    try:
        result = run_training(cfg, data_index, log=said.append)
    finally:
        watch.halt.set()
        watch.join(10)
        killer.join(10)
        if killed:
            slurm_local.restart_node(slurm_cluster, 1)
    assert killed.get(1), "node 1 was never killed"
    return run_dir, result, said, watch.names


def test_the_driver_in_the_allocation_runs_on_its_first_node_with_one_job_for_the_run(
    allocation_run, tmp_path, data_index
):
    """driver=allocation: one Slurm job for the whole run (its relaunch included), whose first node
    runs the driver (its log passed on to the submitter's); the losses equal one local node's (dp2),
    the relaunch after the lost node continuing the same curve."""
    run_dir, result, said, names = allocation_run
    assert result.final_step == 4, result.history
    assert names == {"mega-run-driver"}  # one job, never one per attempt
    [job_id] = _job_ids(run_dir)
    assert f"driver on {host(0)} in Slurm job {job_id}" in said, said[:5]
    assert slurm.job_info(job_id)["JobState"] == "COMPLETED"
    one_node = [o for o in DRILL if not o.startswith("cluster.procs_per_node")] + ["cluster.procs_per_node=2"]
    local = compose([*one_node, *ALLOCATION_RUN, f"train.run_dir={tmp_path / 'ref'}"])
    reference = [m["loss"] for m in run_training(local, data_index, log=lambda _: None).metrics]
    losses = {m["step"]: m["loss"] for m in result.metrics}  # a step redone after the loss: its last row
    assert max(abs(losses[i + 1] - ref) for i, ref in enumerate(reference)) <= 1e-6, (losses, reference)


def test_in_the_allocation_a_lost_node_is_replaced_by_its_spare_in_a_new_step_of_the_same_job(allocation_run):
    """Node 1 lost: the driver excludes its host and the next attempt is an srun step of the same
    job on the first node and the spare (no second submission, no queue wait)."""
    run_dir, result, said, _ = allocation_run
    assert [h.get("excluded_hosts") for h in result.history[-2:]] == [[host(1)], None], result.history
    assert any("the next attempt runs on a spare" in line for line in said), said
    last = result.history[-1]["attempt"]
    step = (run_dir / "slurm" / f"train-attempt{last}" / "srun.sh").read_text()
    assert f"--nodelist={host(0)},{host(2)}" in step, step
    hosts = {
        json.loads(line)["host"]
        for p in run_dir.glob(f"nodes/*/procs-attempt{last}.jsonl")
        for line in p.read_text().splitlines()
    }
    assert hosts == {host(0), host(2)}
    assert len(_job_ids(run_dir)) == 1


def test_in_the_allocation_a_lost_first_node_is_resubmitted_without_it_and_dp_shrinks(
    slurm_cluster, tmp_path, data_index
):
    """dp2 on two nodes in the driver's job, no spare, ``restart.min_nodes=1``: the first node (the
    driver's and rank 0's) dies after step 2 (marked DOWN at once: ``_lose_node``). Once Slurm
    drops that host from the job, the submitter cancels the job and submits one of a single node
    with the host in ``--exclude``; its driver continues the lost driver's loop (attempt numbers go
    on, the lost attempt counted as a failure) on one node (DP 2 -> 1, global batch kept) from the
    last save and finishes."""
    run_dir = tmp_path / "run"
    cfg = _drill_cfg(
        run_dir,
        "train.steps=3",
        "checkpoint.interval=1",
        "checkpoint.async_save=false",
        "restart.backoff_s=0",
        "restart.min_nodes=1",
        "launcher.slurm.stop_timeout_s=5",
        *IN_ALLOCATION,
    )
    killed: dict[int, list[int]] = {}

    def kill_the_drivers_node():
        # rank 0 (on the first node, the driver's) is frozen first: on a loaded machine the tiny
        # model's last step and its save take less than the scontrol calls before the node dies
        with contextlib.suppress(ProcessLookupError, StopIteration):
            os.kill(next(p["pid"] for p in read_processes(run_dir, 0) if p["rank"] == 0), signal.SIGSTOP)
        first = _job_ids(run_dir)[0]
        k = int(slurm.job_info(first)["BatchHost"].rsplit("n", 1)[1])
        killed[k] = _lose_node(slurm_cluster, k)

    killer = _when_step(run_dir, 2, kill_the_drivers_node, 0)
    said: list[str] = []
    try:
        result = run_training(cfg, data_index, log=said.append)
    finally:
        killer.join(10)
        for k in killed:
            slurm_local.restart_node(slurm_cluster, k)
    [lost] = [host(k) for k in killed]
    assert result.final_step == 3 and result.attempts == 2, result.history
    assert result.history[0]["excluded_hosts"] == [lost], result.history
    assert any(f"resubmitted without {lost}, continuing on 1 node(s) (failure 1)" in x for x in said), said
    jobs = [line.split()[3].rstrip(":") for line in said if line.startswith("submitted Slurm job ")]
    first_job, second = (slurm.job_info(j) for j in jobs)
    assert first_job["JobState"] != "RUNNING" and second["JobState"] == "COMPLETED", (first_job, second)
    assert second["ExcNodeList"] == lost and second["NumNodes"] == "1", second
    assert lost not in slurm.hostnames(second["NodeList"]), second
    last = json.loads((run_dir / "config.json").read_text())
    assert (last["cluster"]["nodes"], last["parallelism"]["dp"]) == (1, 1)
    assert result.history[-1]["attempt"] > result.history[0]["attempt"], result.history
    assert result.history[-1]["restored"].endswith(("1", "2")), result.history
    assert {r["step"] for r in read_metrics(run_dir)} == {1, 2, 3}


def test_a_step_with_a_dead_node_is_signalled_at_once(slurm_cluster, tmp_path):
    """The SIGTERM that stops an attempt (``slurm.signal_steps``) reaches the live node's task at
    once while the other node is dead (every process in its namespace killed): scancel through
    slurmctld returns at once, where scancel straight to the nodes' slurmds waits ~11 s on the dead
    one before it returns (MessageTimeout 10 s)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    # \$: the task's shell expands its own node id, not the batch script's
    task = f"trap 'touch {marks}/term-\\$SLURM_NODEID; exit 0' TERM; touch {marks}/up-\\$SLURM_NODEID; sleep 600 & wait"
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --output=/dev/null\n"
        f"#SBATCH --nodelist={host(0)},{host(1)}\n"
        f'srun --nodes=2 --ntasks-per-node=1 bash -c "{task}"\n'
    )
    job = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    killed = []
    try:
        deadline = time.monotonic() + 60
        while not all((marks / f"up-{k}").exists() for k in (0, 1)):
            assert time.monotonic() < deadline, slurm.job_info(job)
            time.sleep(0.2)
        # a step slurmctld refuses (there is no step 9) comes back as scancel's error, not silence
        assert "scancel" in (slurm.signal_steps([f"{job}.9"], "TERM", attempts=1) or "")
        # srun finishes launching the step just after its tasks start; a node lost before that makes
        # srun cancel the step itself (no TERM reaches node 0's trap): this test is about the signal
        time.sleep(1)
        killed = slurm_local.kill_node(slurm_cluster, 1)
        t0 = time.monotonic()
        error = slurm.signal_steps([f"{job}.0"], "TERM")
        returned = time.monotonic() - t0
        while not (marks / "term-0").exists() and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        reached = time.monotonic() - t0
        show_step = ["scontrol", "show", "step", f"{job}.0"]  # in the message: run only on failure
        assert error is None and returned < 3 and reached < 5, (
            error,
            returned,
            reached,
            subprocess.run(show_step, capture_output=True, text=True).stdout,
            slurm.job_info(job),
        )
    finally:
        subprocess.run(["scancel", job], timeout=30)
        if killed:
            slurm_local.restart_node(slurm_cluster, 1)


def test_a_node_whose_failure_ends_the_job_is_still_one_of_its_hosts(slurm_cluster, tmp_path):
    """While a job completes Slurm lists only its nodes still completing: node 1 dead and the job
    cancelled, NodeList shows node 1 alone, and a node that failed first is no longer in it. The
    backend keeps the hosts it read while the job ran (``poll``), so the lost host is found among
    them (``lost_hosts``) and never read from a completing job's partial list."""
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --output=/dev/null\n"
        f"#SBATCH --nodelist={host(0)},{host(1)}\nsrun --nodes=2 sleep 600\n"
    )
    job = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    cfg = _drill_cfg(tmp_path / "run", "launcher.slurm.driver=host")
    watched, fresh = (slurm.SlurmBackend(cfg, tmp_path / run, log=lambda _: None) for run in ("a", "b"))
    for backend in (watched, fresh):
        backend.job_id, backend._exit_dir = job, tmp_path / "exit"
    killed = []
    try:
        deadline = time.monotonic() + 60
        while slurm.job_state(job) != "RUNNING":
            assert time.monotonic() < deadline, slurm.job_info(job)
            time.sleep(0.2)
        watched.poll()  # what the driver's watch does every half second
        killed = slurm_local.kill_node(slurm_cluster, 1)
        subprocess.run(["scancel", job], check=True, timeout=30)
        while (info := slurm.job_info(job)).get("NodeList") != host(1):  # node 0 done, node 1 never
            assert time.monotonic() < deadline, info
            time.sleep(0.2)
        assert info["JobState"] == "COMPLETING"
        assert fresh.hosts() == []  # not node 1 alone as node rank 0
        assert watched.hosts() == [host(0), host(1)]
        _lose_node(slurm_cluster, 1)
        assert watched.lost_hosts() == [host(1)]
    finally:
        subprocess.run(["scancel", job], timeout=30)
        if killed:
            slurm_local.restart_node(slurm_cluster, 1)


def test_a_self_check_that_cannot_start_on_a_dead_node_evicts_that_node_alone(slurm_cluster, tmp_path):
    """Node 1 dead before Slurm knows (its slurmd killed, the node still idle to slurmctld): the
    diagnosis's self-check job gets nodes 0 and 1, srun cannot start its task on node 1 ("Task
    launch ... failed on node"), aborts the step and kills node 0's task, which reports nothing
    either. Node 1 alone is evicted and its host excluded from later attempts; the run goes on on
    node 0 (DP 2 -> 1) with the same backend, so what it excluded before stays excluded."""
    cfg = _drill_cfg(
        tmp_path / "run",
        "launcher.slurm.driver=host",
        f"launcher.slurm.exclude=[{host(2)}]",
        "launcher.slurm.stop_timeout_s=5",
        "restart.min_nodes=1",
    )
    killed = slurm_local.kill_node(slurm_cluster, 1)
    nodes = Nodes(cfg, tmp_path / "run")
    backend, said = nodes.backend, []
    try:
        evicted = nodes.diagnose(1, [1], said.append)
        output = next((tmp_path / "run" / "diagnosis" / "attempt1").glob("slurm-*.out")).read_text()
        assert f"failed on node {host(1)}" in output, output  # the case under test happened
        assert [(e["node"], e.get("host")) for e in evicted] == [(1, host(1))], (evicted, said)
        assert nodes.backend is backend and backend.excluded == [host(1)]
        assert (nodes.cfg.cluster.nodes, nodes.cfg.parallelism.dp) == (1, 1)
    finally:
        nodes.close()
        if killed:
            slurm_local.restart_node(slurm_cluster, 1)


def test_down_leaves_no_process_of_the_cluster_behind():
    """``slurm_local.down`` (also the fixture's teardown) with a job step running: slurmstepd
    outlives its slurmd and rewrites its command line, yet down ends it, the job's processes and
    every daemon; no process of the cluster is left."""
    import psutil

    root = Path(tempfile.mkdtemp(prefix="mega-slurm-"))  # short: slurmstepd's socket paths are limited
    state = slurm_local.up(1, root, "10.218.0.0/24", timeout_s=120, net_id="slurmz")
    try:
        env = {**os.environ, **state.env()}
        subprocess.run(
            ["sbatch", "--output=/dev/null", "--wrap", "srun sleep 600"], env=env, check=True, timeout=30
        )
        deadline = time.monotonic() + 60
        while len(steps := [p for p in slurm_local._job_processes(state) if _is_stepd(p)]) < 2:
            assert time.monotonic() < deadline, "the job's batch step and srun step never started"
            time.sleep(0.5)
        left = slurm_local._job_processes(state)
    finally:
        slurm_local.down(root)
    procs = []
    for pid in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive and len(steps) == 2, (steps, alive)
    assert not [
        p for p in state.pids.values() if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
    ]
    assert (
        "mega-slurmz-n0" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )


def _is_stepd(pid: int) -> bool:
    import psutil

    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).name() == "slurmstepd"
    return False
