"""Per-device efficiencies of the performance model: what fraction of a datasheet figure a device
type reaches, and the two costs of running many of them in lock-step.

One ``DeviceCalibration`` per device type (the ``mega.flops.PEAK_TFLOPS`` key: "A100", "H100
SXM", ...). Three ways to get one, the same JSON shape for all:

* the built-in priors below (``prior``), each with its source;
* fitted on published runs of that device (``mega.perf.published.fit``: ``python -m mega.plan
  validate`` fits one per device on every source but the one it predicts);
* measured on a GPU node (``python -m mega.perf.calibrate --device cuda --out FILE``), then given
  to the planner with ``python -m mega.plan ... --calibration FILE``.

A device type that no published row validates is flagged (``validated: false``) and the planner
warns about it.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Fitted on the published runs in tests/fixtures/published that calibrate (mega.perf.published.fit
# over published.calibrates: not the rows of a PRIOR_LIKE device, which check its transfer; `python -m
# mega.plan validate --json` prints them again as `fitted_on_all`): the GEMM efficiency of each
# device type on its rows; the straggler spread, the step overhead and the NIC's per-hop latency on
# all rows, least squares of the MFU error in points. The last three are properties of a job and its
# fabric, not of a device (calibrate cannot measure them on one node): every device type's built-in
# calibration takes them (JOB_FIELDS).
# validate never uses these: it fits again without the source it predicts.
FITTED = {
    "A100": {"gemm_efficiency": 0.7654},
    "H100 SXM": {"gemm_efficiency": 0.6267, "fp8_gemm_efficiency": 0.5564},
}
FITTED_JOB = {"straggler_sigma": 0.0296, "step_overhead_s": 0.036, "nic_latency_us": 5.2473}
JOB_FIELDS = tuple(FITTED_JOB)


def error_band(
    rows: int, mae: float, mean: float, lowest: float, highest: float, within: int
) -> dict[str, float]:
    """One accuracy record (``published.accuracy``): rows, MAE, mean, lowest and highest error
    (MFU points), rows within +-3."""
    return {
        "rows": rows,
        "mae_mfu_pts": mae,
        "mean_err_mfu_pts": mean,
        "min_err_mfu_pts": lowest,
        "max_err_mfu_pts": highest,
        "within_3_pts": within,
    }


# What the planner's error was on the published runs of each device type and precision, held out
# (leave one source out; MFU points, predicted - published), on the rows the model explains and on
# all of them: the "accuracy" block of `python -m mega.plan validate --json` (2026-11-29), which a
# test re-derives. The planner prints it beside a plan on that device type (or the one it takes its
# calibration from, PRIOR_LIKE).
ACCURACY: dict[str, dict[str, dict[str, dict[str, float]]]] = {
    "A100": {
        "bf16": {
            "explained": error_band(41, 1.17, -0.08, -2.5, 3.2, 40),
            "all": error_band(44, 1.44, 0.28, -2.5, 5.6, 40),
        }
    },
    "H100 SXM": {
        "bf16": {
            "explained": error_band(19, 1.9, 0.21, -3.6, 5.2, 15),
            "all": error_band(20, 2.12, 0.51, -3.6, 6.3, 15),
        },
        "fp8": {
            "explained": error_band(23, 1.65, 0.39, -7.4, 3.6, 21),
            "all": error_band(24, 2.25, -0.3, -16.2, 3.6, 21),
        },
    },
    # every Blackwell row is explained: one band for both
    "B200": {"fp8": dict.fromkeys(("explained", "all"), error_band(4, 5.81, 2.56, -4.6, 10.0, 1))},
    "GB200": {"fp8": dict.fromkeys(("explained", "all"), error_band(4, 2.99, 2.99, 0.1, 5.5, 2))},
}
# Device types with rows in tests/fixtures/published: those with a record above.
VALIDATED = tuple(ACCURACY)

# Priors (docs/perf-model.md, "Constants"):
# fused attention against the dense peak: FlashAttention-2 reaches 50-73% of the A100 peak forward +
# backward (Dao 2023, section 4.1), counting the FLOPs a causal kernel executes (half the s x s
# square), as mega.perf.step charges them; the middle of that range.
ATTENTION_EFFICIENCY = 0.6
# Hopper (GH100: H100 SXM, H200): the same paper measures up to 335 TFLOP/s forward + backward on an
# H100 (its A100 kernels, no Hopper-specific instructions): 335 / 989.4 of the dense bf16 peak. A
# standalone causal-SDPA loop on one H200 gave 0.26-0.51 by sequence length (docs/perf-model.md).
PRIOR_ATTENTION = {"H100 SXM": 0.34}
# streaming kernels reach ~85% of the HBM datasheet bandwidth (STREAM-like copies on A100/H100).
MEMORY_EFFICIENCY = 0.85
# NCCL bus bandwidth over NVLink against the datasheet per-direction figure (nccl-tests
# all_reduce_perf on DGX A100: ~230-240 of 300 GB/s).
NVLINK_EFFICIENCY = 0.8
# NCCL bus bandwidth over InfiniBand/RoCE against the NIC line rate (one NIC per GPU).
NIC_EFFICIENCY = 0.85
# Relative spread (standard deviation / mean) of one data-parallel replica's step time: the step of
# N replicas meeting at the gradient reduction is the slowest one's (mechanism in mega.perf.scale).
# MegaScale (NSDI'24 section 5.1) finds ~0.5% of machines markedly slow and MFU varying between runs
# with them; fitted.
STRAGGLER_SIGMA = 0.01
# Host work per optimizer step a GPU does not hide (zero_grad, scheduler, logging, the data
# loader's hand-off, Python between the schedule's phases), seconds; fitted.
STEP_OVERHEAD_S = 0.05
# Latency of one step of a ring collective between nodes (an NCCL ring step over InfiniBand/RoCE:
# the proxy posts the RDMA write, the peer's GPU sees the flag), microseconds; a ring over n nodes
# pays (n - 1) of them per call, so it sets how a data-parallel reduction in fixed buckets slows as
# dp grows. NCCL's own tuning model charges 2.7 (LL), 4.0 (LL128) and 14 (Simple) per network ring
# step (src/graph/tuning.cc, hwLatencies): the range the fit searches.
NIC_LATENCY_US = 10.0
NIC_LATENCY_RANGE_US = (2.7, 14.0)

FIELDS = (
    "gemm_efficiency",
    "fp8_gemm_efficiency",
    "attention_efficiency",
    "memory_efficiency",
    "nvlink_efficiency",
    "nic_efficiency",
    "straggler_sigma",
    "step_overhead_s",
    "nic_latency_us",
)


# GEMM efficiency before any fit, per device type. A100: least squares over Korthikanti et al. 2022
# Table 5's eight iteration times (mega.perf.published.fit on that fixture alone). H100 SXM: a
# micro-benchmark on the same chip, an H200 (the H100 SXM's GH100: 132 SMs, 989 TFLOP/s dense bf16;
# it differs only in HBM, which compute-bound GEMMs do not feel), measured with
# python -m mega.perf.calibrate --device cuda (torch 2.11+cu130, 2026-11-26) over the layer GEMMs of
# GPT-175B, Nemotron-4 340B and Llama 3 405B at TP 1-8: the median over the 102 shapes of achieved /
# (peak x the model's shape factor) = 0.7178 (per model 0.749, 0.717, 0.709; the runs are
# tests/fixtures/calibration/h200-2026-11-26-*.json).
PRIOR_GEMM = {"A100": 0.76, "H100 SXM": 0.7178}
PRIOR_SOURCE = {
    "A100": "GEMM prior: least squares over Korthikanti et al. 2022 Table 5",
    "H100 SXM": (
        "GEMM prior: python -m mega.perf.calibrate --device cuda on one H200 (the H100 SXM's GH100 "
        "chip), 2026-11-26, tests/fixtures/calibration/h200-2026-11-26-*.json"
    ),
}
DEFAULT_GEMM = 0.76

# A device type takes another's calibration (that device's fit, where it has one) for what no
# published run of its own fits. The H200 is the H100 SXM's chip (GH100; the model reads its larger,
# faster HBM from the cluster preset). Blackwell (B200, GB200) is taken to reach the same fractions
# of its own datasheet peaks and bandwidths as Hopper: Megatron-Bridge 25.11's DGX-B200 and DGX-GB200
# rows check it, predicted by validate from the H100 SXM's fit on the other sources.
PRIOR_LIKE = {"H200": "H100 SXM", "B200": "H100 SXM", "GB200": "H100 SXM"}


@dataclass(frozen=True)
class DeviceCalibration:
    device: str
    gemm_efficiency: float = DEFAULT_GEMM
    attention_efficiency: float = ATTENTION_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    nvlink_efficiency: float = NVLINK_EFFICIENCY
    nic_efficiency: float = NIC_EFFICIENCY
    straggler_sigma: float = STRAGGLER_SIGMA
    step_overhead_s: float = STEP_OVERHEAD_S
    nic_latency_us: float = NIC_LATENCY_US
    # FP8 GEMMs (train.precision=fp8) against the dense FP8 peak; None: gemm_efficiency, i.e. an FP8
    # GEMM reaches the same fraction of its peak as a bf16 one (docs/perf-model.md, "FP8")
    fp8_gemm_efficiency: float | None = None
    # Measured fused-attention efficiency by kernel length ((tokens, efficiency), ascending;
    # ``calibrate --device cuda`` times the model's sequence and its CP chunks): a kernel shorter
    # than the longest measured runs at attention_efficiency x eff(length) / eff(longest). Empty: one
    # efficiency for every length.
    attention_by_length: tuple[tuple[int, float], ...] = ()
    source: str = "prior"
    validated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def attention_length_factor(self, length: int | None) -> float:
        """The share of ``attention_efficiency`` a kernel over ``length`` tokens reaches: the measured
        efficiency interpolated in log(length) between the lengths measured, relative to the
        longest one; 1 at or above the longest, the shortest's share below it (no extrapolation)."""
        table = self.attention_by_length
        if not table or length is None or length >= table[-1][0]:
            return 1.0
        longest = table[-1][1]
        i = bisect.bisect_right([n for n, _ in table], length)  # table[i - 1] <= length < table[i]
        if i == 0:
            return table[0][1] / longest
        (l0, e0), (l1, e1) = table[i - 1], table[i]
        return (e0 + math.log(length / l0) / math.log(l1 / l0) * (e1 - e0)) / longest

    def replace(self, **changes: Any) -> DeviceCalibration:
        return dataclasses.replace(self, **changes)


