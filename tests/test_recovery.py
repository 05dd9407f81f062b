"""Recovery of runs that should be training but are not: the run registry (mega.launch.runs), a real
launcher killed mid-run and restarted by the `recover` flow onto the uninterrupted loss curve, and
the `recover-runs` deployment, schedule and automation of infra/prefect.yaml under real Prefect."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import prefect_deploy
from prefect_pool import ensure_work_pool
from waiting import wait_for

from mega.config import compose, from_dict, save
from mega.launch import runs

REPO = Path(__file__).resolve().parent.parent
STEPS = 4


# ---------------------------------------------------------------------------------------------
# The registry


def make_run(
    root: Path,
    name: str,
    *,
    state="training",
    host=None,
    pid=None,
    heartbeat_age_s=0.0,
    latest: str | None = None,
    **fields,
) -> Path:
    """A run directory with a config and a record, as a launcher would have left it."""
    run_dir = root / name
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True)
    cfg = from_dict(
        {
            "train": {"run_dir": str(run_dir), "steps": STEPS},
            "checkpoint": {"dir": str(ckpt), "interval": 2},
            "optimizer": {"warmup_steps": 1},
        }
    )
    save(cfg, run_dir / "config.json")
    if latest:
        (ckpt / "latest").write_text(latest)
    now = time.time()
    runs.write_record(
        runs.RunRecord(
            run_dir=str(run_dir),
            state=state,
            config=str(run_dir / "config.json"),
            data_index="/nowhere/index.json",
            target_steps=STEPS,
            cwd=str(root),
            pid=os.getpid() if pid is None else pid,
            host=socket.gethostname() if host is None else host,
            heartbeat=now - heartbeat_age_s,
            started=now,
            **fields,
        )
    )
    return run_dir


_DEAD_PID: list[int] = []


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    if not _DEAD_PID:
        proc = subprocess.Popen(["true"])
        proc.wait()
        _DEAD_PID.append(proc.pid)
    return _DEAD_PID[0]


def verdicts(root: Path, **kwargs) -> dict[str, str]:
    return {Path(s.run_dir).name: s.verdict for s in runs.scan_runs(root, stale_after_s=60, **kwargs)}


def test_registry_finds_runs_whose_launcher_is_gone(tmp_path):
    make_run(tmp_path, "alive")  # this process, fresh heartbeat
    make_run(tmp_path, "dead-pid", pid=dead_pid())
    make_run(tmp_path, "stale", host="another-host", heartbeat_age_s=600)
    make_run(tmp_path, "remote-fresh", host="another-host", heartbeat_age_s=5)
    make_run(tmp_path, "completed", state="completed", pid=dead_pid())
    make_run(tmp_path, "stopped", state="stopped", pid=dead_pid())
    make_run(tmp_path, "failed", state="failed", pid=dead_pid(), error="TrainingFailed: boom")
    make_run(tmp_path, "finished", pid=dead_pid(), latest=f"iter_{STEPS:07d}")  # died after the last save
    make_run(tmp_path, "exhausted", pid=dead_pid(), recoveries=3)

    assert verdicts(tmp_path) == {
        "alive": "alive",
        "dead-pid": "recover",
        "stale": "recover",
        "remote-fresh": "alive",
        "completed": "completed",
        "stopped": "stopped",
        "failed": "recover",
        "finished": "finished",
        "exhausted": "exhausted",
    }
    assert verdicts(tmp_path, include_failed=False)["failed"] == "failed"
    found = {Path(s.run_dir).name: s for s in runs.find_runs_to_recover(tmp_path, stale_after_s=60)}
    assert set(found) == {"dead-pid", "stale", "failed"}
    assert "is gone" in found["dead-pid"].reason and "heartbeat 6" in found["stale"].reason
    assert found["failed"].reason.startswith("failed at step 0 (TrainingFailed: boom)")

    partial = make_run(tmp_path / "more", "partial", pid=dead_pid(), latest="iter_0000002")
    (status,) = runs.scan_runs(tmp_path / "more", stale_after_s=60)
    assert (status.verdict, status.checkpoint, status.checkpoint_step) == ("recover", "iter_0000002", 2)
    runs.mark_finished(make_run(tmp_path / "more", "done", pid=dead_pid(), latest=f"iter_{STEPS:07d}"))
    assert runs.read_record(tmp_path / "more" / "done").state == "completed"
    assert runs.read_record(partial).state == "training"


@pytest.mark.parametrize(
    "content, error",
    [
        ('{"state": "training", "pid": ', "not valid JSON"),  # torn write of a non-atomic writer
        ("[1, 2]", "expected a JSON object"),
        ('{"state": "training"}', "missing field 'run_dir'"),
    ],
)
def test_bad_run_record_is_reported_and_skipped(tmp_path, content, error):
    make_run(tmp_path, "good", pid=dead_pid())
    bad = make_run(tmp_path, "bad", pid=dead_pid())
    (bad / runs.RUN_FILE).write_text(content)

    with pytest.raises(runs.RunRecordError, match=error) as info:
        runs.read_record(bad)
    assert str(bad / runs.RUN_FILE) in str(info.value)
    statuses = {Path(s.run_dir).name: s for s in runs.scan_runs(tmp_path, stale_after_s=60)}
    assert statuses["bad"].verdict == "error" and error in statuses["bad"].reason
    assert statuses["good"].verdict == "recover"  # the scan went on


def test_bad_state_and_unreadable_config_are_errors_not_crashes(tmp_path):
    weird = make_run(tmp_path, "weird", pid=dead_pid())
    record = json.loads((weird / runs.RUN_FILE).read_text())
    (weird / runs.RUN_FILE).write_text(json.dumps({**record, "state": "paused"}))
    no_config = make_run(tmp_path, "no-config", pid=dead_pid())
    (no_config / "config.json").unlink()

    statuses = {Path(s.run_dir).name: s for s in runs.scan_runs(tmp_path, stale_after_s=60)}
    assert statuses["weird"].verdict == "error" and "state 'paused'" in statuses["weird"].reason
    assert statuses["no-config"].verdict == "error" and "config.json" in statuses["no-config"].reason


def test_claim_is_exclusive_across_processes(tmp_path):
    run_dir = make_run(tmp_path, "run", pid=dead_pid())
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from mega.launch import runs\n"
            "with runs.hold(sys.argv[1], 'other recovery'):\n"
            "    print('held', flush=True); time.sleep(60)",
            str(run_dir),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert runs.held_elsewhere(run_dir)
        with pytest.raises(runs.RunBusy, match="other recovery"):
            with runs.hold(run_dir, "me"):
                pass
        # a run another process holds is being driven: not recovered, though its recorded pid is dead
        assert runs.inspect_run(run_dir, stale_after_s=60).verdict == "alive"
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the dead holder's claim; the claim is re-entrant in one process
    assert not runs.held_elsewhere(run_dir)
    with runs.hold(run_dir, "me"):
        with runs.hold(run_dir, "me again"):
            assert not runs.held_elsewhere(run_dir)
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from mega.launch import runs; print(runs.held_elsewhere(sys.argv[1]))",
                str(run_dir),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        assert probe.stdout.strip() == "True"
    assert runs.inspect_run(run_dir, stale_after_s=60).verdict == "recover"


def test_recover_flow_leaves_cancelled_and_unknown_runs_alone(prefect_harness, tmp_path):
    """A run whose driving flow run an operator cancelled stays stopped; a flow run that left no
    record (it failed before training) is reported, not an error; nothing is restarted."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Failed

    from flows.recover import recover

    @flow(name="pretrain")
    def stand_in():  # only its flow runs are needed: their states and ids
        pass

    with get_client(sync_client=True) as client:
        cancelled = client.create_flow_run(stand_in, state=Cancelled())
        no_record = client.create_flow_run(
            stand_in, parameters={"overrides": [f"train.run_dir={tmp_path}/x"]}, state=Failed()
        )
    make_run(tmp_path / "runs", "cancelled", pid=dead_pid(), flow_run_ids=[str(cancelled.id)])

    summary = recover(runs_root=str(tmp_path / "runs"))
    assert [(r["found"], r["action"]) for r in summary["runs"]] == [("cancelled", "none")]
    assert summary["restarted"] == []
    summary = recover(runs_root=str(tmp_path / "runs"), flow_run_id=str(no_record.id))
    (row,) = summary["runs"]
    assert row["found"] == "none" and "ended before training" in row["reason"]
    assert runs.read_record(tmp_path / "runs" / "cancelled").state == "training"  # untouched


