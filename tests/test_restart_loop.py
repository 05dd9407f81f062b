"""The driver's restart loop step by step (mega/launch/driver.py), on a scripted backend: each
attempt ends as its script says (the steps rank 0 logs, every node's exit code); no processes.
The loop on real ranks is tests/test_launch.py's, test_recovery.py's, test_eviction.py's."""

from __future__ import annotations

import contextlib
import copy
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mega import faults
from mega.config import compose
from mega.launch import driver, incidents, runs
from mega.launch.driver import REQUEUE, RESTART, Ended, Launch, LoopState, TrainingFailed
from mega.launch.nodes import Nodes
from mega.launch.slurm import PREEMPTED
from mega.launch.watch import JobOutcome
from mega.rank_env import ATTEMPT_ENV
from mega.stability import rollback
from mega.stability.membership import Membership

STEPS = 4


class ScriptedBackend:
    """A launch backend whose attempts end as scripted: ``(steps, codes)`` per attempt. ``start``
    appends the steps to metrics.jsonl as rank 0 would (with the job's attempt), ``poll`` answers
    the exit codes, every node's at once."""

    def __init__(self, run_dir: Path, script: list[tuple[list[int], dict[int, int | None]]]):
        self.run_dir, self.script = run_dir, list(script)
        self.jobs, self.stops, self.codes = [], 0, {}

    def start(self, job) -> None:
        self.jobs.append(job)
        steps, self.codes = self.script.pop(0)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            for s in steps:
                f.write(json.dumps({"step": s, "loss": 1.0, "attempt": int(job.env[ATTEMPT_ENV]), "time": 0}))
                f.write("\n")

    def wait_exit(self, seconds: float) -> None:  # the scripted agents have exited already
        pass

    def poll(self) -> dict[int, int | None]:
        return dict(self.codes)

    def stop(self) -> None:
        self.stops += 1

    def close(self) -> None:
        pass


class SlurmLike(ScriptedBackend):
    """Slurm's extras: hosts it holds down, how many nodes stay usable, a resized allocation."""

    def __init__(self, run_dir, script, lost: list[str], usable: int):
        super().__init__(run_dir, script)
        self.lost, self.usable, self.excluded, self.resized = lost, usable, [], None

    def lost_hosts(self) -> list[str]:
        return list(self.lost)

    def exclude(self, host: str) -> None:
        self.excluded.append(host)

    def usable_nodes(self) -> int:
        return self.usable

    def resize(self, cfg) -> None:
        self.resized = cfg.cluster.nodes


@pytest.fixture(scope="module")
def base_cfgs():
    common = [
        "model=tiny",
        f"train.steps={STEPS}",
        "restart.backoff_s=0",
        "restart.max_restarts=1",
        "launcher.slurm.max_requeues=1",
    ]
    one = compose([*common, "parallelism=single"])
    two = compose(
        [
            *common,
            "parallelism=tp2-pp2-dp2",
            "launcher=local-nodes",
            "cluster.nodes=2",
            "cluster.procs_per_node=4",
            "restart.min_nodes=1",
        ]
    )
    return {1: one, 2: two}


@pytest.fixture
def loop(base_cfgs, tmp_path):
    """``make(script, nodes=1, backend=None)``: a Launch on a scripted backend and the first state."""
    stack = contextlib.ExitStack()
    said: list[str] = []

    def make(script=(), nodes=1, backend=None):
        cfg = copy.deepcopy(base_cfgs[nodes])
        cfg.train.run_dir = str(tmp_path)
        cfg.checkpoint.dir = str(tmp_path / "checkpoints")
        backend = backend or ScriptedBackend(tmp_path, script)
        run = stack.enter_context(
            runs.track(tmp_path, config=tmp_path / "config.json", data_index="index.json", target_steps=STEPS)
        )
        book = incidents.IncidentFiler(run, None, said.append)
        launch = Launch(
            tmp_path, Path("index.json"), said.append, run, Nodes(cfg, tmp_path, backend), {}, book
        )
        return launch, LoopState(cfg, attempt=run.record.attempts), backend

    make.said = said
    with stack:
        yield make


def outcome(code: int, codes: dict, failed=()) -> JobOutcome:
    return JobOutcome(code, "completed" if code == 0 else f"exit {code}", list(failed), codes)


# -- the steps ----------------------------------------------------------------------------------


