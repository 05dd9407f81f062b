"""Polling with a deadline, for tests that wait on other processes."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    """The first truthy value of ``predicate()``; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
