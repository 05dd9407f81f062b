"""What a launcher config may say: node faults, network-namespace nodes and their servers, self-check
floors, Kubernetes (rendered, not driven); refused before launch naming the key."""

from __future__ import annotations

import pytest

from mega.config import ConfigError, compose, from_dict
from mega.launch.backends import backend_for

TWO_NODES = {
    "launcher": {"name": "local-nodes"},
    "cluster": {"nodes": 2, "procs_per_node": 4},
    "parallelism": {"tp": 2, "pp": 2, "dp": 2},
    "model": {"num_layers": 4},
}
NETNS = {"launcher": {"name": "local-nodes", "local_nodes": {"netns": True}}}


def merged(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.mark.parametrize(
    "data, key, fragment",
    [
        ({"fault": {"kill_node": 2, "kill_at_step": 1}}, "fault.kill_node", "no node 2 in cluster.nodes=2"),
        ({"fault": {"kill_node": 1}}, "fault.kill_at_step", "needed with fault.kill_node"),
        ({"fault": {"kill_node": 1, "kill_rank": 0, "kill_at_step": 1}}, "fault.kill_node", "not both"),
        (
            {"fault": {"mode": "kill_agent", "kill_rank": 0, "kill_at_step": 1}},
            "fault.mode",
            "set fault.kill_node",
        ),
        (
            {"fault": {"mode": "kill_in_upload", "kill_node": 1, "kill_at_step": 1}},
            "fault.mode",
            "use fault.kill_rank",
        ),
        (
            {
                "launcher": {"name": "local", "local_nodes": {"netns": True}},
                "cluster": {"nodes": 1, "procs_per_node": 8},
            },
            "launcher.local_nodes.netns",
            "not launcher=local",
        ),
        (
            {**NETNS, "store": {"kind": "redis", "redis_url": "redis://127.0.0.1:6379/0"}},
            "store.redis_url",
            "unreachable from network-namespace nodes",
        ),
        (
            {**NETNS, "checkpoint": {"s3_endpoint_url": "http://localhost:8333"}},
            "checkpoint.s3_endpoint_url",
            "bridge address",
        ),
        (
            {"selfcheck": {"gemm_fraction": 1.5}},
            "selfcheck.gemm_fraction",
            "must be in (0, 1]",
        ),
        ({"selfcheck": {"nic_fraction": 0}}, "selfcheck.nic_fraction", "must be in (0, 1]"),
        (
            {"selfcheck": {"min_inter_node_mb_per_s": -1}},
            "selfcheck.min_inter_node_mb_per_s",
            ">= 0",
        ),
    ],
)
def test_config_rejections(data, key, fragment):
    with pytest.raises(ConfigError) as info:
        from_dict(merged(TWO_NODES, data))
    assert info.value.key == key and fragment in str(info.value), str(info.value)


def test_netns_nodes_with_non_loopback_servers_are_accepted():
    cfg = from_dict(
        merged(
            TWO_NODES,
            NETNS,
            {
                "store": {"kind": "redis", "redis_url": "redis://10.213.0.1:6379/0"},
                "checkpoint": {"s3_endpoint_url": "http://10.213.0.1:8333"},
            },
        )
    )
    assert cfg.launcher.local_nodes.netns


def test_kubernetes_is_rendered_not_driven(tmp_path):
    cfg = compose(["cluster=a100-8x", "launcher=kubernetes"])
    with pytest.raises(ConfigError, match="python -m mega.launch.kubernetes"):
        backend_for(cfg, tmp_path)
