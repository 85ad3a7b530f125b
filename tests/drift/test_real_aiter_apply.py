"""``apply()`` on real AITER code: the wheel's ``aiter`` imported on CPU through the fakes.

Runs in a subprocess (the fakes and a real ``aiter`` must never enter the test
runner). Checks that ``apply()`` raises nothing, that every patch is skipped
with exactly the reason the drift report predicts, that ``revert()`` leaves
every module-level binding of every ``aiter`` module as it was, and that the
same holds when ``apply()`` runs before ``import aiter`` (post-import hook).
"""

import json
import os
import subprocess

import pytest

from aiter_patches import drift

BODY = r"""
import importlib, json, sys
import aiter_patches
from aiter_patches import registry

def bindings():
    return {(m, k): id(v) for m, mod in list(sys.modules.items())
            if (m == "aiter" or m.startswith("aiter.")) and mod is not None
            for k, v in list(vars(mod).items())}

def states(report):
    return {n: [r["state"], r["reason"]] for n, r in report.items()}

out = {}
before_import = aiter_patches.apply()
out["before_import"] = states(before_import)
import aiter  # the post-import hooks run here, and at each module the registry's patches target in AITER
for module in sorted({m for p in registry.patches() for m in p.modules if m.split(".")[0] == "aiter"}):
    importlib.import_module(module)
out["aiter_file"] = aiter.__file__
out["after_hook"] = {r["name"]: [r["state"], r["reason"]] for r in registry.status()["patches"]}
snap = bindings()
out["reverted_hooked"] = aiter_patches.revert()
out["restored_after_hooked"] = bindings() == snap
out["immediate"] = states(aiter_patches.apply())
out["reverted_immediate"] = aiter_patches.revert()
after = bindings()
out["changed_bindings"] = sorted(f"{m}.{k}" for (m, k), i in snap.items() if after.get((m, k)) != i)
out["restored"] = after == snap
print("RESULT " + json.dumps(out))
"""


def expected_reasons(aiter_wheel):
    """The skip reason the registry must give for each patch, derived from the static drift report."""
    report = drift.check(drift.open_source(wheel=aiter_wheel))
    reasons = {}
    for t in report.targets:  # in each patch's declared target order: the first problem is the reason
        if t.patch in reasons or t.status == "match":
            continue
        if t.status == "missing":
            reasons[t.patch] = f"{t.target} is missing"
        else:
            labels = ", ".join(p["label"] for p in t.pins)
            reasons[t.patch] = f"{t.target} signature drifted ({t.reason}); accepted pins: {labels}"
    from aiter_patches import registry

    for p in registry.patches():  # declared needs first: a patch whose need is skipped says so (issue 31)
        skipped_need = next((n for n in p.needs if n in reasons), None)
        if skipped_need is not None and p.name in reasons:
            reasons[p.name] = f"needs {skipped_need}, which is skipped: {reasons[skipped_need]}"
    return reasons


def test_apply_on_the_real_wheel_skips_with_the_drift_reports_reasons(aiter_wheel, unpacked_wheel, tmp_path):
    try:
        import pandas  # noqa: F401
    except ImportError:
        pytest.fail("the wheel's `import aiter` reads its tuned-config CSVs with pandas at import: install "
                    "pandas (the project's `test` extra)")
    from helpers import fake_rocm

    home = fake_rocm.make_rocm_home(tmp_path / "rocm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITER_PATCHES")}
    env["AITER_LOG_LEVEL"] = "WARNING"
    proc = subprocess.run(fake_rocm.python_command(unpacked_wheel, home, BODY), capture_output=True, text=True,
                          env=env, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = json.loads(lines[0][len("RESULT "):])

    assert out["aiter_file"].startswith(str(unpacked_wheel))
    from aiter_patches import registry

    opt_in = [p.name for p in registry.patches() if p.opt_in]  # server integrations: off unless switched on
    names = set(expected_reasons(aiter_wheel)) - set(opt_in)
    for key in ("before_import", "after_hook", "immediate"):  # not AITER's: inactive without SGLang
        assert out[key].pop("sglang_takeover") == ["inactive", "sglang is not installed"]
        for n in opt_in:
            assert out[key].pop(n)[0] == "disabled"
    assert {n for n, (state, _) in out["before_import"].items()} == names
    assert all(state == "pending" for state, _ in out["before_import"].values())
    want = {n: ["skipped", r] for n, r in expected_reasons(aiter_wheel).items() if n not in opt_in}
    assert out["after_hook"] == want
    assert out["immediate"] == want
    assert sorted(out["reverted_hooked"]) == []  # skipped patches have nothing to take off
    assert out["restored_after_hooked"] and out["restored"], out["changed_bindings"]
    assert "skipped patch 'gemm_out_zeroed': aiter.ops.gemm_op_a8w8.gemm_a8w8_blockscale_bpreshuffle_asm is missing" \
        in proc.stderr
