"""NCCL environment presets are checked before launch (mega/cluster/nccl.py via mega.config.validate)."""

from __future__ import annotations

import pytest

from mega.cluster.nccl import KNOWN, check_env
from mega.config import ConfigError, compose, from_dict


@pytest.mark.parametrize("preset", ["h100-8x", "gpu-1"])
def test_cluster_presets_pass_their_own_checks(preset):
    layout = ["parallelism=tp2-pp2-dp2"] if preset == "h100-8x" else ["parallelism=single"]
    cfg = compose([f"cluster={preset}", *layout])
    assert check_env(cfg.cluster.env) == {}
    assert cfg.cluster.group_init == "light"


def test_h100_preset_carries_the_tuned_network_settings():
    env = compose(["cluster=h100-8x", "parallelism=tp2-pp2-dp2"]).cluster.env
    # longer ACK timeout than NCCL's default 20, and the most retransmits a 3-bit field holds
    assert int(env["NCCL_IB_TIMEOUT"]) > 20 and env["NCCL_IB_RETRY_CNT"] == "7"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


@pytest.mark.parametrize(
    "name, value, fragment",
    [
        ("NCCL_IB_RETRY_CNT", "12", "[0, 7]"),  # the old preset's value: does not fit 3 bits
        ("NCCL_IB_RETRY_CNT", "-1", "[0, 7]"),
        ("NCCL_IB_RETRY_CNT", "seven", "integer"),
        ("NCCL_IB_TIMEOUT", "32", "[1, 31]"),  # 5-bit exponent
        ("NCCL_IB_TIMEOUT", "0", "[1, 31]"),  # would wait for an ACK forever
        ("NCCL_IB_TIMEOUT", "2.5", "integer"),
        ("NCCL_IB_SL", "16", "[0, 15]"),
        ("NCCL_IB_DISABLE", "yes", "['0', '1']"),
        ("NCCL_DEBUG", "LOUD", "NCCL log level"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "4", "[0, 3]"),
    ],
)
def test_bad_values_fail_validation_naming_the_variable(name, value, fragment):
    with pytest.raises(ConfigError) as err:
        from_dict({"cluster": {"env": {name: value}}})
    assert err.value.key == f"cluster.env.{name}"
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "name, value",
    [
        ("NCCL_IB_RETRY_CNT", "0"),
        ("NCCL_IB_RETRY_CNT", "7"),
        ("NCCL_IB_TIMEOUT", "1"),
        ("NCCL_IB_TIMEOUT", "31"),
        ("NCCL_IB_TC", "255"),
        ("NCCL_DEBUG", "info"),
        ("NCCL_SOCKET_IFNAME", "=eth0"),  # not in the table: passed through unchecked
    ],
)
def test_values_in_range_are_accepted(name, value):
    assert from_dict({"cluster": {"env": {name: value}}}).cluster.env[name] == value


def test_socket_threads_times_sockets_is_capped():
    assert check_env({"NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "8"}) == {}
    problems = check_env({"NCCL_SOCKET_NTHREADS": "16", "NCCL_NSOCKS_PERTHREAD": "8"})
    assert "exceeds" in problems["NCCL_NSOCKS_PERTHREAD"]


def test_the_flow_rejects_a_bad_preset_before_launch():
    # pretrain() resolves (and so validates) its config before the first task runs
    from flows.pretrain import resolve_config

    with pytest.raises(ConfigError) as err:
        resolve_config(
            ["cluster=h100-8x", "parallelism=tp2-pp2-dp2", "cluster.env.NCCL_IB_RETRY_CNT=12"], None
        )
    assert err.value.key == "cluster.env.NCCL_IB_RETRY_CNT" and "[0, 7]" in str(err.value)


def test_group_init_is_validated():
    with pytest.raises(ConfigError) as err:
        from_dict({"cluster": {"group_init": "fast"}})
    assert err.value.key == "cluster.group_init"
    assert from_dict({"cluster": {"group_init": "default"}}).cluster.group_init == "default"


def test_table_names_are_environment_variables():
    assert all(name.isupper() and name.isidentifier() for name in KNOWN)
