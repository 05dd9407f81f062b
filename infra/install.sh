#!/usr/bin/env bash
# Install what is missing for mega into ./.venv (idempotent; a no-op when nothing changed).
# torch==2.13.0 resolves to the CPU wheel this machine kind keeps on disk (pip's find-links).
set -euo pipefail
cd "$(dirname "$0")/.."

# redis-server for store.kind=redis (tests, local runs): Debian's package, only when missing.
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[install] installing redis-server (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  else
    echo "[install] warning: redis-server is missing and apt-get is not usable here (needs root);" \
         "install it for store.kind=redis (the Redis tests fail without it)" >&2
  fi
fi

# ip and tc (iproute2) for network-namespace nodes (launcher.local_nodes.netns, root only).
if [ "$(id -u)" = 0 ] && ! { command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; }; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "[install] installing iproute2 (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y -qq --no-install-recommends iproute2 >/dev/null
  else
    echo "[install] warning: ip/tc are missing; network-namespace nodes need iproute2" >&2
  fi
fi

# shellcheck: the tests lint the sbatch scripts mega renders (tests/test_slurm.py).
if ! command -v shellcheck >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[install] installing shellcheck (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y -qq --no-install-recommends shellcheck >/dev/null
  else
    echo "[install] warning: shellcheck is missing and apt-get is not usable here (needs root);" \
         "tests/test_slurm.py needs it" >&2
  fi
fi

# slurm-wlm + munge: the local Slurm cluster (python -m mega.launch.slurm_local, tests/test_slurm_cluster.py).
if ! { command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; }; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[install] installing slurm-wlm and munge (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
  else
    echo "[install] warning: slurm-wlm/munge are missing and apt-get is not usable here (needs root);" \
         "the local Slurm cluster and its tests need them" >&2
  fi
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

if [ ! -x .venv/bin/python ]; then
  echo "[install] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi

# Reinstall only when the dependency list changed since the last successful install.
stamp=.venv/.mega-install-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[install] installing mega and its dependencies (first time: about 2 minutes)"
  find_links=()
  [ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "${find_links[@]}" -e '.[test]' 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  # fail here, not mid-run; megatron-core's warnings about the absent GPU packages filtered as a
  # run filters them (its first run says once what they are)
  .venv/bin/python -c "from mega import optional_packages; optional_packages.quiet_megatron()
import torch, megatron.core, prefect, hydra"
  echo "$want" > "$stamp"
fi
