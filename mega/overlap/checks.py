"""What each ``parallelism.tp_overlap`` backend needs, checked before launch (torch-free: imported
by ``mega.config.validate``). Returns (dotted key, problem) pairs; the caller raises."""

from __future__ import annotations

TP_OVERLAP = ("none", "ring", "symm_mem", "te")


def tp_overlap_problems(cfg) -> list[tuple[str, str]]:
    p, c, m = cfg.parallelism, cfg.cluster, cfg.model
    mode = p.tp_overlap
    if mode not in TP_OVERLAP:
        return [("parallelism.tp_overlap", f"must be one of {list(TP_OVERLAP)}, got {mode!r}")]
    if mode == "none":
        return []
    if p.tp < 2:
        return [
            (
                "parallelism.tp_overlap",
                f"tp_overlap={mode} overlaps tensor-parallel communication: needs parallelism.tp>1, got {p.tp}",
            )
        ]
    if not p.sequence_parallel:
        return [
            (
                "parallelism.tp_overlap",
                f"tp_overlap={mode} overlaps the all-gather/reduce-scatter of sequence parallelism: "
                "needs parallelism.sequence_parallel=true",
            )
        ]
    problems = []
    if mode in ("symm_mem", "te") and (c.device != "cuda" or c.backend != "nccl"):
        problems.append(
            (
                "cluster.device",
                f"tp_overlap={mode} runs CUDA kernels over NVLink: needs "
                f"cluster.device=cuda and cluster.backend=nccl (got {c.device}/{c.backend}); "
                "tp_overlap=ring runs anywhere",
            )
        )
    if mode in ("symm_mem", "te") and c.procs_per_node % p.tp:
        memory = "Transformer Engine userbuffers" if mode == "te" else "symmetric memory"
        problems.append(
            (
                "parallelism.tp",
                f"tp_overlap={mode} keeps each TP group inside one NVLink node "
                f"({memory}): tp={p.tp} must divide cluster.procs_per_node={c.procs_per_node}",
            )
        )
    if mode == "te":
        if c.env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
            problems.append(
                (
                    "cluster.env.CUDA_DEVICE_MAX_CONNECTIONS",
                    "tp_overlap=te needs CUDA_DEVICE_MAX_CONNECTIONS=1 in cluster.env (one hardware "
                    "queue, so communication kernels are scheduled in issue order, as Megatron-LM "
                    f"requires), got {c.env.get('CUDA_DEVICE_MAX_CONNECTIONS')!r}",
                )
            )
        if m.block == "parallel":
            problems.append(
                (
                    "model.block",
                    "tp_overlap=te reduce-scatters inside each Transformer Engine "
                    "row-parallel linear, so the parallel block's two branches cannot share one "
                    "reduction: use parallelism.tp_overlap=ring (or symm_mem) with model.block=parallel",
                )
            )
    return problems
