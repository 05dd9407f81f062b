"""The whole tree passes ruff's lint rules and is ruff-formatted ([tool.ruff] in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "."], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_lint_passes():
    r = _ruff("check", "--no-cache", "--output-format", "concise")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_applied():
    r = _ruff("format", "--check", "--no-cache")
    assert r.returncode == 0, "run `.venv/bin/ruff format .`:\n" + r.stdout + r.stderr
