"""mega.config: Hydra composition of conf/, the rejections (each naming its key), and round trips."""

import dataclasses

import pytest

from mega.config import CONF_DIR, ConfigError, MegaConfig, compose, from_dict, load, save


def test_default_composition_is_tp2_pp2_dp2_on_local_cpu():
    cfg = compose()
    assert (cfg.model.name, cfg.parallelism.name, cfg.cluster.name) == ("tiny", "tp2-pp2-dp2", "local-cpu")
    # local-cpu derives its process count from the layout: 2 * 2 * 2
    assert (cfg.cluster.nodes, cfg.cluster.procs_per_node) == (1, 8)
    assert cfg.train.run_dir == "runs/tiny-tp2-pp2-dp2"
    assert cfg.checkpoint.dir == "runs/tiny-tp2-pp2-dp2/checkpoints"


def test_single_layout_runs_one_process():
    assert compose(["parallelism=single"]).cluster.procs_per_node == 1


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        # 3 heads over tp=2 (hidden 66 keeps hidden % heads valid)
        (["model.num_attention_heads=3", "model.hidden_size=66"], "parallelism.tp", "not divisible by tp=2"),
        (["model.num_layers=3"], "parallelism.pp", "pp*vpp=2*1"),
        (["parallelism=tp2-pp2-vpp2-dp2", "model.num_layers=6"], "parallelism.pp", "pp*vpp=2*2"),
        # h100-8x has 8 procs per node: 2 nodes are 16 processes for a layout of 8
        (["cluster=h100-8x", "cluster.nodes=2"], "cluster.procs_per_node", "2*8=16 does not equal"),
        (["cluster=h100-8x", "parallelism=single"], "cluster.procs_per_node", "does not equal"),
        (["parallelism.global_batch_size=10"], "parallelism.global_batch_size", "micro_batch_size*dp=2*2"),
        (["+model.foo=1"], "model.foo", "not in 'ModelConfig'"),
        (["model.foo=1"], "model.foo", "not in 'ModelConfig'"),
        (["model.num_layers=abc"], "model.num_layers", "could not be converted to Integer"),
        (["model=nope"], "model", "'nope'"),
        (["train.precision=fp4"], "train.precision", "must be one of"),
        (["train.precision=fp16"], "train.precision", "for GPUs"),
        (["parallelism.fp8_param_gather=true"], "parallelism.fp8_param_gather", "set train.precision=fp8"),
        (["cluster.backend=nccl"], "cluster.backend", "needs cluster.device=cuda"),
        (
            ["parallelism=single", "parallelism.sequence_parallel=true"],
            "parallelism.sequence_parallel",
            "tp>1",
        ),
        (["fault.kill_rank=8", "fault.kill_at_step=3"], "fault.kill_rank", "no rank 8 in world 8"),
        (["fault.kill_rank=-1", "fault.kill_at_step=3"], "fault.kill_rank", "no rank -1"),
        # nodes and launchers: how a run starts must fit what the hardware is
        (["cluster.nodes=2", "cluster.procs_per_node=4"], "cluster.nodes", "launcher=local starts one node"),
        (
            ["launcher=local-nodes", "cluster.nodes=3", "cluster.procs_per_node=3"],
            "cluster.procs_per_node",
            "3*3=9 does not equal",
        ),
        (["launcher=slurm"], "launcher.name", "cluster=local-cpu cannot be started by launcher=slurm"),
        (
            ["cluster=h100-8x", "launcher=local-nodes"],
            "launcher.name",
            "cannot be started by launcher=local-nodes",
        ),
        (["launcher=nope"], "launcher", "'nope'"),
        (
            ["launcher=local-nodes", "launcher.local_nodes.subnet=8.8.8.0/24"],
            "launcher.local_nodes.subnet",
            "private IPv4",
        ),
        (["cluster.peak_tflops=-1"], "cluster.peak_tflops", "must be positive"),
        # PP/DP overlap: megatron's non-interleaved 1F1B refuses p2p overlap and never
        # calls param_sync_func, so asking for them explicitly without virtual stages names vpp
        (["parallelism.overlap_p2p_comm=true"], "parallelism.vpp", "refuses overlap_p2p_comm"),
        (
            [
                "parallelism=pp2",
                "parallelism.overlap_param_gather=true",
                "parallelism.align_param_gather=true",
            ],
            "parallelism.vpp",
            "never calls param_sync_func",
        ),
        (
            ["parallelism=tp2-pp2-vpp2-dp2", "parallelism.overlap_p2p_comm_warmup_flush=true"],
            "parallelism.overlap_p2p_comm_warmup_flush",
            "needs parallelism.overlap_p2p_comm=true",
        ),
        (
            ["parallelism=tp2-pp2-vpp2-dp2", "parallelism.align_param_gather=true"],
            "parallelism.align_param_gather",
            "needs parallelism.overlap_param_gather=true",
        ),
        (
            ["parallelism.overlap_param_gather=true", "parallelism.use_distributed_optimizer=false"],
            "parallelism.overlap_param_gather",
            "use_distributed_optimizer=true",
        ),
        (["parallelism.comm_overlap=on"], "parallelism.comm_overlap", "must be one of"),
        (
            ["parallelism.overlap_param_gather=true", "parallelism.overlap_grad_reduce=false"],
            "parallelism.overlap_param_gather",
            "needs parallelism.overlap_grad_reduce=true",
        ),
        (["parallelism.ddp_bucket_size=0"], "parallelism.ddp_bucket_size", "must be a positive number"),
        # stability: heartbeats and hang thresholds
        (["stability.heartbeat_s=0"], "stability.heartbeat_s", "must be positive"),
        (["stability.progress_factor=1"], "stability.progress_factor", "must be >= 2"),
        (["stability.min_hang_s=1"], "stability.min_hang_s", "must be >= 2 x stability.heartbeat_s"),
        (["stability.straggler_factor=1"], "stability.straggler_factor", "must be > 1"),
        # stability: membership on failure, rollback and its drills (mega/stability)
        (["restart.spare_nodes=-1"], "restart.spare_nodes", "must be >= 0"),
        (["restart.min_nodes=2"], "restart.min_nodes", "must be in [1, cluster.nodes=1]"),
        (["restart.min_nodes=0"], "restart.min_nodes", "must be in [1, cluster.nodes=1]"),
        (
            ["train.steps=5", "optimizer.warmup_steps=1", "train.skip_steps=[6]"],
            "train.skip_steps",
            "at most train.steps=5",
        ),
        (["train.skip_steps=[0]"], "train.skip_steps", "1-based"),
        (["train.log_interval=-1"], "train.log_interval", "must be >= 0"),
        (
            ["train.steps=5", "optimizer.warmup_steps=1", "fault.nan_at_step=9"],
            "fault.nan_at_step",
            "must be in [1, train.steps=5]",
        ),
        (["fault.bad_node=1"], "fault.bad_node", "no node 1 in cluster.nodes=1"),
        (["stability.spike_z=-1"], "stability.spike_z", "must be >= 0 (0: off)"),
        (
            ["stability.spike_min_steps=40"],
            "stability.spike_min_steps",
            "must be in [3, stability.spike_window=32]",
        ),
        (["fault.spike_at_step=0"], "fault.spike_at_step", "must be in [1, train.steps="),
        (
            ["parallelism=pp2", "parallelism.account_for_loss_in_pipeline_split=true"],
            "parallelism.pp",
            "model.num_layers=4 + 1 (embedding/loss accounted in the pipeline split) is not divisible by pp*vpp=2*1",
        ),
    ],
)
def test_rejection_names_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "optimizer, steps, warmup",
    [
        ("adam", 100, 10),
        ("lamb", 100, 10),  # the default run
        ("adam", 1000, 10),  # long runs keep 10 steps
        ("adam", 50, 5),
        ("adam", 10, 1),
        ("lamb", 10, 1),  # a shortened run warms up for a tenth of it
        ("adam", 5, 0),
    ],
)
def test_default_warmup_follows_the_run_length(optimizer, steps, warmup):
    cfg = compose([f"optimizer={optimizer}", f"train.steps={steps}"])
    assert cfg.optimizer.warmup_steps == warmup  # settled at composition: the saved config says what ran
    assert from_dict(dataclasses.asdict(cfg)).optimizer.warmup_steps == warmup