def test_launch_attempt_saves_the_config_and_hands_the_attempt_its_number_and_skipped_steps(loop, tmp_path):
    launch, state, _ = loop()
    launch.run.record.skipped_steps.append({"step": 3, "what": "loss is nan"})
    (tmp_path / "init.json").write_text("{}")  # the previous attempt's
    attempt = driver.launch_attempt(launch, replace(state, attempt=5))
    assert attempt.number == 5 and attempt.job.name == "train-attempt5"
    assert attempt.job.env[ATTEMPT_ENV] == "5" and attempt.job.env[rollback.SKIP_ENV] == "3"
    assert attempt.job.args == ["--config", str(tmp_path / "config.json"), "--data-index", "index.json"]
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == STEPS
    assert not (tmp_path / "init.json").exists()
    assert runs.read_record(tmp_path).attempts == 6  # the record counts the attempt as it starts


def test_watch_attempt_ends_on_a_failed_node_and_stops_every_node(loop):
    launch, state, backend = loop([([1, 2], {0: 1, 1: -9})], nodes=2)
    attempt = driver.launch_attempt(launch, state)
    o = driver.watch_attempt(launch, attempt)
    assert o.failed_nodes == [1] and o.code == -9 and "SIGKILL" in o.reason  # the killed one is the cause
    assert backend.stops == 1 and backend.jobs == [attempt.job]
    assert any("stopping every node" in m for m in loop.said)


def test_collect_outcome_reads_the_step_reached_and_what_the_ranks_restored(loop, tmp_path):
    launch, state, _ = loop([([1, 2, 3], {0: 1})])
    attempt = driver.launch_attempt(launch, state)
    o = driver.watch_attempt(launch, attempt)
    restore = {"checkpoint": "iter_0000002", "refused": [{"name": "iter_0000003"}]}
    (tmp_path / "init.json").write_text(json.dumps({"restore": restore}))
    ended = driver.collect_outcome(launch, attempt, o)
    assert ended.final_step == 3 and ended.restored == "iter_0000002" and not ended.outcome.ok
    assert runs.read_record(tmp_path).final_step == 3
    assert "attempt 0: resumed from iter_0000002, from the durable store (refused iter_0000003)" in loop.said
    (tmp_path / "init.json").write_text('{"restore": ')  # rank 0 died writing it
    assert driver.collect_outcome(launch, attempt, o).init == {}


@pytest.mark.parametrize(
    "code, codes, final_step, step, failure",
    [
        (0, {0: 0}, STEPS, driver.DONE, 0),
        (PREEMPTED, {0: PREEMPTED, 1: PREEMPTED}, STEPS, driver.DONE, 0),  # the signal came late
        (PREEMPTED, {0: PREEMPTED, 1: PREEMPTED}, 2, REQUEUE, 0),  # a requeue is no failure
        (PREEMPTED, {0: PREEMPTED, 1: 1}, 2, RESTART, 1),  # a node failed on its way out
        (0, {0: 0}, 2, RESTART, 1),  # every agent exited 0 short of train.steps
        (1, {0: 1}, STEPS, RESTART, 1),
    ],
)
def test_verdict_and_the_failure_budget(base_cfgs, code, codes, final_step, step, failure):
    cfg = base_cfgs[1]
    ended = Ended(outcome(code, codes), final_step, [], {})
    assert driver.verdict(ended, cfg) == step
    attempt = driver.Attempt(7, cfg, None, None, None)
    state = driver.counted(LoopState(cfg, attempt=7, failures=1), attempt, ended)
    assert (state.attempt, state.failures) == (8, 1 + failure)
    assert state.history[-1]["attempt"] == 7 and state.history[-1]["final_step"] == final_step


def test_the_cpu_peak_an_attempt_measured_goes_to_the_next_attempt_of_its_size(loop, tmp_path, monkeypatch):
    from mega import rank_env

    launch, state, _ = loop([([1], {0: 1}), ([2], {0: 1})])
    attempt = driver.launch_attempt(launch, state)
    assert rank_env.PEAK_FLOPS_ENV not in attempt.job.env  # the first attempt measures
    (tmp_path / "init.json").write_text(json.dumps({"peak_flops": 2.5e10, "world_size": 1}))
    ended = driver.collect_outcome(launch, attempt, driver.watch_attempt(launch, attempt))
    state = driver.counted(state, attempt, ended)
    env = driver.launch_attempt(launch, state).job.env
    monkeypatch.setenv(rank_env.PEAK_FLOPS_ENV, env[rank_env.PEAK_FLOPS_ENV])
    assert rank_env.peak_flops(1) == 2.5e10  # what the ranks of the relaunch read
    assert rank_env.peak_flops(2) is None  # measured at another size: measured again
    # an attempt that died before measuring (no init.json) hands on the one before it
    state = driver.counted(state, attempt, Ended(outcome(1, {0: 1}), 1, [], {}))
    assert dict(state.carried) == {rank_env.PEAK_FLOPS_ENV: env[rank_env.PEAK_FLOPS_ENV]}


