"""bench/host_proxy_asm_cpu.py runs end to end on CPU (no timing asserted): every shape takes the
`.co` branch's fast path both with and without kept verdicts (the script asserts it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import aiter_tree

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (os.environ.get(aiter_tree.ENV) or aiter_tree.find_tarball()),
                    reason="needs AITER's tree (AITER_PATCHES_TEST_AITER_SRC or the fixture tarball)")
def test_asm_proxy_writes_its_table(tmp_path):
    out = tmp_path / "asm.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "host_proxy_asm_cpu.py"), "--calls", "3",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 4 and all(r.count(" | ") == 4 for r in rows)
