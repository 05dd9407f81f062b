"""launcher=kubernetes: one attempt of a training job as built-in Kubernetes objects.

``render_manifests(cfg, job)`` returns, in apply order:

* a ConfigMap with the resolved config (``config.json``, no secrets), mounted at ``/etc/mega``;
* a headless Service (``clusterIP: None``, not-ready addresses published) that gives every pod
  of the run a DNS name, ``<job>-<index>.<service>``: pod 0 is the master, its agent serves the
  rendezvous on ``launcher.rdzv_port``;
* an indexed Job (``completionMode: Indexed``, ``completions = parallelism = cluster.nodes``):
  one pod per node, each a torchrun agent whose node rank is the pod's completion index
  (``$(NODE_RANK)``, from the ``batch.kubernetes.io/job-completion-index`` annotation), with
  ``cluster.procs_per_node`` devices of ``launcher.kubernetes.gpu_resource``, ``/dev/shm`` an
  in-memory emptyDir of ``shm_size``, the ``cluster.env`` presets, the store's URL in the
  environment and its password from a Secret (never in the manifest), and the shared volume.
  ``backoffLimit: 0``: a failed pod fails the Job and the Job controller ends the others; the
  driver relaunches every node from ``latest`` as a new Job (Jobs are immutable).

``python -m mega.launch.kubernetes render [overrides] --data-index PATH --out DIR`` writes
``DIR/config.json`` and ``DIR/<job>.yaml`` (``kubectl apply -f``). Validated offline against the
API schemas of ``KUBERNETES_VERSION`` (tests/test_kubernetes.py, kubernetes-validate --strict).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mega.cluster import rendezvous
from mega.config import ConfigError
from mega.launch.backend import JobSpec, agent_argv

if TYPE_CHECKING:
    from mega.config import MegaConfig

KUBERNETES_VERSION = "1.31.0"  # the API version the manifests are validated against
CONFIG_MOUNT = "/etc/mega"  # the ConfigMap's mount point: --config /etc/mega/config.json
PYTHON = "python"  # the image's interpreter
DEFAULT_RDZV_PORT = 29500  # launcher.rdzv_port=0: every pod has its own network namespace
LABEL_PREFIX = "mega.dev"
_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def dns_label(text: str, max_len: int = 63) -> str:
    """``text`` as a DNS-1123 label: lower case alphanumerics and '-', alphanumeric at both ends."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return label[:max_len].rstrip("-") or "mega"


def names(cfg: "MegaConfig", job: JobSpec) -> dict[str, str]:
    """The objects' names. The run's (Service, ConfigMap) stay across attempts; the Job is one
    attempt's. Pod host names are ``<job>-<index>``, so the Job's name leaves room for the index."""
    run = dns_label(f"mega-{Path(cfg.train.run_dir).name}", 40)
    index_room = len(str(cfg.cluster.nodes - 1)) + 1
    return {"run": run, "service": run, "configmap": f"{run}-config",
            "job": dns_label(f"{run}-{job.name}", 63 - index_room)}


def check(cfg: "MegaConfig") -> None:
    k, c = cfg.launcher.kubernetes, cfg.cluster
    if c.store == "redis":
        if c.redis_url is None:
            raise ConfigError("cluster.redis_url", "launcher=kubernetes with cluster.store=redis needs a Redis "
                                                   "server the pods reach: set cluster.redis_url")
        _, password = rendezvous.split_redis_password(c.redis_url)
        if password is not None and k.redis_secret is None:
            raise ConfigError("launcher.kubernetes.redis_secret", "the Redis password must come from a Secret "
                                                                  "(key 'password'), not from cluster.redis_url")
    if not re.fullmatch(r"\d+(\.\d+)?([KMGTPE]i?)?", k.shm_size):
        raise ConfigError("launcher.kubernetes.shm_size", f"not a Kubernetes quantity: {k.shm_size!r} (e.g. 64Gi)")
    if k.backoff_limit < 0:
        raise ConfigError("launcher.kubernetes.backoff_limit", f"must be >= 0, got {k.backoff_limit}")
    if not k.mount_path.startswith("/"):
        raise ConfigError("launcher.kubernetes.mount_path", f"must be an absolute path, got {k.mount_path!r}")


