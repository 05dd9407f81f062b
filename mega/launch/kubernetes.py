"""launcher=kubernetes: a training run as Kubernetes objects whose restarts belong to the cluster.

``render_manifests(cfg, job)`` returns, in apply order:

* a ConfigMap with the resolved config (``config.json``, no secrets), mounted at ``/etc/mega``;
* ``launcher.kubernetes.workload=jobset`` (default): a JobSet (jobset.x-k8s.io/v1alpha2) of one
  replicated job, an indexed Job of one pod per node (completion index = node rank), queued in Kueue
  (``kueue.x-k8s.io/queue-name``, created suspended: admitted as a gang), with
  ``failurePolicy.maxRestarts = restart.max_restarts`` and its own headless Service (pod 0,
  ``<jobset>-node-0-0.<jobset>``, is the rendezvous master);
* ``workload=job``: the built-in fallback, a headless Service and an indexed Job with the same pod
  failure policy (restarts counted by ``backoffLimit = nodes x restart.max_restarts``).

Which exit means what (``POD_FAILURE_RULES``): a pod disrupted (preemption, drain, eviction:
the ``DisruptionTarget`` condition) or whose ranks saved and exited on a signal (85) restarts
every pod without counting a failure; the watcher's restart code (86, mega/launch/incluster_watch.py)
and any other failure restart every pod and count. Every pod runs ``python -m mega.launch.pod``:
the node self-check, then its torchrun agent; ranks resume from ``latest`` on every restart.

Pods meet Pod Security "restricted" (non-root, no privilege escalation, every capability dropped,
RuntimeDefault seccomp) except the opt-in ``IPC_LOCK`` of ``launcher.kubernetes.rdma``. ``check``
refuses, naming the key, what would not survive a restart: several nodes without shared checkpoint
storage, paths outside the mount, secrets in plain text.

``python -m mega.launch.kubernetes render [overrides] --data-index PATH --out DIR`` writes
``DIR/config.json`` and ``DIR/<name>.yaml`` (``kubectl apply -f``). Validated offline
(tests/test_kubernetes.py): built-in kinds against ``KUBERNETES_VERSION``, JobSet and Kueue
objects against their released CRD schemas.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mega import rank_env
from mega.cluster import rendezvous
from mega.config import ConfigError
from mega.launch.backend import JobSpec, agent_argv
from mega.launch.pod import NODE_NAME_ENV
from mega.stability import exit_signal, heartbeat_redis

if TYPE_CHECKING:
    from mega.config import MegaConfig

KUBERNETES_VERSION = "1.31.0"  # the API version the manifests are validated against
JOBSET_API = "jobset.x-k8s.io/v1alpha2"  # JobSet v0.12.0 (tests/fixtures/crds)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
EXCLUSIVE_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"  # set by JobSet on its pods
NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"  # Multus
CONFIG_MOUNT = "/etc/mega"  # the ConfigMap's mount point: --config /etc/mega/config.json
PYTHON = "python"  # the image's interpreter
DEFAULT_RDZV_PORT = 29500  # launcher.rdzv_port=0: every pod has its own network namespace
RUN_AS_USER = 1000  # the image's non-root user (infra/image/Dockerfile)
REPLICATED_JOB = "node"
LABEL_PREFIX = "mega.dev"
_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
_ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany")
_SECRET = re.compile(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|PRIVATE_KEY|^AWS_ACCESS_KEY_ID$")

# (what happened, how the pod's Job reacts under JobSet, under the built-in Job)
POD_FAILURE_RULES = [
    ("disrupted: preempted, drained, evicted (DisruptionTarget)", "FailJob", "Ignore"),
    (f"saved and exited on a signal (exit {exit_signal.EXIT_CODE})", "FailJob", "Ignore"),
    (f"hung, ended by the watcher (exit {heartbeat_redis.RESTART_EXIT_CODE})", "Count", "Count"),
]


def dns_label(text: str, max_len: int = 63) -> str:
    """``text`` as a DNS-1123 label: lower case alphanumerics and '-', alphanumeric at both ends."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return label[:max_len].rstrip("-") or "mega"