def test_requeue_is_bounded_by_its_own_budget(loop, tmp_path):
    launch, state, _ = loop()
    attempt = driver.Attempt(0, state.cfg, None, None, None)
    ended = Ended(outcome(PREEMPTED, {0: PREEMPTED}), 2, [], {})
    state = replace(state, history=({"attempt": 0},))
    state = driver.requeue(launch, state, attempt, ended)  # 1 of at most 1
    assert state.requeues == 1 and state.failures == 0 and state.history[-1]["requeued"] is True
    with pytest.raises(TrainingFailed, match="requeued 2 times"):
        driver.requeue(launch, state, attempt, ended)
    assert runs.read_record(tmp_path).state == "failed"


def test_in_its_allocation_the_driver_requeues_its_job_and_the_next_run_continues_its_budgets(
    loop, tmp_path, monkeypatch
):
    """driver=allocation: a requeue ends this driver (JobRequeued, the run record still training)
    with what the job's next run continues from: the same budgets, history, config and excluded
    hosts (through JSON, as mega.launch.in_allocation hands them on)."""
    launch, state, _ = loop(backend=SlurmLike(tmp_path, (), [], 1))
    launch.nodes.backend.exclude("node-b")
    monkeypatch.setattr(driver.slurm_steps, "inside_allocation", lambda cfg: True)
    attempt = driver.Attempt(3, state.cfg, None, None, None)
    ended = Ended(outcome(PREEMPTED, {0: PREEMPTED}), 2, [], {})
    state = replace(state, attempt=4, failures=1, history=({"attempt": 3},))
    with pytest.raises(driver.JobRequeued) as requeued:
        driver.requeue(launch, state, attempt, ended)
    assert runs.read_record(tmp_path).state == "training"
    carried = json.loads(json.dumps(requeued.value.carried))
    again = SlurmLike(tmp_path, (), [], 1)
    resumed = driver._first_state(state.cfg, 4, Nodes(state.cfg, tmp_path, again), carried)
    assert (resumed.failures, resumed.requeues, resumed.attempt) == (1, 1, 4)
    assert resumed.history == ({"attempt": 3, "requeued": True},) and resumed.cfg == state.cfg
    assert again.excluded == ["node-b"]


def test_a_requeued_run_whose_nodes_fail_their_check_keeps_its_last_step(loop, tmp_path, monkeypatch):
    """driver=allocation: the job's next run checks its nodes again; a check that ends the run
    records it failed at the step it had reached, not at step 0."""
    from mega.stability.membership import CannotContinue

    launch, state, _ = loop(backend=SlurmLike(tmp_path, (), [], 1))
    launch.run.beat(final_step=3)
    monkeypatch.setattr(driver.slurm_steps, "inside_allocation", lambda cfg: True)

    def check(cfg, backend, run_dir, log):
        raise CannotContinue("no healthy node left")

    monkeypatch.setattr(driver.slurm_preflight, "check_allocation", check)
    with pytest.raises(TrainingFailed, match="no healthy node left"):
        driver.check_allocation(launch, state)
    record = runs.read_record(tmp_path)
    assert (record.state, record.final_step) == ("failed", 3)


def test_prepare_restart_spends_the_failure_budget_then_fails(loop, tmp_path):
    launch, state, _ = loop([([1, 2], {0: 1}), ([3], {0: 1})])
    for failures in (1, 2):
        attempt = driver.launch_attempt(launch, state)
        ended = driver.collect_outcome(launch, attempt, driver.watch_attempt(launch, attempt))
        state = driver.counted(state, attempt, ended)
        assert state.failures == failures
        if failures == 1:  # restart.max_restarts=1: one restart
            state = driver.prepare_restart(launch, state, attempt, ended)
    with pytest.raises(TrainingFailed, match="training failed 2 times"):
        driver.prepare_restart(launch, state, attempt, ended)
    record = runs.read_record(tmp_path)
    assert record.state == "failed" and [i["kind"] for i in record.incidents] == ["rank-exit", "rank-exit"]


