"""The goodput ledger's parts on small inputs (mega/goodput, docs/goodput.md); the ledgers of real
runs are checked where those runs are made (test_training.py, test_rollback.py, test_flow.py)."""

import json

import pytest

from mega.goodput import ledger
from mega.goodput.ledger import Interval, sweep
from mega.goodput.samples import sample_ledger


def test_sweep_gives_each_instant_to_the_highest_priority_and_names_the_gaps():
    ivs = [
        Interval(0, 10, "unattributed", 1, "attempt 0: no rank records"),
        Interval(2, 8, "productive", 4),
        Interval(3, 4, "checkpoint_stall", 5),
        Interval(12, 14, "idle", 2),
    ]
    totals, parts, timeline, _ = sweep(ivs, 0, 15)
    assert totals["productive"] == 5 and totals["checkpoint_stall"] == 1 and totals["idle"] == 2
    assert totals["unattributed"] == 7 and sum(totals.values()) == 15
    assert parts == {"attempt 0: no rank records": 4, "no record covers it": 3}
    assert [c for _, _, c in timeline] == [
        "unattributed",
        "productive",
        "checkpoint_stall",
        "productive",
        "unattributed",
        "idle",
        "unattributed",
    ]


def steps(attempt, first, last, dp=2, per_rank=4, skipped=()):
    return [
        {
            "attempt": attempt,
            "step": s,
            "skipped": s in skipped,
            "samples": {
                "dp_rank": r,
                "dp_size": dp,
                "first": (s - 1) * dp * per_rank + r * per_rank,
                "count": per_rank,
            },
        }
        for s in range(first, last + 1)
        for r in range(dp)
    ]


def test_sample_ledger_counts_a_replayed_step_once_and_lists_a_skipped_batch():
    rows = steps(0, 1, 4) + steps(1, 3, 6, skipped=(5,))  # attempt 1 restored step 2 and skipped 5
    s = sample_ledger(rows, 6)
    assert s["exact"] and s["replayed_steps"] == [3, 4]
    assert s["skipped"] == [{"step": 5, "positions": list(range(32, 40))}]
    assert s["trained_samples"] == s["distinct_samples"] == 5 * 8


def test_sample_ledger_is_not_exact_with_a_slice_missing_or_a_step_short():
    rows = [r for r in steps(0, 1, 3) if not (r["step"] == 2 and r["samples"]["dp_rank"] == 1)]
    s = sample_ledger(rows, 3)
    assert not s["exact"] and s["missing_steps"] == [2]
    assert not sample_ledger(steps(0, 1, 2), 3)["exact"]  # step 3 never ran


def test_a_run_dir_without_marks_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no driver or flow marks"):
        ledger.build(tmp_path)


