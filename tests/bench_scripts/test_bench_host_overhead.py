"""bench/bench_host_overhead.py runs end to end on CPU (tiny shapes; no timing asserted).

The interpreter run takes every patched entry through the real kernels; the fake-launch run
takes them through Triton's real binder and the direct launch over the fake driver. Both
must produce the full table (every entry, and the patched sort taking its fast path, which
the script itself asserts in ``--smoke``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = ("moe_sorting", "_moe_sorting_impl", "_moe_sorting_impl + stage-1 MXFP4 quant",
           "the same, outputs reused (as in fused_moe)", "MXFP4 quant helper hand-back", "fused_moe, MXFP4 weights", "fused_moe, bf16 weights",
           "fused_moe(moe_addend=...)", "gemm ... out_zeroed=True")


def run_bench(tmp_path, script: str, *args: str, timeout: int = 300) -> str:
    """``bench/<script> *args --out F`` in a subprocess; the table it wrote."""
    out = tmp_path / f"{Path(script).stem}.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # TRITON_INTERPRET=1 comes from conftest without a GPU
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_text()


@pytest.mark.parametrize("mode", [[], ["--fake-launch"]], ids=["interpreter", "fake-launch"])
def test_smoke_writes_the_whole_table(tmp_path, mode):
    table = run_bench(tmp_path, "bench_host_overhead.py", "--smoke", *mode)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0][2:] for r in rows] == list(ENTRIES)
    assert "2 alternating rounds" in table and all(r.count(" | ") == 8 for r in rows)  # the per-round ratios
    assert "Empty Triton launch:" in table and "Command: `python bench/bench_host_overhead.py --smoke" in table


def test_host_primitives_writes_its_table(tmp_path):
    table = run_bench(tmp_path, "host_primitives.py", "--calls", "1", "--reps", "1")
    for op in ("`torch.empty(n, dtype, device)`", "`t.view(dtype)`", "empty Triton launch, prepared"):
        assert f"| {op}" in table


@pytest.mark.slow_ci  # a C++ build of half a minute on 2 cores: CI's second step (python -m pytest -m slow_ci)
def test_native_alloc_probe_builds_and_matches_the_python_allocations(tmp_path):
    """The probe's C++ allocations are checked against the Python ones (shapes, dtypes, strides) before
    it times them; without a compiler it says the build failed and times the Python side only."""
    import shutil

    table = run_bench(tmp_path, "native_alloc_probe.py", "--calls", "1", "--reps", "1", timeout=600)
    rows = [line for line in table.splitlines() if line.startswith("| sort")]
    assert len(rows) == 8
    built = (shutil.which(os.environ.get("CXX", "g++")) is not None  # a compiler and Python's headers
             and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists())
    assert ("failed:" not in table) == built, table
    assert all(("| - |" not in r) == built for r in rows), rows
