"""Prefect task: run the torchrun training job and watch it (restarts live in run_training)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, runtime, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from mega import optional_packages
from mega.config import MegaConfig
from mega.launch import TrainingResult, run_training
from tasks.incidents import publish_incident
from tasks.selfcheck import publish_selfcheck


# No Prefect retries: run_training already relaunches failed ranks from the latest checkpoint
# (cfg.restart.max_restarts, with backoff); a Prefect retry would start over from step 0's view.
@task(name="train", cache_policy=NO_CACHE)
def train(cfg: MegaConfig, index_path: Path) -> TrainingResult:
    logger = get_run_logger()
    # The flow run's id goes into the run's record (run.json): the recovery automation maps a
    # Failed or Crashed pretrain flow run to its run directory by it.
    flow_run_id = runtime.flow_run.id  # a UUID, None outside a flow run
    absent = optional_packages.notice(cfg.cluster.device)  # once, instead of megatron's per-rank warnings
    if absent:
        logger.info(absent)
    # every incident (hang, rank exit, NaN, eviction, straggler) a Prefect event and artifact
    result = run_training(
        cfg,
        index_path,
        log=logger.info,
        flow_run_id=flow_run_id and str(flow_run_id),
        on_incident=publish_incident,
        on_selfcheck=publish_selfcheck,  # the driver's check of its Slurm allocation's nodes
    )
    create_table_artifact(
        key="training-run",
        table=[
            {
                "run_dir": str(result.run_dir),
                "attempts": result.attempts,
                "final_step": result.final_step,
                "nodes": len(result.init.get("nodes") or []) or cfg.cluster.nodes,
                **{
                    k: (round(v, 4) if isinstance(v, float) else v)
                    for k, v in result.init.items()
                    if k != "nodes"
                },
            }
        ],
        description=f"{cfg.model.name} on {cfg.parallelism.name}: {result.final_step} steps "
        f"in {result.attempts} attempt(s)",
    )
    return result