def test_an_explicit_warmup_too_long_for_the_run_says_what_to_set():
    assert compose(["train.steps=10", "optimizer.warmup_steps=3"]).optimizer.warmup_steps == 3
    with pytest.raises(ConfigError) as info:
        compose(["train.steps=10", "optimizer.warmup_steps=10"])
    assert info.value.key == "optimizer.warmup_steps"
    assert "10 must be smaller than train.steps=10" in str(info.value)
    assert "leave optimizer.warmup_steps unset (null: a tenth of the run, here 1)" in str(info.value)
    with pytest.raises(ConfigError) as info:  # a one-step run too: megatron's scheduler would assert
        compose(["train.steps=1", "optimizer.warmup_steps=1"])
    assert info.value.key == "optimizer.warmup_steps"


@pytest.mark.parametrize(
    "data, key",
    [
        ({"parallelism": {"tpp": 2}}, "parallelism.tpp"),
        ({"model": {"foo": {"bar": 1}}}, "model.foo"),
        ({"model": {"num_layers": "abc"}}, "model.num_layers"),
    ],
)
def test_from_dict_names_the_full_dotted_key(data, key):
    with pytest.raises(ConfigError) as info:
        from_dict(data)
    assert info.value.key == key


# What a group option needs besides the defaults (tiny model, tp2-pp2-dp2, local-cpu) to be
# consistent, and the key it is rejected with when composed alone.
COMPANIONS = {
    "model/gpt-530b": ["parallelism=tp2"],  # 105 layers do not split over pp=2
    "parallelism/paper-175b-256gpu": [
        "model=gpt-175b",
        "cluster=h100-8x",
        "cluster.nodes=32",
        "launcher=slurm",
    ],
    "cluster/gpu-1": ["parallelism=single"],  # one GPU, one process
    "cluster/gb200-nvl72": ["parallelism.dp=1"],  # a node of 4 GPUs: tp2 x pp2
    "launcher/slurm": ["cluster=h100-8x"],  # the CPU preset pairs with local launchers only
    "launcher/kubernetes": ["cluster=a100-8x"],
}
ALONE_FAILS_WITH = {
    "cluster/gb200-nvl72": "cluster.procs_per_node",
    "model/gpt-530b": "parallelism.pp",
    "parallelism/paper-175b-256gpu": "parallelism.tp",  # tiny's 4 heads over tp=8
    "launcher/slurm": "launcher.name",
    "launcher/kubernetes": "launcher.name",
}
GROUP_OPTIONS = sorted(f"{p.parent.name}/{p.stem}" for p in CONF_DIR.glob("*/*.yaml"))


