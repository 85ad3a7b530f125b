"""CI: a pairwise-covering set of every variant the patches launch compiles for gfx942 and gfx950.

One run of ``aiter-patches compile --covering`` over every preset: every pair of settings that occurs together in some captured variant occurs in a
compiled one. It must compile with no error, no scratch, LDS within the arch's limit, no
float->int or float narrowing conversion; every configuration of the patches must launch at
most 16 variants across all token counts and block sizes; and it must fit the CI budget
(6 minutes on 2 cores: checked on the CPU time the run used, halved, so that a busy test
machine does not fail it). The weekly workflow .github/workflows/amd-compile.yml compiles the
full set.
"""

import json
import resource

import pytest

pytestmark = pytest.mark.slow_ci  # minutes on 2 cores: CI's second step (python -m pytest -m slow_ci)

KERNELS = {"_sort_quant_kernel", "_chunk_rank_kernel", "_chunk_scan_kernel", "_scale_tiles_kernel"}
BUDGET_S = 360


def test_covering_set_compiles_for_both_archs(run_python, tmp_path):
    out = tmp_path / "compile.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = run_python(["-m", "aiter_patches", "compile", "--arch", "gfx942,gfx950", "--covering",
                    "--max-variants", "16", "--jobs", "2", "--json", str(out)],
                   timeout=BUDGET_S + 240)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert rows and all(row["status"] == "ok" for row in rows)
    assert {(row["arch"], row["kernel"]) for row in rows} == {(a, k) for a in ("gfx942", "gfx950") for k in KERNELS}
    assert all(row["scratch"] == 0 and row["vgpr_spill"] == 0 for row in rows)
    patch_counts = [c["variants"] for c in data["counts"]]
    assert patch_counts and max(patch_counts) <= 16
    assert cpu_s / 2 < BUDGET_S, f"{cpu_s:.0f} CPU s on 2 cores > the {BUDGET_S} s CI budget"
