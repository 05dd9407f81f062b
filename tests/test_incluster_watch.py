"""The hang watcher where the cluster restarts the pods (mega/launch/incluster_watch.py,
mega/launch/pod.py), on launcher=local-nodes: no Kubernetes runs here, and nothing of it is
Kubernetes-specific.

Each node's agent runs under the pod entry, as in a pod; node 0's entry runs the watcher. The loop
in the test stands in for the cluster's controller (JobSet's restart of every pod, or the Job
controller's after an ignored exit code): it starts every node, waits until all have exited, and
relaunches all of them when every one exited with the restart code, exactly as the rendered
failure policy does; it never stops a node itself.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from mega.config import compose
from mega.launch import incluster_watch
from mega.launch import kubernetes as k8s
from mega.launch.backend import JobSpec
from mega.launch.local_nodes import LocalNodesBackend
from mega.metrics import read_metrics
from mega.stability import heartbeat_redis

STEPS = 6
ATTEMPT_DEADLINE_S = 150


def _controller(backend: LocalNodesBackend, job: JobSpec, attempts: int) -> list[dict[int, int | None]]:
    """Start every node, wait for all to exit; again while every node exited with the restart code."""
    ends = []
    for _ in range(attempts):
        backend.start(job)
        deadline = time.monotonic() + ATTEMPT_DEADLINE_S
        while None in (codes := backend.poll()).values() and time.monotonic() < deadline:
            time.sleep(0.5)
        backend.stop()
        ends.append(codes)
        if set(codes.values()) != {heartbeat_redis.RESTART_EXIT_CODE}:
            break
    return ends


@pytest.mark.slow
def test_a_hung_attempt_is_ended_by_the_watcher_and_relaunched_from_latest(tmp_path, data_index, data_cache):
    cfg = compose(
        [
            "launcher=local-nodes",
            "cluster.nodes=2",
            "cluster.procs_per_node=1",
            "model=tiny",
            "parallelism.tp=1",
            "parallelism.pp=1",
            "parallelism.dp=2",
            f"train.steps={STEPS}",
            f"train.run_dir={tmp_path}",
            f"data.cache_dir={data_cache}",
            "train.tensorboard=false",
            "optimizer.warmup_steps=1",
            "checkpoint.async_save=false",
            "checkpoint.interval=2",
            "stability.hang_timeout_s=120",
            "checkpoint.upload_timeout_s=10",
            "stability.heartbeat_s=0.5",
            "stability.min_hang_s=4",
            "stability.progress_factor=4",
            "fault.mode=hang",
            "fault.kill_node=1",
            "fault.kill_at_step=3",
            "train.eval_batches=0",
        ]
    )
    from mega import config as mega_config

    config_path = tmp_path / "config.json"
    mega_config.save(cfg, config_path)
    backend = LocalNodesBackend(cfg, tmp_path)
    backend.agent_prefix = [sys.executable, "-m", "mega.launch.pod", "--selfcheck", "--watch", "--"]
    try:
        with heartbeat_redis.heartbeat_env(cfg, {}) as hb_env:
            # the pod template's environment: the same for every attempt (MEGA_ATTEMPT=0 as rendered)
            env = {**cfg.cluster.env, **hb_env, "PYTHONUNBUFFERED": "1", "MEGA_ATTEMPT": "0"}
            job = JobSpec(
                "mega.train",
                ["--config", str(config_path), "--data-index", str(data_index)],
                env,
                tmp_path,
                "train",
            )
            ends = _controller(backend, job, attempts=3)
            client, prefix = heartbeat_redis.client_from_env(hb_env)
            order = json.loads(client.get(heartbeat_redis.stop_key(prefix, 0)))
            evicted = incluster_watch.evicted_hosts(client, prefix)
            generation = incluster_watch.generation(client, prefix)
    finally:
        backend.close()

    logs = {k: job.log_path(k, 2).read_text()[-3000:] for k in range(2)}
    # attempt 0: the watcher (in node 0's entry) told every rank to exit; every node exited with the code
    assert ends[0] == {0: heartbeat_redis.RESTART_EXIT_CODE, 1: heartbeat_redis.RESTART_EXIT_CODE}, logs
    assert order["attempt"] == 0 and order["reason"].startswith("hung") and order["culprit"]["node"] == 1
    # attempt 1 (numbered by the channel, not by the unchanged template) resumed and finished
    assert len(ends) == 2 and ends[1] == {0: 0, 1: 0}, logs
    assert generation == 1 and "node 1: attempt 1" in job.log_path(1, 2).read_text()  # whole log
    metrics = read_metrics(tmp_path)
    assert metrics[-1]["step"] == STEPS and metrics[-1]["attempt"] == 1
    init = json.loads((tmp_path / "init.json").read_text())
    assert init["restore"]["checkpoint"] is not None  # from `latest`, not from scratch
    assert json.loads((tmp_path / "selfcheck" / "attempt-1.json").read_text())["healthy"]
    [incident] = (tmp_path / "incidents").glob("*-attempt0-hang.json")
    assert json.loads(incident.read_text())["culprit"]["node"] == 1

    # the culprit's node is named for the next placement: kept out by node anti-affinity
    assert evicted == order["evict"] and len(evicted) == 1
    kcfg = compose(
        [
            "cluster=h100-8x",
            "launcher=kubernetes",
            "launcher.kubernetes.image=reg/mega:1",
            f"launcher.kubernetes.avoid_hosts={json.dumps(evicted)}",
        ]
    )
    pod = k8s.pod_template(kcfg, k8s.names(kcfg, job), job)["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": evicted} in terms[0][
        "matchExpressions"
    ]
