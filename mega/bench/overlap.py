"""``python -m mega.bench overlap [overrides] [--steps N] [--warmup N] [--link-mbit M] [--json]``.

Communication overlap, judged by exposed communication (docs/overlap.md): for each of
TP (``parallelism.tp_overlap=ring``), PP (``overlap_p2p_comm`` + warm-up/flush, interleaved) and
DP (``overlap_param_gather``), the same 2-rank job runs with the overlap off and on, one after the
other, as two local nodes in their own network namespaces joined by a veth shaped with ``tc tbf``
(``launcher.local_nodes.link_mbit``, 1000 = 1 Gbit/s), so that a transfer costs wire time and not
a memory copy competing with compute on the same cores. Per row: the median over the steps after
the warm-up of the exposed communication of that kind (``exposed_{tp,pp,dp}_s`` of metrics.jsonl,
mega/obs) and of the step time, both runs' loss curves compared exactly, and whether the issue's
goal is met (exposed at most half of off, step at most 5% above off, losses equal: bitwise for
PP and DP, to ``LOSS_RTOL`` for the TP ring, whose sums run in another order). Each row also
splits the logging rank's exposed time by operation (``exposed_by_op_off``/``_on``, from its span
file): the DP row's is the parameter all-gather, which ``overlap_param_gather`` moves, plus the
gradient reduce-scatter, which megatron's ``overlap_grad_reduce`` overlaps in both runs.

What each row is judged on (``exposed_basis``): the PP row on the step summaries' ``exposed_pp_s``,
whose receive waits count from when the sending peer had posted (mega.obs.timeline); the DP and
TP rows likewise on their waits counted from when the last peer of the group had launched the same
collective (the same bucket's, the same ring step's: ``mega.obs.analysis.exposed_by_op(...,
from_arrival=True)``): otherwise a rank whose backward ends 50 ms after its peer's books those 50 ms
as the peer's reduce-scatter (measured: this skew between the two ranks moves from step to step and
decided the DP row). Every row also gives the raw figures (``exposed_comm_raw_off_s``/``_on_s``,
the step summaries' medians, peers' lateness included) and their ratio.

Last line: ``{"rows": [{"name", "link", "exposed_comm_off_s", "exposed_comm_on_s", "step_off_s",
"step_on_s", "loss_equal", "target_met", ...}], ...}``. Needs root (network namespaces).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from mega.bench import common
from mega.metrics import read_metrics

# Big enough on 2 CPU cores that each kind's traffic is a real share of the step at 1 Gbit/s.
MODEL = [
    "model=tiny",
    "model.hidden_size=512",
    "model.num_attention_heads=8",
    "model.seq_length=256",
    "model.num_layers=4",
]
# The TP ring sums each output chunk in another order than megatron's reduce-scatter, so its losses
# agree to fp32 rounding, not bitwise (the tolerance of tests/test_tp_overlap.py); PP and DP overlap
# move the same bytes at other times and must be bit-identical.
LOSS_RTOL = {"tp": 2e-5, "pp": 0.0, "dp": 0.0}
# kinds judged on waits counted from the last group peer's launch (see the module docstring)
FROM_ARRIVAL = {"dp", "tp"}
# name -> (kind, layout overrides, overlap-on overrides); every layout is 2 ranks
ROWS = {
    "tp-overlap": (
        "tp",
        ["parallelism=tp2", "parallelism.sequence_parallel=true"],
        ["parallelism.tp_overlap=ring"],
    ),
    "pp-overlap": (
        "pp",
        ["parallelism=pp2-vpp2", "parallelism.global_batch_size=8"],
        ["parallelism.overlap_p2p_comm=true", "parallelism.overlap_p2p_comm_warmup_flush=true"],
    ),
    # 2M-parameter buckets (~7 for this model): reduction and all-gather proceed bucket by bucket.
    # One microbatch of 4 per DP rank (no gradient accumulation, as a pure-DP job that fits does):
    # with several, the all-gather can only hide behind the first microbatch's forward and the
    # reduce-scatter behind the last one's backward (docs/overlap.md measures both).
    "dp-overlap": (
        "dp",
        [
            "parallelism=dp2",
            "parallelism.global_batch_size=8",
            "parallelism.micro_batch_size=4",
            "parallelism.ddp_bucket_size=2000000",
        ],
        ["parallelism.overlap_param_gather=true"],
    ),
}


def link_overrides(link_mbit: float) -> list[str]:
    return [
        "launcher=local-nodes",
        "cluster.nodes=2",
        "cluster.procs_per_node=1",
        "launcher.local_nodes.netns=true",
        f"launcher.local_nodes.link_mbit={link_mbit:g}",
    ]


def run_configs(name: str, overrides: list[str], steps: int, link_mbit: float, tmp: str):
    """The off and on configs of one row (off first)."""
    kind, layout, on = ROWS[name]
    base = [
        *MODEL,
        *layout,
        *link_overrides(link_mbit),
        "train.eval_batches=0",
        "optimizer.warmup_steps=1",
        *overrides,
    ]
    return [
        common.compose_run([*base, *extra], steps, Path(tmp) / f"{name}-{label}")
        for label, extra in (("off", []), ("on", on))
    ]


def logging_rank_by_op(
    run_dir: str | Path, kind: str, metrics: list[dict], warmup: int
) -> tuple[dict, dict | None]:
    """The logging rank's (last stage, TP 0, DP 0: whose metrics the row reads) exposed
    communication of ``kind`` by operation and in ``total``, median over the timed steps
    (mega.obs.analysis): raw, and for the ``FROM_ARRIVAL`` kinds without the waits on a late peer
    (else None). The span files are read once for both."""
    from mega.obs import analysis

    tl = analysis.load(run_dir)
    rank = max(
        (r for r, h in tl.headers.items() if h.get("tp", 0) == 0 and h.get("dp", 0) == 0),
        key=lambda r: tl.headers[r].get("pp", 0),
    )
    steps = [m["step"] for m in common.steady(metrics, warmup)]
    return (
        analysis.exposed_by_op(tl, rank, kind, steps),
        analysis.exposed_by_op(tl, rank, kind, steps, from_arrival=True) if kind in FROM_ARRIVAL else None,
    )


def _basis(kind: str, from_arrival: bool) -> str:
    if from_arrival:
        return f"{kind} waits from the last {kind.upper()} peer's launch of the same operation (span files)"
    return f"exposed_{kind}_s of the step summaries" + (
        " (p2p waits from the peer's post)" if kind == "pp" else ""
    )


def build_row(
    name: str,
    link: str,
    off: list[dict],
    on: list[dict],
    warmup: int,
    arrival: tuple[dict, dict] | None = None,
) -> dict:
    """One row from the off and on runs' metrics rows; ``arrival``: the off and on runs' exposure
    without the waits on a late peer (``logging_rank_by_op``), whose totals the row is then judged on."""
    kind = ROWS[name][0]
    key = f"exposed_{kind}_s"
    a, b = common.steady(off, warmup), common.steady(on, warmup)
    raw = round(common.median(a, key), 6), round(common.median(b, key), 6)
    judged = raw if arrival is None else (arrival[0].get("total", 0.0), arrival[1].get("total", 0.0))
    row = {
        "name": name,
        "link": link,
        "exposed_comm_off_s": judged[0],
        "exposed_comm_on_s": judged[1],
        "step_off_s": round(common.median(a, "step_s"), 6),
        "step_on_s": round(common.median(b, "step_s"), 6),
        "loss_equal": [m["loss"] for m in off] == [m["loss"] for m in on] and len(off) == len(on) > 0,
        "loss_max_rel_diff": max(
            (abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(off, on)), default=None
        ),
        "loss_rtol": LOSS_RTOL[kind],
        "steps_timed": len(b),
        "exposed_basis": _basis(kind, arrival is not None),
        "exposed_comm_raw_off_s": raw[0],
        "exposed_comm_raw_on_s": raw[1],
    }
    row["losses_match"] = row["loss_equal"] or (
        len(off) == len(on) > 0 and row["loss_max_rel_diff"] <= row["loss_rtol"]
    )
    row["exposed_ratio"] = (
        round(row["exposed_comm_on_s"] / row["exposed_comm_off_s"], 4)
        if row["exposed_comm_off_s"] > 0
        else None
    )
    row["exposed_raw_ratio"] = round(raw[1] / raw[0], 4) if raw[0] > 0 else None
    row["step_ratio"] = round(row["step_on_s"] / row["step_off_s"], 4)
    row["target_met"] = bool(
        row["exposed_ratio"] is not None
        and row["exposed_ratio"] <= 0.5
        and row["step_ratio"] <= 1.05
        and row["losses_match"]
    )
    return row


def bench_overlap(
    overrides: list[str],
    steps: int = 8,
    warmup: int = 3,
    link_mbit: float = 1000.0,
    names: tuple[str, ...] = tuple(ROWS),
) -> dict:
    link = f"2 netns nodes, each on a veth to the bridge shaped by tc tbf {link_mbit:g} Mbit/s"
    rows = []
    with tempfile.TemporaryDirectory(prefix="mega-bench-overlap-") as tmp:
        for name in names:
            kind = ROWS[name][0]
            metrics, by_op, arrival = [], [], []
            for cfg in run_configs(name, overrides, steps, link_mbit, tmp):
                index = common.prepare_data(cfg)
                common.log(f"overlap: {name} {Path(cfg.train.run_dir).name} ({steps} steps, {link})")
                common.train(cfg, index)
                metrics.append(read_metrics(cfg.train.run_dir))
                raw, late = logging_rank_by_op(cfg.train.run_dir, kind, metrics[-1], warmup)
                by_op.append(raw)
                if late is not None:
                    arrival.append(late)
            rows.append(build_row(name, link, *metrics, warmup, tuple(arrival) if arrival else None))
            # what the exposed time waited for: e.g. dp = the parameter all-gather (what
            # overlap_param_gather changes) + the gradient reduce-scatter (overlapped in both runs)
            rows[-1].update(exposed_by_op_off=by_op[0], exposed_by_op_on=by_op[1])
            if arrival:
                rows[-1].update(
                    exposed_by_op_from_arrival_off=arrival[0], exposed_by_op_from_arrival_on=arrival[1]
                )
            common.log(f"overlap: {rows[-1]}")
    return {
        "rows": rows,
        "steps": steps,
        "warmup_steps": warmup,
        "model": MODEL,
        "note": "2 ranks on 2 CPU cores shared with the host; medians over the steps after the warm-up",
    }
