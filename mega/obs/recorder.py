"""The span recorder of one training rank: cheap in the loop, flushed by a thread.

The training thread records spans ``(name, category, start, end, depth, blocked, args)`` with
``perf_counter_ns`` and appends them to the current step's lists; nothing is formatted, written or
synchronised in the loop. ``end_step`` summarises the step (compute time, exposed communication per
kind: ``mega.obs.timeline``) for the metrics row and hands the step's record to the flush thread,
which writes one JSON line per step to ``<run_dir>/obs/attempt-<a>/rank-<r>.jsonl``.

Other threads may read, at any time and without locks (attribute reads of immutable values):

* ``phase``: ``(category, name, since_ns)`` of the innermost open phase span (``data``,
  ``schedule`` (the forward-backward, between microbatches), ``forward``, ``backward``,
  ``optimizer``, ``checkpoint``, ``gc``; ``("idle", "", 0)`` outside them); ``doing``: the same for the innermost span of any kind (e.g. ``("pp", "p2p recv_prev",
  t)`` while the schedule waits for a pipeline receive);
* ``last_step``: the previous step's summary (a dict that is replaced, never mutated);
* ``snapshot()``: all of it in one dict, with ages in seconds.

Only the thread that created the recorder records; calls from other threads pass through.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mega.obs import timeline

IDLE = ("idle", "", 0)
_get_ident = threading.get_ident
_PHASE_CATS = frozenset((*timeline.PHASES, "schedule"))  # what a watcher sees as the rank's phase
# What end_step returns for the metrics row (mega.metrics logs them to TensorBoard too).
# Instrumented code paths whose calls are counted (their unit cost: mega.obs.overhead.calibrate).
COUNTED_PATHS = (
    "span",
    "fwdbwd",
    "communicate",
    "collective",
    "tp_mapping",
    "bucket",
    "p2p",
    "p2p_wait",
    "async",
    "passthrough",
    "gc",
)
ROW_KEYS = ("compute_s", "exposed_tp_s", "exposed_pp_s", "exposed_dp_s", "exposed_other_s", "pp_wait_s")


class _Span:
    """Context manager of one span (``Recorder.span``), and the open-span entry on the stack."""

    __slots__ = ("rec", "name", "cat", "args", "blocked", "t0", "d0", "prev_phase", "prev_doing")

    def __init__(self, rec: Recorder, name: str, cat: str, args, blocked: bool):
        self.rec, self.name, self.cat, self.args, self.blocked = rec, name, cat, args, blocked

    def __enter__(self):
        self.rec._push(self)
        return self

    def __exit__(self, *exc):
        self.rec._pop(self)
        return False


class _NullSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NULL_SPAN = _NullSpan()


class Recorder:
    """Spans of one rank. ``enabled=False`` gives a recorder whose calls do nothing (``obs.enabled``
    off), so the training loop calls it unconditionally."""

    def __init__(
        self,
        run_dir: str | Path | None,
        identity: dict,
        *,
        enabled: bool = True,
        clock: Callable[[], int] = time.perf_counter_ns,
        clock_offset_ns: int = 0,
        exchange=None,
        device_timer=None,
        attempt: int = 0,
    ):
        self.enabled = enabled
        self.identity = identity
        self.rank = identity.get("rank", 0)
        self.clock = clock
        self.clock_offset_ns = clock_offset_ns  # aligned = local + offset (rank 0's clock)
        self.exchange = exchange  # mega.obs.session.PostExchange: the PP group's p2p post times
        self._exchange_pending = None
        self.device_timer = device_timer  # mega.obs.cuda.DeviceTimer on GPUs, None on CPU
        self.owner = _get_ident()
        self.active = False  # between the first begin_step and close: the wrappers record
        self.suppress = 0  # >0 inside a wrapped megatron call: its inner collectives are its own
        self.phase = self.doing = IDLE
        self.last_step: dict = {}
        self.step: int | None = None
        self.fwd_meta: dict = {}  # id(forward output) -> (microbatch, chunk), for the backward span
        self.dp_inflight: dict = {}  # bucket group -> its in-flight async record
        self._stack: list[_Span] = []
        self._seq: dict[tuple, int] = {}
        self._reset_step(0)
        # calls per instrumented path, for the overhead accounting (mega.obs.overhead)
        self.counts = dict.fromkeys(COUNTED_PATHS, 0)
        self.step_end_cpu_ns = 0  # measured: thread CPU time of end_step's own work
        self.exchange_wall_ns = 0  # measured: wall time in the per-step exchange of p2p posts
        self.setup_cpu_ns = 0  # measured by mega.obs.session (clock sync, hooks)
        self.created_ns = clock()
        self.path: Path | None = None
        self._writer: _FlushThread | None = None
        if enabled and run_dir is not None:
            self.path = Path(run_dir) / "obs" / f"attempt-{attempt}" / f"rank-{self.rank:05d}.jsonl"
            self._writer = _FlushThread(
                self.path, {"header": {**identity, "attempt": attempt, "clock_offset_ns": clock_offset_ns}}
            )
            atexit.register(self._at_exit)  # a rank failing mid-run still leaves its last steps

    # -- spans ---------------------------------------------------------------------------------

    def span(self, name: str, cat: str, args: Any = None, blocked: bool = False):
        """``with rec.span("optimizer", "optimizer"): ...``; a no-op off the recording thread."""
        if not self.active or _get_ident() != self.owner:
            return NULL_SPAN
        self.counts["span"] += 1
        return _Span(self, name, cat, args, blocked)

    def _push(self, s: _Span) -> None:
        s.prev_phase, s.prev_doing = self.phase, self.doing
        dt = self.device_timer
        if dt is not None:
            s.d0 = dt.mark()
        s.t0 = t0 = self.clock()
        self._stack.append(s)
        self.doing = (s.cat, s.name, t0)
        if s.cat in _PHASE_CATS:
            self.phase = self.doing

    def _pop(self, s: _Span) -> None:
        t1 = self.clock()
        dt = self.device_timer
        if dt is not None:
            dt.span(len(self.spans), s.d0, dt.mark())
        self._stack.pop()
        self.spans.append((s.name, s.cat, s.t0, t1, len(self._stack), s.blocked, s.args))
        self.phase, self.doing = s.prev_phase, s.prev_doing

    def record(
        self,
        name: str,
        cat: str,
        t0: int,
        t1: int,
        blocked: bool = True,
        args: Any = None,
        dev: tuple | None = None,
    ) -> None:
        """A finished span measured by the caller (the wrappers of mega.obs.megatron_hooks);
        ``dev``: its (start, end) device events on GPUs."""
        if dev is not None:
            self.device_timer.span(len(self.spans), *dev)
        self.spans.append((name, cat, t0, t1, len(self._stack), blocked, args))

    def device_mark(self):
        dt = self.device_timer
        return None if dt is None else dt.mark()

    # -- point-to-point and asynchronous operations ----------------------------------------------

    def p2p_posted(self, op: str, peer: int, nbytes: int, post_ns: int) -> list:
        """A pipeline send/recv was posted; returns its record, completed when it is waited on:
        ``[op, peer, seq, post, wait_t0, wait_t1, nbytes]`` (+ device events on GPUs)."""
        key = (op, peer)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        rec = [op, peer, seq, post_ns, None, None, nbytes]
        if self.device_timer is not None:
            rec += [self.device_timer.mark(), None, None]
        self.p2p.append(rec)
        return rec

    def async_posted(self, kind: str, name: str, post_ns: int) -> list:
        """An asynchronous collective was issued: ``[kind, name, post, wait_t0, wait_t1]``."""
        rec = [kind, name, post_ns, None, None]
        self.asyncs.append(rec)
        return rec

    # -- steps ---------------------------------------------------------------------------------

    def _reset_step(self, t0: int) -> None:
        if self.device_timer is not None:
            # Spans recorded after end_step (checkpoint, GC) were flushed with host times; their
            # events must not be resolved against the new step's spans (stale indices).
            self.device_timer.reset()
        self.spans: list[tuple] = []
        self.p2p: list[list] = []
        self.asyncs: list[list] = []
        self.device: dict | None = None
        self.step_t0 = t0
        self.step_t1: int | None = None
        self.summary: dict | None = None
        self.fwd_meta.clear()

    def begin_step(self, step: int) -> None:
        """Start recording step ``step`` (0-based, as the loop counts). Flushes the previous one,
        with whatever ran between its ``end_step`` and now (checkpoint, GC)."""
        if not self.enabled:
            return
        now = self.clock()
        self._flush_step(now)
        self.step = step
        self._reset_step(now)
        self.active = True

    def end_step(self) -> dict:
        """Close the step's body; returns its summary for the metrics row: ``compute_s``,
        ``exposed_{tp,pp,dp,other}_s`` and ``pp_wait_s`` (raw pipeline waits, peers' compute
        included). Spans recorded until the next ``begin_step`` still belong to this step."""
        if not self.enabled or self.step is None:
            return {}
        cpu0 = time.thread_time_ns()
        self.step_t1 = t1 = self.clock()
        spans, p2p = self.spans, self.p2p
        dt = self.device_timer
        if dt is not None:
            resolved = dt.resolve(spans, p2p)
            dt.reset()
            self.p2p = p2p = [r[:7] for r in p2p]  # events are not data
            if resolved is not None:
                spans, p2p = resolved
                self.device = {"spans": spans, "p2p": p2p}
        peer_posts = None
        if self.exchange is not None:
            if self._exchange_pending is None:  # no schedule ran, or device times: post now
                self.post_exchange(p2p, force=True)
            w0 = time.perf_counter_ns()
            posts = self.exchange.collect(self._exchange_pending)
            self.exchange_wall_ns += time.perf_counter_ns() - w0
            self._exchange_pending = None
            peer_posts = {k: v - self.clock_offset_ns for k, v in posts.items()}
        self.summary = timeline.summarize(spans, p2p, self.step_t0, t1, peer_posts, self.rank)
        self.summary["device_times"] = self.device is not None
        self.last_step = {"step": self.step + 1, "t_end_ns": t1, **self.summary}
        row = {k: self.summary[k] for k in ROW_KEYS}
        self.step_end_cpu_ns += time.thread_time_ns() - cpu0
        return row

    def post_exchange(self, p2p: list | None = None, force: bool = False) -> None:
        """Share this step's p2p post times with the pipeline group (asynchronously; collected by
        ``end_step``). Called when the pipeline schedule returns: every p2p of the step is done.
        On GPUs the post times are device times, known only at ``end_step``: it posts then."""
        if self.exchange is None or self._exchange_pending is not None:
            return
        if self.device_timer is not None and not force:
            return
        p2p = self.p2p if p2p is None else p2p
        mine = [(timeline.post_key(r[0], self.rank, r[1], r[2]), r[3] + self.clock_offset_ns) for r in p2p]
        w0 = time.perf_counter_ns()
        self._exchange_pending = self.exchange.post(mine)
        self.exchange_wall_ns += time.perf_counter_ns() - w0

    def _flush_step(self, now: int) -> None:
        if self.step is None or self._writer is None:
            return
        self._writer.put(
            {
                "step": self.step + 1,
                "t0": self.step_t0,
                "t1": self.step_t1 or now,
                "tail_t1": now,
                "summary": self.summary,
                "spans": self.spans,
                "p2p": self.p2p,
                "async": self.asyncs,
                "device": self.device,
            }
        )

    def snapshot(self) -> dict:
        """For a watcher thread: what the rank is doing now and its last step's numbers."""
        now = self.clock()
        cat, name, since = self.phase
        dcat, dname, dsince = self.doing
        return {
            "rank": self.rank,
            "step": None if self.step is None else self.step + 1,
            "phase": cat,
            "phase_s": (now - since) * 1e-9 if since else None,
            "doing": f"{dcat} {dname}".strip(),
            "doing_s": (now - dsince) * 1e-9 if dsince else None,
            "last_step": self.last_step,
        }

    def close(self, account: Callable[[Recorder], dict] | None = None) -> dict | None:
        """Flush the last step and stop the flush thread; then ``account(self)`` (the overhead
        accounting, which needs the flush thread's final CPU time) is appended to the file."""
        if not self.enabled:
            return None
        self.closed_ns = now = self.clock()
        self._flush_step(now)
        self.active = False
        self.step = None
        self.phase = self.doing = IDLE
        if self._writer is None:
            return None
        self._writer.close()
        accounting = account(self) if account is not None else None
        if accounting is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"accounting": accounting}) + "\n")
        return accounting

    def _at_exit(self) -> None:
        if self.enabled and self.active and self._writer is not None:
            self._flush_step(self.clock())
            self.active = False
            self._writer.close(timeout=5.0)

    @property
    def flush_cpu_ns(self) -> int:
        return self._writer.cpu_ns if self._writer is not None else 0


class _FlushThread:
    """Writes step records as JSON lines off the training thread; its CPU time is measured."""

    def __init__(self, path: Path, header: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.cpu_ns = 0
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queue.put(header)
        self._thread = threading.Thread(target=self._run, name="mega-obs-flush", daemon=True)
        self._thread.start()

    def put(self, item: dict) -> None:
        self._queue.put(item)

    def _run(self) -> None:
        try:
            with open(self.path, "w") as f:
                while True:
                    item = self._queue.get()
                    if item is None:
                        break
                    f.write(json.dumps(item, separators=(",", ":"), default=str))
                    f.write("\n")
                    if self._queue.empty():
                        f.flush()
                f.flush()
                os.fsync(f.fileno())
        except BaseException as e:
            self.error = e
        finally:
            self.cpu_ns = time.thread_time_ns()  # this thread's CPU time, all of it

    def close(self, timeout: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        if self.error is not None:
            import sys

            print(f"[mega.obs] could not write {self.path}: {self.error}", file=sys.stderr)
