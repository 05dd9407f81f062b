"""`python -m mega.bench faults`: the rows computed from a drill's run directory, and the CLI's last
line (one real drill; the whole bench is too long for the suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from mega.bench import faults
from mega.launch import runs
from mega.stability.incident import Incident

T0 = 1_800_000_000.0


def recorded(
    run_dir: Path,
    fault: str,
    *,
    history: list[dict],
    log: list[tuple[float, str]],
    metrics: list[dict],
    fault_rows: list[dict] = (),
    events: dict | None = None,
    steps: int = faults.STEPS,
    incidents: list[Incident] = (),
    evicted: list[dict] = (),
) -> Path:
    """A run directory as run_drill and the ranks leave it."""
    run_dir.mkdir(parents=True)
    (run_dir / faults.DRILL_FILE).write_text(
        json.dumps(
            {
                "fault": fault,
                "steps": steps,
                "attempts": len(history),
                "final_step": history[-1]["final_step"],
                "history": history,
                "error": None,
                "log": [list(x) for x in log],
                "events": events or {},
            }
        )
    )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in fault_rows))
    record = runs.RunRecord(
        run_dir=str(run_dir),
        state="completed",
        config="",
        data_index="",
        target_steps=steps,
        cwd=".",
        pid=0,
        host="h",
        heartbeat=T0,
        started=T0,
        evicted_nodes=list(evicted),
    )
    d = run_dir / "incidents"
    d.mkdir()
    for i, inc in enumerate(incidents):  # as Incident.write names them (its markdown is not read here)
        path = d / f"{inc.name(i)}.json"
        path.write_text(json.dumps(asdict(inc)))
        record.incidents.append(inc.brief(path))
    runs.write_record(record)
    return run_dir


def steps(attempt: int, numbers, t: float) -> list[dict]:
    return [
        {"step": s, "attempt": attempt, "time": t + i, "step_s": 0.1, "loss": 5.0}
        for i, s in enumerate(numbers)
    ]


def kill_run(tmp_path: Path, failed_nodes: list[int]) -> Path:
    return recorded(
        tmp_path / "rank-kill",
        "rank-kill",
        history=[
            {
                "attempt": 0,
                "code": 1,
                "reason": "node 1: ...",
                "failed_nodes": failed_nodes,
                "final_step": 3,
                "restored": None,
            },
            {
                "attempt": 1,
                "code": 0,
                "reason": "completed",
                "failed_nodes": [],
                "final_step": 6,
                "restored": "iter_0000002",
            },
        ],
        log=[
            (T0, "attempt 0: launching 2 ranks"),
            (T0 + 10.5, "attempt 0: node 1: killed; stopping every node"),
            (T0 + 11, "attempt 1: launching 2 ranks"),
        ],
        metrics=steps(0, [1, 2, 3], T0 + 5) + steps(1, [3, 4, 5, 6], T0 + 30),
        fault_rows=[{"rank": 1, "node": 1, "kind": "kill", "step": 3, "time": T0 + 10.0}],
    )


def test_rank_kill_row_times_the_drill_from_its_records(tmp_path):
    row = faults.row_rank_kill(kill_run(tmp_path, failed_nodes=[1]))
    assert {k: row[k] for k in faults.ROW_KEYS} == {
        "fault": "rank-kill",
        "detected": True,
        "detect_s": 0.5,
        "culprit_named": True,
        "recovered": True,
        "recover_s": 19.5,
        "steps_lost": 1,
    }  # 3 logged by attempt 0, iter 2 restored


def test_rank_kill_blaming_the_wrong_node_is_no_culprit_named(tmp_path):
    assert faults.row_rank_kill(kill_run(tmp_path, failed_nodes=[0, 1]))["culprit_named"] is False


def hang_run(tmp_path: Path, detected_after_s: float, culprit_rank: int) -> Path:
    inc = Incident(
        "hang",
        0,
        T0 + detected_after_s,
        "no step",
        {"rank": culprit_rank, "node": 1, "coords": {"tp": 0, "pp": 0, "dp": 1}},
        {"threshold_s": 6.0},
        "relaunch from latest",
    )
    return recorded(
        tmp_path / "rank-hang",
        "rank-hang",
        history=[
            {"attempt": 0, "code": 124, "reason": "hung: no step", "failed_nodes": [], "final_step": 3},
            {
                "attempt": 1,
                "code": 0,
                "reason": "completed",
                "failed_nodes": [],
                "final_step": 6,
                "restored": "iter_0000002",
            },
        ],
        log=[],
        metrics=steps(0, [1, 2, 3], T0 - 3) + steps(1, [3, 4, 5, 6], T0 + 20),
        events={"rank": 1, "node": 1, "pid": 123, "time": T0, "step": 3},
        incidents=[inc],
    )


@pytest.mark.parametrize(
    "after_s, culprit, within, named", [(7.5, 1, True, True), (8.5, 1, False, True), (7.0, 0, True, False)]
)
def test_rank_hang_row_checks_the_target_and_the_culprit(tmp_path, after_s, culprit, within, named):
    """Target: detected within 2 x heartbeat_s (1 s) + the incident's threshold (6 s) of the SIGSTOP."""
    row = faults.row_rank_hang(hang_run(tmp_path, after_s, culprit))
    assert row["detected"] and row["detect_s"] == after_s and row["threshold_s"] == 6.0
    assert row["within_target"] is within and row["culprit_named"] is named
    assert row["recovered"] and row["recover_s"] == 20 - after_s and row["steps_lost"] == 1