def test_prepare_restart_takes_a_rollback_request_into_the_record(loop, tmp_path):
    launch, state, _ = loop([([1, 2], {0: 1})])
    attempt = driver.launch_attempt(launch, state)
    ended = driver.collect_outcome(launch, attempt, driver.watch_attempt(launch, attempt))
    request = {"attempt": 0, "step": 3, "what": "loss is nan", "kind": "nan", "time": time.time()}
    (tmp_path / rollback.ROLLBACK_FILE).write_text(json.dumps(request))
    state = driver.prepare_restart(launch, driver.counted(state, attempt, ended), attempt, ended)
    assert state.history[-1]["skipped_step"] == 3
    assert [s["step"] for s in runs.read_record(tmp_path).skipped_steps] == [3]
    assert driver.launch_attempt(launch, state).job.env[rollback.SKIP_ENV] == "3"  # the next attempt skips it


def test_prepare_restart_continues_on_fewer_nodes_when_slurm_loses_a_host(loop, tmp_path):
    backend = SlurmLike(tmp_path, [([1], {0: 0, 1: -9})], lost=["n2"], usable=1)
    launch, state, _ = loop(nodes=2, backend=backend)
    attempt = driver.launch_attempt(launch, state)
    ended = driver.collect_outcome(launch, attempt, driver.watch_attempt(launch, attempt))
    after = driver.prepare_restart(launch, driver.counted(state, attempt, ended), attempt, ended)
    assert backend.excluded == ["n2"] and backend.resized == 1
    assert after.history[-1]["excluded_hosts"] == ["n2"]
    assert (after.cfg.cluster.nodes, after.cfg.parallelism.dp) == (1, 1)  # the next attempt's config
    assert (state.cfg.cluster.nodes, attempt.cfg.cluster.nodes) == (2, 2)  # the earlier values stand


def test_diagnose_evicts_the_node_the_self_check_blames_and_the_next_attempt_runs_without_it(loop, tmp_path):
    # attempt 0: node 1's agent fails; the self-check job on the same backend: node 1's agent fails
    launch, state, backend = loop([([1, 2], {0: None, 1: 1}), ([], {0: None, 1: 1})], nodes=2)
    attempt = driver.launch_attempt(launch, state)
    ended = driver.collect_outcome(launch, attempt, driver.watch_attempt(launch, attempt))
    after = driver.prepare_restart(launch, driver.counted(state, attempt, ended), attempt, ended)
    assert backend.jobs[1].module == "mega.cluster.selfcheck"
    assert after.history[-1]["evicted"] == [1]
    assert (after.cfg.cluster.nodes, after.cfg.parallelism.dp) == (1, 1)  # restart.min_nodes=1: DP shrinks
    record = runs.read_record(tmp_path)
    assert [e["node"] for e in record.evicted_nodes] == [1] and record.membership["nodes"] == [0]
    assert [i["kind"] for i in record.incidents] == ["rank-exit", "eviction"]


class CheckBackend(ScriptedBackend):
    """The backend of a self-check beside the run: its job exits 0 and writes a verdict, every
    node healthy but the one the drill's environment names (``fault.bad_node``, as the real
    check's ranks read it)."""

    made = 0  # backends made: one per size, kept for every check of that size

    def __init__(self, cfg, out_dir: Path):
        super().__init__(out_dir, [])
        self.nodes = cfg.cluster.nodes
        CheckBackend.made += 1

    def start(self, job) -> None:
        self.script = [([], dict.fromkeys(range(self.nodes), 0))]
        super().start(job)
        bad = job.env.get(faults.SELFCHECK_BAD_NODE_ENV)
        rows = [
            {"node": k, "healthy": str(k) != bad, "reasons": [] if str(k) != bad else ["gemm"]}
            for k in range(self.nodes)
        ]
        out = Path(job.args[job.args.index("--out") + 1])
        out.write_text(json.dumps({"healthy": bad is None, "reasons": [], "nodes": rows}))