# ---------------------------------------------------------------------------------------------
# A real launcher killed mid-run, restarted by the recover flow


def overrides(run_dir: Path, data_cache: Path, *extra: str) -> list[str]:
    # async_save=false: `latest` moves before the next step, so "checkpoint at step 2" is a fact
    # the test can wait for (an asynchronous save is published by a later step's poll).
    return [
        "model=tiny",
        "parallelism=single",
        f"train.steps={STEPS}",
        "checkpoint.interval=2",
        "checkpoint.async_save=false",
        "optimizer.warmup_steps=1",
        "restart.backoff_s=0",
        "train.tensorboard=false",
        f"train.run_dir={run_dir}",
        f"data.cache_dir={data_cache}",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(single_process_reference):
    """The uninterrupted run every recovered one must reproduce, bit-exact on CPU (conftest: its
    checkpoints and evaluation aside, the same run as these)."""
    assert runs.read_record(single_process_reference.run_dir).state == "completed"
    assert len(single_process_reference.metrics) == STEPS
    return single_process_reference.metrics


def test_recover_flow_restarts_a_run_whose_launcher_was_killed(
    prefect_harness, tmp_path, data_index, data_cache, reference
):
    """The launcher is SIGKILLed while its rank hangs at step 4 (checkpoint at step 2 durable): the
    record still says training, its pid is dead and the rank is orphaned. The recover flow finds
    it, stops the orphan, restarts from the rank's in-memory copy of step 3 (newer than the
    durable iter_0000002; the rank hung after its copy) and ends on the uninterrupted curve."""
    from mega.checkpoint import latest_durable

    run_dir = tmp_path / "runs" / "killed"
    # cold processes: warm ones (forks of a zygote whose lifeline is the launcher) die with it
    hang_at_step_4 = overrides(
        run_dir,
        data_cache,
        "fault.kill_rank=0",
        "fault.kill_at_step=3",
        "fault.mode=hang",
        "launcher.warm_processes=false",
    )
    cfg = compose(hang_at_step_4)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from mega import config; from mega.launch import run_training\n"
            "run_training(config.compose(sys.argv[2:]), sys.argv[1])",
            str(data_index),
            *hang_at_step_4,
        ],
        cwd=REPO,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: (
                latest_durable(cfg) == "iter_0000002"
                and (run_dir / "metrics.jsonl").exists()
                and len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
            ),
            300,
            "step 3 and a checkpoint",
        )
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher only: torchrun runs in its own session
        launcher.wait()
    try:
        check_recovery(tmp_path, run_dir, cfg, launcher, reference)
    finally:  # whatever happened, leave no rank of this test running
        runs.stop_processes(runs.processes_of(run_dir / "config.json"))


