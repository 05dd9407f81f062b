"""The planner: evaluate a layout with its open knobs chosen, or search the layouts for a GPU count.

Knobs the planner chooses when the overrides leave them open (configs.py says what "open" means):
micro-batch size, recomputation (none / selective / full, and under full the fewest layers per
model chunk that fit: ``model.recompute_num_layers``), sequence parallelism (tp > 1) and the
training precision (bf16 on GPUs, fp32 on CPUs). Context parallelism (``parallelism.cp``) and
FSDP (``parallelism.fsdp``) are the user's: never searched, every layout keeps them. The best
choice is the one with the highest predicted MFU among those that fit in memory; when nothing fits, the one needing the least memory
(reported with ``fits: false``). ``search`` also enumerates tp, pp, vpp and dp (tp within a node:
TP across nodes is never faster) for the cluster's GPU count, keeping the layout keys the user
fixed, and ranks every layout that fits.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mega.config import ConfigError, MegaConfig, validate
from mega.perf import device, hardware
from mega.perf.configs import Planning
from mega.perf.hardware import GIB, Hardware
from mega.perf.step import MEGA, Prediction, Stack, effective_overlap, memory_of, precision_of, predict

DEFAULT_CALIBRATION = Path("runs/perf-calibration.json")
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
KNOBS = {  # knob name -> the config key a user fixes it with
    "micro_batch_size": "parallelism.micro_batch_size",
    "recompute": "model.recompute",
    "recompute_num_layers": "model.recompute_num_layers",
    "sequence_parallel": "parallelism.sequence_parallel",
    "precision": "train.precision",
    "vpp": "parallelism.vpp",
}
LAYOUT = {"tp": "parallelism.tp", "pp": "parallelism.pp", "vpp": "parallelism.vpp", "dp": "parallelism.dp"}


def settle_precision(plan: Planning) -> None:
    """The precision knob first (the hardware's peak depends on it): bf16 on GPUs, fp32 on CPUs
    when the overrides leave ``train.precision`` open."""
    if plan.is_open(KNOBS["precision"]) and "precision" not in plan.chosen:
        precision = "bf16" if plan.cfg.cluster.device == "cuda" else "fp32"
        plan.cfg = dataclasses.replace(
            plan.cfg, train=dataclasses.replace(plan.cfg.train, precision=precision)
        )
        plan.chosen["precision"] = precision


def settle_dp(plan: Planning) -> None:
    """dp left open: the cluster's GPU count over tp x pp x cp (so a sweep over tp or pp needs no dp)."""
    c, p = plan.cfg.cluster, plan.cfg.parallelism
    world, mp = c.nodes * c.procs_per_node, p.tp * p.pp * p.cp
    if plan.is_open(LAYOUT["dp"]) and world % mp == 0 and world // mp != p.dp:
        dp = world // mp
        plan.cfg = dataclasses.replace(plan.cfg, parallelism=dataclasses.replace(p, dp=dp))
        plan.chosen["dp"] = dp


def hardware_for(cfg: MegaConfig, calibration: str | Path | None = None) -> tuple[Hardware, float]:
    """The Hardware of ``cfg``'s cluster and the MFU denominator per device: the preset's dense
    bf16 peak on GPUs (efficiencies from the device's built-in calibration, or the GPU calibration
    file ``calibration`` written by ``python -m mega.perf.calibrate --device cuda``); on a CPU
    cluster the calibrated GEMM rate (the calibration JSON written by ``python -m mega.plan calibrate``)."""
    c = cfg.cluster
    if c.device == "cuda":
        cal = device.load(calibration) if calibration else None
        hw = hardware.from_cluster(c, precision_of(cfg), cfg.model.fused_ops, cal, cfg.train.fp8_recipe)
        return hw, c.peak_tflops * 1e12
    path = Path(calibration) if calibration else DEFAULT_CALIBRATION
    if not path.is_file():
        raise ConfigError(
            "cluster.peak_tflops",
            f"cluster={c.name} is a CPU cluster without datasheet facts: "
            f"run `python -m mega.plan calibrate` first (writes {DEFAULT_CALIBRATION}) "
            "or pass --calibration FILE",
        )
    hw = hardware.from_calibration(json.loads(path.read_text()), c, str(path))
    return hw, hw.peak_flops


@dataclass
class Evaluation:
    cfg: MegaConfig
    prediction: Prediction
    knobs: dict[str, Any]
    chosen: list[str]
    evaluated: int

    def to_dict(self, hw: Hardware | None = None) -> dict[str, Any]:
        pr, p, m = self.prediction, effective_overlap(self.cfg).parallelism, self.cfg.model
        out = {
            "mfu": pr.mfu,
            "step_s": pr.step_s,
            "tokens_per_s": pr.tokens_per_s,
            "memory_gib": pr.memory.total / GIB,
            "fits": pr.fits,
            "knobs": self.knobs,
            "breakdown": pr.breakdown(),
            "chosen": self.chosen,
            "hfu": pr.hfu,
            "layout": {
                "tp": p.tp,
                "pp": p.pp,
                "vpp": p.chunks_per_stage,
                "cp": p.cp,
                "dp": p.dp,
                "world_size": p.world_size,
                "global_batch_size": p.global_batch_size,
                "microbatches": p.num_microbatches,
                "nodes": self.cfg.cluster.nodes,
            },
            "memory": pr.memory.to_gib(),
            "model": {
                "name": m.name,
                "block": m.block,
                "window_size": m.window_size,
                "fused_ops": m.fused_ops,
                "optimizer": self.cfg.optimizer.name,
            },
            # the flags training runs with (comm_overlap=auto resolved as mega.train resolves it)
            "overlap": {
                "comm_overlap": p.comm_overlap,
                **{
                    k: getattr(p, k)
                    for k in (
                        "tp_overlap",
                        "overlap_p2p_comm",
                        "overlap_grad_reduce",
                        "overlap_param_gather",
                        "align_param_gather",
                        "overlap_param_gather_with_optimizer_step",
                    )
                },
            },
            "model_flops_per_step": pr.model_flops_per_step,
            "evaluated": self.evaluated,
        }
        if hw is not None:
            out["hardware"] = hw.describe()
            out["memory"]["usable"] = hw.memory_bytes / GIB
            if pr.host_per_node is not None:
                out["memory"]["host_per_node"] = pr.host_per_node / GIB
                out["memory"]["host_usable"] = hw.host_memory_bytes / GIB
        return out


def _knob_values(plan: Planning, cfg: MegaConfig) -> dict[str, list]:
    p, m = cfg.parallelism, cfg.model
    per_replica = p.global_batch_size // p.dp if p.global_batch_size % p.dp == 0 else 0
    slots = p.layer_slots(m.num_layers)  # megatron's pipeline split: layers (+ embedding, loss)
    per_stage = slots // p.pp if slots % p.pp == 0 else 0
    values: dict[str, list] = {
        "micro_batch_size": [b for b in MICRO_BATCH_SIZES if per_replica and per_replica % b == 0]
        or [p.micro_batch_size],
        "recompute": [None, "selective", "full"],
        "sequence_parallel": [True, False] if p.tp > 1 else [False],
        # virtual stages: only with a pipeline; every split of a stage's layers (slots) into equal
        # chunks that megatron's interleaved schedule accepts, down to one layer a chunk
        "vpp": [None] + [v for v in _divisors(per_stage) if v > 1] if p.pp > 1 else [p.vpp],
    }
    fixed = {
        "micro_batch_size": p.micro_batch_size,
        "recompute": m.recompute,
        "sequence_parallel": p.sequence_parallel,
        "vpp": p.vpp,
    }
    return {k: (v if plan.is_open(KNOBS[k]) else [fixed[k]]) for k, v in values.items()}


def _with(cfg: MegaConfig, knobs: dict[str, Any], layout: dict[str, Any] | None = None) -> MegaConfig:
    changes = {
        "micro_batch_size": knobs["micro_batch_size"],
        "sequence_parallel": knobs["sequence_parallel"],
        "vpp": knobs["vpp"],
        **(layout or {}),
    }
    par = dataclasses.replace(cfg.parallelism, **changes)
    return dataclasses.replace(
        cfg, parallelism=par, model=dataclasses.replace(cfg.model, recompute=knobs["recompute"])
    )


def _recompute_layers_open(plan: Planning) -> bool:
    """The planner picks the recomputed layers only where it picks the recomputation itself."""
    return plan.is_open(KNOBS["recompute"]) and plan.is_open(KNOBS["recompute_num_layers"])


def fewest_recomputed(cfg: MegaConfig, hw: Hardware, stack: Stack = MEGA) -> MegaConfig:
    """Full recomputation of only the first N layers of each model chunk (megatron-core's block
    method) with the smallest N that fits in memory: each layer not recomputed saves its forward
    again. ``cfg`` itself (every layer recomputed) when no N short of a whole chunk fits."""
    m = cfg.model
    for n in range(1, cfg.parallelism.largest_chunk(m.num_layers)):
        candidate = dataclasses.replace(cfg, model=dataclasses.replace(m, recompute_num_layers=n))
        if memory_of(candidate, hw, stack).total <= hw.memory_bytes:
            return candidate
    return cfg


def evaluate(
    plan: Planning,
    hw: Hardware | None = None,
    mfu_peak: float | None = None,
    calibration: str | Path | None = None,
    layout: dict[str, Any] | None = None,
    memory_known: bool = False,
    **predict_kwargs: Any,
) -> Evaluation:
    """The layout of ``plan`` (or ``layout`` over it) with its open knobs chosen as the best that
    fits. Raises the ConfigError of the first candidate when no candidate is a valid config.

    ``memory_known``: the run is known to fit (a published run whose memory savings the memory
    model does not describe): every candidate is ranked by MFU alone, ``fits`` still reports the
    model's own view."""
    settle_precision(plan)
    if not layout:
        settle_dp(plan)
    base = plan.cfg
    if layout:
        base = dataclasses.replace(base, parallelism=dataclasses.replace(base.parallelism, **layout))
    if hw is None:
        hw, mfu_peak = hardware_for(base, calibration)
    values = _knob_values(plan, base)
    if layout and "vpp" in layout:
        values["vpp"] = [layout["vpp"]]  # a searched layout fixes its virtual stages
    best: tuple | None = None
    first_error: ConfigError | None = None
    evaluated = 0
    names = list(values)
    for combo in itertools.product(*(values[n] for n in names)):
        knobs = dict(zip(names, combo))
        cfg = _with(base, knobs)
        try:
            validate(cfg, planning=True)
        except ConfigError as err:
            first_error = first_error or err
            continue
        # the planner's own full recomputation (a given one is evaluated as given: every layer
        # unless model.recompute_num_layers says otherwise)
        if cfg.model.recompute == "full" and _recompute_layers_open(plan) and not memory_known:
            cfg = fewest_recomputed(cfg, hw, predict_kwargs.get("stack", MEGA))
        pr = predict(cfg, hw, mfu_peak, **predict_kwargs)
        evaluated += 1
        fits = pr.fits or memory_known
        rank = (fits, pr.mfu if fits else -pr.memory.total)
        if best is None or rank > best[0]:
            best = (rank, cfg, pr, knobs)
    if best is None:
        assert first_error is not None
        raise first_error
    _, cfg, pr, knobs = best
    chosen = [k for k in names if plan.is_open(KNOBS[k])]
    if cfg.model.recompute == "full":
        knobs = {**knobs, "recompute_num_layers": cfg.model.recompute_num_layers}
        if _recompute_layers_open(plan):
            chosen.append("recompute_num_layers")
    knobs = {**knobs, "precision": cfg.train.precision, "cp": cfg.parallelism.cp, **plan.chosen}
    return Evaluation(cfg, pr, knobs, chosen + list(plan.chosen), evaluated)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(plan: Planning, hw: Hardware) -> list[dict[str, int | None]]:
    """(tp, pp, vpp, dp) for the cluster's world size and the given cp; fixed keys stay as given."""
    cfg = plan.cfg
    m, p, c = cfg.model, cfg.parallelism, cfg.cluster
    world = c.nodes * c.procs_per_node
    groups = m.num_query_groups or m.num_attention_heads
    tps = (
        [p.tp]
        if not plan.is_open(LAYOUT["tp"])
        else [t for t in _divisors(min(world, hw.domain)) if groups % t == 0 and m.ffn % t == 0]
    )
    slots = p.layer_slots(m.num_layers)  # megatron's pipeline split: layers (+ embedding, loss)
    pps = [p.pp] if not plan.is_open(LAYOUT["pp"]) else _divisors(slots)
    out = []
    for tp in tps:
        for pp in pps:
            if world % (tp * pp * p.cp):
                continue
            dp = world // (tp * pp * p.cp)
            if not plan.is_open(LAYOUT["dp"]) and dp != p.dp:
                continue
            if p.global_batch_size % dp:
                continue
            if not plan.is_open(LAYOUT["vpp"]):
                vpps = [p.vpp]
            else:
                vpps = [None] + ([v for v in _divisors(slots // pp) if v > 1] if pp > 1 else [])
            for vpp in vpps:
                out.append({"tp": tp, "pp": pp, "vpp": vpp, "dp": dp})
    return out


def search(plan: Planning, calibration: str | Path | None = None, **predict_kwargs: Any) -> dict[str, Any]:
    """Every layout of the cluster's GPU count that fits, ranked by predicted MFU."""
    settle_precision(plan)
    hw, mfu_peak = hardware_for(plan.cfg, calibration)
    rows, rejected = [], {"invalid": 0, "does_not_fit": 0}
    for layout in layouts(plan, hw):
        try:
            ev = evaluate(plan, hw, mfu_peak, layout=layout, **predict_kwargs)
        except ConfigError:
            rejected["invalid"] += 1
            continue
        if not ev.prediction.fits:
            rejected["does_not_fit"] += 1
            continue
        row = ev.to_dict()
        row.pop("breakdown")
        rows.append(row)
    rows.sort(key=lambda r: r["mfu"], reverse=True)
    best = None
    if rows:
        top = rows[0]["layout"]
        best = evaluate(
            plan,
            hw,
            mfu_peak,
            layout={k: (top[k] if k != "vpp" or top[k] > 1 else None) for k in ("tp", "pp", "vpp", "dp")},
            **predict_kwargs,
        ).to_dict(hw)
    return {
        "best": best,
        "rows": rows,
        "rejected": rejected,
        "world_size": plan.cfg.cluster.nodes * plan.cfg.cluster.procs_per_node,
    }
