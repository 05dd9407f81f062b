"""Observability of training ranks (docs/observability.md).

In a rank: ``Session.start(cfg)`` (mega.obs.session) sets up the span recorder of this rank, the
clock offsets, the megatron-core instrumentation and controlled garbage collection; the loop marks
its phases with ``with obs.span("optimizer"): ...``. Offline: ``python -m mega.trace RUN_DIR``
merges the ranks' timelines into one Chrome trace; ``mega.obs.analysis`` gives per-rank and
per-step numbers, straggler scores and the heat map.

Importing this package is cheap (no torch, no megatron).
"""

from __future__ import annotations

import contextlib

from mega.obs.recorder import NULL_SPAN, ROW_KEYS, Recorder

NULL_RECORDER = Recorder(None, {}, enabled=False)
_current: Recorder = NULL_RECORDER


def current() -> Recorder:
    """This process's active recorder (a disabled one outside a training loop): a watcher thread
    reads ``current().snapshot()``, ``.phase`` and ``.last_step``."""
    return _current


@contextlib.contextmanager
def paused():
    """Nothing is recorded inside (e.g. the validation passes after a step's ``end_step``)."""
    rec = _current
    was, rec.active = rec.active, False
    try:
        yield
    finally:
        rec.active = was


def span(name: str, cat: str | None = None, args=None, blocked: bool = False):
    """A span of the current recorder, e.g. ``with obs.span("optimizer"): ...`` (``cat``
    defaults to the name: the phases are data, forward, backward, optimizer, checkpoint, gc).
    A communication kind (tp, pp, dp, other) with ``blocked=True`` is exposed communication:
    ``with obs.span("ring wait", "tp", blocked=True): work.wait()``."""
    rec = _current
    if not rec.active:
        return NULL_SPAN
    return rec.span(name, cat or name, args, blocked)


__all__ = ["NULL_RECORDER", "ROW_KEYS", "Recorder", "current", "paused", "span"]
