"""Barrier-light group creation (mega/cluster/parallel_groups.py) builds exactly megatron-core's groups.

Real gloo worlds of 4 and 8 processes build megatron-core's model-parallel groups for several
layouts, first the upstream way (``default``) and then members-only (``light``), and compare every
group megatron-core keeps -- its module state and its getters, rank for rank, with group names,
descriptions and backends -- and the store operations each rank issued. Then a 4-rank training
run gives the same losses with either strategy.

Processes come from a forkserver with torch and megatron-core preloaded, so the modules are
imported once rather than once per rank (as tests/test_redis_store.py does).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest
from helpers import free_port

from mega.cluster import bootstrap_sim as bs
from mega.cluster import parallel_groups
from mega.config import compose, save
from mega.store.recording import load_recordings

# layout name -> megatron-core keyword arguments (world size 4)
LAYOUTS_4 = [
    ("tp2-dp2", {"tensor_model_parallel_size": 2}),
    ("pp2-vpp2-dp2", {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    ("tp2-pp2", {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    ("dp4-ep2-2distopt", {"expert_model_parallel_size": 2, "num_distributed_optimizer_instances": 2}),
    (
        "tp2-cp2-allgather",
        {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "create_all_gather_group": True},
    ),
]
LAYOUTS_8 = [
    ("tp2-pp2-dp2", {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    (
        "pp2-vpp2-dp2-ep2",
        {
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "expert_model_parallel_size": 2,
        },
    ),
]

# every group getter of megatron-core 0.16.1, called as the model code calls it
GETTERS = [
    ("tp", "get_tensor_model_parallel_group", {"check_initialized": False}),
    ("pp", "get_pipeline_model_parallel_group", {"check_initialized": False}),
    ("mp", "get_model_parallel_group", {"check_initialized": False}),
    ("dp", "get_data_parallel_group", {}),
    ("dp-cp", "get_data_parallel_group", {"with_context_parallel": True}),
    (
        "dp-cp-partial",
        "get_data_parallel_group",
        {"with_context_parallel": True, "partial_data_parallel": True},
    ),
    ("dp-cp-ag", "get_data_parallel_group", {"with_context_parallel": True, "independent_all_gather": True}),
    ("dp-gloo", "get_data_parallel_group_gloo", {}),
    ("dp-cp-gloo", "get_data_parallel_group_gloo", {"with_context_parallel": True}),
    (
        "dp-cp-partial-gloo",
        "get_data_parallel_group_gloo",
        {"with_context_parallel": True, "partial_data_parallel": True},
    ),
    ("cp", "get_context_parallel_group", {"check_initialized": False}),
    ("embedding", "get_embedding_group", {"check_initialized": False}),
    ("position-embedding", "get_position_embedding_group", {"check_initialized": False}),
    ("tp-dp", "get_tensor_and_data_parallel_group", {"check_initialized": False}),
    (
        "tp-dp-cp",
        "get_tensor_and_data_parallel_group",
        {"check_initialized": False, "with_context_parallel": True},
    ),
    ("tp-cp", "get_tensor_and_context_parallel_group", {"check_initialized": False}),
    ("ep", "get_expert_model_parallel_group", {"check_initialized": False}),
    ("ep-tp", "get_expert_tensor_parallel_group", {"check_initialized": False}),
    ("ep-tp-mp", "get_expert_tensor_and_model_parallel_group", {"check_initialized": False}),
    ("ep-tp-pp", "get_expert_tensor_model_pipeline_parallel_group", {"check_initialized": False}),
    ("ep-dp", "get_expert_data_parallel_group", {"check_initialized": False}),
    (
        "ep-dp-partial",
        "get_expert_data_parallel_group",
        {"check_initialized": False, "partial_expert_data_parallel": True},
    ),
    ("ep-dp-gloo", "get_expert_data_parallel_group_gloo", {}),
    ("ep-dp-partial-gloo", "get_expert_data_parallel_group_gloo", {"partial_expert_data_parallel": True}),
    ("intra-distopt", "get_intra_distributed_optimizer_instance_group", {"check_initialized": False}),
    ("inter-distopt", "get_inter_distributed_optimizer_instance_group", {"check_initialized": False}),
    ("amax", "get_amax_reduction_group", {}),
]


# ---------------------------------------------------------------------------------------------
# Rank side


def _describe(value, base: int):
    """A comparable picture of megatron state: groups as (ranks, name index, desc, backend)."""
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return {
            "ranks": dist.get_process_group_ranks(value),
            "name": int(value.group_name) - base,
            "desc": value.group_desc,
            "backend": dist.get_backend(value),
        }
    if isinstance(value, (list, tuple)):
        return [_describe(v, base) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v, base) for k, v in value.items()}
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    return f"<{type(value).__name__}>"


def _megatron_state(base: int) -> dict:
    """Every module-level group, rank list and size megatron-core's parallel_state keeps."""
    from megatron.core import parallel_state as ps

    return {
        name: _describe(value, base)
        for name, value in sorted(vars(ps).items())
        if name.startswith("_")
        and (name.isupper() or name == "_global_process_group_list")
        and not name.startswith("_GLOBAL_")
        and not callable(value)
    }