def render_manifests(cfg: "MegaConfig", job: JobSpec, python: str = PYTHON) -> list[dict]:
    """ConfigMap, headless Service and indexed Job of one attempt of ``job``."""
    check(cfg)
    c, k = cfg.cluster, cfg.launcher.kubernetes
    n = names(cfg, job)
    port = cfg.launcher.rdzv_port or DEFAULT_RDZV_PORT
    master = f"{n['job']}-0.{n['service']}"
    run_labels = {"app.kubernetes.io/name": "mega", f"{LABEL_PREFIX}/run": n["run"]}
    job_labels = {**run_labels, f"{LABEL_PREFIX}/job": n["job"]}
    meta = {"namespace": k.namespace}

    env = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{_INDEX_ANNOTATION}']"}}}]
    env += [{"name": key, "value": value} for key, value in sorted({**c.env, **rendezvous.public_env(job.env)}.items())]
    if c.store == "redis":
        public, _ = rendezvous.split_redis_password(c.redis_url)
        if rendezvous.REDIS_URL_ENV not in job.env:
            env.append({"name": rendezvous.REDIS_URL_ENV, "value": public})
        if k.redis_secret:
            env.append({"name": rendezvous.REDIS_PASSWORD_ENV,
                        "valueFrom": {"secretKeyRef": {"name": k.redis_secret, "key": "password"}}})

    limits = dict(k.extra_resources)
    if c.device == "cuda":
        limits[k.gpu_resource] = str(c.procs_per_node)
    resources: dict = {}
    if limits:
        resources["limits"] = limits
    requests = {key: value for key, value in (("cpu", k.cpu), ("memory", k.memory)) if value}
    if requests:
        resources["requests"] = requests

    mounts = [{"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}},
               {"name": "config", "configMap": {"name": n["configmap"]}}]
    if k.volume_claim:
        mounts.append({"name": "shared", "mountPath": k.mount_path})
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": k.volume_claim}})

    container = {
        "name": "node",
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": agent_argv(cfg, "$(NODE_RANK)", master, port, job, python=python),
        "env": env,
        "ports": [{"name": "rdzv", "containerPort": port, "protocol": "TCP"}],
        "volumeMounts": mounts,
    }
    if resources:
        container["resources"] = resources
    pod_spec: dict = {
        "restartPolicy": "Never",
        "subdomain": n["service"],  # <job>-<index>.<service> resolves to the pod
        "containers": [container],
        "volumes": volumes,
    }
    if k.service_account:
        pod_spec["serviceAccountName"] = k.service_account
    if k.node_selector:
        pod_spec["nodeSelector"] = dict(k.node_selector)

    from mega import config as mega_config

    configmap = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": n["configmap"], **meta, "labels": run_labels},
        "data": {"config.json": json.dumps(mega_config.to_dict(rendezvous.without_secrets(cfg)), indent=2,
                                           sort_keys=True)},
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": n["service"], **meta, "labels": run_labels},
        "spec": {
            "clusterIP": "None",
            # DNS names exist before the pods are ready: agents resolve the master while it starts
            "publishNotReadyAddresses": True,
            "selector": run_labels,
            "ports": [{"name": "rdzv", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
    job_manifest = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": n["job"], **meta, "labels": job_labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": c.nodes,
            "parallelism": c.nodes,
            "backoffLimit": k.backoff_limit,
            "template": {"metadata": {"labels": job_labels}, "spec": pod_spec},
        },
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


def _write(cfg: "MegaConfig", job: JobSpec, out: Path) -> list[Path]:
    manifests = render_manifests(cfg, job)
    path = out / f"{manifests[-1]['metadata']['name']}.yaml"
    path.write_text(to_yaml(manifests))
    return [path]


def check_args(argv: list[str]) -> "MegaConfig":
    """Validate ``render`` arguments without writing anything (mega.launch.render.check)."""
    from mega.launch import render

    return render.check_args(argv, prog="python -m mega.launch.kubernetes", what="Kubernetes manifests")


def main(argv: list[str] | None = None) -> int:
    from mega.launch import render

    return render.cli(argv, prog="python -m mega.launch.kubernetes", what="Kubernetes manifests", write=_write,
                      config_path=lambda out: f"{CONFIG_MOUNT}/config.json")


if __name__ == "__main__":
    sys.exit(main())
