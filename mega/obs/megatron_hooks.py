"""Where the spans come from: wrappers around megatron-core (and torch.distributed collectives),
installed at run time from this one module; megatron-core itself is not modified.

``install(recorder)`` wraps

* ``pipeline_parallel.schedules``' three schedules (``get_forward_backward_func`` returns them from
  the module's globals): a span over the step's forward-backward, and the moment its p2p are over;
* ``pipeline_parallel.schedules.forward_step`` / ``backward_step``: one span per microbatch and
  model chunk (the schedules call them through their module globals);
* ``pipeline_parallel.p2p_communication._p2p_ops`` / ``_batched_p2p_ops``: every pipeline send and
  receive is numbered per peer and its request handle is wrapped, so the ``wait()`` the schedule
  does becomes a blocked ``pp`` span and a p2p record (post time, wait interval);
  ``P2PCommunicator._communicate`` gives the enclosing span its name;
* ``distributed.param_and_grad_buffer._ParamAndGradBucketGroup``'s ``start/finish_grad_sync``
  and ``start/finish_param_sync``: the DP reduce-scatter (all-reduce) of gradients and all-gather
  of parameters per bucket group, blocked when synchronous or waiting;
* ``tensor_parallel.mappings``' collectives (``_reduce``, ``_gather_along_*``,
  ``_reduce_scatter_along_first_dim``) and the all-gather / reduce-scatter functions
  ``tensor_parallel.layers`` bound at import (sequence parallelism);
* ``torch.distributed``'s collectives, for the calls megatron makes through the module (the TP
  all-reduce of the column-parallel backward, the vocab-parallel cross entropy, the grad-norm and
  embedding all-reduces): classified by process group into ``tp``/``pp``/``dp``/``other``.

Inside a wrapped megatron call the collectives it makes are not recorded again (``suppress``).
Each wrapped megatron function's source is fingerprinted in ``PATCHED_SOURCES``;
tests/test_obs.py fails when megatron-core changes under a wrapper. ``uninstall()`` restores all.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from mega.obs.recorder import Recorder, _get_ident, _Span

MEGATRON_VERSION = "0.16.1"

# "module:qualname" of every megatron-core function a wrapper relies on (its signature, or that
# it reaches the wrapped function through a module global), with the sha256 (first 16 hex digits)
# of its source in 0.16.1 (mega.megatron_cpu.source_fingerprint).
PATCHED_SOURCES = {
    "megatron.core.pipeline_parallel.schedules:get_forward_backward_func": "107cdfb6f221dc4f",
    "megatron.core.pipeline_parallel.schedules:forward_step": "24c526af44458ac2",
    "megatron.core.pipeline_parallel.schedules:backward_step": "6ac4aa596b1b6261",
    "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining": "84399467bcc06296",
    "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving": "bd10736079d7ed41",
    "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving": "ecf7d69308cda660",
    "megatron.core.pipeline_parallel.p2p_communication:_p2p_ops": "20995746a48170ca",
    "megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops": "4b0901807501c561",
    "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate": "a902480caa75a260",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync": "d8391c531988157b",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.finish_grad_sync": "fc9901ff22db701a",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_param_sync": "ec6000db1595ca41",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.finish_param_sync": "fd365a1cb1055ca9",
    "megatron.core.tensor_parallel.mappings:_reduce": "d8dac1bff328972c",
    "megatron.core.tensor_parallel.mappings:_gather_along_last_dim": "78507d5543935a72",
    "megatron.core.tensor_parallel.mappings:_gather_along_first_dim": "44633fe36d60a51f",
    "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim": "7322068fab71d319",
    "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_last_dim": "4cb9faa13c8c5a39",
    "megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.forward": "5ee1c1ef5c5f1e5e",
    "megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.backward": "b50b2ea4a1c90270",
    "megatron.core.tensor_parallel.cross_entropy:_VocabParallelCrossEntropy.forward": "7fec4627837fc6bb",
}

# torch.distributed collectives wrapped at module level (megatron calls them as torch.distributed.X)
TORCH_COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "_all_gather_base",
    "_reduce_scatter_base",
)
_TP_MAPPINGS = {
    "_reduce": "all_reduce",
    "_gather_along_last_dim": "all_gather",
    "_gather_along_first_dim": "all_gather",
    "_reduce_scatter_along_first_dim": "reduce_scatter",
}

_SCHEDULES = {
    "forward_backward_no_pipelining": "forward-backward (no pipelining)",
    "forward_backward_pipelining_without_interleaving": "forward-backward (1F1B)",
    "forward_backward_pipelining_with_interleaving": "forward-backward (interleaved 1F1B)",
}

_REC: Recorder | None = None
_KINDS: dict = {}
_IN_FORWARD: Callable[[], None] | None = None  # a fault hook run inside every forward (mega/faults.py)
_originals: list[tuple[Any, str, Any]] = []


def _recording() -> Recorder | None:
    """The recorder when this call should be recorded: active, on its thread, not nested."""
    rec = _REC
    if rec is None:
        return None
    if not rec.active or rec.suppress or _get_ident() != rec.owner:
        rec.counts["passthrough"] += 1
        return None
    return rec


def group_kinds() -> dict:
    """Process group -> communication kind, from megatron's parallel_state (call after
    ``initialize_model_parallel``). The world and the model-parallel group are ``other``."""
    from megatron.core import parallel_state as ps

    kinds: dict = {}

    def add(kind: str, getter: Callable, **kwargs) -> None:
        try:
            group = getter(**kwargs)
        except (AssertionError, AttributeError, RuntimeError, TypeError):
            return
        if group is not None and group not in kinds:
            kinds[group] = kind

    add("tp", ps.get_tensor_model_parallel_group, check_initialized=False)
    add("pp", ps.get_pipeline_model_parallel_group, check_initialized=False)
    add("pp", ps.get_embedding_group, check_initialized=False)
    add("pp", ps.get_position_embedding_group, check_initialized=False)
    add("dp", ps.get_data_parallel_group, with_context_parallel=False)
    add("dp", ps.get_data_parallel_group, with_context_parallel=True)
    add("dp", ps.get_data_parallel_group_gloo, with_context_parallel=False)
    add("dp", ps.get_data_parallel_group_gloo, with_context_parallel=True)
    add("dp", ps.get_intra_distributed_optimizer_instance_group, check_initialized=False)
    add("other", ps.get_model_parallel_group, check_initialized=False)
    return kinds


def kind_of(group, default: str = "other") -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "other"
    return _KINDS.get(group, default)


def _dev(rec: Recorder, d0) -> tuple | None:
    """(start, end) device events of a span on GPUs (``d0`` taken at its start), else None."""
    return None if d0 is None else (d0, rec.device_timer.mark())


# ---------------------------------------------------------------------------------------------
# Wrapped work handles: their wait() is the blocked time of an asynchronous operation


class _RecordedWait:
    """A request handle whose ``wait()`` is recorded (the rest is the handle's own)."""

    __slots__ = ("_work", "_rec")
    counter = ""

    def wait(self, *args, **kwargs):
        rec = self._rec
        if not rec.active or _get_ident() != rec.owner:
            return self._work.wait(*args, **kwargs)
        rec.counts[self.counter] += 1
        d0 = rec.device_mark()
        t0 = rec.clock()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._waited(rec, t0, rec.clock(), _dev(rec, d0))

    def _waited(self, rec: Recorder, t0: int, t1: int, dev: tuple | None) -> None:
        raise NotImplementedError

    def __getattr__(self, name):
        return getattr(self._work, name)


class _TimedWork(_RecordedWait):
    """An asynchronous collective's handle; ``wait()`` is a blocked span and completes the
    operation's in-flight record."""

    __slots__ = ("_kind", "_label", "_record")
    counter = "async"

    def __init__(self, work, rec: Recorder, kind: str, label: str, post_ns: int):
        self._work, self._rec, self._kind, self._label = work, rec, kind, label
        self._record = rec.async_posted(kind, label, post_ns)

    def _waited(self, rec, t0, t1, dev):
        if self._record[3] is None:
            self._record[3], self._record[4] = t0, t1
        rec.record(f"wait {self._label}", self._kind, t0, t1, True, None, dev)


class _P2PWork(_RecordedWait):
    """A pipeline send/recv request; ``wait()`` completes the p2p records it covers (one, or
    every operation of a coalesced batch) and is recorded as a blocked ``pp`` span."""

    __slots__ = ("_records", "_label")
    counter = "p2p_wait"

    def __init__(self, work, rec: Recorder, records: list, label: str):
        self._work, self._rec, self._records, self._label = work, rec, records, label

    def _waited(self, rec, t0, t1, dev):
        for r in self._records:
            if r[4] is None:
                r[4], r[5] = t0, t1
                if dev is not None:
                    r[8], r[9] = dev
        rec.record(self._label, "pp", t0, t1, True, {"p2p": [r[2] for r in self._records]}, dev)


# ---------------------------------------------------------------------------------------------
# Wrappers


def _wrap_collective(fn: Callable, label: str, default_kind: str = "other") -> Callable:
    """A torch.distributed-style collective: synchronous -> a blocked span; ``async_op=True`` ->
    a short launch span and a handle whose wait() is blocked."""
    params = list(inspect.signature(fn).parameters)
    gi = params.index("group") if "group" in params else None
    ai = params.index("async_op") if "async_op" in params else None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rec = _recording()
        if rec is None:
            return fn(*args, **kwargs)
        rec.counts["collective"] += 1
        group = kwargs.get("group", args[gi] if gi is not None and len(args) > gi else None)
        async_op = kwargs.get("async_op", args[ai] if ai is not None and len(args) > ai else False)
        kind = kind_of(group, default_kind)
        d0 = rec.device_mark()
        t0 = rec.clock()
        work = fn(*args, **kwargs)
        t1 = rec.clock()
        if not async_op:
            rec.record(label, kind, t0, t1, True, None, _dev(rec, d0))
            return work
        rec.record(f"launch {label}", kind, t0, t1, False, None, _dev(rec, d0))
        return work if work is None else _TimedWork(work, rec, kind, label, t1)

    return wrapper


def _wrap_tp_mapping(fn: Callable, label: str) -> Callable:
    """megatron's synchronous TP collectives (mappings.py): one blocked span each."""

    @functools.wraps(fn)
    def wrapper(input_, group, *args, **kwargs):
        rec = _recording()
        if rec is None or group is None or group.size() == 1:
            return fn(input_, group, *args, **kwargs)
        rec.counts["tp_mapping"] += 1
        rec.suppress += 1
        d0 = rec.device_mark()
        t0 = rec.clock()
        try:
            return fn(input_, group, *args, **kwargs)
        finally:
            t1 = rec.clock()
            rec.suppress -= 1
            rec.record(label, kind_of(group, "tp"), t0, t1, True, None, _dev(rec, d0))

    return wrapper


def _wrap_schedule(fn: Callable, name: str) -> Callable:
    """A pipeline schedule (what ``get_forward_backward_func`` returns): a ``schedule`` span;
    when it returns, the step's p2p are over and their post times go to the PP peers."""

    @functools.wraps(fn)
    def schedule(*args, **kwargs):
        rec = _recording()
        if rec is None:
            return fn(*args, **kwargs)
        rec.counts["span"] += 1
        s = _Span(rec, name, "schedule", None, False)
        rec._push(s)
        try:
            return fn(*args, **kwargs)
        finally:
            rec._pop(s)
            rec.post_exchange()

    return schedule


def _output_id(output) -> int:
    return id(output[0] if isinstance(output, list) else output)


def _wrap_microbatch(fn: Callable, phase: str) -> Callable:
    """``forward_step`` / ``backward_step``: a span per microbatch and model chunk. The forward
    knows both (its ``current_microbatch``, ``vp_stage`` arguments) and leaves them under its
    output tensor, which the schedule hands to the matching backward."""
    forward = phase == "forward"

    @functools.wraps(fn)
    def microbatch(*args, **kwargs):
        rec = _recording()
        if rec is None:
            return fn(*args, **kwargs)
        rec.counts["fwdbwd"] += 1
        if forward:
            meta = {"mb": kwargs.get("current_microbatch"), "chunk": kwargs.get("vp_stage") or 0}
        else:
            meta = rec.fwd_meta.pop(
                _output_id(args[1] if len(args) > 1 else kwargs.get("output_tensor")), None
            )
        s = _Span(rec, phase, phase, meta, False)
        rec._push(s)
        try:
            if forward and _IN_FORWARD is not None:
                _IN_FORWARD()
            out = fn(*args, **kwargs)
        finally:
            rec._pop(s)
        if forward:
            rec.fwd_meta[_output_id(out[0])] = meta
        return out

    return microbatch


_P2P_SLOTS = (
    ("tensor_send_prev", "send", "prev", "send_prev"),
    ("tensor_recv_prev", "recv", "prev", "recv_prev"),
    ("tensor_send_next", "send", "next", "send_next"),
    ("tensor_recv_next", "recv", "next", "recv_next"),
)


def _wrap_p2p_ops(fn: Callable) -> Callable:
    """``_p2p_ops`` (dict of requests by slot) / ``_batched_p2p_ops`` (list, in slot order)."""

    @functools.wraps(fn)
    def p2p_ops(**kwargs):
        rec = _recording()
        if rec is None:
            return fn(**kwargs)
        rec.counts["p2p"] += 1
        # posted when the call begins: the peer's data cannot arrive before it, even if this
        # rank is descheduled before the call returns (which a timestamp after it would book)
        post = rec.clock()
        reqs = fn(**kwargs)
        peers = {"prev": kwargs["prev_pipeline_rank"], "next": kwargs["next_pipeline_rank"]}
        ops = []
        for arg, op, side, slot in _P2P_SLOTS:
            tensor = kwargs.get(arg)
            if tensor is not None:
                peer = peers[side]
                record = rec.p2p_posted(op, peer, tensor.numel() * tensor.element_size(), post)
                ops.append((slot, record, f"wait {op} {'->' if op == 'send' else '<-'} {peer}"))
        if isinstance(reqs, dict):
            by_slot = {slot: (record, label) for slot, record, label in ops}
            return {
                k: _P2PWork(w, rec, [by_slot[k][0]], by_slot[k][1]) if k in by_slot else w
                for k, w in reqs.items()
            }
        reqs = list(reqs)
        if len(reqs) == len(ops):
            return [_P2PWork(w, rec, [record], label) for w, (_, record, label) in zip(reqs, ops)]
        # a coalesced batch (NCCL): any of its handles completes all of its operations
        records = [record for _, record, _ in ops]
        return [_P2PWork(w, rec, records, "wait p2p batch") for w in reqs]

    return p2p_ops


def _wrap_communicate(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def _communicate(self, **kwargs):
        rec = _recording()
        if rec is None:
            return fn(self, **kwargs)
        what = [
            name
            for name, on in (
                ("send_next", kwargs.get("tensor_send_next") is not None),
                ("send_prev", kwargs.get("tensor_send_prev") is not None),
                ("recv_prev", kwargs.get("recv_prev")),
                ("recv_next", kwargs.get("recv_next")),
            )
            if on
        ]
        rec.counts["communicate"] += 1
        s = _Span(rec, "p2p " + "+".join(what), "pp", None, False)
        rec._push(s)
        try:
            return fn(self, **kwargs)
        finally:
            rec._pop(s)

    return _communicate


_BUCKETS: dict[int, int] = {}


def _wrap_bucket(fn: Callable, what: str) -> Callable:
    """A DDP bucket group's grad reduce / param gather, start or finish."""
    start = what.startswith("start")
    grad = what.endswith("grad_sync")

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        rec = _recording()
        if rec is None:
            return fn(self, *args, **kwargs)
        rec.counts["bucket"] += 1
        index = _BUCKETS.setdefault(id(self), len(_BUCKETS))
        cfg = self.ddp_config
        if grad:
            op = "reduce_scatter grads" if cfg.use_distributed_optimizer else "all_reduce grads"
            overlapped = cfg.overlap_grad_reduce
        else:
            op = "all_gather params"
            overlapped = cfg.overlap_param_gather and not (
                args[0] if args else kwargs.get("force_sync", False)
            )
        blocked = not (start and overlapped)
        rec.suppress += 1
        d0 = rec.device_mark()
        t0 = rec.clock()
        try:
            return fn(self, *args, **kwargs)
        finally:
            t1 = rec.clock()
            rec.suppress -= 1
            label = f"{op} bucket {index} {'start' if start else 'wait'}"
            rec.record(label, "dp", t0, t1, blocked, {"bucket": index}, _dev(rec, d0))
            key = (id(self), grad)
            if start and overlapped:
                rec.dp_inflight[key] = rec.async_posted("dp", f"{op} bucket {index}", t1)
            elif not start and key in rec.dp_inflight:
                record = rec.dp_inflight.pop(key)
                record[3], record[4] = t0, t1

    return wrapper


# ---------------------------------------------------------------------------------------------


def _replace(owner, name: str, new) -> None:
    _originals.append((owner, name, getattr(owner, name)))
    setattr(owner, name, new)


def install(rec: Recorder, in_forward: Callable[[], None] | None = None) -> None:
    """Wrap megatron-core and torch.distributed for ``rec`` (idempotent: a second call re-targets
    the recorder). ``in_forward``: called inside every recorded forward (``faults.slow_forward``)."""
    global _REC, _KINDS, _IN_FORWARD
    _REC, _IN_FORWARD = rec, in_forward
    _KINDS = group_kinds()
    if _originals:
        return
    import megatron.core

    if megatron.core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(
            f"mega.obs instruments megatron-core {MEGATRON_VERSION}, found "
            f"{megatron.core.__version__}: re-run tests/test_obs.py and update the wrappers"
        )
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers, mappings

    for name, label in _SCHEDULES.items():
        _replace(schedules, name, _wrap_schedule(getattr(schedules, name), label))
    _replace(schedules, "forward_step", _wrap_microbatch(schedules.forward_step, "forward"))
    _replace(schedules, "backward_step", _wrap_microbatch(schedules.backward_step, "backward"))
    _replace(p2p, "_p2p_ops", _wrap_p2p_ops(p2p._p2p_ops))
    _replace(p2p, "_batched_p2p_ops", _wrap_p2p_ops(p2p._batched_p2p_ops))
    _replace(p2p.P2PCommunicator, "_communicate", _wrap_communicate(p2p.P2PCommunicator._communicate))
    group = pgb._ParamAndGradBucketGroup
    for what in ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync"):
        _replace(group, what, _wrap_bucket(getattr(group, what), what))
    for name, label in _TP_MAPPINGS.items():
        _replace(mappings, name, _wrap_tp_mapping(getattr(mappings, name), f"{label} ({name.strip('_')})"))
    _replace(
        layers,
        "dist_all_gather_func",
        _wrap_collective(layers.dist_all_gather_func, "all_gather (linear)", "tp"),
    )
    _replace(
        layers,
        "dist_reduce_scatter_func",
        _wrap_collective(layers.dist_reduce_scatter_func, "reduce_scatter (linear)", "tp"),
    )
    for name in TORCH_COLLECTIVES:
        _replace(dist, name, _wrap_collective(getattr(dist, name), name.strip("_")))


def uninstall() -> None:
    global _REC
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)
    _REC = None
    _BUCKETS.clear()


def installed() -> bool:
    return bool(_originals)