def test_the_option_tables_name_real_options():
    assert len(GROUP_OPTIONS) >= 15
    assert set(COMPANIONS) | set(ALONE_FAILS_WITH) <= set(GROUP_OPTIONS)


@pytest.mark.parametrize("option", GROUP_OPTIONS)
def test_every_group_option_composes(option):
    group, name = option.split("/")
    cfg = compose([f"{group}={name}"] + COMPANIONS.get(option, []))
    section = getattr(cfg, group, None)  # preset groups (features/) set keys elsewhere
    if hasattr(section, "name"):
        assert section.name == name
    if option in ALONE_FAILS_WITH:
        with pytest.raises(ConfigError) as info:
            compose([f"{group}={name}"])
        assert info.value.key == ALONE_FAILS_WITH[option]


def test_paper_shapes():
    gpt175 = compose(["model=gpt-175b"]).model
    assert (gpt175.num_layers, gpt175.hidden_size, gpt175.num_attention_heads) == (96, 12288, 128)
    assert (gpt175.seq_length, gpt175.vocab_size) == (2048, 64000)
    gpt530 = compose(["model=gpt-530b", "parallelism=tp2"]).model
    assert (gpt530.num_layers, gpt530.hidden_size, gpt530.num_attention_heads) == (105, 20480, 160)


def test_paper_layout_on_32_h100_nodes():
    cfg = compose(COMPANIONS["parallelism/paper-175b-256gpu"] + ["parallelism=paper-175b-256gpu"])
    p = cfg.parallelism
    assert (p.tp, p.pp, p.vpp, p.dp, p.world_size) == (8, 8, 2, 4, 256)
    assert (
        cfg.cluster.world_size == 256 and cfg.cluster.env["NCCL_IB_RETRY_CNT"] == "7"
    )  # 3-bit field: 7 is the most


def test_save_and_load_round_trip(tmp_path):
    # a layout with vpp, a cluster with env presets and a fault set: nulls, dicts and nesting
    cfg = compose(
        ["parallelism=tp2-pp2-vpp2-dp2", "cluster=h100-8x", "fault.kill_rank=3", "fault.kill_at_step=5"]
    )
    path = tmp_path / "config.json"
    save(cfg, path)
    loaded = load(path)
    assert isinstance(loaded, MegaConfig)
    assert loaded == cfg
    assert dataclasses.asdict(loaded) == dataclasses.asdict(cfg)


@pytest.mark.parametrize(
    "layout, on, left_off",
    [
        # interleaved: everything megatron supports; 1F1B: only the pre-hook-driven all-gather
        (
            "tp2-pp2-vpp2-dp2",
            [
                "overlap_p2p_comm",
                "overlap_p2p_comm_warmup_flush",
                "overlap_param_gather",
                "align_param_gather",
            ],
            [],
        ),
        ("tp2-pp2-dp2", ["overlap_param_gather"], ["overlap_p2p_comm", "align_param_gather"]),
        ("pp2", [], ["overlap_p2p_comm", "overlap_param_gather"]),
    ],
)
def test_megascale_turns_on_what_the_layout_supports(layout, on, left_off):
    from mega.overlap import pp_dp

    cfg = compose([f"parallelism={layout}", "features=megascale"])
    assert cfg.parallelism.comm_overlap == "auto"
    record = pp_dp.record(cfg.parallelism)
    assert record["on"] == on
    assert sorted(record["left_off"]) == sorted(left_off)
    assert all(f in pp_dp.log_line(cfg.parallelism) for f in on + left_off)
    # the same layout without the feature: nothing on
    assert pp_dp.record(compose([f"parallelism={layout}"]).parallelism)["on"] == []
