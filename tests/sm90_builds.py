"""Offline sm_90 builds for the tests (lab/aot.py), in a child process: this one may run Triton's CPU
interpreter, whose library functions (the combine functions of gl.max / gl.sum) cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_records(script: str, *args: str) -> list[dict]:
    """Run `script` (python source that imports lab/aot.py and prints one JSON object per build) compiled for
    real, and return the objects it printed. Fails the test with the child's stderr when it fails."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "lab")]))
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