def check_recovery(tmp_path, run_dir, cfg, launcher, reference):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.recover import recover
    from mega.checkpoint import latest_durable
    from mega.metrics import read_metrics

    (status,) = runs.find_runs_to_recover(tmp_path / "runs", stale_after_s=60)
    assert status.record.state == "training" and f"launcher pid {launcher.pid} is gone" in status.reason
    orphans = status.orphans
    assert orphans, "the hung rank and its torchrun should still be running"

    state = recover(runs_root=str(tmp_path / "runs"), return_state=True)

    assert state.is_completed(), state
    summary = state.result()
    assert summary["restarted"] == [str(run_dir)]
    (row,) = summary["runs"]
    assert row["checkpoint"] == "iter_0000002" and row["final_step"] == STEPS
    assert not any(runs.pid_alive(p) for p in orphans)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restored = json.loads((run_dir / "init.json").read_text())["restore"]
    assert (restored["source"], restored["step"]) == ("memory", 3), restored
    assert [(r["step"], r["attempt"]) for r in rows] == [(1, 0), (2, 0), (3, 0), (4, 1)]  # none lost
    assert [m["loss"] for m in read_metrics(run_dir)] == [m["loss"] for m in reference]
    assert latest_durable(cfg) == f"iter_{STEPS:07d}"
    record = runs.read_record(run_dir)
    assert (record.state, record.final_step, record.attempts, record.recoveries) == ("completed", STEPS, 2, 1)
    assert record.flow_run_ids == [str(state.state_details.flow_run_id)]

    runs_filter = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        (artifact,) = [a for a in client.read_artifacts(flow_run_filter=runs_filter) if a.key == "recovery"]
    assert "iter_0000002" in json.dumps(artifact.data) and "restarted" in json.dumps(artifact.data)

    # a second pass finds nothing to do
    again = recover(runs_root=str(tmp_path / "runs"))
    assert again["restarted"] == [] and again["runs"][0]["found"] == "completed"


# ---------------------------------------------------------------------------------------------
# The deployment, its schedule and its automation, under a real Prefect server


