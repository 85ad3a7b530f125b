"""A SGLang-like process under `aiter-patches run`: its log tells the operator what ran, summed by `status --from-log`."""

import os
import subprocess
import sys
import textwrap

from aiter_patches_standin import ROOT as STUB_ROOT

from helpers import registry_view
from processes.procs import ROOT, run_cmd

SCRIPT = textwrap.dedent("""
    import torch
    from aiter_patches_standin import use as use_stub_aiter  # noqa: F401  (the stand-in is first on PYTHONPATH)
    import aiter
    from tests.with_sglang.test_sglang_takeover import fused_moe, inputs
    from tests.with_sglang.conftest import run_sglang_patch
    run_sglang_patch()          # SGLang's AiterRunnerCore.__init__, after `run` applied the patches
    for M in (1, 2):
        fused_moe(inputs(aiter, M, "fp8", seed=M))
""")


def _env(sglang_root):
    e = {k: v for k, v in os.environ.items() if not k.startswith("AITER_PATCHES")}
    e["PYTHONPATH"] = os.pathsep.join([STUB_ROOT, str(sglang_root), str(ROOT)])
    e["TRITON_INTERPRET"] = "1"
    e["CUDA_VISIBLE_DEVICES"] = ""  # what is under test is the log, not a device: the same CPU run everywhere
    return e


def test_the_log_of_a_sglang_process_sums_to_what_ran(sglang_root, tmp_path):
    proc = subprocess.run(run_cmd(sys.executable, "-c", SCRIPT), capture_output=True, text=True, cwd=ROOT,
                          env=_env(sglang_root), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = tmp_path / "server.log"
    log.write_text(proc.stderr)
    out = subprocess.run([sys.executable, "-m", "aiter_patches", "status", "--from-log", str(log)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    live = [n for n in registry_view.names() if not registry_view.opt_in_off(n)]  # every patch but the switched-off
    assert f"applied {len(live)} (" in out.stdout and "sglang_takeover" in out.stdout
    assert "sglang_takeover: 1 fast-path hits, 0 fallbacks, 0 errors over 1 processes" in out.stdout
    assert "moe_sort_mx_quant: 4 fast-path hits, 0 fallbacks, 0 errors over 1 processes" in out.stdout
    assert "foreign" not in out.stdout
