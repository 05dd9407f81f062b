"""launcher=kubernetes (mega/launch/kubernetes.py) and the Prefect Kubernetes work pool (infra/).

No cluster runs here: the manifests are validated offline with kubernetes-validate --strict
against the API schemas of the pinned version (unknown fields and wrong types are errors), and
the work pool's template goes through a real Prefect server and ``prefect deploy``, then through
prefect-kubernetes' own rendering of a flow run's Job, which is validated the same way.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from mega.config import ConfigError, compose
from mega.launch import kubernetes as k8s
from mega.launch.backend import JobSpec

REPO = Path(__file__).resolve().parent.parent
WORK_POOL = "mega-kubernetes"
PASSWORD = "pw-never-in-a-manifest"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def validate(manifests: list[dict]) -> None:
    for m in manifests:
        kubernetes_validate.validate(m, k8s.KUBERNETES_VERSION, strict=True)


def _cfg(*overrides):
    return compose(["launcher=kubernetes", *overrides])


def _job(cfg, **env):
    return JobSpec("mega.train", ["--config", f"{k8s.CONFIG_MOUNT}/config.json", "--data-index", "/mnt/mega/data/index.json"],
                   {**cfg.cluster.env, "MEGA_ATTEMPT": "0", **env}, Path(cfg.train.run_dir), "train-attempt0")


def _layout(preset: str, nodes: int) -> list[str]:
    dp = 8 * nodes // 4  # tp2 x pp2 x dp over nodes x 8 devices
    return [f"cluster={preset}", f"cluster.nodes={nodes}", "parallelism=tp2-pp2-dp2", f"parallelism.dp={dp}",
            f"parallelism.global_batch_size={2 * dp}", "train.run_dir=/mnt/mega/runs/gpt-13b"]


@pytest.mark.parametrize("preset, nodes", [("h100-8x", 1), ("h100-8x", 2), ("h100-8x", 16), ("a100-8x", 4),
                                           ("a100-8x", 64)])
def test_manifests_validate_and_wire_one_pod_per_node(preset, nodes):
    cfg = _cfg(*_layout(preset, nodes), "launcher.kubernetes.volume_claim=mega-shared",
               "+launcher.kubernetes.node_selector={nvidia.com/gpu.product: x}",
               "+launcher.kubernetes.extra_resources={rdma/ib: '8'}", "launcher.kubernetes.cpu=96")
    manifests = k8s.render_manifests(cfg, _job(cfg))
    validate(manifests)

    configmap, service, job = manifests
    assert [m["kind"] for m in manifests] == ["ConfigMap", "Service", "Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
    assert spec["backoffLimit"] == 0  # the driver relaunches, not the Job controller
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "8"}
    command = container["command"]
    assert f"--nnodes={nodes}" in command and "--nproc-per-node=8" in command
    # node rank = the pod's completion index; master = pod 0 through the headless Service
    assert "--node-rank=$(NODE_RANK)" in command
    node_rank = next(e for e in container["env"] if e["name"] == "NODE_RANK")
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert f"--master-addr={job['metadata']['name']}-0.{service['metadata']['name']}" in command
    assert f"--master-port={service['spec']['ports'][0]['port']}" in command
    assert command[command.index("--config") + 1] == f"{k8s.CONFIG_MOUNT}/config.json"
    assert json.loads(configmap["data"]["config.json"])["cluster"]["nodes"] == nodes
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "mega-shared"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert all(env[k] == v for k, v in cfg.cluster.env.items())
    # every pod's host name <job>-<index> is a DNS label
    assert DNS_LABEL.fullmatch(f"{job['metadata']['name']}-{nodes - 1}") and len(f"{job['metadata']['name']}-{nodes - 1}") <= 63


def test_the_store_password_comes_from_a_secret():
    cfg = _cfg("cluster=h100-8x", "cluster.store=redis", f"cluster.redis_url=redis://:{PASSWORD}@redis.mega:6379/0",
               "launcher.kubernetes.redis_secret=mega-redis")
    manifests = k8s.render_manifests(cfg, _job(cfg, MEGA_REDIS_PASSWORD=PASSWORD, MEGA_JOB_ID="j1"))
    validate(manifests)
    assert PASSWORD not in k8s.to_yaml(manifests)
    env = {e["name"]: e for e in manifests[2]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MEGA_REDIS_URL"]["value"] == "redis://redis.mega:6379/0"
    assert env["MEGA_REDIS_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "mega-redis", "key": "password"}}
    assert env["MEGA_JOB_ID"]["value"] == "j1"


@pytest.mark.parametrize("overrides, key", [
    (["cluster.store=redis"], "cluster.redis_url"),  # no server the pods reach
    (["cluster.store=redis", f"cluster.redis_url=redis://:{PASSWORD}@r:6379/0"], "launcher.kubernetes.redis_secret"),
    (["launcher.kubernetes.shm_size=lots"], "launcher.kubernetes.shm_size"),
    (["launcher.kubernetes.mount_path=mnt"], "launcher.kubernetes.mount_path"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, key):
    cfg = _cfg("cluster=h100-8x", *overrides)
    with pytest.raises(ConfigError) as err:
        k8s.render_manifests(cfg, _job(cfg))
    assert err.value.key == key and PASSWORD not in str(err.value)


def test_long_run_names_stay_dns_labels():
    cfg = _cfg(*_layout("h100-8x", 16), "train.run_dir=/runs/A_Very_Long_Run_Name_For_The_175B_Model_On_256_GPUs_v2")
    n = k8s.names(cfg, _job(cfg))
    assert all(DNS_LABEL.fullmatch(v) and len(v) <= 63 for v in n.values())
    assert len(f"{n['job']}-15") <= 63


def test_render_cli_output_passes_the_validator_cli_and_a_broken_one_does_not(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "mega.launch.kubernetes", "render", *_layout("a100-8x", 2),
                          "launcher=kubernetes", "--data-index", "/mnt/mega/data/index.json", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    (manifest,) = tmp_path.glob("*.yaml")
    validator = [str(Path(sys.executable).with_name("kubernetes-validate")), "--strict", "--no-warn",
                 "-k", k8s.KUBERNETES_VERSION]
    ok = subprocess.run([*validator, str(manifest)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("passed") == 3

    docs = list(yaml.safe_load_all(manifest.read_text()))
    docs[2]["spec"]["completionsMode"] = docs[2]["spec"].pop("completionMode")  # a typo: unknown field
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump_all(docs))
    bad = subprocess.run([*validator, str(broken)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "completionsMode" in bad.stdout, bad.stdout

    docs = list(yaml.safe_load_all(manifest.read_text()))
    docs[2]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = [8]  # a list
    with pytest.raises(kubernetes_validate.ValidationError, match="nvidia.com/gpu"):
        validate(docs)


# ---------------------------------------------------------------------------------------------
# The Prefect Kubernetes work pool and the deployment onto it


def _flow_run_job(base_job_template: dict, job_variables: dict) -> dict:
    """The Job prefect-kubernetes' worker would create for a flow run of this deployment."""
    import asyncio
    import uuid

    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(base_job_template, job_variables))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="test-run"))
    return config.job_manifest