def fail_node_1(loop, extra=(), script=()):
    """Attempt 0 on 2 nodes with one spare: node 1's agent fails; through prepare_restart."""
    CheckBackend.made = 0
    launch, state, backend = loop([([1, 2], {0: None, 1: 1}), *script], nodes=2)
    for o in ["restart.spare_nodes=1", *extra]:
        key, value = o.split("=")
        section, name = key.split(".")
        setattr(getattr(launch.nodes.cfg, section), name, int(value))
    launch.nodes.members = Membership.initial(launch.nodes.cfg)
    launch.nodes.aside_backend = CheckBackend
    launch.nodes.check_spares(launch.log)
    attempt = driver.launch_attempt(launch, replace(state, cfg=launch.nodes.cfg))
    ended = driver.collect_outcome(launch, attempt, driver.watch_attempt(launch, attempt))
    after = driver.prepare_restart(launch, driver.counted(state, attempt, ended), attempt, ended)
    return launch, after, backend


def test_a_checked_spare_takes_a_failed_nodes_place_at_once_and_the_node_is_checked_beside_the_run(
    loop, tmp_path
):
    launch, after, backend = fail_node_1(loop, ["fault.bad_node=1"])
    assert [j.module for j in backend.jobs] == ["mega.train"]  # no self-check before the relaunch
    assert launch.nodes.members == Membership([0, 2], [], [])  # node 1 set aside: not evicted yet
    assert after.history[-1]["set_aside"] == [1] and after.cfg.cluster.nodes == 2
    assert after.cfg.fault.bad_node is None  # the relaunch runs clean
    [check] = launch.nodes.aside
    assert check.physical == [1] and check.thread.is_alive()  # held back until the relaunch trains
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "attempt": 1, "time": 0}) + "\n")
    check.thread.join(10)
    assert not check.thread.is_alive()
    settled = driver.settle_checks(launch, after)
    assert settled.history[-1]["evicted"] == [1]
    assert CheckBackend.made == 1 and len(launch.nodes._aside_backends[1].jobs) == 2  # spare, then node 1
    record = runs.read_record(tmp_path)
    assert [(e["node"], e["attempt"], e["replaced_by"]) for e in record.evicted_nodes] == [(1, 0, 2)]
    assert record.membership == {"nodes": [0, 2], "spares": [], "evicted": [1]}
    [evicted] = [i for i in record.incidents if i["kind"] == "eviction"]
    assert evicted["culprit_node"] == 1


def test_a_set_aside_node_that_passes_its_check_is_a_spare_again(loop, tmp_path):
    launch, after, _ = fail_node_1(loop)
    driver.settle_checks(launch, after)  # releases the held-back check and waits for it
    assert launch.nodes.members == Membership([0, 2], [1], [])
    assert runs.read_record(tmp_path).evicted_nodes == []


def test_a_spare_that_fails_its_check_never_trains_and_the_nodes_are_checked_first(loop, tmp_path):
    # the spare (node 2) fails its start-up check; node 1 fails, and its self-check job fails too
    launch, after, backend = fail_node_1(loop, ["fault.bad_node=2"], script=[([], {0: None, 1: 1})])
    assert [j.module for j in backend.jobs] == ["mega.train", "mega.cluster.selfcheck"]
    assert launch.nodes.members == Membership([0], [], [2, 1])  # restart.min_nodes=1: DP shrinks
    assert after.cfg.cluster.nodes == 1
    kinds = [(i["kind"], i["culprit_node"]) for i in runs.read_record(tmp_path).incidents]
    assert ("eviction", 2) in kinds and ("eviction", 1) in kinds


# -- the loop -----------------------------------------------------------------------------------


def test_the_loop_restarts_a_failure_and_requeues_a_signal_until_done(loop, tmp_path):
    script = [
        ([1, 2], {0: 1}),  # a rank failed: restart (backoff 0 s)
        ([3], {0: PREEMPTED}),  # Slurm's signal short of the end: requeue, not counted
        ([4], {0: 0}),
    ]
    launch, state, backend = loop(script)
    result = driver.train_with_restarts(launch, state)
    assert (result.attempts, result.final_step) == (2, STEPS)
    assert [h["attempt"] for h in result.history] == [0, 1, 2]
    assert [h.get("requeued", False) for h in result.history] == [False, True, False]
    assert [j.env[ATTEMPT_ENV] for j in backend.jobs] == ["0", "1", "2"]
    assert runs.read_record(tmp_path).attempts == 3