def test_cli_prints_the_ledger_and_json_last(tmp_path, capsys):
    from mega.goodput.__main__ import main

    g = tmp_path / "goodput"
    g.mkdir()
    rows = [
        {"event": "start", "t": 100.0, "t_entered": 100.0},
        {"event": "launch", "t": 101.0, "attempt": 0},
        {"event": "stopped", "t": 110.0, "attempt": 0, "ok": True, "reason": "completed", "stop_s": 0.0},
        {"event": "end", "t": 110.5},
    ]
    (g / "driver.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    # no rank wrote anything: the attempt is unattributed under its name, the rest is the launcher's
    assert out["wall_s"] == 10.5 and out["unattributed_parts"] == {"attempt 0: no rank records": 9.0}
    assert out["ledger_s"]["queue_wait"] == 1.0 and out["ledger_s"]["teardown"] == 0.5
    assert (tmp_path / "goodput.json").exists()


# ---------------------------------------------------------------------------------------------
# The soak's parts (mega/bench/soak.py); the soak itself is a benchmark, too long for the suite


def test_fault_schedule_is_seeded_poisson_over_the_kinds():
    from mega.bench.soak import KINDS, fault_schedule

    a, b = fault_schedule(600, 60, 7), fault_schedule(600, 60, 7)
    assert a == b and a != fault_schedule(600, 60, 8)
    long = fault_schedule(6000, 60, 1)  # 100 hours' worth of minutes: ~6000 faults
    gaps = [y["at_s"] - x["at_s"] for x, y in zip(long, long[1:])]
    assert abs(sum(gaps) / len(gaps) - 60) < 3  # mean gap = mtbf_s
    assert {f["kind"] for f in long} == set(KINDS) and all(0 < f["at_s"] < 360000 for f in long)
    with pytest.raises(ValueError, match="--mtbf-s"):
        fault_schedule(10, 0, 1)


def test_config_faults_take_one_of_each_kind_at_a_step_and_kill_in_a_save():
    from mega.bench.soak import config_faults

    schedule = [
        {"at_s": 30, "kind": "nan"},
        {"at_s": 50, "kind": "rank-kill"},
        {"at_s": 61, "kind": "kill-in-save"},
        {"at_s": 90, "kind": "nan"},
    ]
    overrides, out = config_faults(schedule, step_s=2.0, interval=4, steps=100)
    assert overrides == [
        "fault.nan_at_step=15",
        "fault.mode=kill_in_upload",
        "fault.kill_rank=0",
        "fault.kill_at_step=28",
    ]
    assert [f["how"] for f in out] == ["config", "harness", "config", "not injected (one per soak)"]


def _led(exact=True, skipped=(4,), trained=56, ettr=0.5):
    return {
        "ettr": ettr,
        "wall_s": 10.0,
        "ledger_s": {"productive": 5.0},
        "unattributed_s": 0.01,
        "samples": {"exact": exact, "skipped": [{"step": s} for s in skipped], "trained_samples": trained},
    }


def test_compare_needs_both_sample_ledgers_exact_and_the_same_skips():
    from mega.bench.soak import compare

    ok = compare(_led(), _led(ettr=0.9), {"equal": True}, True)
    assert ok["samples_exact"] and ok["final_weights_equal_reference"] and ok["reference_ettr"] == 0.9
    assert not compare(_led(skipped=(4, 7)), _led(), {"equal": True}, True)["samples_exact"]
    assert not compare(_led(exact=False), _led(), {"equal": True}, True)["samples_exact"]
    assert not compare(_led(), _led(), {"equal": False}, True)["final_weights_equal_reference"]


def test_fault_rows_take_the_first_answering_incident_after_each_fault():
    from mega.bench.soak import fault_rows

    incidents = [
        {"kind": "straggler", "attempt": 0, "detected_at": 1010.0},
        {"kind": "hang", "attempt": 0, "detected_at": 1020.0, "time_to_recover_s": 9.0},
        {"kind": "store", "attempt": 1, "detected_at": 1100.0},
    ]
    saves = [
        {"event": "retry", "time": 1202.0},
        {"event": "committed", "time": 1215.0},
        {"event": "committed", "time": 1230.0},
    ]
    rows = fault_rows(
        [
            {"kind": "rank-hang", "at_s": 5, "time": 1005.0},
            {"kind": "redis-stop", "at_s": 90, "time": 1090.0},
            {"kind": "rank-kill", "at_s": 150, "time": 1150.0},
            {"kind": "s3-stop", "at_s": 200, "time": 1200.0},
        ],
        incidents,
        {0: 3.5},
        saves,
    )
    assert [(r["detected"], r["detect_s"], r["recovered"], r["recover_s"], r["lost_s"]) for r in rows] == [
        (True, 15.0, True, 9.0, 3.5),
        (True, 10.0, True, None, 0.0),
        (False, None, False, None, 0.0),
        (True, 2.0, True, 10.0, 0.0),
    ]


def test_simulated_ettr_falls_with_scale_and_says_it_is_not_measured():
    from mega.bench.soak import simulate

    small, big = simulate(1024, 50000), simulate(16384, 50000)
    assert big["measured"] is False and "group_creation_s_per_rank" in big["assumptions"]
    assert 0 < big["ettr"] < small["ettr"] < 1
    assert big["job_mtbf_h"] == pytest.approx(50000 / 16384)
    assert simulate(16384, 50000, overrides={"checkpoint_stall_s": 50.0})["ettr"] < big["ettr"]


def test_not_struck_says_why():
    from mega.bench.soak import _not_struck

    schedule = [
        {"at_s": 1.0, "kind": "rank-kill", "how": "harness"},
        {"at_s": 2.0, "kind": "nan", "how": "config", "step": 9},
        {"at_s": 2.5, "kind": "kill-in-save", "how": "config", "step": 12},
        {"at_s": 3.0, "kind": "straggler", "how": "harness"},
        {"at_s": 4.0, "kind": "nan", "how": "not injected (one per soak)"},
        {"at_s": 5.0, "kind": "s3-stop", "how": "harness"},
    ]
    done = [
        {"kind": "rank-kill", "at_s": 1.0, "struck": True, "time": 10.0},
        {"kind": "straggler", "at_s": 3.0, "struck": False, "why": "no live rank"},
    ]
    struck = [done[0]]
    assert [(f["kind"], f["why"]) for f in _not_struck(schedule, done, struck)] == [
        ("nan", "step 9 not trained (skipped by a rollback, or the run ended first)"),
        ("kill-in-save", "step 12's checkpoint never uploaded (its save skipped, or the run ended first)"),
        ("straggler", "no live rank"),
        ("nan", "not injected (one per soak)"),
        ("s3-stop", "the run ended first"),
    ]


def test_a_strike_that_fails_is_reported_and_the_harness_strikes_on(tmp_path, monkeypatch):
    """The soak harness's thread survives a strike that raises (the victim exited between being
    chosen and struck): that fault is reported with why, the next one is struck on time."""
    from mega.bench.soak import Harness, _not_struck

    (tmp_path / "metrics.jsonl").write_text("{}\n")  # training has started: fault times count from now
    schedule = [
        {"at_s": 0.0, "kind": "rank-kill", "how": "harness"},
        {"at_s": 0.2, "kind": "redis-stop", "how": "harness"},
    ]
    outcomes = iter([ProcessLookupError("[Errno 3] No such process"), {"struck": True}])

    def strike(kind):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    harness = Harness(tmp_path, schedule, redis_pid=0, s3=None, seed=0)
    monkeypatch.setattr(harness, "_strike", strike)
    harness.start()
    harness.thread.join(timeout=10)
    assert not harness.thread.is_alive()
    failed, struck = harness.done
    assert struck["kind"] == "redis-stop" and struck["struck"] is True
    assert [f["why"] for f in _not_struck(schedule, harness.done, [struck])] == [
        "harness: ProcessLookupError: [Errno 3] No such process"
    ]


def test_a_relaunch_is_cut_into_its_steps_by_the_slowest_rank(tmp_path):
    """mega.goodput.recovery: verdict -> first step of the relaunch, each boundary the latest rank's."""
    from mega.goodput.recovery import STEPS, recoveries

    g = tmp_path / "goodput"
    (g / "attempt-1").mkdir(parents=True)
    driver = [
        {"event": "launch", "t": 0.0, "attempt": 0},
        {"event": "stopped", "t": 10.5, "attempt": 0, "ok": False, "reason": "node 1 died", "stop_s": 0.5},
        {"event": "launch", "t": 11.0, "attempt": 1},
        {"event": "stopped", "t": 30.0, "attempt": 1, "ok": True, "reason": "completed", "stop_s": 0.1},
    ]
    (g / "driver.jsonl").write_text("".join(json.dumps(e) + "\n" for e in driver))
    for rank, late in ((0, 0.0), (1, 0.25)):  # rank 1 is a quarter second behind at every mark
        rows = [
            {"event": "header", "created_t": 12.0 + late, "main_t": 12.5 + late},
            {"event": "group_creation", "t0": 13.0 + late, "t1": 14.0 + late},
            {"event": "restore", "t0": 15.0 + late, "t1": 15.5 + late},
            {"event": "step", "step": 3, "t0": 15.6 + late, "t1": 16.0 + late},
        ]
        (g / "attempt-1" / f"rank-{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    [row] = recoveries(tmp_path)
    assert row["attempt"] == 1 and row["after"] == "node 1 died"
    assert list(row["steps_s"]) == list(STEPS)
    assert row["steps_s"]["stop"] == 0.5 and row["steps_s"]["driver"] == 0.5
    assert row["steps_s"]["agents_to_ranks"] == 1.25  # launch -> rank 1's process
    assert row["total_s"] == 6.25 == round(sum(row["steps_s"].values()), 3)


def test_a_rank_fault_waits_for_the_attempt_after_the_one_the_last_ended(tmp_path):
    """The soak's harness never strikes a rank of an attempt a rank fault already ended (its
    relaunch would absorb the fault: neither detected nor survived)."""
    import json
    import subprocess
    import sys

    from mega.bench.soak import Harness

    def rank_of(attempt: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        path = tmp_path / "nodes" / "0" / f"procs-attempt{attempt}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": 0, "node": 0, "pid": proc.pid}) + "\n")
        return proc

    harness = Harness(tmp_path, [], redis_pid=0, s3=None, seed=0)
    first = rank_of(0)
    assert harness._strike("rank-kill") == {"struck": True, "rank": 0, "node": 0}
    assert first.wait(timeout=10) == -9
    survivor = rank_of(0)  # attempt 0 still has a live rank: being torn down, not a target
    try:
        assert harness._live_ranks() == []
        gone = rank_of(1)  # the relaunch's rank, already gone: nothing to strike yet
        gone.kill()
        gone.wait(timeout=10)
        assert harness._live_ranks() == []
        relaunch = rank_of(1)
        assert [(r["attempt"], r["pid"]) for r in harness._live_ranks()] == [(1, relaunch.pid)]
        relaunch.kill()
    finally:
        survivor.kill()


