"""The lab scripts (lab/*.py) need the device to run, but each must import on any machine: a renamed or removed
name they use then fails here instead of in the next device session. Importing one runs nothing (every script
keeps its work under `if __name__ == "__main__":`) and writes nothing to $OUT."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAB = REPO / "lab"
SCRIPTS = sorted(LAB.glob("*.py"))


@pytest.fixture
def lab_path(monkeypatch, tmp_path):
    """sys.path, the working directory and $OUT as a device run has them (lab/memcheck_cases.py puts tests/ on
    the path relative to the repository root; the scripts import each other by name); the scripts' modules are
    forgotten afterwards, so each test imports its script and what it imports afresh."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", [str(LAB), *sys.path])
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    yield tmp_path / "out"
    for script in SCRIPTS:
        sys.modules.pop(script.stem, None)


def test_lab_has_scripts():
    assert {"explore1.py", "explore14.py", "aot.py", "memcheck_cases.py"} <= {s.name for s in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_lab_script_imports(script, lab_path):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[script.stem] = module
    spec.loader.exec_module(module)
    assert not lab_path.exists(), f"importing {script.name} wrote to $OUT"


def test_lab_readme_indexes_every_script():
    readme = (LAB / "README.md").read_text()
    missing = [s.name for s in SCRIPTS if f"`{s.name}`" not in readme]
    assert not missing, f"lab/README.md does not index {missing}"