def deploy_all() -> None:
    """`prefect deploy --all` of infra/prefect.yaml against the session's server, unless it ran
    already this session (tests/test_flow.py deploys the same file; a second deploy costs ~20 s)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name("recover/recover-runs")
            return
        except ObjectNotFound:
            pass
    ensure_work_pool()
    out = prefect_deploy("infra/prefect.yaml")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.slow  # ~80 s: a whole pretrain flow (self-check, bootstrap, training) and a recovery
def test_failed_pretrain_run_triggers_the_deployed_recovery(prefect_harness, tmp_path, data_cache, reference):
    """`prefect deploy --all` creates recover-runs (cron schedule, concurrency limit 1) and its
    automation; a real pretrain flow run whose training fails (a rank killed at step 4, no
    restarts left) ends Failed, the server's trigger service fires, and the flow run it creates
    for recover-runs, executed here, resumes the run onto the uninterrupted curve."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.flow_engine import run_flow

    from flows.pretrain import pretrain
    from flows.recover import recover
    from mega.launch import TrainingFailed
    from mega.metrics import read_metrics

    deploy_all()
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("recover/recover-runs")
        (automation,) = client.read_automations_by_name("recover-failed-pretrain")
    assert deployment.entrypoint == "flows/recover.py:recover" and deployment.work_pool_name == "mega-process"
    assert deployment.parameters == {"runs_root": "runs", "stale_after_s": 120}
    ((schedule),) = deployment.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == (
        "*/10 * * * *",
        "UTC",
        True,
    )
    assert deployment.global_concurrency_limit.limit == 1
    trigger = automation.trigger
    assert trigger.expect == {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}
    assert trigger.match_related.model_dump() == {
        "prefect.resource.role": "flow",
        "prefect.resource.name": "pretrain",
    }
    assert trigger.posture == "Reactive" and automation.enabled
    (action,) = automation.actions
    assert action.deployment_id == deployment.id
    assert action.parameters == {
        "runs_root": "runs",
        "flow_run_id": "{{ event.resource.id | replace('prefect.flow-run.', '') }}",
    }

    run_dir = tmp_path / "run"
    failed = pretrain(
        overrides=overrides(
            run_dir, data_cache, "fault.kill_rank=0", "fault.kill_at_step=3", "restart.max_restarts=0"
        ),
        return_state=True,
    )
    assert failed.is_failed()
    with pytest.raises(TrainingFailed):
        failed.result()
    failed_id = str(failed.state_details.flow_run_id)
    record = runs.read_record(run_dir)
    assert record.state == "failed" and record.flow_run_ids == [failed_id] and record.final_step == 3
    # the rank's death is an incident: a markdown artifact of the flow run and an event (docs/stability.md)
    [brief] = record.incidents
    assert (brief["kind"], brief["culprit_rank"], brief["culprit_node"]) == ("rank-exit", 0, 0)
    artifacts = flow_run_artifacts(failed.state_details.flow_run_id)
    [artifact] = [a for a in artifacts if a.key == "incident-run-000-attempt0-rank-exit"]
    assert "| culprit | rank 0 on node 0" in artifact.data and "rank 0 killed by SIGKILL" in artifact.data
    assert "| time to recovery | not recovered |" in artifact.data
    [event] = wait_for(
        lambda: incident_events(run_dir, "mega.incident.rank-exit"), 30, "the incident's event"
    )
    assert event.payload["culprit_rank"] == 0 and event.payload["stage"] == "detected"
    assert f"prefect.flow-run.{failed_id}" in {
        r.id for r in event.related
    }  # automations can match the flow run

    def triggered():
        with get_client(sync_client=True) as client:
            flow_runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
            )
        return [fr for fr in flow_runs if fr.parameters.get("flow_run_id") == failed_id]

    (flow_run,) = wait_for(triggered, 60, "the automation to create a recover-runs flow run")
    assert (flow_run.parameters["runs_root"], flow_run.parameters["flow_run_id"]) == ("runs", failed_id)

    # What a worker of the mega-process pool would do with it, in this process.
    state = run_flow(recover, flow_run=flow_run, parameters=flow_run.parameters, return_type="state")

    assert state.is_completed(), state
    (row,) = state.result()["runs"]
    assert (row["run_dir"], row["found"], row["checkpoint"], row["action"]) == (
        str(run_dir),
        "recover",
        "iter_0000002",
        "restarted",
    )
    assert [m["loss"] for m in read_metrics(run_dir)] == [m["loss"] for m in reference]
    record = runs.read_record(run_dir)
    assert (record.state, record.recoveries, record.flow_run_ids) == (
        "completed",
        1,
        [failed_id, str(flow_run.id)],
    )
    # the recovery's first step ends the incident: a second event, a new version of the artifact
    [back] = record.incidents
    assert back["time_to_recover_s"] > 0
    [event] = wait_for(
        lambda: incident_events(run_dir, "mega.recovery.rank-exit"), 30, "the recovery's event"
    )
    assert event.payload["time_to_recover_s"] == back["time_to_recover_s"]
    artifacts = flow_run_artifacts(flow_run.id)
    [artifact] = [a for a in artifacts if a.key == "incident-run-000-attempt0-rank-exit"]
    assert f"| time to recovery | {back['time_to_recover_s']:.1f} s |" in artifact.data


