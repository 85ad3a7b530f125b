import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def compile_env(**extra) -> dict:
    """The environment of a compile subprocess: this checkout first, no interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env.update(extra)
    return env


def run_py(args, timeout, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=compile_env(**env), cwd=REPO)


@pytest.fixture
def run_python():
    return run_py
