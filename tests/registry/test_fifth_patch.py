"""An independent fifth patch touches at most five files, and everything finds it through the registry.

The test copies the package into ``tmp_path``, adds a toy patch the way README's
"Adding a patch" says (its pins in ``patches/pins.py``; ``patches/toy_gelu_mul.py``
with its check; ``kernels/toy_gelu_mul.py``; ``reference/toy_gelu_mul.py``; its
test), and runs, on that copy: the registry, ``status()``, ``verify``, the drift
check, SIGNATURES.md's generator and the tests' registry view. No other file of
the copy is edited, and the test proves it by comparing the two trees.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiter_patches
import aiter_patches_standin

PACKAGE = Path(aiter_patches.__file__).parent
STAND_IN = Path(aiter_patches_standin.__file__).parent
TESTS = Path(__file__).resolve().parents[1]

PINS = '''

# aiter.ops.moe_op.gelu_and_mul, for the toy_gelu_mul patch (the README's worked example)
GELU_AND_MUL = (Pin("v0.1.20", "(out, input)", "ROCm/aiter v0.1.20 aiter/ops/moe_op.py (the stand-in's pin)"),)
'''

PATCH_MODULE = '''"""Patch: ``gelu_and_mul`` through the toy kernel (README "Adding a patch": the worked example)."""

from __future__ import annotations

from ..core.declarations import CheckResult, Patch, Target
from . import pins

NAME = "toy_gelu_mul"


def _wrapper(inner, site):
    def gelu_and_mul(*args, **kwargs):
        bound, problems = site.binder.bind(args, kwargs)
        if problems:
            site.counters.fallback(problems[0])
            return inner(*args, **kwargs)
        from ..kernels.toy_gelu_mul import gelu_mul_into

        reason = gelu_mul_into(bound["out"], bound["input"])
        if reason is not None:
            site.counters.fallback(reason)
            return inner(*args, **kwargs)
        site.counters.hit()
        return None

    return gelu_and_mul


def check(device) -> CheckResult:
    import sys

    import torch

    from .. import registry, verify

    op = sys.modules["aiter.ops.moe_op"].gelu_and_mul
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(device)
    patched = torch.full((4, 32), float("nan"), device=device)
    before = registry.stats()[NAME]["fast"]
    op(patched, x)
    if registry.stats()[NAME]["fast"] != before + 1:
        return CheckResult("bitwise", False, "fast path not taken")
    original = torch.full((4, 32), float("nan"), device=device)
    with verify.suspended():
        op(original, x)
    return CheckResult("bitwise", torch.equal(patched, original), "toy kernel equals AITER")


PATCH = Patch(
    name=NAME,
    summary="gelu_and_mul through a toy kernel (the README's worked example)",
    targets=(Target("aiter.ops.moe_op", "gelu_and_mul", pins.GELU_AND_MUL, _wrapper),),
    kernel_module="aiter_patches.kernels.toy_gelu_mul",
    order=60,
    check=check,
)
'''

KERNEL = '''"""Toy kernel: ``out = gelu(gate) * up`` for ``input = [gate | up]`` (fp32 rows)."""

import torch

from ..reference.toy_gelu_mul import gelu_mul_reference


def gelu_mul_into(out, x):
    """Write into ``out``, or say why not (the patch then hands the call back)."""
    if x.dtype != torch.float32 or out.shape[-1] * 2 != x.shape[-1]:
        return "not fp32 [.., 2n] -> [.., n]"
    out.copy_(gelu_mul_reference(x))
    return None
'''

REFERENCE = '''"""Torch reference of AITER's ``gelu_and_mul``: ``gelu(gate) * up`` over ``[gate | up]``, in fp32."""

import torch


def gelu_mul_reference(x):
    n = x.shape[-1] // 2
    x = x.float()
    return torch.nn.functional.gelu(x[..., :n]) * x[..., n:]
'''

TOY_TEST = '''"""The toy kernel equals its reference."""

import torch

from aiter_patches.kernels.toy_gelu_mul import gelu_mul_into
from aiter_patches.reference.toy_gelu_mul import gelu_mul_reference


def test_toy_kernel_equals_its_reference():
    x = torch.randn(3, 8)
    out = torch.empty(3, 4)
    assert gelu_mul_into(out, x) is None and torch.equal(out, gelu_mul_reference(x))
'''

PROBE = r'''
import json
from aiter_patches import drift, registry, signatures_doc, verify
from aiter_patches_standin import ROOT as STUB_ROOT
from helpers import registry_view

out = {"package": registry.__file__, "names": registry_view.names(), "on_stand_in": registry_view.stand_in_names(),
       "modules": registry_view.modules("toy_gelu_mul"), "signatures": "## `toy_gelu_mul`" in signatures_doc.render()}
report = drift.check(drift.open_source(STUB_ROOT))
out["drift"] = [[t.patch, t.target, t.status] for t in report.targets if t.patch == "toy_gelu_mul"]
rows, used = verify.run("cpu", names=["toy_gelu_mul"])
out["verify"] = rows
out["status"] = [[p["name"], p["state"]] for p in registry.status()["patches"] if p["name"] == "toy_gelu_mul"]
out["stats"] = "toy_gelu_mul" in registry.stats()
import os
os.environ["AITER_PATCHES_DISABLE"] = "toy_gelu_mul"
out["disabled"] = registry.apply(["toy_gelu_mul"])["toy_gelu_mul"]["state"]
print("RESULT " + json.dumps(out))
'''


def tree_files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_a_fifth_patch_needs_five_files_and_nothing_else(tmp_path):
    copy = tmp_path / "src" / "aiter_patches"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(STAND_IN, copy.parent / STAND_IN.name, ignore=shutil.ignore_patterns("__pycache__"))  # beside it
    (copy / "patches" / "pins.py").write_text((copy / "patches" / "pins.py").read_text() + PINS)
    (copy / "patches" / "toy_gelu_mul.py").write_text(PATCH_MODULE)
    (copy / "kernels" / "toy_gelu_mul.py").write_text(KERNEL)
    (copy / "reference" / "toy_gelu_mul.py").write_text(REFERENCE)
    toy_tests = tmp_path / "toy_tests"
    toy_tests.mkdir()
    (toy_tests / "test_toy_gelu_mul.py").write_text(TOY_TEST)

    original, edited = tree_files(PACKAGE), tree_files(copy)
    touched = sorted(set(edited) - set(original)) + sorted(
        f for f in original if f in edited and not filecmp.cmp(original[f], edited[f], shallow=False))
    assert len(touched) + 1 <= 5, touched  # + its test file
    assert sorted(touched) == ["kernels/toy_gelu_mul.py", "patches/pins.py", "patches/toy_gelu_mul.py",
                               "reference/toy_gelu_mul.py"]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy.parent), str(TESTS)]), "TRITON_INTERPRET": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("AITER_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=240,
                          cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["package"].startswith(str(copy))
    assert "toy_gelu_mul" in out["names"] and "toy_gelu_mul" in out["on_stand_in"]
    assert out["modules"] == ["aiter.ops.moe_op"] and out["signatures"]
    assert out["drift"] == [["toy_gelu_mul", "aiter.ops.moe_op.gelu_and_mul", "match"]]
    assert [(r["patch"], r["state"], r["result"]) for r in out["verify"]] == [("toy_gelu_mul", "applied", "ok")]
    assert out["status"] == [["toy_gelu_mul", "inactive"]]  # verify ran on the stand-in, then let it go
    assert out["stats"] and out["disabled"] == "disabled"

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(toy_tests)],
                          capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
