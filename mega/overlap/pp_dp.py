"""PP and DP communication overlap: which of megatron-core's flags a run gets (docs/overlap.md).

megatron-core has the mechanisms; this module decides, per layout, which ones apply:

* PP: ``overlap_p2p_comm`` (the interleaved schedule posts the next send/receive before the
  forward/backward and waits after it) and ``overlap_p2p_comm_warmup_flush`` (the same in the
  warm-up and flush phases). Needs ``batch_p2p_comm=False`` (mega.cluster.backend_flags).
* DP: ``overlap_param_gather`` (the distributed optimizer's parameter all-gather runs bucket by
  bucket behind the forward pass, dispatched from forward pre-hooks), ``align_param_gather``
  (the interleaved schedule dispatches each chunk's all-gather itself, at the same microbatch on
  every pipeline rank, through ``param_sync_func``), and ``overlap_param_gather_with_optimizer_step``
  (chunk 0's all-gather dispatched at the end of the optimizer step).

megatron's non-interleaved 1F1B refuses ``overlap_p2p_comm`` and never calls ``param_sync_func``,
so those need virtual stages (``parallelism.vpp>1``). Two ways to ask:

* explicitly, one flag at a time: a flag the layout cannot honour is a config error naming
  ``parallelism.vpp`` (``problems``);
* ``parallelism.comm_overlap=auto`` (set by ``features=megascale``): every flag the layout
  supports is turned on and the rest are listed with the reason (``resolve``), in the run's log
  line and in ``init.json``'s ``comm_overlap``.

With ``overlap_param_gather`` mega also prefetches the first all-gather at the very start of the
step, before the microbatches are loaded (``prefetch_first_chunk``), where megatron would start it
only at the first forward. torch-free: config validation imports it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

COMM_OVERLAP_MODES = ("off", "auto")


@dataclass(frozen=True)
class PpDpOverlap:
    """The effective PP/DP overlap flags of a run, and what ``auto`` left off (flag -> why)."""

    overlap_p2p_comm: bool
    overlap_p2p_comm_warmup_flush: bool
    overlap_param_gather: bool
    align_param_gather: bool
    overlap_param_gather_with_optimizer_step: bool
    left_off: dict

    def on(self) -> list[str]:
        return [k for k, v in asdict(self).items() if v is True]

    def record(self) -> dict:
        """What init.json and the log say."""
        return {"mode": None, "on": self.on(), "left_off": dict(self.left_off)}


def _interleaved(p) -> bool:
    return p.pp > 1 and p.chunks_per_stage > 1


def resolve(p) -> PpDpOverlap:
    """Effective flags of ``ParallelismConfig`` ``p``: the explicit ones, plus with
    ``comm_overlap=auto`` every one the layout supports."""
    auto = getattr(p, "comm_overlap", "off") == "auto"
    left_off = {}
    vpp_reason = "needs the interleaved schedule (parallelism.vpp>1): megatron's 1F1B has no hook for it"
    p2p = p.overlap_p2p_comm
    flush = p.overlap_p2p_comm_warmup_flush
    gather = p.overlap_param_gather
    align = p.align_param_gather
    if auto:
        if _interleaved(p):
            p2p = flush = True
        else:
            left_off["overlap_p2p_comm"] = "pp=1: no pipeline" if p.pp == 1 else vpp_reason
        if p.use_distributed_optimizer and p.overlap_grad_reduce and p.dp > 1:
            gather = True
        else:
            left_off["overlap_param_gather"] = (
                "dp=1: nothing to all-gather"
                if p.dp == 1
                else "needs parallelism.use_distributed_optimizer=true"
                if not p.use_distributed_optimizer
                else "needs parallelism.overlap_grad_reduce=true"
            )
        if gather and _interleaved(p):
            align = True
        elif gather:
            left_off["align_param_gather"] = vpp_reason
    return PpDpOverlap(p2p, flush, gather, align, p.overlap_param_gather_with_optimizer_step, left_off)


def problems(cfg) -> list[tuple[str, str]]:
    """(dotted key, message) for each PP/DP overlap flag asked for that the layout cannot honour."""
    p = cfg.parallelism
    out = []
    if p.comm_overlap not in COMM_OVERLAP_MODES:
        return [("parallelism.comm_overlap", f"must be one of {COMM_OVERLAP_MODES}, got {p.comm_overlap!r}")]
    why = "megatron's non-interleaved 1F1B {}; set parallelism.vpp>1 (with pp>1) or turn it off"
    if not _interleaved(p):
        for flag, what in [
            ("overlap_p2p_comm", "refuses overlap_p2p_comm"),
            ("overlap_p2p_comm_warmup_flush", "refuses overlap_p2p_comm"),
            ("align_param_gather", "never calls param_sync_func"),
            ("overlap_param_gather_with_optimizer_step", "has no chunk 0 to prefetch"),
        ]:
            if getattr(p, flag):
                out.append(("parallelism.vpp", f"parallelism.{flag}=true: " + why.format(what)))
    eff = resolve(p)
    if p.overlap_p2p_comm_warmup_flush and not eff.overlap_p2p_comm:
        out.append(("parallelism.overlap_p2p_comm_warmup_flush", "needs parallelism.overlap_p2p_comm=true"))
    for flag in ("align_param_gather", "overlap_param_gather_with_optimizer_step"):
        if getattr(p, flag) and not eff.overlap_param_gather:
            out.append((f"parallelism.{flag}", "needs parallelism.overlap_param_gather=true"))
    if p.ddp_bucket_size is not None and p.ddp_bucket_size < 1:
        out.append(
            (
                "parallelism.ddp_bucket_size",
                f"must be a positive number of parameters or null, got {p.ddp_bucket_size}",
            )
        )
    if eff.overlap_param_gather and not p.use_distributed_optimizer:
        out.append(("parallelism.overlap_param_gather", "needs parallelism.use_distributed_optimizer=true"))
    if eff.overlap_param_gather and not p.overlap_grad_reduce:  # as Megatron-LM's arguments.py asserts
        out.append(("parallelism.overlap_param_gather", "needs parallelism.overlap_grad_reduce=true"))
    return out


def record(p) -> dict:
    """init.json's ``comm_overlap``: mode, the flags on, and what auto left off and why."""
    out = resolve(p).record()
    out["mode"] = p.comm_overlap
    return out


