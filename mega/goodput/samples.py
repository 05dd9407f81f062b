"""The sample ledger: which samples (walk positions, i.e. indices into the data permutation) the
surviving steps trained on, and whether that is the schedule exactly once.

Rank side (``consumed``): every rank of pipeline stage 0 and TP rank 0 (one per DP rank) records
the walk positions of the global batch slice it read for the step (mega/data/dataset.py: step s
takes positions [s*G, (s+1)*G), DP rank r the r-th contiguous 1/dp of it). Ledger side
(``sample_ledger``): a step's surviving occurrence is the one of the latest attempt that ran it;
its positions count once; a skipped step's batch is listed as skipped, never silently dropped.
"""

from __future__ import annotations

from collections import Counter


def consumed(cfg, step: int) -> dict | None:
    """The walk positions this rank read for 0-based ``step`` (None on ranks that are not the
    first stage's TP rank 0: their DP peer there records the same slice)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_rank() != 0 or ps.get_pipeline_model_parallel_rank() != 0:
        return None
    p = cfg.parallelism
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per_rank = p.micro_batch_size * p.num_microbatches
    first = step * per_rank * dp_size + dp_rank * per_rank
    return {"dp_rank": dp_rank, "dp_size": dp_size, "first": first, "count": per_rank}


def _positions(s: dict) -> range:
    return range(s["first"], s["first"] + s["count"])


def sample_ledger(step_rows: list[dict], target_steps: int) -> dict:
    """``step_rows``: every rank's step marks (``attempt``, ``step``, ``skipped``, ``samples``).

    Returns the trained and skipped positions per step, the steps whose record is missing, and
    ``exact``: every position of the schedule's non-skipped steps trained exactly once, none else.
    """
    latest: dict[int, int] = {}
    for r in step_rows:
        latest[r["step"]] = max(latest.get(r["step"], -1), r["attempt"])
    trained: Counter = Counter()
    skipped: dict[int, list[int]] = {}
    dp_seen: dict[int, set] = {}
    dp_size: dict[int, int] = {}
    for r in step_rows:
        s = r.get("samples")
        if not s or r["attempt"] != latest[r["step"]]:
            continue
        if s["dp_rank"] in dp_seen.setdefault(r["step"], set()):
            continue  # the same DP slice from another rank of the same attempt (never expected)
        dp_seen[r["step"]].add(s["dp_rank"])
        dp_size[r["step"]] = s["dp_size"]
        if r["skipped"]:
            skipped.setdefault(r["step"], []).extend(_positions(s))
        else:
            trained.update(_positions(s))
    incomplete = sorted(
        s for s in range(1, target_steps + 1) if s not in dp_seen or len(dp_seen[s]) != dp_size.get(s)
    )
    per_step = {
        s: dp_size[s] * next(r["samples"]["count"] for r in step_rows if r["step"] == s and r.get("samples"))
        for s in dp_size
    }
    expected = Counter()
    for s in range(1, target_steps + 1):
        if s in per_step and s not in skipped:
            g = per_step[s]
            expected.update(range((s - 1) * g, s * g))
    twice = sorted(p for p, n in trained.items() if n > 1)
    return {
        "steps": target_steps,
        "trained_samples": sum(trained.values()),
        "distinct_samples": len(trained),
        "skipped": [{"step": s, "positions": sorted(v)} for s, v in sorted(skipped.items())],
        "replayed_steps": sorted({r["step"] for r in step_rows if r["attempt"] != latest[r["step"]]}),
        "missing_steps": incomplete,
        "duplicates": twice[:20],
        "exact": not incomplete and not twice and trained == expected,
    }
