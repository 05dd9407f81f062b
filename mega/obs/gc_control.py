"""Garbage collection under control: a known straggler source, made deterministic.

Python's automatic GC runs whenever a rank's allocation counters say so: every rank at a different
moment, and a full collection over the few million objects of torch + megatron takes long enough
to hold up every collective that rank takes part in. ``train.gc_interval = N > 0``: at the start
of the loop collect once, move everything alive to the permanent generation (``gc.freeze``: later
collections skip the model, optimizer and modules), disable automatic GC, and collect on every rank
at the same step boundary every N steps. ``N = 0`` leaves Python's automatic GC on.

Either way, collections on the training thread are recorded as ``gc`` spans (``gc.callbacks``).
"""

from __future__ import annotations

import gc

from mega.obs.recorder import Recorder, _get_ident


class GarbageCollection:
    def __init__(self, interval: int, rec: Recorder):
        self.interval = interval
        self.rec = rec
        self._t0: int | None = None
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.rec.enabled:
            gc.callbacks.append(self._callback)
        if self.interval > 0:
            gc.collect()
            gc.freeze()
            gc.disable()

    def after_step(self, done: int) -> None:
        """At the boundary after step ``done``: every ``interval`` steps, collect (all ranks)."""
        if self.interval > 0 and done % self.interval == 0:
            with self.rec.span("collect", "gc", {"step": done}):
                gc.collect()

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self.interval > 0:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()

    def _callback(self, phase: str, info: dict) -> None:
        rec = self.rec
        if not rec.active or _get_ident() != rec.owner:
            return
        if phase == "start":
            self._t0 = rec.clock()
            return
        if self._t0 is None:
            return
        rec.counts["gc"] += 1
        t1 = rec.clock()
        if not rec._stack or rec._stack[-1].cat != "gc":  # not inside our own "collect" span
            rec.record(
                f"gc gen{info.get('generation')} (auto)",
                "gc",
                self._t0,
                t1,
                False,
                {"collected": info.get("collected")},
            )
        self._t0 = None