def log_line(p) -> str:
    r = record(p)
    off = "; ".join(f"{k}: {v}" for k, v in r["left_off"].items())
    return f"comm overlap ({r['mode']}): pp/dp on: {', '.join(r['on']) or 'none'}" + (
        f"; left off: {off}" if off else ""
    )


# --- megatron-core wiring (torch/megatron imported by the callers only) ----------------------


def transformer_config_kwargs(cfg) -> dict:
    eff = resolve(cfg.parallelism)
    return {
        "overlap_p2p_comm": eff.overlap_p2p_comm,
        "overlap_p2p_comm_warmup_flush": eff.overlap_p2p_comm_warmup_flush,
    }


def ddp_config_kwargs(cfg) -> dict:
    eff = resolve(cfg.parallelism)
    return {"overlap_param_gather": eff.overlap_param_gather, "align_param_gather": eff.align_param_gather}


def param_sync_funcs(cfg, model: list):
    """``TransformerConfig.param_sync_func`` as Megatron-LM's training.py sets it (only with
    ``align_param_gather``; otherwise the forward pre-hooks dispatch the all-gathers). Chunk 0's
    entry skips the dispatch ``prefetch_first_chunk`` already made this step."""
    eff = resolve(cfg.parallelism)
    if not eff.align_param_gather:
        return None
    funcs = [m.start_param_sync for m in model]
    funcs[0] = _unless_dispatched(model[0])
    return funcs[0] if len(funcs) == 1 else funcs


def _unless_dispatched(chunk):
    def start_param_sync(*args, **kwargs):
        groups = chunk.bucket_groups + chunk.expert_parallel_bucket_groups
        if groups and all(g.param_gather_dispatched for g in groups):
            return  # prefetched at the step's start
        chunk.start_param_sync(*args, **kwargs)

    return start_param_sync


def prefetch_first_chunk(cfg, model: list) -> None:
    """Dispatch the first parameter all-gather of the step now, before its data is read; megatron
    would dispatch it only at the first forward. With ``align_param_gather`` that is all of chunk 0
    (the schedule dispatches whole chunks; ``param_sync_funcs`` then skips it). Without, it is the
    bucket group the forward uses first (the last one: buckets are in reverse registration order);
    the forward pre-hooks wait for it and dispatch the next one, as they would have."""
    eff = resolve(cfg.parallelism)
    if not eff.overlap_param_gather or eff.overlap_param_gather_with_optimizer_step:
        return  # synchronous gathers in the optimizer step, or dispatched there already
    if eff.align_param_gather:
        model[0].start_param_sync()
    elif model[0].bucket_groups and not model[0].bucket_groups[-1].param_gather_dispatched:
        model[0].bucket_groups[-1].start_param_sync()  # not dispatched: validation may have gathered
