"""The lifecycle matrix: every order of import, apply, revert, fork, spawn and threads, one fresh process per case.

Modelled on ddtrace's per-integration patch tests: each case (scenarios.py)
runs for every registered patch alone and for all of them, and checks every
binding by identity against ``status()``. A hang fails the case at its timeout.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .scenarios import CASES

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_lifecycle(case):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITER_PATCHES")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / "scenarios.py"), case], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith(f"OK {case}"), proc.stdout + proc.stderr[-6000:]
