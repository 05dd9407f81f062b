"""launcher=kubernetes (mega/launch/kubernetes.py) and the Prefect Kubernetes work pool (infra/).

No cluster runs here: built-in kinds are validated offline with kubernetes-validate --strict against
the API schemas of the pinned version (unknown fields and wrong types are errors); JobSet and Kueue
objects against their released CRD schemas (tests/fixtures/crds, closed to unknown fields as the API
server's strict field validation is), the JobSet's Job template as a batch/v1 Job too. The work
pool's template goes through a real Prefect server and ``prefect deploy``, then through
prefect-kubernetes' own rendering of a flow run's Job, which is validated the same way.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers import prefect_deploy

from mega.config import ConfigError, compose
from mega.launch import kubernetes as k8s
from mega.launch.backend import JobSpec
from mega.stability import heartbeat_redis

REPO = Path(__file__).resolve().parent.parent
CRDS = REPO / "tests" / "fixtures" / "crds"
JOBSET_SCHEMA = "jobset-v0.12.0-jobsets.json"
KUEUE_SCHEMAS = {
    "LocalQueue": "kueue-v0.19.2-localqueues.json",
    "ClusterQueue": "kueue-v0.19.2-clusterqueues.json",
    "ResourceFlavor": "kueue-v0.19.2-resourceflavors.json",
}
WORK_POOL = "mega-kubernetes"
PASSWORD = "pw-never-in-a-manifest"
IMAGE = "ghcr.io/mega-llm/mega:0.1.0@sha256:" + "0" * 64
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
INVALID = (kubernetes_validate.ValidationError, jsonschema.ValidationError)


def _closed(schema):
    """Unknown fields are errors (kubectl's default strict field validation), as in kubernetes-validate."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    return [_closed(v) for v in schema] if isinstance(schema, list) else schema


@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    doc = json.loads((CRDS / (JOBSET_SCHEMA if kind == "JobSet" else KUEUE_SCHEMAS[kind])).read_text())
    assert doc["kind"] == kind
    schema = _closed(doc["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{doc['group']}/{doc['version']}"}
    return jsonschema.Draft7Validator(schema)


def validate(manifests: list[dict]) -> None:
    for m in manifests:
        if m["kind"] == "JobSet" or m["kind"] in KUEUE_SCHEMAS:
            errors = sorted(crd_validator(m["kind"]).iter_errors(m), key=str)
            if errors:
                raise errors[0]
        else:
            kubernetes_validate.validate(m, k8s.KUBERNETES_VERSION, strict=True)
        if m["kind"] == "JobSet":
            for r in m["spec"]["replicatedJobs"]:
                kubernetes_validate.validate(
                    {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **r["template"]},
                    k8s.KUBERNETES_VERSION,
                    strict=True,
                )


def restricted_violations(pod: dict) -> list[str]:
    """What in a pod spec fails Pod Security "restricted" (the checks of the v1.31 profile that a
    rendered pod can fail): privilege, host namespaces and paths, capabilities beyond
    NET_BIND_SERVICE, privilege escalation, root, seccomp, volume types."""
    found = []
    allowed_volumes = {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(f"{key}: true")
    for v in pod.get("volumes", []):
        if not set(v) - {"name"} <= allowed_volumes:
            found.append(f"volume {v['name']}: {sorted(set(v) - {'name'})}")
    psc = pod.get("securityContext", {})
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc, where = c.get("securityContext", {}), f"container {c['name']}"
        if sc.get("privileged"):
            found.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation not false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            found.append(f"{where}: capabilities not dropping ALL")
        for cap in sc.get("capabilities", {}).get("add", []):
            if cap != "NET_BIND_SERVICE":
                found.append(f"{where}: capability {cap}")
        if (
            not sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
            or sc.get("runAsUser", psc.get("runAsUser")) == 0
        ):
            found.append(f"{where}: may run as root")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{where}: hostPort")
    return found


def _cfg(*overrides):
    return compose(["launcher=kubernetes", f"launcher.kubernetes.image={IMAGE}", *overrides])


def _job(cfg, index="/mnt/mega/data/index.json", **env):
    return JobSpec(
        "mega.train",
        ["--config", f"{k8s.CONFIG_MOUNT}/config.json", "--data-index", index],
        {**cfg.cluster.env, "MEGA_ATTEMPT": "0", **env},
        Path(cfg.train.run_dir),
        "train-attempt0",
    )


SHARED = [
    "launcher.kubernetes.volume_claim=mega-shared",
    "launcher.kubernetes.volume_access_mode=ReadWriteMany",
    "checkpoint.dir=/mnt/mega/checkpoints/gpt-13b",
]


def _layout(preset: str, nodes: int) -> list[str]:
    dp = 8 * nodes // 4  # tp2 x pp2 x dp over nodes x 8 devices
    return [
        f"cluster={preset}",
        f"cluster.nodes={nodes}",
        "parallelism=tp2-pp2-dp2",
        f"parallelism.dp={dp}",
        f"parallelism.global_batch_size={2 * dp}",
        "train.run_dir=/mnt/mega/runs/gpt-13b",
        *SHARED,
    ]


def _pod(workload: dict) -> dict:
    spec = workload["spec"]
    return (spec["replicatedJobs"][0]["template"]["spec"] if workload["kind"] == "JobSet" else spec)[
        "template"
    ]


@pytest.mark.parametrize(
    "workload, preset, nodes",
    [
        ("jobset", "h100-8x", 1),
        ("jobset", "h100-8x", 16),
        ("jobset", "a100-8x", 64),
        ("job", "h100-8x", 2),
        ("job", "a100-8x", 4),
    ],
)
def test_manifests_validate_and_wire_one_pod_per_node(workload, preset, nodes):
    cfg = _cfg(
        *_layout(preset, nodes),
        f"launcher.kubernetes.workload={workload}",
        "launcher.kubernetes.node_selector={nvidia.com/gpu.product: x}",
        "launcher.kubernetes.extra_resources={example.com/fpga: '1'}",
        "launcher.kubernetes.cpu=96",
        "launcher.kubernetes.memory=1600Gi",
    )
    manifests = k8s.render_manifests(cfg, _job(cfg))
    validate(manifests)

    configmap, *_, work = manifests
    assert [m["kind"] for m in manifests] == (
        ["ConfigMap", "JobSet"] if workload == "jobset" else ["ConfigMap", "Service", "Job"]
    )
    job_spec = work["spec"]["replicatedJobs"][0]["template"]["spec"] if workload == "jobset" else work["spec"]
    pod = job_spec["template"]["spec"]
    assert (
        job_spec["completionMode"] == "Indexed"
        and job_spec["completions"] == job_spec["parallelism"] == nodes
    )
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {
        "nvidia.com/gpu": "8",
        "example.com/fpga": "1",
        "cpu": "96",
        "memory": "1600Gi",
    }
    assert container["resources"]["requests"] == {"cpu": "96", "memory": "1600Gi"}  # Guaranteed QoS
    command = container["command"]
    assert command[:4] == ["python", "-m", "mega.launch.pod", "--selfcheck"]  # the pod entry, then the agent
    assert (
        f"--nnodes={nodes}" in command
        and "--nproc-per-node=8" in command
        and "--node-rank=$(NODE_RANK)" in command
    )
    env = {e["name"]: e for e in container["env"]}
    assert (
        env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert all(env[k]["value"] == v for k, v in cfg.cluster.env.items())
    if workload == "jobset":  # the JobSet's headless Service: <jobset>-node-0-0.<jobset>
        name = work["metadata"]["name"]
        assert f"--master-addr={name}-node-0-0.{name}" in command
        assert (
            env["MEGA_ATTEMPT"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"
        )
        host = f"{name}-node-0-{nodes - 1}"
    else:
        service = manifests[1]
        assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
        assert f"--master-addr={work['metadata']['name']}-0.{service['metadata']['name']}" in command
        host = f"{work['metadata']['name']}-{nodes - 1}"
    assert DNS_LABEL.fullmatch(host) and len(host) <= 63
    assert command[command.index("--config") + 1] == f"{k8s.CONFIG_MOUNT}/config.json"
    assert json.loads(configmap["data"]["config.json"])["cluster"]["nodes"] == nodes
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "mega-shared"
    assert (
        container["image"] == IMAGE and container["imagePullPolicy"] == "IfNotPresent"
    )  # a digest never changes
    assert restricted_violations(pod) == []


def test_jobset_is_queued_and_restarted_by_the_cluster_with_disruptions_not_counted():
    cfg = _cfg(
        *_layout("h100-8x", 4),
        "launcher.kubernetes.exclusive_topology=cloud.example.com/rack",
        "launcher.kubernetes.priority_class=training",
        "launcher.kubernetes.active_deadline_s=864000",
        "launcher.kubernetes.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
        "launcher.kubernetes.annotations={team: llm}",
        "restart.max_restarts=5",
    )
    _, jobset = k8s.render_manifests(cfg, _job(cfg))
    validate([jobset])
    meta, spec = jobset["metadata"], jobset["spec"]
    assert meta["namespace"] == "mega" and meta["labels"][k8s.QUEUE_LABEL] == "mega"
    assert spec["suspend"] is True  # until Kueue admits every pod at once
    assert meta["annotations"] == {"team": "llm", k8s.EXCLUSIVE_ANNOTATION: "cloud.example.com/rack"}
    assert spec["failurePolicy"]["maxRestarts"] == 5 and spec["ttlSecondsAfterFinished"] == 86400
    assert spec["failurePolicy"]["rules"] == [
        {
            "name": "disrupted-or-saved",
            "action": "RestartJobSetAndIgnoreMaxRestarts",
            "onJobFailureReasons": ["PodFailurePolicy"],
        }
    ]
    assert spec["startupPolicy"] == {"startupPolicyOrder": "AnyOrder"}
    [rj] = spec["replicatedJobs"]
    job = rj["template"]["spec"]
    assert rj["replicas"] == 1 and job["backoffLimit"] == 0 and job["activeDeadlineSeconds"] == 864000
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailJob",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert [(r["action"], r["onExitCodes"]["values"]) for r in rules[1:]] == [
        ("FailJob", [85]),
        ("Count", [heartbeat_redis.RESTART_EXIT_CODE]),
    ]
    pod = job["template"]["spec"]
    assert pod["priorityClassName"] == "training" and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert job["template"]["metadata"]["annotations"] == {"team": "llm"}
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti == [
        {
            "labelSelector": {"matchLabels": job["template"]["metadata"]["labels"]},
            "topologyKey": "kubernetes.io/hostname",
        }
    ]  # one pod of the run per node

    fallback = _cfg(*_layout("h100-8x", 4), "launcher.kubernetes.workload=job", "restart.max_restarts=5")
    job = k8s.render_manifests(fallback, _job(fallback))[2]
    assert job["spec"]["backoffLimit"] == 4 * 5 and job["spec"]["suspend"] is True
    assert [r["action"] for r in job["spec"]["podFailurePolicy"]["rules"]] == ["Ignore", "Ignore", "Count"]


def test_rdma_is_opt_in_and_its_one_security_exception_is_listed():
    cfg = _cfg(
        *_layout("h100-8x", 2),
        "launcher.kubernetes.rdma.enabled=true",
        "launcher.kubernetes.rdma.network=mega/ib-sriov",
        "launcher.kubernetes.rdma.resources={nvidia.com/hostdev: '8'}",
        "launcher.kubernetes.rdma.hca=mlx5",
        "launcher.kubernetes.rdma.socket_ifname=eth0",
        "launcher.kubernetes.rdma.gid_index=3",
    )
    _, jobset = k8s.render_manifests(cfg, _job(cfg))
    validate([jobset])
    template = _pod(jobset)
    (container,) = template["spec"]["containers"]
    assert template["metadata"]["annotations"] == {k8s.NETWORKS_ANNOTATION: "mega/ib-sriov"}
    assert container["resources"]["limits"]["nvidia.com/hostdev"] == "8"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["NCCL_IB_HCA"], env["NCCL_SOCKET_IFNAME"], env["NCCL_IB_GID_INDEX"]) == ("mlx5", "eth0", "3")
    assert restricted_violations(template["spec"]) == ["container node: capability IPC_LOCK"]
    _, plain = k8s.render_manifests(_cfg(*_layout("h100-8x", 2)), _job(cfg))
    assert "NCCL_IB_HCA" not in json.dumps(plain) and "annotations" not in _pod(plain)["metadata"]


def test_credentials_come_from_secrets_and_never_appear_in_a_manifest():
    cfg = _cfg(
        *_layout("h100-8x", 2),
        "store.kind=redis",
        f"store.redis_url=redis://:{PASSWORD}@redis.mega:6379/0",
        "launcher.kubernetes.redis_secret=mega-redis",
        "launcher.kubernetes.s3_secret=mega-s3",
        "checkpoint.storage_uri=s3://ckpt/gpt-13b",
    )
    manifests = k8s.render_manifests(cfg, _job(cfg, MEGA_REDIS_PASSWORD=PASSWORD, MEGA_JOB_ID="j1"))
    validate(manifests)
    assert PASSWORD not in k8s.to_yaml(manifests)
    env = {e["name"]: e for e in _pod(manifests[1])["spec"]["containers"][0]["env"]}
    assert (
        env["MEGA_REDIS_URL"]["value"] == env[heartbeat_redis.URL_ENV]["value"] == "redis://redis.mega:6379/0"
    )
    for name, secret, key in (
        ("MEGA_REDIS_PASSWORD", "mega-redis", "password"),
        (heartbeat_redis.PASSWORD_ENV, "mega-redis", "password"),
        ("AWS_ACCESS_KEY_ID", "mega-s3", "AWS_ACCESS_KEY_ID"),
        ("AWS_SECRET_ACCESS_KEY", "mega-s3", "AWS_SECRET_ACCESS_KEY"),
    ):
        assert env[name]["valueFrom"] == {"secretKeyRef": {"name": secret, "key": key}}
    assert (
        env[heartbeat_redis.PREFIX_ENV]["value"] == f"mega:hb:{k8s.names(cfg, _job(cfg))['run']}"
    )  # one per run


NODES4 = [*_layout("h100-8x", 4)[:5], "train.run_dir=/mnt/mega/runs/gpt-13b"]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (NODES4, "launcher.kubernetes.volume_claim"),  # 4 nodes, checkpoints in each pod's own filesystem
        (
            [
                *NODES4,
                "launcher.kubernetes.volume_claim=c",
                "launcher.kubernetes.volume_access_mode=ReadWriteOnce",
            ],
            "launcher.kubernetes.volume_access_mode",
        ),
        (
            [*NODES4, *SHARED[:2], "checkpoint.dir=checkpoints"],
            "checkpoint.dir",
        ),  # relative: not under the mount
        ([*NODES4, *SHARED, "train.run_dir=runs/x"], "train.run_dir"),
        (
            [*_layout("h100-8x", 4), "cluster.env={AWS_SECRET_ACCESS_KEY: abc}"],
            "cluster.env.AWS_SECRET_ACCESS_KEY",
        ),
        ([*NODES4, "checkpoint.storage_uri=s3://b/p"], "launcher.kubernetes.s3_secret"),
        (["cluster=h100-8x", "store.kind=redis"], "store.redis_url"),  # no server the pods reach
        (
            ["cluster=h100-8x", "store.kind=redis", f"store.redis_url=redis://:{PASSWORD}@r:6379/0"],
            "launcher.kubernetes.redis_secret",
        ),
        (["cluster=h100-8x", "launcher.kubernetes.shm_size=lots"], "launcher.kubernetes.shm_size"),
        (["cluster=h100-8x", "launcher.kubernetes.mount_path=mnt"], "launcher.kubernetes.mount_path"),
        (
            ["cluster=h100-8x", "launcher.kubernetes.image=ghcr.io/mega-llm/mega:latest"],
            "launcher.kubernetes.image",
        ),
        (["cluster=h100-8x", "launcher.kubernetes.cpu=8"], "launcher.kubernetes.memory"),
        (["cluster=h100-8x", "launcher.kubernetes.rdma.enabled=true"], "launcher.kubernetes.rdma.resources"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(overrides, key):
    cfg = _cfg(*overrides)
    with pytest.raises(ConfigError) as err:
        k8s.render_manifests(cfg, _job(cfg))
    assert err.value.key == key and PASSWORD not in str(err.value) and "abc" not in str(err.value)


def test_a_data_index_outside_every_mount_is_refused():
    cfg = _cfg(*_layout("h100-8x", 2))
    with pytest.raises(ConfigError) as err:
        k8s.render_manifests(cfg, _job(cfg, index="/data/index.json"))
    assert err.value.key == "--data-index" and "/mnt/mega" in str(err.value)


def test_a_tag_without_digest_is_pulled_always():
    cfg = _cfg("cluster=h100-8x", "launcher.kubernetes.image=ghcr.io/mega-llm/mega:0.1.0")
    assert k8s.pull_policy(cfg) == "Always"


def test_long_run_names_stay_dns_labels():
    cfg = _cfg(
        *_layout("h100-8x", 16),
        "train.run_dir=/mnt/mega/runs/A_Very_Long_Run_Name_For_The_175B_Model_On_256_GPUs_v2",
    )
    n = k8s.names(cfg, _job(cfg))
    assert all(DNS_LABEL.fullmatch(v) and len(v) <= 63 for v in n.values())
    assert len(f"{n['job']}-15") <= 63 and len(f"{n['jobset']}-node-0-15") <= 63


def test_the_admins_kueue_objects_validate_and_name_the_default_queue():
    docs = list(yaml.safe_load_all((REPO / "infra" / "kubernetes" / "kueue.yaml").read_text()))
    validate(docs)
    [queue] = [d for d in docs if d["kind"] == "LocalQueue"]
    cfg = _cfg("cluster=h100-8x")
    assert (queue["metadata"]["name"], queue["metadata"]["namespace"]) == (
        cfg.launcher.kubernetes.queue,
        cfg.launcher.kubernetes.namespace,
    )
    broken = json.loads(json.dumps(docs))
    broken[1]["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] = ["1536"]
    with pytest.raises(INVALID):
        validate(broken)


def test_render_cli_output_passes_the_validators_and_a_broken_one_does_not(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mega.launch.kubernetes",
            "render",
            *_layout("a100-8x", 2),
            "launcher=kubernetes",
            f"launcher.kubernetes.image={IMAGE}",
            "launcher.kubernetes.workload=job",
            "--data-index",
            "/mnt/mega/data/index.json",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (manifest,) = tmp_path.glob("*.yaml")
    validator = [
        str(Path(sys.executable).with_name("kubernetes-validate")),
        "--strict",
        "--no-warn",
        "-k",
        k8s.KUBERNETES_VERSION,
    ]
    ok = subprocess.run([*validator, str(manifest)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("passed") == 3

    docs = list(yaml.safe_load_all(manifest.read_text()))
    docs[2]["spec"]["completionsMode"] = docs[2]["spec"].pop("completionMode")  # a typo: unknown field
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump_all(docs))
    bad = subprocess.run([*validator, str(broken)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "completionsMode" in bad.stdout, bad.stdout

    cfg = _cfg(*_layout("a100-8x", 2))
    _, jobset = k8s.render_manifests(cfg, _job(cfg))
    jobset["spec"]["failurePolicy"]["maxRestart"] = jobset["spec"]["failurePolicy"].pop("maxRestarts")  # typo
    with pytest.raises(INVALID, match="maxRestart"):
        validate([jobset])
    _, jobset = k8s.render_manifests(cfg, _job(cfg))
    _pod(jobset)["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = [
        8
    ]  # a list, inside the Job
    with pytest.raises(INVALID, match="nvidia.com/gpu"):
        validate([jobset])


# ---------------------------------------------------------------------------------------------
# The Prefect Kubernetes work pool and the deployment onto it


def _flow_run_job(base_job_template: dict, job_variables: dict) -> dict:
    """The Job prefect-kubernetes' worker would create for a flow run of this deployment."""
    import asyncio
    import uuid

    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    config = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(base_job_template, job_variables)
    )
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

    template = json.loads((REPO / "infra" / "kubernetes" / "work-pool.json").read_text())
    with get_client(sync_client=True) as client:
        try:  # the server validates the template: every placeholder must be a declared variable
            client.create_work_pool(
                WorkPoolCreate(name=WORK_POOL, type="kubernetes", base_job_template=template)
            )
        except ObjectAlreadyExists:
            pass

    out = prefect_deploy("infra/prefect-kubernetes.yaml")
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
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
    }

    # the server checks job variables against the pool's schema: a wrong type is refused
    from prefect.exceptions import PrefectHTTPStatusError

    with get_client(sync_client=True) as client, pytest.raises(PrefectHTTPStatusError) as err:
        client.create_deployment(
            flow_id=deployment.flow_id,
            name="bad-gpus",
            work_pool_name=WORK_POOL,
            entrypoint=deployment.entrypoint,
            job_variables={"gpus": "eight"},
        )
    assert "Validation failed for field 'gpus'" in str(err.value)
    # credentials only from Secrets: a plain-text one in the job variables is refused by the pool
    with get_client(sync_client=True) as client, pytest.raises(PrefectHTTPStatusError) as err:
        client.create_deployment(
            flow_id=deployment.flow_id,
            name="plain-secret",
            work_pool_name=WORK_POOL,
            entrypoint=deployment.entrypoint,
            job_variables={"env": {"AWS_SECRET_ACCESS_KEY": PASSWORD}},
        )
    assert "env" in str(err.value) and PASSWORD not in str(err.value)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs["AWS_SECRET_ACCESS_KEY"] == {
        "name": "mega-s3",
        "key": "AWS_SECRET_ACCESS_KEY",
        "optional": True,
    }
    assert refs["MEGA_REDIS_PASSWORD"]["name"] == "mega-redis"
    assert restricted_violations(job["spec"]["template"]["spec"]) == []
