"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and break on an upward import.

The contracts: flows -> tasks -> mega only downward; mega never imports Prefect; mega's packages and
modules in a declared layer order; no import cycle between the modules of any package. Imports
inside functions count (import-linter reads every import statement).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_import_contracts_hold():
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 5 kept, 0 broken." in r.stdout, r.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract", "named"),
    [
        # the data layer reaching up into the launcher (a layer below importing one above)
        ("mega/data/corpus.py", "from mega.launch import runs", "mega's packages and modules", "mega.launch"),
        # the library reaching up into the flows
        ("mega/obs/clock.py", "import flows.cli", "flows -> tasks -> mega", "mega.obs.clock -> flows.cli"),
        # the library importing Prefect
        ("mega/store/recording.py", "import prefect", "mega never imports Prefect", "mega.store.recording"),
        # a module config validation calls growing a dependency (it would close a circle)
        ("mega/overlap/pp_dp.py", "from mega import config", "the rule modules", "mega.overlap.pp_dp"),
    ],
)
def test_an_upward_import_breaks_a_contract(tmp_path, module, line, contract, named):
    for package in ("mega", "flows", "tasks"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / module
    # inside a function: the contract tool sees imports that run late as well
    target.write_text(target.read_text() + f"\n\ndef _added_for_the_test():\n    {line}\n")

    r = _lint_imports(tmp_path)

    assert r.returncode != 0, r.stdout
    broken = r.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and named in broken, r.stdout