def _getters(base: int) -> dict:
    from megatron.core import parallel_state as ps

    out = {}
    for label, fn, kwargs in GETTERS:
        try:
            out[label] = _describe(getattr(ps, fn)(**kwargs), base)
        except AssertionError as err:  # not built for this layout: must be so in both strategies
            out[label] = f"AssertionError: {err}"
    out["ranks"] = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
        "first": ps.is_pipeline_first_stage(),
        "last": ps.is_pipeline_last_stage(),
        "in-embedding": ps.is_rank_in_embedding_group(),
    }
    return out


def _group_index(key: str, base: int):
    """The group (creation index) a store key belongs to; None for keys of no group."""
    key = key.split("//", 1)[1] if "//" in key else key  # the default group's prefix
    head = key.split("//", 1)[0]
    if head.startswith("store_based_barrier_key:"):
        head = head.split(":")[1]
    return int(head) - base if head.isdigit() else None


def _all_reduce_every_group(rank: int) -> list:
    """Sum of member ranks over every group this rank holds, in creation order (no deadlock:
    every rank walks the groups in the same global order)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    sums = []
    for group in ps._global_process_group_list[1:]:
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=group)
        sums.append((dist.get_process_group_ranks(group), x.item()))
    return sums


def _groups_rank(rank: int, world: int, port: int, layouts, results) -> None:
    try:
        # torch's store-based barrier after each new_group (off by default since torch 2.1; the
        # setting MegaScale measured): the world-wide traffic `light` replaces by one barrier
        os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from torch.distributed import distributed_c10d as c10d

        from mega.store.recording import RecordingStore

        tcp = dist.TCPStore(
            "127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=90), wait_for_workers=False
        )
        store = RecordingStore(tcp, rank)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=90)
        )
        rows = {}
        for name, kwargs in layouts:
            for strategy in ("default", "light"):
                dist.barrier()
                base = c10d._world.group_count
                store.reset()
                parallel_groups.initialize_model_parallel(
                    strategy, create_gloo_process_groups=True, distributed_timeout_minutes=1, **kwargs
                )
                ops = [keys for _, keys in store.ops]
                row = {
                    "state": _megatron_state(base),
                    "getters": _getters(base),
                    "created": c10d._world.group_count - base,
                    "ops": len(ops),
                    "group_barrier_ops": sum("store_based_barrier_key" in k for keys in ops for k in keys),
                    "ready_barrier_ops": sum(
                        parallel_groups.READY_BARRIER_PREFIX in k for keys in ops for k in keys
                    ),
                    "touched": sorted(
                        {i for keys in ops for k in keys if (i := _group_index(k, base)) is not None}
                    ),
                    "member_of": sorted(int(g.group_name) - base for g in ps._global_process_group_list[1:]),
                    # the context manager put megatron's and torch's functions back
                    "restored": ps.create_group.__module__ == ps.__name__
                    and c10d._process_group_name.__module__ == c10d.__name__
                    and c10d._is_barrier_after_init.__module__ == c10d.__name__,
                    "sums": _all_reduce_every_group(rank),
                }
                ps.destroy_model_parallel()
                rows[f"{name}/{strategy}"] = row
        dist.barrier()
        dist.destroy_process_group()
        rows["cpu_s"] = time.process_time()  # this process's CPU time: the test's cost on idle cores
        results.put((rank, json.dumps(rows)))
    except BaseException as err:  # report, do not hang the parent
        import traceback

        results.put((rank, json.dumps({"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"})))
        raise


def _run_world(world: int, target, args_for, timeout_s: float = 240) -> dict:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "megatron.core.parallel_state",
            "mega.cluster.parallel_groups",
            "mega.store.recording",
            "mega.train",
        ]
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(*args_for(rank), results), daemon=True) for rank in range(world)
    ]
    for p in procs:
        p.start()
    rows = {}
    try:
        for _ in range(world):
            rank, payload = results.get(timeout=timeout_s)
            rows[rank] = json.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: row["error"] for r, row in rows.items() if "error" in row}
    assert not errors, errors
    assert all(p.exitcode == 0 for p in procs)
    print(f"{world} ranks: {sum(row.pop('cpu_s') for row in rows.values()):.1f} s CPU in all")
    return rows


# ---------------------------------------------------------------------------------------------
# Tests


def _check_layouts(rows: dict, layouts, world: int) -> None:
    for name, _ in layouts:
        totals = {}
        for rank, by_layout in rows.items():
            default, light = by_layout[f"{name}/default"], by_layout[f"{name}/light"]
            where = f"{name}, rank {rank}"
            assert light["state"] == default["state"], where
            assert light["getters"] == default["getters"], where
            assert light["created"] == default["created"] > 0, where  # same names for later groups
            assert light["member_of"] == default["member_of"], where
            assert light["restored"] and default["restored"], where
            # every group works: an all_reduce over it sums its members' ranks
            assert all(total == sum(ranks) for ranks, total in light["sums"]), where
            assert light["sums"] == default["sums"], where
            # store traffic: default joins every group's world-wide barrier, light only its own groups
            assert default["touched"] == list(range(default["created"])), where
            assert set(light["touched"]) <= set(light["member_of"]), where
            assert light["ops"] < default["ops"], where
            # default: torch's barrier after every group, world-wide; light: none per group, one
            # world barrier at the end (add + wait, and the set of the rank completing the count)
            assert (
                default["group_barrier_ops"] >= 3 * default["created"] and not default["ready_barrier_ops"]
            ), where
            assert light["group_barrier_ops"] == 0 and light["ready_barrier_ops"] in (2, 3), where
            for strategy in ("default", "light"):
                totals[strategy] = totals.get(strategy, 0) + by_layout[f"{name}/{strategy}"]["ops"]
        print(f"{name} (world {world}): store ops default={totals['default']} light={totals['light']}")
        assert totals["light"] < totals["default"]


@pytest.mark.slow  # one 4-process job, all layouts in it: ~15 s on two idle cores
def test_light_groups_equal_default_groups_world4():
    port = free_port()
    rows = _run_world(4, _groups_rank, lambda rank: (rank, 4, port, LAYOUTS_4))
    _check_layouts(rows, LAYOUTS_4, 4)
    # the layouts really exercise non-trivial groups: pipeline stages, experts, context parallel
    tp2pp2 = rows[0]["tp2-pp2/light"]["getters"]
    assert tp2pp2["pp"]["ranks"] == [0, 2] and tp2pp2["tp"]["ranks"] == [0, 1]
    assert rows[0]["dp4-ep2-2distopt/light"]["getters"]["ep"]["ranks"] == [0, 1]
    assert rows[0]["tp2-cp2-allgather/light"]["getters"]["cp"]["ranks"] == [0, 2]


@pytest.mark.slow  # one 8-process job: ~25 s on two idle cores
def test_light_groups_equal_default_groups_world8():
    port = free_port()
    rows = _run_world(8, _groups_rank, lambda rank: (rank, 8, port, LAYOUTS_8))
    _check_layouts(rows, LAYOUTS_8, 8)
    assert rows[5]["tp2-pp2-dp2/light"]["getters"]["dp"]["ranks"] == [5, 7]


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="cluster.group_init"):
        parallel_groups.initialize_model_parallel("fast")


@pytest.mark.parametrize("target", sorted(parallel_groups.RELIED_ON_SOURCES))
def test_relied_on_sources_unchanged(target):
    """light relies on how megatron-core's initialize_model_parallel/create_group and torch's
    new_group name and create groups; a changed source must be re-verified."""
    from mega.megatron_cpu import source_fingerprint

    assert source_fingerprint(target) == parallel_groups.RELIED_ON_SOURCES[target], (
        f"{target} changed: re-verify mega/cluster/parallel_groups.py against it"
    )


# ---------------------------------------------------------------------------------------------
# Training: the same losses with either strategy


def _train_rank(rank: int, world: int, port: int, config_path: str, index_path: str, results) -> None:
    try:
        # torch's default (no post-init barrier), whatever the environment the forkserver was
        # started with says (a forkserver child has that one, not the test's current one)
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCH_DIST_INIT_BARRIER": "0",
            }
        )
        from mega import train

        train.main(["--config", config_path, "--data-index", index_path])
        results.put((rank, json.dumps({"cpu_s": time.process_time()})))
    except BaseException as err:
        results.put((rank, json.dumps({"error": f"{type(err).__name__}: {err}"})))
        raise


@pytest.mark.slow  # two 4-process training runs of 3 steps: ~20 s on two idle cores
def test_training_losses_are_the_same_with_light_and_default(tmp_path, data_index, data_cache):
    from mega.metrics import read_metrics

    losses = {}
    for strategy in ("default", "light"):
        run_dir = tmp_path / strategy
        cfg = compose(
            [
                "model=tiny",
                "parallelism=pp2",
                "parallelism.dp=2",
                "train.steps=3",
                f"train.run_dir={run_dir}",
                f"data.cache_dir={data_cache}",
                "train.tensorboard=false",
                "optimizer.warmup_steps=1",
                "checkpoint.interval=0",
                f"cluster.group_init={strategy}",
                "store.record=true",
            ]
        )
        assert cfg.parallelism.world_size == 4
        run_dir.mkdir()
        save(cfg, run_dir / "config.json")
        port = free_port()
        _run_world(
            4, _train_rank, lambda rank: (rank, 4, port, str(run_dir / "config.json"), str(data_index))
        )
        metrics = read_metrics(run_dir)
        assert [m["step"] for m in metrics] == [1, 2, 3]
        losses[strategy] = [(m["loss"], m["grad_norm"]) for m in metrics]
        init = json.loads((run_dir / "init.json").read_text())
        assert init["group_init"] == strategy and init["store"] == "tcp" and init["world_size"] == 4
        # store.record: each rank's store traffic up to its groups, exactly what the
        # bootstrap simulator replays for this layout (torch's post-init barrier is off here)
        recorded = load_recordings(run_dir / "store-traffic" / "train-attempt0")
        simulated: list = []
        bs.run_in_memory(
            strategy, bs.Layout(4, 1, 2, backend="gloo", gloo_groups=True, barrier=False), ops=simulated
        )
        assert sorted(recorded) == [0, 1, 2, 3]
        for rank, row in recorded.items():
            assert [tuple(op) for op in row["ops"]] == simulated[rank], (strategy, rank)
    assert losses["light"] == losses["default"]  # same groups, same order of reductions: bit-equal
