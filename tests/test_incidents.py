"""Every fault an incident (mega/launch/incidents.py), the error patterns of rank logs
(mega/stability/logscan.py) and the Prefect side's names (tasks/incidents.py). The logs are real
agent logs of mega's drills (tests/fixtures/logs/README.md); the drills themselves check their
incidents in tests/test_launch.py, test_rollback.py, test_eviction.py and test_recovery.py."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mega.config import compose
from mega.launch.backend import JobSpec
from mega.launch.incidents import Diagnosed, IncidentFiler, narrow_to_culprits, suspect_nodes
from mega.launch.runs import read_record, track
from mega.launch.watch import JobOutcome
from mega.stability import logscan
from mega.stability.incident import Incident, read_incidents

LOGS = Path(__file__).parent / "fixtures" / "logs"


def scan(*names: str) -> dict:
    return logscan.scan_logs({k: LOGS / n for k, n in enumerate(names)})


# ---------------------------------------------------------------------------------------------
# Error patterns


def test_a_sigkilled_rank_is_the_culprit_of_its_torchrun_table():
    s = scan("rank-kill.log")
    assert s["culprit_ranks"] == [0]
    [f] = s["failures"]
    assert (f["rank"], f["exitcode"], f["root_cause"], f["host"]) == (0, -9, True, "localhost")
    assert "rank 0 killed by SIGKILL" in s["summary"]
    assert [m["pattern"] for m in s["matches"]] == [
        "injected-fault"
    ]  # torchrun's own traceback is not an error line


def test_a_killed_node_is_blamed_not_the_peers_that_lost_it():
    s = scan("node-kill-node0.log", "node-kill-node1.log")
    assert s["culprit_ranks"] == [
        4,
        5,
        6,
        7,
    ]  # SIGKILLed on node 1; node 0's ranks exited 1 or were SIGTERMed
    on_node = {f["rank"]: (f["node"], f["exitcode"]) for f in s["failures"]}
    assert on_node[0] == (0, 1) and on_node[1] == (0, -15) and on_node[4] == (1, -9)
    by = {}
    for m in s["matches"]:
        by.setdefault(m["pattern"], set()).add(m["rank"])
    assert by["gloo-peer-closed"] == {0} and by["connection-reset"] == {1, 2, 3}
    assert "Connection closed by peer" in s["summary"] and "rank 4 killed by SIGKILL" in s["summary"]


def test_gloo_timeout_and_nccl_errors_are_named():
    s = scan("gloo-timeout.log")
    assert s["culprit_ranks"] == [3]  # exit code 1, the root cause, no peer error
    assert [(m["pattern"], m["rank"]) for m in s["matches"]] == [("collective-timeout", 3)]
    n = scan("nccl-xid.log")
    kinds = {(m["pattern"], m["rank"]) for m in n["matches"]}
    assert {("nccl-watchdog-timeout", 1), ("nccl-error", 2), ("cuda-error", 2)} <= kinds
    assert n["failures"] == [] and n["culprit_ranks"] == []


def test_identical_lines_fold_and_matches_are_bounded():
    line = "[rank1]: RuntimeError: [pair.cc:537] Read error [10.0.0.2]:1234: Connection reset by peer."
    [m] = logscan.scan_text("\n".join([line] * 5))
    assert (m.pattern, m.rank, m.count) == ("connection-reset", 1, 5)
    many = "\n".join(f"RuntimeError: failure number {i}" for i in range(500))
    assert len(logscan.scan_text(many)) == logscan.MAX_MATCHES


def test_only_the_tail_of_a_log_is_read(tmp_path):
    log = tmp_path / "big.log"
    log.write_text(
        "RuntimeError: early, out of reach\n"
        + "x" * 80
        + "\n" * 4000
        + "filler line\n" * 30_000
        + "RuntimeError: late\n"
    )
    text = logscan.read_tail(log, 4096)
    assert len(text.encode()) <= 4096 and text.endswith("RuntimeError: late\n")
    assert text.startswith("filler line")  # no half line at the cut
    assert [m.line for m in logscan.scan_text(text)] == ["RuntimeError: late"]
    assert logscan.read_tail(tmp_path / "missing.log") == ""


def test_xid_lines_after_the_attempt_started():
    dmesg = (LOGS / "dmesg-xid.txt").read_text()
    assert len(logscan.xid_lines(dmesg)) == 2  # Xid lines only, not the driver's other NVRM lines
    [xid] = logscan.xid_lines(dmesg, after_s=9000.0)  # the MMU fault at 8100 s is older
    assert "Xid (PCI:0000:3b:00): 79" in xid
    assert isinstance(logscan.dmesg_xid(since=time.time()), list)  # unreadable or empty here: never raises


# ---------------------------------------------------------------------------------------------
# Which nodes a failed attempt's diagnosis checks


def hang(node, silent_nodes=()):
    return Incident("hang", 0, 0.0, "no step", {"rank": 5, "node": node, "silent_nodes": list(silent_nodes)})


def test_failed_nodes_are_the_suspects_else_the_hangs_culprit_node():
    assert suspect_nodes(JobOutcome(1, "node 1 failed", [1], {}), [hang(0)]) == [1]
    assert suspect_nodes(JobOutcome(124, "hung", [], {}), [hang(1)]) == [1]
    assert suspect_nodes(JobOutcome(124, "hung", [], {}), [hang(0, silent_nodes=[2])]) == [0, 2]
    assert (
        suspect_nodes(JobOutcome(124, "hung", [], {}), [hang(None)]) == []
    )  # no culprit node: nothing to check
    straggler = Incident("straggler", 0, 0.0, "slow", {"rank": 1, "node": 1})
    assert suspect_nodes(JobOutcome(124, "hung", [], {}), [straggler]) == []


def test_agents_failed_in_one_poll_are_narrowed_to_the_culprits_node(tmp_path):
    """The node-kill drill's logs: node 1's ranks were SIGKILLed, node 0's rank 0 then failed on
    'Connection closed by peer' (exit 1). Both agents seen failed in one poll: node 1 is the cause."""
    logs = {k: LOGS / f"node-kill-node{k}.log" for k in (0, 1)}
    both = JobOutcome(1, "node 0: torchrun agent exited with code 1; node 1: ...", [0, 1], {0: 1, 1: 1})
    narrowed = narrow_to_culprits(both, logs)
    assert (
        narrowed.failed_nodes == [1]
        and narrowed.reason == both.reason
        and narrowed.exit_codes == both.exit_codes
    )
    # one failed node: nothing to narrow
    assert narrow_to_culprits(JobOutcome(1, "node 0", [0], {0: 1, 1: None}), logs).failed_nodes == [0]
    # the culprit's log lost: node 0's own table names only a victim (its root cause saw the peer
    # close), so nothing is narrowed rather than blaming node 0
    lost = {0: logs[0], 1: tmp_path / "missing.log"}
    assert narrow_to_culprits(both, lost).failed_nodes == [0, 1]


# ---------------------------------------------------------------------------------------------
# The book: the driver's incidents, their diagnosis, recovery and listeners (a real run record)

IDENTITIES = {
    r: {"rank": r, "node": r // 4, "host": f"host{r // 4}", "tp": r % 2, "pp": (r // 2) % 2, "dp": r // 4}
    for r in range(8)
}


@pytest.fixture
def book_on(tmp_path):
    """A run record, a two-node job whose attempt-0 logs are the node-kill drill's, a listener."""
    cfg = compose(
        [
            "model=tiny",
            "parallelism=tp2-pp2-dp2",
            "launcher=local-nodes",
            "cluster.nodes=2",
            "cluster.procs_per_node=4",
            "train.steps=6",
            "optimizer.warmup_steps=1",
            f"train.run_dir={tmp_path}",
        ]
    )
    job = JobSpec("mega.train", [], {}, tmp_path, "train-attempt0")
    for k in (0, 1):
        job.log_path(k, 2).parent.mkdir(parents=True)
        shutil.copy(LOGS / f"node-kill-node{k}.log", job.log_path(k, 2))
    heard: list[dict] = []
    with track(
        tmp_path, config=tmp_path / "config.json", data_index=tmp_path / "index.json", target_steps=6
    ) as run:
        book = IncidentFiler(run, heard.append, log=lambda _: None)
        book.begin(0, job, cfg, SimpleNamespace(identities=IDENTITIES, incidents=[]), lambda: 2)
        yield book, run, heard, cfg