def names(cfg: MegaConfig, job: JobSpec) -> dict[str, str]:
    """The objects' names, the same for every attempt (the cluster restarts pods, not objects). Pod
    host names are ``<job>-<index>`` (JobSet: ``<jobset>-node-0-<index>``): room is left for them."""
    run = dns_label(f"mega-{Path(cfg.train.run_dir).name}", 40)
    index_room = len(str(cfg.cluster.nodes - 1)) + 1
    return {
        "run": run,
        "service": run,
        "configmap": f"{run}-config",
        "job": dns_label(f"{run}-train", 63 - index_room),
        "jobset": dns_label(f"{run}-train", 63 - index_room - len(f"-{REPLICATED_JOB}-0")),
    }


# ---------------------------------------------------------------------------------------------
# Checks before rendering


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _data_index(job: JobSpec) -> str | None:
    return job.args[job.args.index("--data-index") + 1] if "--data-index" in job.args else None


def check(cfg: MegaConfig, job: JobSpec | None = None) -> None:
    k = cfg.launcher.kubernetes
    _check_basics(cfg)
    if cfg.store.kind == "redis" and cfg.store.redis_url is None:
        raise ConfigError(
            "store.redis_url",
            "launcher=kubernetes with store.kind=redis needs a Redis "
            "server the pods reach: set store.redis_url",
        )
    if k.rdma.enabled and not k.rdma.resources:
        raise ConfigError(
            "launcher.kubernetes.rdma.resources",
            "RDMA needs the device resource of the network operator, e.g. {rdma/ib: '1'}",
        )
    _check_secrets(cfg, job)
    _check_storage(cfg, job)


def _check_basics(cfg: MegaConfig) -> None:
    k = cfg.launcher.kubernetes
    if k.workload not in ("jobset", "job"):
        raise ConfigError("launcher.kubernetes.workload", f"jobset or job, got {k.workload!r}")
    for key in ("shm_size", "cpu", "memory"):
        value = getattr(k, key)
        if value is not None and not re.fullmatch(r"\d+(\.\d+)?(m|[KMGTPE]i?)?", str(value)):
            raise ConfigError(
                f"launcher.kubernetes.{key}", f"not a Kubernetes quantity: {value!r} (e.g. 64Gi)"
            )
    if (k.cpu is None) != (k.memory is None):
        raise ConfigError(
            "launcher.kubernetes.cpu" if k.cpu is None else "launcher.kubernetes.memory",
            "set cpu and memory together: requests = limits for both (Guaranteed QoS)",
        )
    if not k.mount_path.startswith("/"):
        raise ConfigError("launcher.kubernetes.mount_path", f"must be an absolute path, got {k.mount_path!r}")
    name = k.image.split("@")[0]
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else None
    if tag in (None, "latest"):
        raise ConfigError(
            "launcher.kubernetes.image",
            f"{k.image!r}: name a release by tag (best tag@sha256:digest), "
            "not latest: every node must run the same image",
        )
    if k.image_pull_policy not in (None, "Always", "IfNotPresent"):
        raise ConfigError(
            "launcher.kubernetes.image_pull_policy", f"Always or IfNotPresent, got {k.image_pull_policy!r}"
        )
    if k.volume_access_mode not in (None, *_ACCESS_MODES):
        raise ConfigError(
            "launcher.kubernetes.volume_access_mode", f"one of {_ACCESS_MODES}, got {k.volume_access_mode!r}"
        )


