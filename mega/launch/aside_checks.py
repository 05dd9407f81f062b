"""Self-checks of nodes outside the job, run beside it: the spares when the run starts, and a
failed attempt's suspects once the relaunch without them trains (local backends).

A node failure must not wait for a verdict: the driver puts a spare that passed its check in
the suspect's place and relaunches at once (mega.launch.nodes). The suspect is checked here, off
the recovery path, and comes back only as a spare, and only if it passes; a node that fails is
evicted. Each check is ``run_selfcheck`` (mega.launch.node_jobs) on a backend of its own, sized to
the nodes it checks, which the driver keeps for the next check of that size (its zygotes import
once). A suspects' check is held back until the relaunch logs a step or the driver
releases it (``release``): on one machine the nodes share the CPU, and the check must not slow
the recovery it was taken off.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mega import faults
from mega.cluster.selfcheck import on_physical_nodes
from mega.launch.node_jobs import run_selfcheck

if TYPE_CHECKING:
    from mega.config import MegaConfig
    from mega.launch.backend import Backend

HOLD_S = 120.0  # a held-back check starts after this long even if nothing released it


def checks_aside(cfg: MegaConfig) -> bool:
    """Whether this launcher can check nodes beside the run: local nodes (a job of its own is one
    more set of processes on this machine). Slurm and network namespaces: not built."""
    return cfg.launcher.name in ("local", "local-nodes") and not cfg.launcher.local_nodes.netns


class AsideCheck:
    """The self-check of physical nodes ``physical`` (not in the job), in a thread.

    ``attempt``: the attempt whose failure set them aside (None: spares at start-up);
    ``replaced``: each one's spare in the job; ``backend``: the (open) backend of a job of the
    check's size; ``ready``: holds the check back until it is true, ``release`` is called, or
    ``HOLD_S`` has passed (a relaunch that never trains must not keep its suspects unjudged);
    ``cfg``: the config whose drills apply (``fault.bad_node`` names a physical node)."""

    def __init__(
        self,
        cfg: MegaConfig,
        physical: list[int],
        out_dir: Path,
        *,
        attempt: int | None = None,
        replaced: dict[int, int] | None = None,
        ready: Callable[[], bool] = lambda: True,
        backend: Callable[[MegaConfig], Backend],
    ):
        self.physical, self.out_dir, self.attempt, self.ready = list(physical), Path(out_dir), attempt, ready
        self.replaced, self.backend = dict(replaced or {}), backend
        self.cfg = copy.deepcopy(cfg)
        self.cfg.cluster.nodes = len(self.physical)  # a job of the checked nodes only
        self.bad_node = faults.selfcheck_bad_node(
            cfg, lambda p: self.physical.index(p) if p in self.physical else None
        )
        self.released, self.cancelled = threading.Event(), threading.Event()
        self.result: dict | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="aside-check", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        held_until = time.monotonic() + HOLD_S
        while not (self.released.is_set() or self.ready()) and time.monotonic() < held_until:
            if self.cancelled.wait(0.2):
                return
        if self.cancelled.is_set():
            return
        try:
            backend = self.backend(self.cfg)
            self.result = run_selfcheck(self.cfg, self.out_dir, backend=backend, bad_node=self.bad_node)
        except Exception as e:  # never silent: the nodes stay unverified, so out of the run
            self.error = f"{type(e).__name__}: {e}"

    def release(self) -> None:
        """Start now if still held back (the driver has no recovery in flight)."""
        self.released.set()

    def verdicts(self, timeout_s: float | None = None) -> dict[int, dict] | None:
        """physical node -> {"healthy": True/False, "reasons"}; None while unfinished after
        ``timeout_s``. A node without a verdict of its own (the job failed) is not healthy."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return None
        rows = {row["node"]: row for row in (self.result or {}).get("nodes", [])}
        why = self.error or "; ".join((self.result or {}).get("reasons", [])) or "no verdict"
        return {
            p: {
                "healthy": rows.get(i, {}).get("healthy") is True,
                "reasons": on_physical_nodes(rows.get(i, {}).get("reasons") or [], self.physical)
                or ([] if rows.get(i, {}).get("healthy") else [why]),
            }
            for i, p in enumerate(self.physical)
        }

    @property
    def result_path(self) -> str:
        return str(self.out_dir / "result.json")

    def cancel(self, timeout_s: float | None = None) -> None:
        """Drop a check still held back; wait for one running (it is bounded by its own timeout)."""
        self.cancelled.set()
        self.thread.join(timeout_s)
