"""The self-check across a server's processes (issue 33): each worker checks its own first calls,
and ``status --from-log`` sums the checks of every process."""

import subprocess
import sys

import pytest

from .procs import HERE, ROOT, env, python


@pytest.mark.slow_ci  # two spawned workers through Triton's interpreter (13 s); the one-process sum: tests/patches
def test_each_worker_checks_its_own_calls_and_from_log_sums_them(tmp_path):
    proc = python(str(HERE / "self_check_server.py"), under_run=True, timeout=300,
                  environ=env(AITER_PATCHES_SELF_CHECK="1", AITER_PATCHES_CHECK_DIR=str(tmp_path / "failed")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stats_lines = [ln for ln in proc.stderr.splitlines()
                   if "aiter_patches stats: " in ln and '"patch":"moe_sort_mx_quant"' in ln and '"at":"exit"' in ln]
    with_checks = [ln for ln in stats_lines if '"checks_passed":1' in ln]
    assert len(with_checks) == 2, proc.stderr  # one per worker (the parent calls nothing)
    log = tmp_path / "server.log"
    log.write_text(proc.stderr)
    out = subprocess.run([sys.executable, "-m", "aiter_patches", "status", "--from-log", str(log)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "self-check: 2 calls equal to AITER's, 0 different" in out.stdout, out.stdout
    assert not (tmp_path / "failed").exists()