def log_step(run_dir: Path, step: int, attempt: int, at: float) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "loss": 5.0, "attempt": attempt, "time": at}) + "\n")


def test_a_rank_exit_names_the_killed_ranks_and_recovers_at_the_next_first_step(book_on, tmp_path):
    book, run, heard, _ = book_on
    log_step(tmp_path, 1, 0, time.time() - 5)
    outcome = JobOutcome(1, "node 1: torchrun agent exited with code 1 (a rank failed)", [1], {0: None, 1: 1})
    [inc] = book.end(outcome, final_step=3)
    assert inc.kind == "rank-exit" and inc.action == "relaunch from latest" and inc.steps_lost == 1
    c = inc.culprit
    assert (c["rank"], c["ranks"], c["node"], c["host"], c["coords"]) == (
        4,
        [4, 5, 6, 7],
        1,
        "host1",
        {"tp": 0, "pp": 0, "dp": 1},
    )
    assert "rank 4 killed by SIGKILL" in inc.diagnosis and "gloo-peer-closed (rank 0)" in inc.diagnosis
    assert inc.evidence["logs"]["culprit_ranks"] == [4, 5, 6, 7]
    md = (tmp_path / "incidents" / "000-attempt0-rank-exit.md").read_text()
    assert (
        "| culprit | ranks 4, 5, 6, 7 on node 1 (host1) |" in md
        and "| time to recovery | not recovered |" in md
    )
    assert [h["stage"] for h in heard] == ["detected"] and heard[0]["markdown"] == md
    [brief] = read_record(tmp_path).incidents
    assert (brief["kind"], brief["culprit_rank"], brief["time_to_recover_s"]) == ("rank-exit", 4, None)

    # attempt 1: a step of attempt 0 changes nothing, the first step of attempt 1 recovers it
    book.begin(1, book.job, book.cfg, SimpleNamespace(identities=IDENTITIES, incidents=[]), lambda: 2)
    book.poll()
    assert len(heard) == 1
    log_step(tmp_path, 3, 1, inc.detected_at + 7.5)
    book.poll()
    assert [h["stage"] for h in heard] == ["detected", "recovered"]
    assert heard[1]["time_to_recover_s"] == pytest.approx(7.5, abs=1e-3)
    [back] = read_incidents(tmp_path)
    assert back["time_to_recover_s"] == pytest.approx(7.5, abs=1e-3)
    assert (
        "| time to recovery | 7.5 s |" in (tmp_path / "incidents" / "000-attempt0-rank-exit.md").read_text()
    )
    assert read_record(tmp_path).incidents[0]["time_to_recover_s"] == pytest.approx(7.5, abs=1e-3)
    book.poll()
    assert len(heard) == 2  # once