def _run_dir(tmp_path, last_ok, commits=(4,)):
    """Attempt 0 runs steps 1-6 and dies; attempt 1 restores step 4 and runs 5-7, then stops
    (``last_ok``: True done, False failed with no restart left, None still running)."""
    g = tmp_path / "goodput"
    driver = [
        {"event": "launch", "t": 0.0, "attempt": 0},
        {"event": "stopped", "t": 8.0, "attempt": 0, "ok": False, "reason": "rank 1 died", "stop_s": 0.5},
        {"event": "launch", "t": 9.0, "attempt": 1},
    ]
    if last_ok is not None:
        reason = "completed" if last_ok else "no restart left"
        driver.append({"event": "stopped", "t": 16.0, "attempt": 1, "ok": last_ok, "reason": reason})
    for attempt, first, last, t in ((0, 1, 6, 1.0), (1, 5, 7, 11.0)):
        rows = [{"event": "header", "created_t": t - 0.5, "main_t": t - 0.4}]
        rows += [
            {"event": "step", "step": s, "t0": t + i, "t1": t + i + 1, "skipped": False, "data_s": None}
            for i, s in enumerate(range(first, last + 1))
        ]
        (g / f"attempt-{attempt}").mkdir(parents=True)
        (g / f"attempt-{attempt}" / "rank-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (g / "driver.jsonl").write_text("".join(json.dumps(e) + "\n" for e in driver))
    saves = [{"event": "committed", "step": s, "time": 1.0 + s} for s in commits]
    saves.append({"event": "failed", "step": 6, "time": 7.5, "error": "store down"})
    (tmp_path / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in saves))
    return tmp_path