def _check_secrets(cfg: MegaConfig, job: JobSpec | None) -> None:
    k, c, url = cfg.launcher.kubernetes, cfg.cluster, cfg.store.redis_url
    if url is not None and rendezvous.split_redis_password(url)[1] is not None and not k.redis_secret:
        raise ConfigError(
            "launcher.kubernetes.redis_secret",
            "the Redis password must come from a Secret (key 'password'), not from store.redis_url",
        )
    for name in sorted(c.env):
        if _SECRET.search(name):
            raise ConfigError(
                f"cluster.env.{name}",
                "a secret in plain text: pods read credentials from "
                "Secrets (launcher.kubernetes.s3_secret, redis_secret)",
            )
    for name in sorted(job.env if job else {}):
        if (
            _SECRET.search(name)
            and name != rank_env.REDIS_PASSWORD_ENV
            and name != heartbeat_redis.PASSWORD_ENV
        ):
            raise ConfigError(f"env.{name}", "a secret in plain text: it would be written into the manifest")
    if _durable(cfg).startswith("s3://") and not k.s3_secret:
        raise ConfigError(
            "launcher.kubernetes.s3_secret",
            "s3:// checkpoints: name the Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        )


def _durable(cfg: MegaConfig) -> str:
    return cfg.checkpoint.storage_uri or cfg.checkpoint.dir


def _check_storage(cfg: MegaConfig, job: JobSpec | None) -> None:
    k, c = cfg.launcher.kubernetes, cfg.cluster
    store = _durable(cfg)
    path = store.removeprefix("file://")
    key = "checkpoint.storage_uri" if cfg.checkpoint.storage_uri else "checkpoint.dir"
    if c.nodes > 1 and not store.startswith("s3://"):
        if not k.volume_claim:
            raise ConfigError(
                "launcher.kubernetes.volume_claim",
                f"{c.nodes} nodes save file checkpoints ({key}="
                f"{store}): mount a ReadWriteMany claim, or use s3://",
            )
        if k.volume_access_mode != "ReadWriteMany":
            raise ConfigError(
                "launcher.kubernetes.volume_access_mode",
                f"{c.nodes} nodes write checkpoints to "
                f"{k.volume_claim}: it must be ReadWriteMany (got {k.volume_access_mode})",
            )
    if k.volume_claim and not store.startswith("s3://") and not _under(path, k.mount_path):
        raise ConfigError(
            key,
            f"{store} is not under the shared volume {k.mount_path}: the checkpoints would "
            "stay in the pod's own filesystem and be lost on a restart",
        )
    if k.volume_claim and not _under(cfg.train.run_dir, k.mount_path):
        raise ConfigError(
            "train.run_dir", f"{cfg.train.run_dir} is not under the shared volume {k.mount_path}"
        )
    index = _data_index(job) if job else None
    if index is not None and not (k.volume_claim and _under(index, k.mount_path)):
        where = (
            f"the shared volume {k.mount_path}" if k.volume_claim else "a mounted volume (no volume_claim)"
        )
        raise ConfigError("--data-index", f"{index} is not inside {where}: the pods would not find it")


# ---------------------------------------------------------------------------------------------
# The pod


def pull_policy(cfg: MegaConfig) -> str:
    """IfNotPresent for an image pinned by digest (it cannot change), Always for a tag only."""
    k = cfg.launcher.kubernetes
    return k.image_pull_policy or ("IfNotPresent" if "@sha256:" in k.image else "Always")


def _secret_env(name: str, secret: str, key: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _env(cfg: MegaConfig, n: dict[str, str], job: JobSpec) -> list[dict]:
    c, st, k = cfg.cluster, cfg.store, cfg.launcher.kubernetes
    field = lambda name, path: {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    env = [
        field("NODE_RANK", f"metadata.annotations['{_INDEX_ANNOTATION}']"),
        field(NODE_NAME_ENV, "spec.nodeName"),
    ]
    if k.workload == "jobset":  # the attempt number is the JobSet's restart count
        env.append(field(rank_env.ATTEMPT_ENV, f"metadata.labels['{RESTART_ATTEMPT_LABEL}']"))
    plain = {**c.env, **rendezvous.public_env(job.env)}
    plain.pop(heartbeat_redis.PASSWORD_ENV, None)
    if k.workload == "jobset":
        plain.pop(rank_env.ATTEMPT_ENV, None)
    if k.rdma.enabled:
        r = k.rdma
        plain.update(
            {
                name: str(v)
                for name, v in (
                    ("NCCL_IB_HCA", r.hca),
                    ("NCCL_SOCKET_IFNAME", r.socket_ifname),
                    ("NCCL_IB_GID_INDEX", r.gid_index),
                )
                if v is not None
            }
        )
    if st.redis_url is not None:
        public, _ = rendezvous.split_redis_password(st.redis_url)
        if st.kind == "redis":
            plain.setdefault(rendezvous.REDIS_URL_ENV, public)
        if cfg.stability.enabled:  # the heartbeat channel: one prefix for the run, over every restart
            plain.update({heartbeat_redis.URL_ENV: public, heartbeat_redis.PREFIX_ENV: f"mega:hb:{n['run']}"})
    env += [{"name": name, "value": value} for name, value in sorted(plain.items())]
    if k.redis_secret:
        if st.kind == "redis":
            env.append(_secret_env(rank_env.REDIS_PASSWORD_ENV, k.redis_secret, "password"))
        if cfg.stability.enabled and st.redis_url is not None:
            env.append(_secret_env(heartbeat_redis.PASSWORD_ENV, k.redis_secret, "password"))
    if k.s3_secret:
        env += [
            _secret_env(name, k.s3_secret, name) for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        ]
    return env


def _resources(cfg: MegaConfig) -> dict:
    c, k = cfg.cluster, cfg.launcher.kubernetes
    limits = dict(k.extra_resources)
    if k.rdma.enabled:
        limits.update(k.rdma.resources)
    if c.device == "cuda":
        limits[k.gpu_resource] = str(c.procs_per_node)
    guaranteed = {"cpu": str(k.cpu), "memory": str(k.memory)} if k.cpu is not None else {}
    resources = {"limits": {**limits, **guaranteed}} if limits or guaranteed else {}
    if guaranteed:
        resources["requests"] = dict(guaranteed)
    return resources


def security_context(cfg: MegaConfig) -> dict:
    """The container's: Pod Security "restricted", plus IPC_LOCK when RDMA is on (pinned memory)."""
    caps: dict = {"drop": ["ALL"]}
    if cfg.launcher.kubernetes.rdma.enabled:
        caps["add"] = ["IPC_LOCK"]
    return {
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "capabilities": caps,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _affinity(cfg: MegaConfig, run_labels: dict[str, str]) -> dict:
    """The user's affinity, plus one pod of the run per node and no pod on an avoided node."""
    k = cfg.launcher.kubernetes
    affinity = json.loads(json.dumps(k.affinity))  # a deep copy
    anti = affinity.setdefault("podAntiAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", []
    )
    anti.append({"labelSelector": {"matchLabels": dict(run_labels)}, "topologyKey": "kubernetes.io/hostname"})
    if k.avoid_hosts:
        required = affinity.setdefault("nodeAffinity", {}).setdefault(
            "requiredDuringSchedulingIgnoredDuringExecution", {}
        )
        terms = (
            required.setdefault("nodeSelectorTerms", [])
            or required["nodeSelectorTerms"].append({})
            or required["nodeSelectorTerms"]
        )
        for term in terms:
            term.setdefault("matchExpressions", []).append(
                {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": list(k.avoid_hosts)}
            )
    return affinity


def _master(cfg: MegaConfig, n: dict[str, str]) -> str:
    if cfg.launcher.kubernetes.workload == "jobset":
        return f"{n['jobset']}-{REPLICATED_JOB}-0-0.{n['jobset']}"  # JobSet's headless Service is the JobSet's name
    return f"{n['job']}-0.{n['service']}"


def pod_template(cfg: MegaConfig, n: dict[str, str], job: JobSpec, python: str = PYTHON) -> dict:
    """The pod template of every node: the pod entry (self-check, watcher on node 0) and the agent."""
    k = cfg.launcher.kubernetes
    port = cfg.launcher.rdzv_port or DEFAULT_RDZV_PORT
    run_labels = {"app.kubernetes.io/name": "mega", f"{LABEL_PREFIX}/run": n["run"]}
    entry = [python, "-m", "mega.launch.pod", *(["--selfcheck"] if k.selfcheck else []), "--watch", "--"]
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
    ]
    volumes = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}},
        {"name": "config", "configMap": {"name": n["configmap"]}},
    ]
    if k.volume_claim:
        mounts.append({"name": "shared", "mountPath": k.mount_path})
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": k.volume_claim}})
    container = {
        "name": "node",
        "image": k.image,
        "imagePullPolicy": pull_policy(cfg),
        "command": entry + agent_argv(cfg, "$(NODE_RANK)", _master(cfg, n), port, job, python=python),
        "env": _env(cfg, n, job),
        "ports": [{"name": "rdzv", "containerPort": port, "protocol": "TCP"}],
        "volumeMounts": mounts,
        "securityContext": security_context(cfg),
    }
    if resources := _resources(cfg):
        container["resources"] = resources
    spec: dict = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "affinity": _affinity(cfg, run_labels),
    }
    if k.workload == "job":
        spec["subdomain"] = n["service"]  # <job>-<index>.<service> resolves to the pod
    for key, value in (
        ("serviceAccountName", k.service_account),
        ("priorityClassName", k.priority_class),
        ("nodeSelector", dict(k.node_selector)),
        ("tolerations", list(k.tolerations)),
    ):
        if value:
            spec[key] = value
    annotations = dict(k.annotations)
    if k.rdma.enabled and k.rdma.network:
        annotations[NETWORKS_ANNOTATION] = k.rdma.network
    metadata: dict = {"labels": run_labels}
    if annotations:
        metadata["annotations"] = annotations
    return {"metadata": metadata, "spec": spec}


