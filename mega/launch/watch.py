"""Run one job on a backend and watch it to the end: every node done, a node failed, a timeout,
a stall, or Ctrl-C. Whatever the end, every node's agent and ranks are stopped before returning."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mega.launch.backend import Backend, JobSpec

TIMEOUT_EXIT = 124
# a node whose task ended without any exit code (killed with its node): below every -signal code
NODE_LOST = -1000


@dataclass
class JobOutcome:
    code: (
        int  # 0: every node's agent exited 0; TIMEOUT_EXIT: timed out or stalled; else the failed node's code
    )
    reason: str  # for people: "completed", "node 1: torchrun agent killed by SIGKILL", ...
    failed_nodes: list[int] = field(default_factory=list)  # the cause: see run_job
    exit_codes: dict[int, int | None] = field(default_factory=dict)  # at the moment the job ended
    elapsed_s: float = 0.0
    stop_s: float = 0.0  # how long stopping every node took

    @property
    def ok(self) -> bool:
        return self.code == 0


def describe_exit(code: int) -> str:
    if code == NODE_LOST:
        return "lost (its task reported no exit code)"
    if code < 0:
        try:
            return f"torchrun agent killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"torchrun agent killed by signal {-code}"
    return f"torchrun agent exited with code {code}" + (" (a rank failed)" if code == 1 else "")


def run_job(
    backend: Backend,
    job: JobSpec,
    *,
    timeout_s: float | None = None,
    progress_file: Path | None = None,
    stall_timeout_s: float | None = None,
    on_poll: Callable[[], str | None] | None = None,
    on_failure: Callable[[JobOutcome], None] | None = None,
    poll_s: float = 0.5,
) -> JobOutcome:
    """Start ``job`` on every node and wait; returns how it ended (never raises for the job's own
    failure). When any node's agent exits non-zero, every node is stopped at once.

    ``progress_file``: a file the job appends to as it makes progress; unchanged for
    ``stall_timeout_s`` once it has changed counts as a hang (start-up is bounded by the ranks'
    own timeouts). A file that exists before the start counts only once it changes.
    ``on_poll``: called every poll (the run record's heartbeat, mega.stability's watcher); a
    non-empty string returned ends the job as hung, with that reason. ``on_failure``: called with the
    outcome once a failure is seen and before the nodes are stopped (drills look at survivors).
    Between polls the backend's ``wait_exit(poll_s)`` (where it has one) returns as soon as an
    agent exits: an agent's exit is seen at once, not at the next poll.
    """
    started = last_progress = time.monotonic()
    initial_mtime = progress_file.stat().st_mtime if progress_file and progress_file.exists() else None
    last_mtime = None
    outcome: JobOutcome | None = None
    backend.start(job)
    wait = getattr(backend, "wait_exit", time.sleep)  # a backend that can: returns once an agent exits
    try:
        while outcome is None:
            wait(poll_s)
            codes = backend.poll()
            failed = sorted(k for k, c in codes.items() if c not in (None, 0))
            now = time.monotonic()
            if failed:
                # one poll may see a node whose agent was killed outright (the node died) and others
                # whose agents exited 1 because their ranks lost it: the killed ones are the cause
                cause = [k for k in failed if codes[k] < 0] or failed
                shown = cause + [k for k in failed if k not in cause]
                outcome = JobOutcome(
                    codes[cause[0]],
                    "; ".join(f"node {k}: {describe_exit(codes[k])}" for k in shown),
                    cause,
                    codes,
                )
            elif codes and all(c == 0 for c in codes.values()):
                outcome = JobOutcome(0, "completed", [], codes)
            elif on_poll is not None and (verdict := on_poll()):  # a watcher saw a hang: its reason
                outcome = JobOutcome(TIMEOUT_EXIT, verdict, [], codes)
            else:
                if progress_file is not None and progress_file.exists():
                    mtime = progress_file.stat().st_mtime
                    if mtime != last_mtime and mtime != initial_mtime:
                        last_mtime, last_progress = mtime, now
                if timeout_s is not None and now - started > timeout_s:
                    outcome = JobOutcome(TIMEOUT_EXIT, f"timed out after {timeout_s:g} s", [], codes)
                elif (
                    stall_timeout_s is not None
                    and last_mtime is not None
                    and now - last_progress > stall_timeout_s
                ):
                    outcome = JobOutcome(TIMEOUT_EXIT, "hung (no progress)", [], codes)
        outcome.elapsed_s = time.monotonic() - started
        if outcome.failed_nodes and on_failure is not None:
            on_failure(outcome)
    finally:
        t0 = time.monotonic()
        backend.stop()  # also on Ctrl-C or an error in a callback: nothing outlives the job
        if outcome is not None:
            outcome.stop_s = time.monotonic() - t0
    return outcome