def outage_run(tmp_path: Path, incident: Incident | None, attempts: int = 1) -> Path:
    history = [
        {"attempt": a, "code": 0, "reason": "completed", "failed_nodes": [], "final_step": 16}
        for a in range(attempts)
    ]
    return recorded(
        tmp_path / "redis-outage",
        "redis-outage",
        steps=16,
        history=history,
        log=[(T0 + 1.5, "attempt 0: heartbeat Redis did not answer for 1.5 s: store outage; ...")],
        metrics=steps(0, range(1, 17), T0 - 2),
        incidents=[incident] if incident else [],
        events={"store": "127.0.0.1:6400", "pid": 9, "time": T0, "resumed": T0 + 10.0, "step": 2},
    )


def test_redis_outage_row_follows_the_store_incident_contract(tmp_path):
    inc = Incident(
        "store",
        0,
        T0 + 11.0,
        "heartbeat Redis did not answer",
        {"store": "redis://127.0.0.1:6400/0"},
        {
            "outage_s": 10.2,
            "read_errors": 12,
            "resumed": True,
            "ranks_resumed": [0, 1],
            "dropped": {"0": 11, "1": 12},
        },
        "reported",
    )
    row = faults.row_redis_outage(outage_run(tmp_path, inc))
    assert row["detected"] and row["culprit_named"] and row["recovered"] and row["mid_run"]
    assert (row["detect_s"], row["recover_s"], row["reported_s"], row["steps_lost"]) == (1.5, 9.5, 11.0, 0)
    inc.evidence["resumed"] = False  # heartbeats never came back: not recovered
    assert not faults.row_redis_outage(outage_run(tmp_path / "b", inc))["recovered"]


def test_redis_outage_without_a_store_incident_is_not_detected(tmp_path):
    row = faults.row_redis_outage(outage_run(tmp_path, None))
    assert row["detected"] is False and row["recovered"] is False and "no store incident" in row["note"]


@pytest.mark.slow
def test_bench_faults_cli_prints_the_contract_as_its_last_line(tmp_path, data_cache, data_index):
    """The cheapest drill (straggler: one DP 2 run, no restart) through the CLI."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mega.bench",
            "faults",
            "--only",
            "straggler",
            "--json",
            "--out",
            str(tmp_path),
            f"data.cache_dir={data_cache}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"faults", "heartbeat_overhead", "heartbeat_overhead_on_off"} <= set(result)
    [row] = result["faults"]
    types = {
        "fault": str,
        "detected": bool,
        "detect_s": float,
        "culprit_named": bool,
        "recovered": bool,
        "recover_s": float,
        "steps_lost": int,
    }
    assert all(isinstance(row[k], t) for k, t in types.items()), row
    assert row["fault"] == "straggler" and row["detected"] and row["culprit_named"] and row["recovered"], row
    assert 0 < row["detect_s"] < 60 and row["steps_lost"] == 0
    assert result["heartbeat_overhead"] is None and "not measured" in result["note"]
    # the row is the one its run directory gives again
    assert {**faults.row_straggler(tmp_path / "straggler"), "recover_steps": []} == row  # no relaunch
    assert "faults: straggler: detected True" in out.stderr


def test_bench_faults_rejects_an_unknown_drill():
    out = subprocess.run(
        [sys.executable, "-m", "mega.bench", "faults", "--only", "rank-kill,meteor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "meteor" in out.stderr and "--only" in out.stderr


def test_heartbeat_overhead_is_the_worst_rank_and_on_off_pools_the_runs(tmp_path):
    def run(name: str, step_s: float, summary: dict | None = None) -> Path:
        rows = [{"step": s, "attempt": 0, "time": T0 + s, "step_s": step_s} for s in range(1, 7)]
        rows[0]["step_s"] = 9.0  # the warm-up step is left out
        d = recorded(tmp_path / name, name, history=[{"attempt": 0, "final_step": 6}], log=[], metrics=rows)
        if summary:
            (d / "heartbeats-attempt0.json").write_text(
                json.dumps({"attempt": 0, "heartbeat_s": 2.0, "ranks": summary})
            )
        return d

    beat = {
        "0": {"sent": 3, "dropped": 0, "cpu_s": 0.004, "wall_s": 4.0},
        "1": {"sent": 3, "dropped": 0, "cpu_s": 0.012, "wall_s": 4.0},
    }
    runs = {
        "on": [run("on-0", 0.11, beat), run("on-1", 0.13, beat)],
        "off": [run("off-0", 0.1), run("off-1", 0.1)],
    }
    out = faults.overhead(runs)
    assert out["heartbeat_overhead"] == 0.003 and out["heartbeat_overhead_detail"]["target_met"]
    assert out["heartbeat_overhead_on_off"] == 0.2  # median of the on runs' steps 0.12 against 0.1
    (runs["on"][1] / "heartbeats-attempt0.json").unlink()
    (runs["on"][0] / "heartbeats-attempt0.json").unlink()
    out = faults.overhead(runs)
    assert out["heartbeat_overhead"] is None and "no heartbeats-attempt0.json" in out["note"]
