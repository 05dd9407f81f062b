"""Checks of the goodput ledger on the run directories other tests' drills leave behind
(mega/goodput, docs/goodput.md): counted from metrics.jsonl, independently of the ledger's code."""

from __future__ import annotations

import json
from pathlib import Path

from mega.goodput import ledger


def raw_metrics(run_dir: Path) -> list[dict]:
    """Every row of metrics.jsonl, replays included (read_metrics keeps the last of each step)."""
    return [
        json.loads(line)
        for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]


def lost_steps_from_metrics(rows: list[dict]) -> list[dict]:
    """Steps an attempt logged at or after the step the next attempt started from (its restore)."""
    first = {}
    for r in rows:
        first.setdefault(r["attempt"], r["step"])
    attempts = sorted(first)
    return [
        {"attempt": r["attempt"], "step": r["step"]}
        for r in rows
        if r["attempt"] != attempts[-1] and r["step"] >= first[attempts[attempts.index(r["attempt"]) + 1]]
    ]


def assert_sums_to_wall(led: dict) -> None:
    assert abs(sum(led["ledger_s"].values()) - led["wall_s"]) <= 1e-6 * led["wall_s"], led["ledger_s"]
    assert led["unattributed_fraction"] < 0.005, (led["unattributed_parts"], led["wall_s"])
    assert led["ettr"] == led["ledger_s"]["productive"] / led["wall_s"]


def assert_ledger_of_faulted_run(run_dir: Path, steps: int) -> dict:
    led = ledger.write(run_dir)
    assert json.loads((Path(run_dir) / ledger.GOODPUT_FILE).read_text())["wall_s"] == led["wall_s"]
    assert_sums_to_wall(led)
    rows = raw_metrics(run_dir)
    lost = lost_steps_from_metrics(rows)
    # the ledger also counts steps the logging rank never logged (the NaN step): those of the metrics are in it
    assert all(x in led["lost_steps"] for x in lost), (lost, led["lost_steps"])
    if not lost:  # the fault struck right after a checkpoint: nothing to redo
        assert led["lost_steps"] == [], led["lost_steps"]
    lost_s = sum(r["step_s"] for r in rows if {"attempt": r["attempt"], "step": r["step"]} in lost)
    assert led["ledger_s"]["lost_work"] >= lost_s
    assert led["ledger_s"]["fault_detection"] > 0 and led["ledger_s"]["productive"] > 0
    assert led["samples"]["exact"] and led["samples"]["steps"] == steps, led["samples"]
    return led


def assert_cut_off_records_are_named(
    run_dir: Path, tmp: Path, attempt: int = 0, node_ranks: list[int] | None = None
) -> dict:
    """A copy of the run's marks without attempt ``attempt``'s rank files (its only node's records
    lost): the ledger still builds, and the attempt's time is unattributed under its own name.
    With ``node_ranks``, first only those ranks' files go (another node's survive): the ledger
    names them missing and attributes the attempt from the node that is left."""
    import shutil

    copy = tmp / "cut-off"
    shutil.copytree(Path(run_dir) / "goodput", copy / "goodput")
    shutil.copy(Path(run_dir) / "faults.jsonl", copy / "faults.jsonl")
    if node_ranks:
        for r in node_ranks:
            (copy / "goodput" / f"attempt-{attempt}" / f"rank-{r}.jsonl").unlink()
        led = ledger.build(copy)
        assert led["missing_rank_files"] == {attempt: node_ranks} and led["unattributed_fraction"] < 0.005, (
            led
        )
    shutil.rmtree(copy / "goodput" / f"attempt-{attempt}")
    led = ledger.build(copy)
    part = led["unattributed_parts"].get(f"attempt {attempt}: no rank records", 0.0)
    assert part > 0 and led["unattributed_s"] >= part, led["unattributed_parts"]
    assert abs(sum(led["ledger_s"].values()) - led["wall_s"]) <= 1e-6 * led["wall_s"]
    return led
