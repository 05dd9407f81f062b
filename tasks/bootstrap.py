"""Prefect tasks: verify the rendezvous store, time process-group initialization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from mega.cluster.bootstrap import StoreNotAvailable, verify_store
from mega.config import MegaConfig
from mega.launch.node_jobs import time_process_groups


def _transient(task, task_run, state) -> bool:
    """Retry port races and slow starts, not a store kind that does not exist or a bad config."""
    return not isinstance(state.data, (StoreNotAvailable, ValueError))


@task(
    name="verify-store",
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=_transient,
    cache_policy=NO_CACHE,
)
def check_rendezvous_store(cfg: MegaConfig) -> dict[str, Any]:
    logger = get_run_logger()
    store = verify_store(cfg)
    create_table_artifact(
        key="rendezvous-store",
        table=[store],
        description=f"{store['store']} store at {store['host']}:{store['port']}: "
        f"median round trip {store['roundtrip_ms']:.3f} ms over {store['ops']} ops of each kind",
    )
    logger.info(
        "%s store %s:%s ok, median round trip %.3f ms",
        store["store"],
        store["host"],
        store["port"],
        store["roundtrip_ms"],
    )
    return store


@task(
    name="time-process-groups",
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=_transient,
    cache_policy=NO_CACHE,
)
def time_process_group_init(cfg: MegaConfig, out_dir: str | Path) -> dict[str, Any]:
    logger = get_run_logger()
    init = time_process_groups(cfg, out_dir)
    p = cfg.parallelism
    how = {"store": init["store"], "group_init": init["group_init"]}
    create_table_artifact(
        key="process-group-init",
        table=[
            {
                "rank": "max",
                "node": "all",
                **how,
                "pg_init_s": round(init["pg_init_s"], 4),
                "model_parallel_init_s": round(init["model_parallel_init_s"], 4),
            }
        ]
        + [
            {
                "rank": "max",
                "node": n["node"],
                **how,
                "pg_init_s": round(n["pg_init_s"], 4),
                "model_parallel_init_s": round(n["model_parallel_init_s"], 4),
            }
            for n in init["nodes"]
        ]
        + [
            {
                "rank": r["rank"],
                "node": r["node"],
                **how,
                "pg_init_s": round(r["pg_init_s"], 4),
                "model_parallel_init_s": round(r["model_parallel_init_s"], 4),
            }
            for r in init["ranks"]
        ],
        description=f"Process-group init over {init['world_size']} ranks on {len(init['nodes'])} node(s) "
        f"(tp={p.tp} pp={p.pp} vpp={p.vpp} dp={p.dp}, {cfg.cluster.backend}, "
        f"{init['store']} store, {init['group_init']} group creation); slowest rank first, then per node",
    )
    logger.info(
        "init_process_group %.3f s (%s store), initialize_model_parallel %.3f s (%s groups), "
        "max over %d ranks",
        init["pg_init_s"],
        init["store"],
        init["model_parallel_init_s"],
        init["group_init"],
        init["world_size"],
    )
    ph = init["phases"]
    logger.info(
        "start-up of the timing job: %.1f s in all; process start %.1f s, imports %.1f s, waiting for "
        "the slowest rank's imports %.2f s, groups %.2f s, exit %.1f s",
        init["job_s"],
        ph["spawn_s"] or 0.0,
        ph["import_s"],
        ph["import_skew_s"] or 0.0,
        init["pg_init_s"] + init["model_parallel_init_s"],
        init["exit_s"],
    )
    return init
