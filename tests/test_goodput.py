"""The goodput ledger's parts on small inputs (mega/goodput, docs/goodput.md); the ledgers of real
runs are checked where those runs are made (test_training.py, test_rollback.py, test_flow.py)."""

import json

import pytest

from mega.goodput import ledger
from mega.goodput.ledger import Interval, sweep
from mega.goodput.samples import sample_ledger


def test_sweep_gives_each_instant_to_the_highest_priority_and_names_the_gaps():
    ivs = [Interval(0, 10, "unattributed", 1, "attempt 0: no rank records"), Interval(2, 8, "productive", 4),
           Interval(3, 4, "checkpoint_stall", 5), Interval(12, 14, "idle", 2)]
    totals, parts, timeline = sweep(ivs, 0, 15)
    assert totals["productive"] == 5 and totals["checkpoint_stall"] == 1 and totals["idle"] == 2
    assert totals["unattributed"] == 7 and sum(totals.values()) == 15
    assert parts == {"attempt 0: no rank records": 4, "no record covers it": 3}
    assert [c for _, _, c in timeline] == ["unattributed", "productive", "checkpoint_stall", "productive",
                                           "unattributed", "idle", "unattributed"]


def steps(attempt, first, last, dp=2, per_rank=4, skipped=()):
    return [{"attempt": attempt, "step": s, "skipped": s in skipped,
             "samples": {"dp_rank": r, "dp_size": dp, "first": (s - 1) * dp * per_rank + r * per_rank, "count": per_rank}}
            for s in range(first, last + 1) for r in range(dp)]


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
    rows = [{"event": "start", "t": 100.0, "t_entered": 100.0}, {"event": "launch", "t": 101.0, "attempt": 0},
            {"event": "stopped", "t": 110.0, "attempt": 0, "ok": True, "reason": "completed", "stop_s": 0.0},
            {"event": "end", "t": 110.5}]
    (g / "driver.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    # no rank wrote anything: the attempt is unattributed under its name, the rest is the launcher's
    assert out["wall_s"] == 10.5 and out["unattributed_parts"] == {"attempt 0: no rank records": 9.0}
    assert out["ledger_s"]["queue_wait"] == 1.0 and out["ledger_s"]["teardown"] == 0.5
    assert (tmp_path / "goodput.json").exists()
