"""Fault injection lives in mega/faults.py: no other module of mega/, flows/ or tasks/ reads a
drill's setting (the config's ``fault`` section, the environment switches), and the hooks strike
only where and when they are armed."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mega import faults
from mega.config import FaultConfig, MegaConfig

ROOT = Path(__file__).resolve().parents[1]
# The config declares and validates the fault section; the hook module is the only reader.
ALLOWED = {"mega/config.py", "mega/faults.py"}


def drill_reads(source: str) -> list[str]:
    """Where ``source`` reads a drill setting: the ``fault`` attribute (the config section), the
    ``FaultConfig`` name, or an environment switch's name in a string."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and n.attr == "fault":
            found.append(f"line {n.lineno}: .fault")
        elif (isinstance(n, ast.Name) and n.id == "FaultConfig") or (
            isinstance(n, ast.alias) and n.name == "FaultConfig"
        ):
            found.append(f"line {getattr(n, 'lineno', '?')}: FaultConfig")
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            found += [f"line {n.lineno}: {e}" for e in faults.ENV_SWITCHES if e in n.value]
    return found


def test_no_drill_setting_is_read_outside_the_hook_module():
    files = [p for d in ("mega", "flows", "tasks") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 100  # the walk found the tree
    offenders = {
        rel: hits
        for p in files
        if (rel := p.relative_to(ROOT).as_posix()) not in ALLOWED and (hits := drill_reads(p.read_text()))
    }
    assert not offenders, f"drill settings read outside mega/faults.py: {offenders}"


@pytest.mark.parametrize(
    "source",
    [
        "def f(cfg):\n    return cfg.fault.kill_rank\n",
        "from mega.config import FaultConfig\n",
        "import os\nos.environ.get('MEGA_DATA_KILL_AFTER_COMMITS')\n",
        "x = {'MEGA_SELFCHECK_BAD_NODE': '1'}\n",
    ],
)
def test_the_check_finds_a_drill_read(source):
    assert drill_reads(source)


def drill(run_dir: Path | str = "unused", **fault) -> MegaConfig:
    cfg = MegaConfig(fault=FaultConfig(**fault))  # unvalidated: the hooks alone are under test
    cfg.train.run_dir = str(run_dir)
    return cfg


def test_config_faults_strike_only_their_rank_step_and_first_attempt(tmp_path, monkeypatch):
    cfg = drill(tmp_path, kill_rank=1, kill_at_step=3, mode="hang")
    me = {"rank": 0, "node": 0, "local_rank": 0}
    faults.at_step_start(cfg, 3, me, os.getpid)  # another rank: nothing happens
    faults.at_step_start(cfg, 2, {**me, "rank": 1}, os.getpid)  # another step
    monkeypatch.setenv("MEGA_ATTEMPT", "1")
    faults.at_step_start(cfg, 3, {**me, "rank": 1}, os.getpid)  # a relaunch runs clean
    assert not (tmp_path / "faults.jsonl").exists()

    assert faults.during_upload(cfg, {**me, "rank": 1}, 3) is None  # mode=hang strikes at the step

    cfg.fault.slow_rank, cfg.fault.slow_s = 1, 0.05
    assert faults.slow_forward(cfg, 0) is None
    t0 = time.thread_time()
    faults.slow_forward(cfg, 1)()
    assert time.thread_time() - t0 >= 0.05  # CPU time, not a sleep

    cfg.fault.clock_skew_rank, cfg.fault.clock_skew_s = 0, 1.5
    assert (faults.clock_skew_ns(cfg, 0), faults.clock_skew_ns(cfg, 1)) == (1_500_000_000, 0)
    cfg.fault.nan_at_step, cfg.fault.spike_at_step = 4, 6
    faults.disarm(cfg)
    assert faults.slow_forward(cfg, 1) is None and faults.clock_skew_ns(cfg, 0) == 0
    assert cfg.fault.mode == "kill" and cfg.fault.kill_rank is None  # the rank-aimed drills end
    assert (cfg.fault.nan_at_step, cfg.fault.spike_at_step) == (4, 6)  # the model's do not


def test_a_kill_in_a_save_strikes_in_the_first_attempt_that_uploads_its_step(tmp_path, monkeypatch):
    """Attempt 1 uploads step 3 (attempt 0 ended before its save): it strikes there, records its
    row and dies; the next attempt's save of step 3 reads the row and runs clean."""
    me = {"rank": 1, "node": 0, "local_rank": 1, "pid": 0}
    cfg = drill(tmp_path, kill_rank=1, kill_at_step=3, mode="kill_in_upload")
    monkeypatch.setenv("MEGA_ATTEMPT", "1")
    assert faults.during_upload(cfg, {**me, "rank": 0}, 3) is None  # another rank
    assert faults.during_upload(cfg, me, 4) is None  # another step
    code = (
        "import os, sys; from mega import faults; from tests.test_faults import drill\n"
        f"cfg = drill({str(tmp_path)!r}, kill_rank=1, kill_at_step=3, mode='kill_in_upload')\n"
        "kill = faults.during_upload(cfg, {'rank': 1, 'node': 0, 'local_rank': 1, 'pid': os.getpid()}, 3)\n"
        "kill(0, 100)\n"  # nothing in the store yet: the upload goes on
        "print('alive', flush=True)\n"
        "kill(10, 100)\n"
        "sys.exit(0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == -9 and proc.stdout == "alive\n", proc.stderr
    assert "[fault] kill_in_upload: rank 1 during stage 2 of step 3 (10/100 bytes sent)" in proc.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert (row["kind"], row["step"], row["rank"], row["attempt"]) == ("kill_in_upload", 3, 1, 1)
    assert row["target_pid"] == row["pid"]
    monkeypatch.setenv("MEGA_ATTEMPT", "2")
    assert faults.during_upload(cfg, me, 3) is None  # once per run


def test_a_change_of_nodes_keeps_the_kill_in_a_save_while_its_rank_exists():
    cfg = drill(kill_rank=5, kill_at_step=8, mode="kill_in_upload", slow_rank=2, slow_s=0.1, nan_at_step=4)
    cfg.parallelism.dp = 8  # world 8: a spare in a node's place keeps the global ranks
    faults.disarm(cfg)
    f = cfg.fault
    assert (f.mode, f.kill_rank, f.kill_at_step, f.nan_at_step) == ("kill_in_upload", 5, 8, 4)
    assert f.slow_rank is None
    cfg.parallelism.dp = 4  # fewer nodes: no rank 5 left
    faults.disarm(cfg)
    assert (cfg.fault.mode, cfg.fault.kill_rank, cfg.fault.nan_at_step) == ("kill", None, 4)
    for mode in ("kill", "hang"):  # a kill or hang at a step ends with the old layout
        cfg = drill(kill_rank=1, kill_at_step=3, mode=mode)
        faults.disarm(cfg)
        assert (cfg.fault.mode, cfg.fault.kill_rank, cfg.fault.kill_at_step) == ("kill", None, None)


def test_a_killed_rank_records_its_fault(tmp_path):
    """mode=kill: the rank SIGKILLs itself after writing its row to faults.jsonl."""
    code = (
        "import os, sys; from mega import faults; from tests.test_faults import drill\n"
        f"cfg = drill({str(tmp_path)!r}, kill_rank=2, kill_at_step=5)\n"
        "faults.at_step_start(cfg, 5, {'rank': 2, 'node': 0, 'local_rank': 2, 'pid': os.getpid()}, os.getppid)\n"
        "sys.exit(0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert "[fault] kill: rank 2 (node 0) at step 5" in proc.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert (row["kind"], row["step"], row["rank"], row["attempt"]) == ("kill", 5, 2, 0)
    assert row["target_pid"] == row["pid"]  # it killed itself


def _node_rank_killing_itself(run_dir: Path, rank: int, wait_s: float | None = None) -> subprocess.Popen:
    """Rank ``rank`` of node 1 (2 ranks a node) running its step-4 drill of fault.kill_node=1."""
    code = (
        "import os, sys; from mega import faults; from tests.test_faults import drill\n"
        + (f"faults.NODE_KILL_WAIT_S = {wait_s}\n" if wait_s is not None else "")
        + f"cfg = drill({str(run_dir)!r}, kill_node=1, kill_at_step=4)\n"
        "cfg.cluster.procs_per_node = 2\n"
        f"me = {{'rank': {rank}, 'node': 1, 'local_rank': {rank - 2}, 'pid': os.getpid()}}\n"
        "faults.at_step_start(cfg, 4, me, os.getppid)\n"
        "sys.exit(0)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True)


def test_a_killed_nodes_ranks_die_together(tmp_path):
    """fault.kill_node: the node's ranks record the kill and wait for each other before dying, so
    the first to die cannot take a later one down (its torchrun agent terminates the rest) before
    that one's drill records it; a rank that never arrives keeps the others waiting at most
    ``NODE_KILL_WAIT_S``."""
    first = _node_rank_killing_itself(tmp_path, 2)
    deadline = time.monotonic() + 60
    while not faults.recorded(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    assert first.poll() is None  # recorded, and alive while rank 3 has not arrived
    second = _node_rank_killing_itself(tmp_path, 3)
    assert first.wait(timeout=60) == -9 and second.wait(timeout=60) == -9, first.stderr.read()
    assert sorted(row["rank"] for row in faults.recorded(tmp_path)) == [2, 3]

    alone = tmp_path / "alone"
    alone.mkdir()
    t0 = time.monotonic()
    lonely = _node_rank_killing_itself(alone, 2, wait_s=1.0)
    assert lonely.wait(timeout=60) == -9, lonely.stderr.read()
    assert time.monotonic() - t0 >= 1.0 and [r["rank"] for r in faults.recorded(alone)] == [2]


def test_selfcheck_drills_travel_in_the_job_environment(monkeypatch):
    env = faults.selfcheck_env(fail_rank=1, bad_node=0)
    assert env == {faults.SELFCHECK_FAIL_RANK_ENV: "1", faults.SELFCHECK_BAD_NODE_ENV: "0"}
    monkeypatch.setenv(faults.SELFCHECK_BAD_NODE_ENV, "0")
    row: dict = {}
    faults.selfcheck_gemm(row, node=1)
    assert row == {}
    faults.selfcheck_gemm(row, node=0)
    assert "fault.bad_node" in row["error"]
    faults.at_selfcheck_start(0)  # not the failing rank (none armed here): returns
    cfg = drill(bad_node=1)
    assert faults.selfcheck_bad_node(cfg, {1: 0, 0: 1}.__getitem__) == 0
