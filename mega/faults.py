"""Injected faults: every drill's fault, and the only code that reads a drill's setting.

Drills and benches arm a fault through the config's ``fault`` section (``FaultConfig``) or, for
processes that have no run config, an environment switch (``ENV_SWITCHES``). Production code calls
the hook of its point and never looks at a drill setting itself (tests/test_faults.py checks it):

====================  =========================================  ======================================
hook                  called from                                armed by
====================  =========================================  ======================================
``at_step_start``     mega/train.py, before each step            fault.kill_rank / fault.kill_node,
                                                                 fault.kill_at_step, fault.mode
                                                                 (kill, hang, kill_agent)
``poison_weights``    mega/train.py, before each step            fault.nan_at_step, fault.spike_at_step
``clock_skew_ns``     mega/obs/session.py, the rank's clock      fault.clock_skew_rank, clock_skew_s
``slow_forward``      mega/obs/session.py -> megatron_hooks,     fault.slow_rank, fault.slow_s
                      inside every recorded forward
``during_upload``     mega/checkpoint/save.py, stage 2 upload    fault.mode=kill_in_upload, kill_rank,
                                                                 kill_at_step
``selfcheck_env``     mega/cluster/selfcheck.py run_selfcheck    its fail_rank / bad_node arguments
``selfcheck_bad_node``  mega/stability/membership.py diagnose    fault.bad_node
``at_selfcheck_start``  mega/cluster/selfcheck.py, each rank     $MEGA_SELFCHECK_FAIL_RANK
``selfcheck_gemm``    mega/cluster/selfcheck.py, each rank       $MEGA_SELFCHECK_BAD_NODE
``data_commit_eager``,  mega/data/prepare.py, journal commits    $MEGA_DATA_KILL_AFTER_COMMITS
``after_data_commit``
``disarm``            mega/stability/membership.py               (ends the drills of an old layout)
====================  =========================================  ======================================

A kill, hang or agent kill at a step strikes in attempt 0 only (``$MEGA_ATTEMPT``), so a relaunch
runs clean; a node's ranks killed together (``kill_node``) each record the kill, then wait for the
node's others to record theirs (``_await_node``, bounded) before dying; the drills aimed at a rank
or node end when other nodes, or fewer, take over (``disarm``). A NaN or spike strikes whichever
attempt trains its step (a rollback skips that step: once). The kill in a save strikes once per
run, in the first attempt whose rank ``kill_rank`` uploads step ``kill_at_step``, and outlives a
change of nodes while that rank exists:
``during_upload`` looks in ``faults.jsonl`` for its own row (the run directory is one for every
node: local nodes share it, Slurm nodes see it on the shared file system). ``bad_node`` breaks its
node's self-check in every diagnosis. A fault that strikes says so on stderr (``[fault] ...``, which
mega/stability/logscan.py looks for) and appends a row to ``<run_dir>/faults.jsonl`` (when, where,
whom: the goodput ledger, the soak and the fault bench read it).

This module imports nothing of mega but the config, so every layer may call it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mega import rank_env
from mega.config import FaultConfig

if TYPE_CHECKING:
    from mega.config import MegaConfig

DATA_KILL_AFTER_COMMITS_ENV = "MEGA_DATA_KILL_AFTER_COMMITS"  # SIGKILL the preparation after N commits
SELFCHECK_FAIL_RANK_ENV = "MEGA_SELFCHECK_FAIL_RANK"  # this self-check rank dies before any collective
SELFCHECK_BAD_NODE_ENV = "MEGA_SELFCHECK_BAD_NODE"  # this node's GEMM check reports a broken unit
ENV_SWITCHES = (DATA_KILL_AFTER_COMMITS_ENV, SELFCHECK_FAIL_RANK_ENV, SELFCHECK_BAD_NODE_ENV)


def _say(line: str) -> None:
    print(f"[fault] {line}", file=sys.stderr, flush=True)


def recorded(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``<run_dir>/faults.jsonl``: every fault that struck in the run, in order."""
    rows = []
    path = Path(run_dir) / "faults.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a killed writer
    return rows