def prior(device: str | None) -> DeviceCalibration:
    """The built-in calibration of a device type (``FITTED`` and ``FITTED_JOB`` over the priors, or
    over the ``PRIOR_LIKE`` device's built-in calibration)."""
    key = device or "unknown"
    like = PRIOR_LIKE.get(key)
    if like:
        base = prior(like).to_dict()
    else:
        base = {
            "gemm_efficiency": PRIOR_GEMM.get(key, DEFAULT_GEMM),
            "attention_efficiency": PRIOR_ATTENTION.get(key, ATTENTION_EFFICIENCY),
            **FITTED_JOB,
        }
    values = {
        **base,
        **FITTED.get(key, {}),
        "device": key,
        "source": "built-in (mega/perf/device.py)"
        + (f", the {like}'s where {key} has no fit" if like else ""),
        "validated": key in VALIDATED,
    }
    return DeviceCalibration(**values)


def unfitted(device: str) -> DeviceCalibration:
    """The prior alone (no fit on published runs): what validate starts from."""
    like = PRIOR_LIKE.get(device)
    if like:
        return unfitted(like).replace(device=device, source=f"the {like}'s prior")
    source = f"prior ({PRIOR_SOURCE[device]})" if device in PRIOR_SOURCE else "prior"
    return DeviceCalibration(
        device,
        gemm_efficiency=PRIOR_GEMM.get(device, DEFAULT_GEMM),
        attention_efficiency=PRIOR_ATTENTION.get(device, ATTENTION_EFFICIENCY),
        source=source,
    )


