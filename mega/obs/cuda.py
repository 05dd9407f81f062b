"""Device time on GPUs: CUDA events on the current stream, resolved later, never a synchronise.

On a GPU the host returns from a kernel launch, or from ``work.wait()`` on an NCCL handle, long
before the GPU has done the work: host timestamps say when work was *issued*. For the device's
view, every span also records a ``torch.cuda.Event(enable_timing=True)`` on the current stream at
its start and end (and every pipeline send/recv one at its post and around its wait). At the end
of a step the events are queried (``Event.query()``, non-blocking); when all have completed, each
is placed on the host clock by its elapsed time from an anchor event, and the step's summary
(compute, exposed communication) is taken from device times. If some event has not completed
yet, that step's summary falls back to host times (megatron's own ``.item()`` calls on the loss and
the grad norm sync the host every step, so in practice the events are done).

The anchor is recorded once, right after a ``torch.cuda.synchronize()`` at start (before the
loop): the GPU is idle then, so the anchor executes when it is recorded. Clock drift between the
host and the GPU over a run is a few ppm. megatron's ``Timers`` synchronise at every start/stop;
this path never does in the loop.

This module cannot run on the CPU-only machines the tests use: ``tests/test_obs.py`` drives it
with host-clock events standing in for CUDA events (same ``record/query/elapsed_time`` calls),
and ``scripts/gpu/obs_cuda_events.py`` checks it on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable


class DeviceTimer:
    def __init__(
        self,
        clock: Callable[[], int],
        event_factory: Callable | None = None,
        synchronize: Callable[[], None] | None = None,
    ):
        if event_factory is None or synchronize is None:
            import torch

            event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
            synchronize = synchronize or torch.cuda.synchronize
        self._event = event_factory
        synchronize()  # once, before the loop: the anchor below executes on an idle GPU
        self.anchor = self.mark()
        self.anchor_ns = clock()
        self._spans: list[tuple] = []  # (index into the step's spans, start event, end event)

    def mark(self):
        event = self._event()
        event.record()
        return event

    def span(self, index: int, start, end) -> None:
        self._spans.append((index, start, end))

    def to_ns(self, event) -> int:
        return self.anchor_ns + round(self.anchor.elapsed_time(event) * 1e6)

    def resolve(self, spans: list, p2p: list) -> tuple[list, list] | None:
        """The step's spans and p2p records with device times, or None while the GPU has not
        reached every event yet (``query()`` only: nothing here waits)."""
        events = [e for _, _, e in self._spans] + [e for r in p2p for e in r[7:10] if e is not None]
        if not all(e.query() for e in events):
            return None
        dev = list(spans)
        for index, start, end in self._spans:
            s = dev[index]
            dev[index] = (s[0], s[1], self.to_ns(start), self.to_ns(end), *s[4:])
        dev_p2p = []
        for r in p2p:
            post, w0, w1 = (None if e is None else self.to_ns(e) for e in r[7:10])
            dev_p2p.append([r[0], r[1], r[2], post if post is not None else r[3], w0, w1, r[6]])
        return dev, dev_p2p

    def reset(self) -> None:
        self._spans = []
