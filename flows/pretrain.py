"""The pretraining pipeline: prepare data -> node self-check -> bootstrap -> train -> report
(loss curve; merged trace, heat map and stragglers). With the driver in the run's Slurm allocation
the self-check is the job's first step, run by that driver (mega/launch/slurm_preflight.py).

Two ways in, one composition per flow run:

* Prefect (deployments, the UI, Python): ``pretrain(overrides=["parallelism=dp2", ...])`` composes
  ``conf/`` with Hydra inside the flow; ``pretrain(config={...})`` takes an already resolved config.
* The CLI, ``python -m flows.pretrain [hydra overrides]`` (flows/cli.py): Hydra composes (so
  ``--cfg job``, ``--help`` and ``-m`` sweeps work), the config is validated before anything
  launches (exit 2 naming the key), and each job calls the flow with the resolved dict.

Prefect runs with its embedded defaults: without PREFECT_API_URL it starts a temporary local server
(with the defaults flows/__init__.py sets for it).
"""

from __future__ import annotations

if __name__ == "__main__":  # the CLI, before this module's imports: showing a config needs none of them
    from flows.cli import main

    def _cli_job(config: dict) -> dict:
        """One job: the flow, imported (with Prefect and the tasks) only now that a job runs."""
        from flows.pretrain import pretrain

        return pretrain(config=config)

    main(_cli_job)
    raise SystemExit(0)

import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from mega.config import MegaConfig, compose, from_dict
from mega.goodput import ledger as goodput_ledger
from mega.goodput.marks import FlowMarks
from mega.launch.slurm_preflight import verdict_path
from mega.launch.slurm_steps import drives_in_allocation
from tasks.bootstrap import check_rendezvous_store, time_process_group_init
from tasks.data import prepare_data
from tasks.observability import observability
from tasks.report import report
from tasks.selfcheck import node_selfcheck
from tasks.train import train


@flow(name="pretrain", log_prints=True)
def pretrain(overrides: list[str] | None = None, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pretrain a GPT with megatron-core; returns a JSON-able summary of every stage."""
    cfg = resolve_config(overrides, config)
    logger = get_run_logger()
    p = cfg.parallelism
    logger.info(
        "model %s, layout %s (tp=%d pp=%d vpp=%s dp=%d), %d steps -> %s",
        cfg.model.name,
        p.name,
        p.tp,
        p.pp,
        p.vpp,
        p.dp,
        cfg.train.steps,
        cfg.train.run_dir,
    )
    run_dir = Path(cfg.train.run_dir)
    marks = FlowMarks(run_dir)  # the goodput ledger's flow phases (docs/goodput.md)
    marks.start()

    in_job = drives_in_allocation(cfg)  # Slurm: the driver checks its job's nodes as the job's first step
    with marks.task("prepare-data"):  # the data preparation overlaps the self-check
        data = prepare_data.submit(cfg.data, cfg.model.vocab_size)
        if not in_job:
            with marks.task("node-selfcheck"):
                node = node_selfcheck(
                    cfg, run_dir / "selfcheck"
                )  # every node; raises NodeUnhealthy: nothing trains
        index_path = data.result()
    with marks.task("verify-store"):
        store = check_rendezvous_store(cfg)
    if cfg.cluster.time_groups_job:  # a separate job times group creation; else training's own start-up does
        with marks.task("time-process-groups"):
            init = time_process_group_init(cfg, run_dir / "bootstrap")
    with marks.task("train"):
        result = train(cfg, index_path)  # in the allocation: publishes the driver's self-check
    node = _allocation_selfcheck(run_dir) if in_job else node
    init = init if cfg.cluster.time_groups_job else result.init
    with marks.task("report"):
        summary = report(result.run_dir, title=f"{cfg.model.name} / {p.name}", metrics=result.metrics)
    # merged trace, heat map, stragglers; the goodput ledger (docs/observability.md, docs/goodput.md)
    with marks.task("observability"):
        obs = observability(
            result.run_dir, title=f"{cfg.model.name} / {p.name}", tensorboard=cfg.train.tensorboard
        )
    marks.end()
    ledger = goodput_ledger.write(run_dir)  # goodput.json again, now over the whole flow

    return {
        "run_dir": str(result.run_dir),
        "model": cfg.model.name,
        "parallelism": p.name,
        "world_size": p.world_size,
        "data_index": str(index_path),
        "selfcheck": node
        and {
            "node": node["node"],
            "healthy": node["healthy"],
            "reasons": node["reasons"],
            "nodes": [{k: n[k] for k in ("node", "address", "healthy")} for n in node["nodes"]],
            "excluded_hosts": node.get("excluded_hosts", []),
        },
        "store": store,
        "process_group_init": {
            k: init[k] for k in ("pg_init_s", "model_parallel_init_s", "world_size", "store", "group_init")
        },
        "training": {"attempts": result.attempts, "final_step": result.final_step, "init": result.init},
        "report": summary,
        "observability": obs,
        "goodput": {k: ledger[k] for k in ("ettr", "wall_s", "unattributed_s")},
    }


def _allocation_selfcheck(run_dir: Path) -> dict[str, Any] | None:
    """The verdict of the driver's check of its Slurm job's nodes (None: launcher.slurm.selfcheck=false)."""
    path = verdict_path(run_dir)
    return json.loads(path.read_text()) if path.exists() else None


def resolve_config(overrides: list[str] | None, config: dict[str, Any] | None) -> MegaConfig:
    """Exactly one composition per flow run: a resolved dict wins, else Hydra composes conf/."""
    if config is not None:
        if overrides:
            raise ValueError("pass either overrides or a resolved config, not both")
        return from_dict(config)
    return compose(overrides)