def _record(run_dir: str | Path, me: dict[str, Any], kind: str, step: int, target_pid: int) -> None:
    """Append a fault that struck to ``<run_dir>/faults.jsonl``; ``me`` is the rank's
    ``mega.cluster.node.identity()``."""
    row = {**me, "kind": kind, "step": step, "target_pid": target_pid, "time": time.time()}
    row["attempt"] = rank_env.attempt()
    with open(Path(run_dir) / "faults.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------
# Training ranks


def at_step_start(cfg: MegaConfig, step: int, me: dict[str, Any], agent_pid: Callable[[], int]) -> None:
    """Before 0-based step ``step``: the struck rank (``fault.kill_rank``, or every rank of
    ``fault.kill_node``) is SIGKILLed (mode=kill), stops making progress (mode=hang), or kills its
    node's torchrun agent and trains on, orphaned (mode=kill_agent, local rank 0 does it).
    kill_in_upload strikes in ``during_upload`` instead."""
    f = cfg.fault
    struck = f.kill_rank == me["rank"] or (f.kill_node is not None and f.kill_node == me["node"])
    if rank_env.attempt() != 0 or f.mode == "kill_in_upload" or not struck or f.kill_at_step != step:
        return
    _say(f"{f.mode}: rank {me['rank']} (node {me['node']}) at step {step}")
    run_dir = cfg.train.run_dir
    if f.mode == "kill_agent":
        if me["local_rank"] == 0:
            _record(run_dir, me, "kill_agent", step, agent_pid())
            os.kill(agent_pid(), signal.SIGKILL)
        return
    _record(run_dir, me, f.mode, step, os.getpid())
    if f.mode == "hang":
        while True:  # alive but silent, like a rank stuck in a driver call
            time.sleep(60)
    if f.kill_node is not None:
        _await_node(run_dir, me, f.mode, step, cfg.cluster.procs_per_node)
    os.kill(os.getpid(), signal.SIGKILL)


# How long the ranks of a killed node wait for each other before dying (fault.kill_node): a rank that
# never arrives does not keep the others alive.
NODE_KILL_WAIT_S = 30.0


def _await_node(run_dir: str | Path, me: dict[str, Any], kind: str, step: int, ranks: int) -> None:
    """A node dies at once: each of its ranks waits until all ``ranks`` have recorded the ``kind``
    fault at ``step`` (or ``NODE_KILL_WAIT_S``) before killing itself. Otherwise the first to die
    takes the rest with it: its torchrun agent sees a worker fail and terminates the others, and a
    rank a few milliseconds behind at the step boundary is gone before its drill records it."""
    deadline = time.monotonic() + NODE_KILL_WAIT_S
    while time.monotonic() < deadline:
        here = {
            row.get("rank")
            for row in recorded(run_dir)
            if (row.get("node"), row.get("kind"), row.get("step"), row.get("attempt"))
            == (me["node"], kind, step, 0)
        }
        if len(here) >= ranks:
            return
        time.sleep(0.01)


def poison_weights(
    cfg: MegaConfig,
    chunks: list,
    step: int,
    skips: set[int],
    me: dict[str, Any],
    before: Callable[[], None] | None = None,
) -> None:
    """Before 1-based step ``step`` (once rolled back, the step is skipped: no second strike):
    ``fault.nan_at_step`` makes one weight of every rank NaN, so the loss and the gradients turn
    NaN through real arithmetic; ``fault.spike_at_step`` scales the final layer norm's weight of
    the last stage by 30, so the logits are 30x too confident and the loss jumps. ``chunks``: the
    rank's model chunks (megatron modules); ``before``: called first when the drill strikes."""
    import torch

    f = cfg.fault
    if step in skips or step not in (f.nan_at_step, f.spike_at_step):
        return
    kind = "nan" if step == f.nan_at_step else "spike"
    if before is not None:
        before()
    with torch.no_grad():
        if kind == "nan":
            next(chunks[0].parameters()).view(-1)[0] = float("nan")
        else:
            for chunk in chunks:
                for name, p in chunk.named_parameters():
                    if name.endswith("final_layernorm.weight"):  # only the last stage has one
                        p.mul_(30.0)
    if me["local_rank"] == 0:
        _say(f"{kind}: weights poisoned before step {step}")
        _record(cfg.train.run_dir, me, kind, step, os.getpid())


def clock_skew_ns(cfg: MegaConfig, rank: int) -> int:
    """How far this rank's timestamps run ahead (``fault.clock_skew_s`` on ``fault.clock_skew_rank``)."""
    f = cfg.fault
    return int(f.clock_skew_s * 1e9) if f.clock_skew_rank == rank else 0


def slow_forward(cfg: MegaConfig, rank: int) -> Callable[[], None] | None:
    """What the straggler drill adds inside every forward of ``fault.slow_rank`` (None elsewhere):
    ``fault.slow_s`` of CPU time in a busy loop. Unlike a sleep it stretches under contention as
    the other ranks' compute does, so the rank stays the slow one however loaded the machine is."""
    f = cfg.fault
    seconds = f.slow_s if f.slow_rank == rank else 0.0
    if not seconds:
        return None

    def burn() -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    return burn


def _struck(run_dir: str | Path, kind: str, step: int) -> bool:
    """Whether ``<run_dir>/faults.jsonl`` records a ``kind`` fault at ``step`` (any attempt, node)."""
    return any(row.get("kind") == kind and row.get("step") == step for row in recorded(run_dir))


def during_upload(cfg: MegaConfig, me: dict[str, Any], step: int) -> Callable[[int, int], None] | None:
    """A progress callback for the upload of step ``step``'s checkpoint (None unless armed):
    ``fault.mode=kill_in_upload`` SIGKILLs ``fault.kill_rank`` once part of it is in the store,
    unless the run's ``faults.jsonl`` says it struck already (in any attempt). ``me``: the rank's
    ``mega.cluster.node.identity()``."""
    f = cfg.fault
    if not (f.mode == "kill_in_upload" and f.kill_rank == me["rank"] and f.kill_at_step == step):
        return None
    run_dir = cfg.train.run_dir
    if _struck(run_dir, "kill_in_upload", step):  # once per run: a relaunch's save of the step runs clean
        return None
    first = threading.Lock()  # the store reports progress from several threads: one strikes

    def kill(done: int, total: int) -> None:
        if done > 0 and first.acquire(blocking=False):  # part of it is in the store, the rest never will be
            _say(
                f"kill_in_upload: rank {me['rank']} during stage 2 of step {step} ({done}/{total} bytes sent)"
            )
            # closed (so in the file) before the kill: the next attempt's save of the step reads it
            _record(run_dir, me, "kill_in_upload", step, os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)

    return kill


# ---------------------------------------------------------------------------------------------
# Self-check and membership (the driver side, and the self-check's ranks)


def selfcheck_bad_node(cfg: MegaConfig, job_rank: Callable[[int], int]) -> int | None:
    """The job node whose self-check ``fault.bad_node`` breaks (``job_rank``: physical node -> its
    node rank in the job), None without the drill."""
    bad = cfg.fault.bad_node
    return None if bad is None else job_rank(bad)


# Drills aimed at the model's numbers at a step (every rank's arithmetic), not at a node or a rank
STEP_DRILLS = ("nan_at_step", "spike_at_step")


def disarm(cfg: MegaConfig) -> None:
    """End the config faults of ``cfg`` aimed at nodes or ranks (in place): other nodes, or fewer,
    run in their place now (``cfg`` is the new layout). A NaN or a loss spike at a step
    (``STEP_DRILLS``) stays armed: it strikes whichever nodes train that step, as the chaos soak's
    schedule means it to. So does the kill in a save while its rank is in the new world (a spare
    takes the global ranks of the node it replaces; fewer nodes may leave the rank out, a rank the
    config's validation refuses): ``during_upload`` strikes it once per run, in whichever attempt
    uploads its step first."""
    f = cfg.fault
    keep = {name: getattr(f, name) for name in STEP_DRILLS}
    if f.mode == "kill_in_upload" and f.kill_rank is not None and f.kill_rank < cfg.parallelism.world_size:
        keep.update(mode=f.mode, kill_rank=f.kill_rank, kill_at_step=f.kill_at_step)
    cfg.fault = FaultConfig(**keep)


def selfcheck_env(fail_rank: int | None = None, bad_node: int | None = None) -> dict[str, str]:
    """The self-check job's environment for its drills: rank ``fail_rank`` dies at start, node
    ``bad_node``'s GEMM check fails."""
    env = {}
    if fail_rank is not None:
        env[SELFCHECK_FAIL_RANK_ENV] = str(fail_rank)
    if bad_node is not None:
        env[SELFCHECK_BAD_NODE_ENV] = str(bad_node)
    return env


def at_selfcheck_start(rank: int) -> None:
    """A self-check rank, before any collective: the drilled rank dies (exit status 17)."""
    if os.environ.get(SELFCHECK_FAIL_RANK_ENV) == str(rank):
        os._exit(17)


def selfcheck_gemm(row: dict, node: int) -> None:
    """A self-check rank's result row: on the drilled node, the GEMM check reports a broken unit."""
    if os.environ.get(SELFCHECK_BAD_NODE_ENV) == str(node):
        row["error"] = "injected fault (fault.bad_node): the GEMM check reports a broken matrix unit"


# ---------------------------------------------------------------------------------------------
# Data preparation


def _data_kill_after() -> int:
    return int(os.environ.get(DATA_KILL_AFTER_COMMITS_ENV, "0"))


def data_commit_eager() -> bool:
    """Whether the preparation commits its journal after every finished shard (the kill drill
    counts commits, so they must not depend on the clock)."""
    return _data_kill_after() > 0


def after_data_commit(commits: int) -> None:
    """After the preparation's ``commits``-th journal commit: SIGKILL it at the drill's count."""
    kill_after = _data_kill_after()
    if kill_after and commits >= kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
