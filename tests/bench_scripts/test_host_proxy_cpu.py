"""bench/host_proxy_cpu.py runs end to end on CPU and prints its table and profiles (no timing asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_proxy_writes_the_table_and_the_profiles(tmp_path):
    out = tmp_path / "proxy.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "host_proxy_cpu.py"), "--models", "2", "--tokens", "1",
                           "--calls", "2", "--reps", "2", "--profile", "3", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("CPU proxy (not the H200)")
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    names = [r.split(" | ")[0][2:] for r in rows]
    assert "_moe_sorting_impl + stage-1 MXFP4 quant" in names and "API: gate + moe_sort_mx_quant (MXFP4)" in names
    assert text.count("### ") == len(rows) and "ncalls" in text
    assert "'moe_sort_mx_quant': 0" not in text  # the patched sort took its fast path
