"""Rendezvous store and process-group init timing, with real stores and real torchrun ranks."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from mega.cluster.bootstrap import connect_tcp_store, start_tcp_store, verify_store
from mega.cluster.rendezvous import new_job_id, rendezvous_env, split_redis_password, without_secrets
from mega.config import compose, from_dict
from mega.launch.node_jobs import time_process_groups


def test_tcp_store_serves_real_operations():
    server = start_tcp_store("127.0.0.1", 0, timeout_s=10)
    assert server.port > 0
    a = connect_tcp_store("127.0.0.1", server.port, timeout_s=10)
    b = connect_tcp_store("127.0.0.1", server.port, timeout_s=10)

    a.set("rendezvous/0", b"tcp://10.0.0.1:29500")
    assert b.get("rendezvous/0") == b"tcp://10.0.0.1:29500"
    assert [a.add("joined", 1), b.add("joined", 1)] == [1, 2]
    assert b.compare_set("leader", b"", b"rank-1") == b"rank-1"  # first claim wins
    assert a.compare_set("leader", b"", b"rank-0") == b"rank-1"

    # wait blocks until another party publishes the key, and times out when nobody does
    threading.Timer(0.1, a.set, args=("go", b"1")).start()
    b.wait(["go"], timedelta(seconds=5))
    with pytest.raises(Exception, match="(?i)timeout|wait"):
        b.wait(["never"], timedelta(milliseconds=200))


def test_verify_store_reports_round_trips():
    result = verify_store(from_dict())

    assert result["store"] == "tcp" and result["ok"] and result["host"] == "127.0.0.1"
    assert 0 < result["port"] < 65536
    for key in ("roundtrip_ms", "set_ms", "get_ms", "add_ms", "wait_ms", "connect_ms"):
        assert result[key] > 0, key


def test_verify_store_redis_starts_a_local_server_and_reports_round_trips():
    from mega.store import RedisServerError, find_redis_server

    try:
        find_redis_server()
    except RedisServerError as err:
        pytest.fail(f"{err} (infra/install.sh installs it)")
    result = verify_store(from_dict({"store": {"kind": "redis"}}))  # start_local_redis (default)

    assert result["store"] == "redis" and result["ok"] and result["host"] == "127.0.0.1"
    assert 0 < result["port"] < 65536
    for key in ("roundtrip_ms", "set_ms", "get_ms", "add_ms", "wait_ms", "connect_ms"):
        assert result[key] > 0, key
    tcp = verify_store(from_dict())
    assert sorted(result) == sorted(tcp)  # the same shape as the tcp branch


def test_verify_store_redis_uses_cluster_redis_url():
    from mega.store import RedisServer, RedisServerError, RedisStore, find_redis_server

    try:
        find_redis_server()
    except RedisServerError as err:
        pytest.fail(f"{err} (infra/install.sh installs it)")
    with RedisServer(password="verify-pw") as server:
        result = verify_store(from_dict({"store": {"kind": "redis", "redis_url": server.url}}))
        assert result["port"] == server.port and result["ok"]
        assert "verify-pw" not in str(result)
        probe = RedisStore(server.url, job_id="probe")
        assert probe._r.dbsize() == 0  # its namespace dropped afterwards
        probe.close()


def test_time_process_groups_tp2_over_redis(tmp_path):
    """The timing job's ranks rendezvous over a local redis-server it starts for the job, and
    build megatron's groups members-only (cluster.group_init=light, the default)."""
    from mega.store import RedisServerError, find_redis_server

    try:
        find_redis_server()
    except RedisServerError as err:
        pytest.fail(f"{err} (infra/install.sh installs it)")
    cfg = compose(["parallelism=tp2", f"train.run_dir={tmp_path}", "store.kind=redis"])
    result = time_process_groups(cfg)

    assert result["world_size"] == 2 and len(result["ranks"]) == 2
    assert (result["store"], result["group_init"]) == ("redis", "light")
    assert result["pg_init_s"] > 0 and result["model_parallel_init_s"] > 0
    assert result["pg_init_s"] == max(r["pg_init_s"] for r in result["ranks"])
    assert (tmp_path / "bootstrap" / "result.json").exists()


def test_redis_password_travels_by_environment_only():
    cfg = from_dict({"store": {"kind": "redis", "redis_url": "redis://ops:s3cret@10.0.0.5:6380/2"}})
    assert split_redis_password(cfg.store.redis_url) == ("redis://ops@10.0.0.5:6380/2", "s3cret")
    assert without_secrets(cfg).store.redis_url == "redis://ops@10.0.0.5:6380/2"
    with rendezvous_env(cfg, job_id="job-1") as env:  # a configured server: nothing is started
        assert env == {
            "MEGA_REDIS_URL": "redis://ops@10.0.0.5:6380/2",
            "MEGA_JOB_ID": "job-1",
            "MEGA_REDIS_PASSWORD": "s3cret",
        }
    with rendezvous_env(from_dict()) as env:
        assert env == {}  # tcp: torchrun's own store
    assert new_job_id(cfg) != new_job_id(cfg)


def test_training_over_a_password_protected_redis_store(tmp_path, data_index, data_cache):
    """run_training with store.kind=redis: ranks build their process group on RedisStore; the
    password reaches them only through the environment; init times land in init.json."""
    from mega.launch import run_training
    from mega.store import RedisServer, RedisStore

    password = "pw-" + "x7" * 8
    with RedisServer(password=password) as server:
        cfg = compose(
            [
                "model=tiny",
                "parallelism=dp2",
                "train.steps=2",
                f"train.run_dir={tmp_path}",
                f"data.cache_dir={data_cache}",
                "train.tensorboard=false",
                "optimizer.warmup_steps=1",
                "checkpoint.interval=0",
                "store.kind=redis",
                f"store.redis_url={server.url}",
            ]
        )
        messages = []
        result = run_training(cfg, data_index, log=messages.append)
        probe = RedisStore(server.url, job_id="probe")
        left = list(probe._r.scan_iter("mega:*"))
        probe.close()

    assert result.final_step == 2 and result.attempts == 1
    # the ranks' rendezvous keys existed (one namespace: job id, attempt 0) and the launcher
    # dropped them once the ranks were gone
    dropped = [m for m in messages if m.startswith("attempt 0: dropped its ")]
    assert len(dropped) == 1 and int(dropped[0].split()[4]) > 0, messages
    assert left == []
    assert result.init["store"] == "redis" and result.init["group_init"] == "light"
    assert result.init["pg_init_s"] > 0 and result.init["model_parallel_init_s"] > 0
    saved = (tmp_path / "config.json").read_text()
    assert f"127.0.0.1:{server.port}" in saved and password not in saved
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert password not in path.read_text(errors="replace"), path


@pytest.mark.slow
def test_bootstrap_timing_reports_per_node(tmp_path):
    from mega.launch.node_jobs import time_process_groups

    cfg = from_dict(
        {
            "parallelism": {"dp": 2},
            "cluster": {"nodes": 2, "procs_per_node": 1},
            "launcher": {"name": "local-nodes"},
            "train": {"run_dir": str(tmp_path)},
        }
    )
    result = time_process_groups(cfg)
    assert result["world_size"] == 2 and [r["node"] for r in result["ranks"]] == [0, 1]
    assert [n["node"] for n in result["nodes"]] == [0, 1]
    assert result["pg_init_s"] == max(n["pg_init_s"] for n in result["nodes"]) > 0
    assert (tmp_path / "bootstrap" / "nodes" / "1" / "bootstrap.log").exists()
