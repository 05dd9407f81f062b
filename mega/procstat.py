"""A process's line of ``/proc/<pid>/stat`` (proc_pid_stat(5)), the fields mega reads of it.

Standard library only, importing nothing of mega, so every layer may use it. psutil reads the same
file, but names the state with a word ("stopped", "zombie") where callers store and compare the
kernel's letter, and costs two to three times as much a call (about 20-35 us against 11 us); the
liveness witness reads a rank's line every heartbeat.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class ProcStat(NamedTuple):
    state: str  # one letter: R running, S sleeping, D disk wait, T stopped, t traced, Z zombie, X dead
    ppid: int
    cpu_ticks: int  # user + system CPU time (utime + stime), in clock ticks
    start_ticks: int  # when the process started, in clock ticks since boot

    @property
    def cpu_s(self) -> float:
        return self.cpu_ticks / os.sysconf("SC_CLK_TCK")

    @property
    def start_s(self) -> float:
        """Seconds since boot (CLOCK_BOOTTIME) at which the process started."""
        return self.start_ticks / os.sysconf("SC_CLK_TCK")


def parse(text: str) -> ProcStat:
    """The fields of one stat line; ValueError when it is not one."""
    # the command name (field 2, in parentheses) may hold spaces and ')': the fields after it
    # begin after the line's last ')'
    _, paren, tail = text.rpartition(")")
    fields = tail.split()
    if not paren or len(fields) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    # fields[i] is field i + 3 of proc_pid_stat(5): state 3, ppid 4, utime 14, stime 15, starttime 22
    return ProcStat(fields[0], int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19]))


def read(pid: int) -> ProcStat | None:
    """``pid``'s stat; None when there is none to read (the process is gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse(f.read())
    except (OSError, ValueError):
        return None