def test_a_nan_rollback_and_an_eviction_are_incidents(book_on, tmp_path):
    book, run, heard, cfg = book_on
    request = {
        "step": 4,
        "attempt": 0,
        "what": "loss not finite and grad_norm not finite",
        "time": time.time(),
    }
    [nan] = book.end(JobOutcome(1, "node 0: exit 1", [0], {0: 1}), final_step=3, rollback=request)
    assert (nan.kind, nan.action, nan.summary) == (
        "nan",
        "rolled back to iter_0000002, step 4 skipped",
        "step 4: loss not finite and grad_norm not finite",
    )
    assert nan.culprit is None and nan.steps_lost == 1
    spike = {"step": 5, "attempt": 0, "what": "loss spike", "time": time.time()}
    [inc] = book.end(JobOutcome(1, "node 0: exit 1", [0], {0: 1}), final_step=4, rollback=spike)
    assert (inc.kind, inc.action, inc.steps_lost) == (
        "spike",
        "rolled back to iter_0000002, step 5 skipped",
        2,
    )
    assert "robust z-score" in inc.diagnosis

    # node 1's ranks died, its self-check failed, the spare (physical node 2) took its place
    check = tmp_path / "diagnosis" / "attempt0" / "result.json"
    check.parent.mkdir(parents=True)
    check.write_text(
        json.dumps(
            {
                "nodes": [
                    {"node": 0, "healthy": True, "reasons": []},
                    {"node": 1, "healthy": False, "reasons": ["rank 4: GEMM check failed"]},
                ]
            }
        )
    )
    diagnosed = Diagnosed(
        [1],
        [0, 1],
        2,
        nodes_after=[0, 2],
        dp_after=2,
        evicted=[{"node": 1, "attempt": 0, "reasons": ["rank 4: GEMM check failed"], "replaced_by": 2}],
    )
    exit_, evicted = book.end(JobOutcome(1, "node 1: exit 1", [1], {1: 1}), final_step=3, diagnosed=diagnosed)
    assert (
        exit_.kind == "rank-exit"
        and "self-check of node 1: unhealthy (rank 4: GEMM check failed)" in exit_.diagnosis
    )
    assert (evicted.kind, evicted.culprit["node"], evicted.diagnosis, evicted.action) == (
        "eviction",
        1,
        "rank 4: GEMM check failed",
        "evicted node 1, spare node 2 in its place",
    )
    shrink = Diagnosed(
        [1],
        [0, 1],
        2,
        evicted=[{"node": 1, "reasons": ["x"], "replaced_by": None}],
        nodes_after=[0],
        dp_after=1,
    )
    assert (
        shrink.action(shrink.evicted[0])
        == "evicted node 1; continuing on 1 nodes (dp 2 -> 1, same global batch)"
    )
    assert [i["kind"] for i in read_incidents(tmp_path)] == ["nan", "spike", "rank-exit", "eviction"]
    assert [h["kind"] for h in heard] == ["nan", "spike", "rank-exit", "eviction"]

    # a later launch (the recovery flow) recovers what is still pending: all four here
    log_step(tmp_path, 3, 1, time.time() + 1)
    heard2 = []
    book2 = IncidentFiler(run, heard2.append, log=lambda _: None)
    book2.poll()
    assert sorted(h["kind"] for h in heard2) == ["eviction", "nan", "rank-exit", "spike"]
    assert all(h["stage"] == "recovered" and h["time_to_recover_s"] > 0 for h in heard2)


