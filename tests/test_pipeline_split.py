"""megatron-core's pipeline split with the embedding and the loss accounted as layers
(``parallelism.account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``):
what training builds, what the performance model charges each stage, and what it refuses."""

from __future__ import annotations

import pytest

from mega.config import compose
from mega.perf import device, hardware
from mega.perf.configs import Composer
from mega.perf.memory import layer_params, stage_params
from mega.perf.step import Message, layer_unit, logits_unit, stages_of

BOTH = [
    "parallelism.account_for_embedding_in_pipeline_split=true",
    "parallelism.account_for_loss_in_pipeline_split=true",
]


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallelism=pp2"],
        ["parallelism=pp2", "parallelism.pp=3", *BOTH],
        ["parallelism=pp2-vpp2", "model.num_layers=6", *BOTH],
        ["parallelism=pp2", "model.num_layers=3", "parallelism.account_for_loss_in_pipeline_split=true"],
        ["parallelism=pp2", "parallelism.pp=4", "model.num_layers=7", BOTH[0]],
        ["parallelism=pp2-vpp2", "parallelism.vpp=3", *BOTH],  # chunks of one slot: embedding, loss alone
    ],
)
def test_stage_layers_are_the_layers_megatron_core_builds(overrides):
    """Training passes the flags to megatron-core (mega.model.transformer_config), whose
    get_num_layers_to_build, summed over a stage's chunks, gives the layers the performance and
    memory models charge that stage (ParallelismConfig.stage_layers)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from mega.model import transformer_config

    cfg = compose(overrides)
    p = cfg.parallelism
    tcfg = transformer_config(cfg)
    built = [
        sum(
            get_num_layers_to_build(tcfg, vp_stage=v if p.virtual_pipeline_size else None, pp_rank=rank)
            for v in range(p.chunks_per_stage)
        )
        for rank in range(p.pp)
    ]
    assert built == p.stage_layers(cfg.model.num_layers)
    assert sum(built) == cfg.model.num_layers


@pytest.fixture(scope="module")
def llama405b():
    with Composer() as c:
        return c.plan(
            [
                "cluster=h100-8x",
                "model=llama3-405b",
                "parallelism.tp=8",
                "parallelism.pp=16",
                "cluster.nodes=128",
                "parallelism.micro_batch_size=1",
                *BOTH,
            ]
        ).cfg


def test_each_stage_is_charged_its_own_layers(llama405b):
    """Llama 3 405B on PP16 (Llama Team 2024 section 3.3.2): 126 layers as 7 on the first and the
    last stage and 8 on the others. A middle stage's microbatch is 8 layers; the last stage's 7
    layers and the output layer and loss; the first stage's 7 layers and the embedding. Its
    parameters follow the same counts."""
    cfg = llama405b
    hw = hardware.from_cluster(cfg.cluster, "bf16", True, device.prior("H100 SXM"))
    stages = stages_of(cfg, hw, 2, Message(0.0, 0.0, 0.0))
    layer = layer_unit(cfg, hw, 2)
    per_layer = layer.forward.total + layer.backward.total
    head = logits_unit(cfg, hw, 2)
    assert [round(s.layers.total / per_layer, 9) for s in stages] == [7] + [8] * 14 + [7]
    assert stages[-1].extra.total == pytest.approx(head.forward.total + head.backward.total)
    # the output layer and loss cost less than the layer it replaced: no stage outweighs the middle
    assert stages[-1].total < stages[1].total
    params = stage_params(cfg.model, cfg.parallelism)
    assert params[1] == 8 * layer_params(cfg.model, 8)
    assert (
        params[0] - 7 * layer_params(cfg.model, 8) == cfg.model.padded_vocab_size * cfg.model.hidden_size / 8
    )