# ---------------------------------------------------------------------------------------------
# The workload


def pod_failure_policy(workload: str) -> dict:
    """POD_FAILURE_RULES as a podFailurePolicy: under JobSet a disruption or a signalled save fails
    the Job with reason PodFailurePolicy (JobSet restarts without counting); the built-in Job
    ignores them (the pod is recreated, nothing counted)."""
    action = {"jobset": 0, "job": 1}[workload]
    rules = [
        {
            "action": POD_FAILURE_RULES[0][1 + action],
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        },
        {
            "action": POD_FAILURE_RULES[1][1 + action],
            "onExitCodes": {"containerName": "node", "operator": "In", "values": [exit_signal.EXIT_CODE]},
        },
        {
            "action": POD_FAILURE_RULES[2][1 + action],
            "onExitCodes": {
                "containerName": "node",
                "operator": "In",
                "values": [heartbeat_redis.RESTART_EXIT_CODE],
            },
        },
    ]
    return {"rules": rules}


def _job_spec(cfg: MegaConfig, n: dict[str, str], job: JobSpec, python: str) -> dict:
    c, k = cfg.cluster, cfg.launcher.kubernetes
    fallback = k.workload == "job"
    spec = {
        "completionMode": "Indexed",
        "completions": c.nodes,
        "parallelism": c.nodes,
        # JobSet: any counted pod failure fails the Job at once and JobSet restarts every pod
        "backoffLimit": c.nodes * cfg.restart.max_restarts if fallback else 0,
        "podFailurePolicy": pod_failure_policy(k.workload),
        "template": pod_template(cfg, n, job, python),
    }
    if k.active_deadline_s is not None:
        spec["activeDeadlineSeconds"] = k.active_deadline_s
    if fallback and k.ttl_after_finished_s is not None:
        spec["ttlSecondsAfterFinished"] = k.ttl_after_finished_s
    if fallback and k.queue:
        spec["suspend"] = True  # Kueue admits (unsuspends) the whole Job at once
    return spec