def test_prefect_kubernetes_default_template_is_refused_and_ours_is_not(prefect_harness):
    """prefect-kubernetes 0.8.0's default puts completions/parallelism into the pod spec; ours
    (infra/kubernetes/work-pool.json) has them in the Job spec, with mega's volumes."""
    from prefect_kubernetes.worker import KubernetesWorker

    with pytest.raises(kubernetes_validate.ValidationError, match="completions|parallelism"):
        validate([_flow_run_job(KubernetesWorker.get_default_base_job_template(), {})])
    ours = json.loads((REPO / "infra" / "kubernetes" / "work-pool.json").read_text())
    job = _flow_run_job(ours, {})
    validate([job])
    pod = job["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == {"shared", "dshm"}
    assert pod["containers"][0]["args"] == ["prefect", "flow-run", "execute"]


def test_prefect_deploy_onto_the_kubernetes_work_pool(prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL

    template = json.loads((REPO / "infra" / "kubernetes" / "work-pool.json").read_text())
    with get_client(sync_client=True) as client:
        try:  # the server validates the template: every placeholder must be a declared variable
            client.create_work_pool(WorkPoolCreate(name=WORK_POOL, type="kubernetes", base_job_template=template))
        except ObjectAlreadyExists:
            pass

    out = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", "infra/prefect-kubernetes.yaml", "--all"],
        cwd=REPO, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("pretrain/pretrain-k8s-h100")
        pool = client.read_work_pool(WORK_POOL)
    assert deployment.work_pool_name == WORK_POOL and deployment.job_variables["gpus"] == 8
    compose(deployment.parameters["overrides"])  # the overrides make a valid config
    job = _flow_run_job(pool.base_job_template, deployment.job_variables)
    validate([job])
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["workingDir"] == "/opt/mega"
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}

    # the server checks job variables against the pool's schema: a wrong type is refused
    from prefect.exceptions import PrefectHTTPStatusError

    with get_client(sync_client=True) as client, pytest.raises(PrefectHTTPStatusError) as err:
        client.create_deployment(flow_id=deployment.flow_id, name="bad-gpus", work_pool_name=WORK_POOL,
                                 entrypoint=deployment.entrypoint, job_variables={"gpus": "eight"})
    assert "Validation failed for field 'gpus'" in str(err.value)