def flow_run_artifacts(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def incident_events(run_dir, name):
    """The events named ``name`` about run ``run_dir`` (tasks/incidents.py)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    with get_client(sync_client=True) as client:
        page = client.read_events(
            EventFilter(
                event=EventNameFilter(name=[name]),
                resource=EventResourceFilter(id=[f"mega.run.{run_dir.name}"]),
            ),
            limit=50,
        )  # the server's maximum (the client's default, 100, is refused)
    return [e for e in page.events if e.resource.get("mega.run-dir") == str(run_dir)]


# -- the policy (mega.launch.recovery), with the orchestrator's answers given ------------------------


def test_the_run_a_flow_run_drove_is_the_one_whose_record_names_it(tmp_path):
    from mega.launch import recovery

    a = make_run(tmp_path, "a", pid=dead_pid(), flow_run_ids=["fr-a"])
    b = make_run(tmp_path, "b", pid=dead_pid(), flow_run_ids=["fr-b"])
    said = []

    def from_parameters(flow_run_id):
        if flow_run_id == "fr-odd":
            raise KeyError("config")
        return a  # every flow run's parameters name directory a

    assert recovery.run_dir_of_flow_run(tmp_path, "fr-a", from_parameters, said.append) == a
    # a's record does not name fr-b (another run took the directory over): the records decide
    assert recovery.run_dir_of_flow_run(tmp_path, "fr-b", from_parameters, said.append) == b
    assert recovery.run_dir_of_flow_run(tmp_path, "fr-odd", from_parameters, said.append) is None
    assert said == ["flow run fr-odd: no run directory from its parameters ('config')"]


def test_a_run_whose_flow_run_was_cancelled_stays_stopped(tmp_path):
    from mega.launch import recovery

    make_run(tmp_path, "cancelled", pid=dead_pid(), flow_run_ids=["fr-1", "fr-2"])
    make_run(tmp_path, "orphaned", pid=dead_pid(), flow_run_ids=["fr-3"])
    make_run(tmp_path, "completed", state="completed", pid=dead_pid(), flow_run_ids=["fr-4"])
    asked = []
    found = recovery.statuses(tmp_path, None, 60, lambda ids: asked.append(ids) or {"fr-2", "fr-4"})
    verdicts = {Path(s.run_dir).name: (s.verdict, s.reason) for s in found}
    assert verdicts["cancelled"] == ("cancelled", "flow run fr-2 was cancelled")
    assert verdicts["orphaned"][0] == "recover" and verdicts["completed"][0] == "completed"
    assert asked == [["fr-2", "fr-3"]]  # only the last drivers of runs to recover are asked about


def test_restart_looks_again_under_the_claim(tmp_path):
    from mega.launch import recovery

    done = make_run(tmp_path, "done", pid=dead_pid(), latest=f"iter_{STEPS:07d}")
    live = make_run(tmp_path, "live", pid=dead_pid())
    (finished,) = recovery.statuses(done, done, 60, lambda ids: set())
    row = recovery.restart(finished, 60, flow_run_id="fr-1", log=lambda _: None)
    assert row["action"] == "marked completed" and runs.read_record(done).state == "completed"

    (scanned,) = recovery.statuses(live, live, 60, lambda ids: set())
    assert scanned.verdict == "recover"
    record = runs.read_record(live)  # another launcher took it up since the scan
    record.pid, record.heartbeat = os.getpid(), time.time()
    runs.write_record(record)
    row = recovery.restart(scanned, 60, flow_run_id="fr-1", log=lambda _: None)
    assert row["action"] == "skipped" and row["result"].startswith("alive: ")