def _jobset(cfg: MegaConfig, n: dict[str, str], job: JobSpec, python: str, meta: dict) -> dict:
    k = cfg.launcher.kubernetes
    spec: dict = {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "startupPolicy": {"startupPolicyOrder": "AnyOrder"},  # one replicated job: every pod at once
        "failurePolicy": {
            "maxRestarts": cfg.restart.max_restarts,
            "rules": [
                {
                    "name": "disrupted-or-saved",
                    "action": "RestartJobSetAndIgnoreMaxRestarts",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                }
            ],
        },
        "replicatedJobs": [
            {"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": _job_spec(cfg, n, job, python)}}
        ],
    }
    if k.queue:
        spec["suspend"] = True  # Kueue admits (unsuspends) the whole JobSet at once: gang admission
    if k.ttl_after_finished_s is not None:
        spec["ttlSecondsAfterFinished"] = k.ttl_after_finished_s
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": n["jobset"], **meta},
        "spec": spec,
    }


def render_manifests(cfg: MegaConfig, job: JobSpec, python: str = PYTHON) -> list[dict]:
    """ConfigMap, then the JobSet, or the headless Service and indexed Job (``workload=job``)."""
    check(cfg, job)
    k = cfg.launcher.kubernetes
    n = names(cfg, job)
    port = cfg.launcher.rdzv_port or DEFAULT_RDZV_PORT
    run_labels = {"app.kubernetes.io/name": "mega", f"{LABEL_PREFIX}/run": n["run"]}
    labels = {**run_labels, **({QUEUE_LABEL: k.queue} if k.queue else {})}
    annotations = dict(k.annotations)
    if k.exclusive_topology and k.workload == "jobset":
        annotations[EXCLUSIVE_ANNOTATION] = k.exclusive_topology
    meta = {
        "namespace": k.namespace,
        "labels": labels,
        **({"annotations": annotations} if annotations else {}),
    }

    from mega import config as mega_config

    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": n["configmap"], "namespace": k.namespace, "labels": run_labels},
        "data": {
            "config.json": json.dumps(
                mega_config.to_dict(rendezvous.without_secrets(cfg)), indent=2, sort_keys=True
            )
        },
    }
    if k.workload == "jobset":
        return [configmap, _jobset(cfg, n, job, python, meta)]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": n["service"], "namespace": k.namespace, "labels": run_labels},
        "spec": {
            "clusterIP": "None",
            # DNS names exist before the pods are ready: agents resolve the master while it starts
            "publishNotReadyAddresses": True,
            "selector": run_labels,
            "ports": [{"name": "rdzv", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
    job_manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": n["job"], **meta},
        "spec": _job_spec(cfg, n, job, python),
    }
    return [configmap, service, job_manifest]


def to_yaml(manifests: list[dict]) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data):  # the label dicts are shared: spell them out, no &anchors
            return True

    return yaml.dump_all(manifests, Dumper=Dumper, sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------------------------
# CLI


def _write(cfg: MegaConfig, job: JobSpec, out: Path) -> list[Path]:
    manifests = render_manifests(cfg, job)
    path = out / f"{manifests[-1]['metadata']['name']}.yaml"
    path.write_text(to_yaml(manifests))
    return [path]


def check_args(argv: list[str]) -> MegaConfig:
    """Validate ``render`` arguments without writing anything (mega.launch.render.check)."""
    from mega.launch import render

    return render.check_args(argv, prog="python -m mega.launch.kubernetes", what="Kubernetes manifests")


def main(argv: list[str] | None = None) -> int:
    from mega.launch import render

    return render.cli(
        argv,
        prog="python -m mega.launch.kubernetes",
        what="Kubernetes manifests",
        write=_write,
        config_path=lambda out: f"{CONFIG_MOUNT}/config.json",
    )


if __name__ == "__main__":
    sys.exit(main())