def load(path: str | Path) -> DeviceCalibration:
    """A calibration JSON (``{"calibration": {...}}`` as calibrate writes it, or the bare block)."""
    data = json.loads(Path(path).read_text())
    block = data.get("calibration", data)
    if "device" not in block:
        raise ValueError(
            f"{path}: not a GPU calibration (no 'device'); CPU calibrations come from "
            "python -m mega.plan calibrate"
        )
    block = {k: v for k, v in block.items() if v is not None}  # null: the built-in value
    unknown = set(block) - set(FIELDS) - {"device", "source", "validated", "attention_by_length"}
    if unknown:
        raise ValueError(f"{path}: unknown calibration field(s) {sorted(unknown)}; known: {sorted(FIELDS)}")
    bad = [
        k
        for k in FIELDS
        if k in block
        and not (isinstance(block[k], (int, float)) and math.isfinite(block[k]) and block[k] >= 0)
    ]
    if bad:
        raise ValueError(f"{path}: {bad[0]} must be a finite number >= 0, got {block[bad[0]]!r}")
    base = prior(block["device"])
    values: dict[str, Any] = {k: float(block[k]) for k in FIELDS if k in block}
    if "attention_by_length" in block:
        values["attention_by_length"] = _length_table(path, block["attention_by_length"])
    return base.replace(
        **values,
        source=block.get("source", str(path)),
        validated=bool(block.get("validated", base.validated)),
    )


def _length_table(path: str | Path, raw: Any) -> tuple[tuple[int, float], ...]:
    """``attention_by_length`` as a calibration file holds it: [[tokens, efficiency], ...]."""
    try:
        table = tuple(sorted((int(n), float(e)) for n, e in raw))
    except (TypeError, ValueError):
        raise ValueError(
            f"{path}: attention_by_length must be a list of [tokens, efficiency] pairs, got {raw!r}"
        ) from None
    lengths = [n for n, _ in table]
    if table and (
        min(lengths) <= 0
        or len(set(lengths)) < len(lengths)
        or any(not e > 0 or math.isinf(e) for _, e in table)
    ):
        raise ValueError(
            f"{path}: attention_by_length needs distinct positive token counts and efficiencies > 0, "
            f"got {raw!r}"
        )
    return table


def save(calibration: DeviceCalibration, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"calibration": calibration.to_dict(), **(extra or {})}, indent=1))
    return path
