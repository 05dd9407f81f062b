"""infra/image/Dockerfile: no container runtime here, so the file is parsed and checked: every pin
it installs agrees with pyproject.toml, the base image is pinned, and it runs as the non-root user
the Kubernetes pods require (mega.launch.kubernetes.RUN_AS_USER)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from mega.launch import kubernetes as k8s

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "infra" / "image" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    rows = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(row.split(None, 1)[0].upper(), row.split(None, 1)[1] if " " in row else "") for row in rows]


def _pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for r in requirements:
        m = re.fullmatch(r'"?([A-Za-z0-9_.-]+)(\[[^\]]*\])?(==|>=)([^,;"\s]+)"?', r.strip())
        if m:
            pins[m.group(1).lower().replace("_", "-")] = (m.group(3), m.group(4))
    return pins


def test_dockerfile_pins_agree_with_pyproject_and_it_runs_as_the_pods_user():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = _pins(project["dependencies"] + project["optional-dependencies"]["gpu"])
    rows = instructions()
    installed = _pins([w for op, args in rows if op == "RUN" and "pip install" in args for w in args.split()])
    assert {"torch", "megatron-core", "transformer-engine", "flash-attn"} <= installed.keys()
    for name, (op, version) in installed.items():
        if name in wanted:
            want_op, want = wanted[name]
            if want_op == "==":
                assert (op, version) == ("==", want), f"{name}: Dockerfile {op}{version}, pyproject =={want}"
            else:  # a floor in pyproject: the image pins a version at or above it
                assert tuple(map(int, version.split(".")[:2])) >= tuple(map(int, want.split(".")[:2])), name
    [base] = [args for op, args in rows if op == "FROM"]
    assert re.fullmatch(r"\S+:\S+", base) and not base.endswith(":latest")
    assert [args for op, args in rows if op == "USER"][-1] == str(k8s.RUN_AS_USER)
    assert ("WORKDIR", "/opt/mega") in rows
