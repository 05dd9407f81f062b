"""What the recorder costs a rank, counted rather than estimated from step times.

* in-loop instrumentation: every instrumented code path counts its calls (``Recorder.counts``);
  the CPU time of one call of each path (the wrapper minus the bare call it wraps) is measured by
  ``calibrate`` in the same process, at the end of the run, with the thread CPU clock
  (``time.thread_time_ns``, which descheduling on a busy machine does not inflate);
* ``end_step`` (summaries): its thread CPU time, measured every step;
* the per-step exchange of pipeline post times: its wall time (a collective: waiting counts);
* the flush thread: its own thread CPU time, all of it;
* set-up (clock sync, installing the wrappers): thread CPU time, measured once.

``overhead`` = their sum over the rank's wall time from the recorder's creation to its close.
The calibration loops run warm (caches hot), so the per-call figure is a lower bound of a cold
call; ``mega.bench observability`` reports the on/off step-time difference next to it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from mega.obs.recorder import COUNTED_PATHS, Recorder


class _Group:
    def size(self) -> int:
        return 2


class _Done:
    def wait(self, *args, **kwargs):
        return True


def _noop(*args, **kwargs):
    return None


def _noop_p2p(**kwargs):
    return {"send_next": _Done()}


def _per_call(fn, n: int, rec: Recorder | None = None) -> float:
    t0 = time.thread_time_ns()
    for i in range(n):
        fn()
        if rec is not None and i % 256 == 255:  # keep the scratch recorder's lists short
            rec._reset_step(0)
            rec._seq.clear()
    return (time.thread_time_ns() - t0) / n


def calibrate(iterations: int = 2000) -> dict[str, float]:
    """CPU nanoseconds of one call of each counted path, over what the bare call costs."""
    from mega.obs import gc_control
    from mega.obs import megatron_hooks as hooks

    rec = Recorder(None, {"rank": 0})
    rec.active = True
    saved = hooks._REC, hooks._KINDS, hooks._IN_FORWARD
    hooks._REC, hooks._KINDS, hooks._IN_FORWARD = rec, {}, None  # (no drill in the calibration)
    try:
        group = _Group()
        tensor = SimpleNamespace(numel=lambda: 1, element_size=lambda: 4)
        bucket = SimpleNamespace(
            ddp_config=SimpleNamespace(
                use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=False
            )
        )
        collective = hooks._wrap_collective(_noop, "all_reduce")
        mapping = hooks._wrap_tp_mapping(_noop, "all_reduce")
        bucket_start = hooks._wrap_bucket(lambda self: None, "start_grad_sync")
        p2p = hooks._wrap_p2p_ops(_noop_p2p)
        forward = hooks._wrap_microbatch(lambda *a, **k: ([None], 0), "forward")
        communicate = hooks._wrap_communicate(lambda self, **k: None)
        gc_hook = gc_control.GarbageCollection(0, rec)
        done = _Done()
        p2p_kwargs = dict(
            tensor_send_prev=None,
            tensor_recv_prev=None,
            tensor_send_next=tensor,
            tensor_recv_next=None,
            group=None,
            prev_pipeline_rank=0,
            next_pipeline_rank=1,
        )

        def span():
            with rec.span("x", "forward"):
                pass

        def p2p_wait():
            p2p(**p2p_kwargs)["send_next"].wait()

        def async_wait():
            hooks._TimedWork(done, rec, "dp", "x", 0).wait()

        def gc_pair():
            gc_hook._callback("start", {})
            gc_hook._callback("stop", {"generation": 0, "collected": 0})

        n = iterations
        empty = _per_call(lambda: None, n)
        bare = _per_call(lambda: _noop(1, group=group), n)
        units = {
            "span": _per_call(span, n, rec) - empty,
            "fwdbwd": _per_call(lambda: forward(None, current_microbatch=0, vp_stage=0), n, rec) - empty,
            "communicate": _per_call(lambda: communicate(None, recv_prev=True), n, rec) - empty,
            "collective": _per_call(lambda: collective(1, group=group), n, rec) - bare,
            "tp_mapping": _per_call(lambda: mapping(1, group), n, rec) - bare,
            "bucket": _per_call(lambda: bucket_start(bucket), n, rec) - bare,
            "p2p": _per_call(lambda: p2p(**p2p_kwargs), n, rec)
            - _per_call(lambda: _noop_p2p(**p2p_kwargs), n),
            "async": _per_call(async_wait, n, rec) - _per_call(done.wait, n),
            "gc": _per_call(gc_pair, n, rec) - empty,
        }
        units["p2p_wait"] = (
            _per_call(p2p_wait, n, rec)
            - _per_call(lambda: _noop_p2p(**p2p_kwargs)["send_next"].wait(), n)
            - units["p2p"]
        )
        rec.active = False
        units["passthrough"] = _per_call(lambda: collective(1, group=group), n) - bare
    finally:
        hooks._REC, hooks._KINDS, hooks._IN_FORWARD = saved
    return {k: max(0.0, units[k]) for k in COUNTED_PATHS}


def account(rec: Recorder, iterations: int = 2000) -> dict:
    """The rank's counted overhead (call after the flush thread has stopped)."""
    unit = calibrate(iterations)
    calls_ns = sum(rec.counts[k] * unit[k] for k in COUNTED_PATHS)
    wall_ns = max(1, getattr(rec, "closed_ns", rec.clock()) - rec.created_ns)
    total_ns = calls_ns + rec.step_end_cpu_ns + rec.exchange_wall_ns + rec.flush_cpu_ns + rec.setup_cpu_ns
    return {
        "counts": dict(rec.counts),
        "unit_ns": {k: round(v, 1) for k, v in unit.items()},
        "calls_cpu_ns": int(calls_ns),
        "step_end_cpu_ns": rec.step_end_cpu_ns,
        "exchange_wall_ns": rec.exchange_wall_ns,
        "flush_cpu_ns": rec.flush_cpu_ns,
        "setup_cpu_ns": rec.setup_cpu_ns,
        "total_ns": int(total_ns),
        "wall_ns": wall_ns,
        "overhead": total_ns / wall_ns,
    }
