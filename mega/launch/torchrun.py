"""One torchrun job in its own session, watched: a timeout, a stall or Ctrl-C kills every rank.

torch's elastic agent starts its workers in a session of their own; the agent itself runs in a
new session too, so killing that process group takes the whole job down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

TIMEOUT_EXIT = 124


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def torchrun(
    module: str,
    args: list[str],
    nproc: int,
    *,
    env: dict | None = None,
    timeout_s: float | None = None,
    log_path: Path | None = None,
    progress_file: Path | None = None,
    stall_timeout_s: float | None = None,
    on_poll: Callable[[], None] | None = None,
) -> int:
    """Run ``module`` on ``nproc`` local ranks; return the exit code (124 on timeout or stall).

    ``progress_file``: a file the job appends to as it makes progress; when it has not changed for
    ``stall_timeout_s`` the job is taken as hung and killed, rather than waited on forever.
    A file that exists before the launch counts as progress only once it changes.
    ``on_poll``: called about once a second while the ranks run (the run record's heartbeat).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}", "--max-restarts=0",
        "-m", module, *args,
    ]
    full_env = {**os.environ, **(env or {})}
    out = open(log_path, "ab") if log_path else None
    try:
        proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True)
        started = last_progress = time.monotonic()
        initial_mtime = progress_file.stat().st_mtime if progress_file and progress_file.exists() else None
        last_mtime = None
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            if on_poll is not None:
                on_poll()
            now = time.monotonic()
            if progress_file is not None and progress_file.exists():
                mtime = progress_file.stat().st_mtime
                if mtime != last_mtime and mtime != initial_mtime:
                    last_mtime, last_progress = mtime, now
            if timeout_s is not None and now - started > timeout_s:
                _kill_session(proc)
                return TIMEOUT_EXIT
            # Start-up (imports, process groups, checkpoint load) is bounded by the ranks' own
            # collective timeouts; the stall clock runs from the first sign of progress.
            if stall_timeout_s is not None and last_mtime is not None and now - last_progress > stall_timeout_s:
                _kill_session(proc)
                return TIMEOUT_EXIT
    except BaseException:
        if "proc" in locals() and proc.poll() is None:
            _kill_session(proc)
        raise
    finally:
        if out:
            out.close()