@pytest.mark.parametrize(
    "last_ok, commits, lost_by_attempt_1",
    [
        (True, (4,), []),  # the run finished: attempt 1's steps are the run's
        (None, (4,), []),  # still running: nothing is decided yet
        (False, (4,), [5, 6, 7]),  # failed after the restart: a resume starts from step 4 again
        (False, (4, 6), [7]),  # attempt 1 saved step 6 before it failed
        (False, (), [5, 6, 7]),  # nothing durable
    ],
)
def test_a_run_that_ends_failed_loses_every_step_after_its_last_durable_checkpoint(
    tmp_path, last_ok, commits, lost_by_attempt_1
):
    led = ledger.build(_run_dir(tmp_path, last_ok, commits))
    lost = {(x["attempt"], x["step"]) for x in led["lost_steps"]}
    durable = max(commits, default=0)
    # attempt 0's steps 5 and 6 were run again by attempt 1; with nothing durable a failed run keeps none
    lost_by_attempt_0 = [5, 6] if last_ok is not False or durable else [1, 2, 3, 4, 5, 6]
    assert lost == {(0, s) for s in lost_by_attempt_0} | {(1, s) for s in lost_by_attempt_1}
    assert led["ledger_s"]["lost_work"] >= len(lost)  # every step takes a second
    if last_ok is False:
        assert led["ledger_s"]["productive"] == pytest.approx(durable)  # one second a kept step