def test_the_watchers_hang_gains_the_diagnosis_and_no_restart_left_is_said(book_on, tmp_path):
    book, run, heard, _ = book_on
    h = hang(1)
    path = h.write(tmp_path)
    run.record.incidents.append(h.brief(path))  # as Watcher.close files it
    book.watcher.incidents = [h]
    [inc] = book.end(
        JobOutcome(124, "hung: no step", [], {0: None, 1: None}), final_step=3, restarts_left=False
    )
    assert inc.kind == "hang" and "Connection closed by peer" in inc.diagnosis
    assert inc.action.startswith("none: no restart left (restart.max_restarts=")
    assert read_incidents(tmp_path)[0]["diagnosis"] == inc.diagnosis


def test_a_failing_listener_never_stops_training(book_on):
    book, _, _, _ = book_on
    said = []

    def broken(_):
        raise ConnectionError("Prefect is down")

    book.on_incident, book.log = broken, said.append
    [inc] = book.end(JobOutcome(1, "node 1: exit 1", [1], {1: 1}), final_step=3)
    assert inc.kind == "rank-exit" and any("on_incident failed: ConnectionError" in s for s in said)


# ---------------------------------------------------------------------------------------------
# Prefect names (the events and artifacts themselves: tests/test_recovery.py, real server)


def test_event_names_and_artifact_keys():
    from tasks.incidents import artifact_key, event_name

    row = {"run_dir": "/runs/My_Run.v2", "file": "incidents/003-attempt1-rank-exit.json", "kind": "rank-exit"}
    assert artifact_key(row) == "incident-my-run-v2-003-attempt1-rank-exit"
    assert event_name({**row, "stage": "detected"}) == "mega.incident.rank-exit"
    assert event_name({**row, "stage": "recovered"}) == "mega.recovery.rank-exit"


def test_a_damaged_incident_file_never_stops_a_launch(book_on, tmp_path):
    _, run, _, _ = book_on
    (tmp_path / "incidents").mkdir()
    (tmp_path / "incidents" / "000-attempt0-hang.json").write_text('{"kind": "hang", "attem')
    said = []
    book = IncidentFiler(run, None, log=said.append)
    assert book.pending == {} and any(
        "000-attempt0-hang.json: unreadable (JSONDecodeError)" in s for s in said
    )
