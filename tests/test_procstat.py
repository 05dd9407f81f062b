"""mega.procstat reads a live process's stat line whatever its command name holds (spaces and ')'
too), follows it through stopped and zombie, and gives None once it is reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from waiting import wait_for

from mega import procstat

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

COMM = "a) b (c) 1 2 )"  # fields-like words after a ')': a split at the first ')' reads them

CHILD = textwrap.dedent(
    f"""
    import ctypes, os, sys, time
    ctypes.CDLL(None).prctl(15, {COMM.encode()!r}, 0, 0, 0)  # PR_SET_NAME: the stat line's comm
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    t = os.times()
    print(t.user + t.system, flush=True)
    sys.stdin.read()
    """
)


def test_a_real_process_with_spaces_and_parentheses_in_its_name():
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    argv = [sys.executable, "-c", CHILD]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            cpu_reported = float(proc.stdout.readline())
            assert Path(f"/proc/{proc.pid}/comm").read_text().rstrip("\n") == COMM
            stat = procstat.read(proc.pid)
            assert stat is not None and stat.state in "RS" and stat.ppid == os.getpid()
            tick = 1 / os.sysconf("SC_CLK_TCK")
            # the same CPU time the child counted itself (times(2)), give or take what it spent since
            assert cpu_reported - tick <= stat.cpu_s < cpu_reported + 0.2
            assert since_boot - tick <= stat.start_s <= time.clock_gettime(time.CLOCK_BOOTTIME)

            os.kill(proc.pid, signal.SIGSTOP)
            wait_for(lambda: procstat.read(proc.pid).state == "T", 10, "the stopped state")
            os.kill(proc.pid, signal.SIGKILL)
            zombie = wait_for(lambda: (s := procstat.read(proc.pid)).state == "Z" and s, 10, "the zombie")
            assert zombie.start_ticks == stat.start_ticks and zombie.cpu_ticks >= stat.cpu_ticks
        finally:
            proc.kill()
    assert procstat.read(proc.pid) is None


def test_a_line_that_is_not_a_stat_line():
    with pytest.raises(ValueError):
        procstat.parse("1 (no closing paren R 0")
    with pytest.raises(ValueError):
        procstat.parse("1 (short) R 0 1 2")
