"""A fifth patch of an AITER function nobody patched yet touches at most six files outside tests/, and
everything finds it through the registry.

The test copies the package and the stand-in into ``tmp_path`` and adds a toy patch of
``aiter.ops.activation.gelu_tanh_and_mul``, a module the stand-in does not have, the way CONTRIBUTING.md
"Adding a patch" says: the stand-in's entry (``aiter_patches_standin/root/aiter/ops/activation.py``), the
patch's folder ``patches/toy_gelu_tanh/`` (declaration, its pins, wrapper and check), its kernel
``kernels/toy_gelu_tanh.py``, its reference ``reference/toy_gelu_tanh.py``, and its test; SIGNATURES.md
is regenerated from the pins (the sixth file). It then runs, on that copy: the registry, ``status()``,
``verify``, the drift check, SIGNATURES.md's generator and the tests' registry view. No other file of the
copy is edited, and the test proves it by comparing the trees.
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

STAND_IN_ENTRY = '''"""Stand-in of AITER's ``aiter/ops/activation.py``: ``gelu_tanh_and_mul`` in torch (AITER's is HIP)."""

import torch


def gelu_tanh_and_mul(out, input):
    n = input.shape[-1] // 2
    x = input.float()
    out.copy_(torch.nn.functional.gelu(x[..., :n], approximate="tanh") * x[..., n:])
'''

PATCH_MODULE = '''"""Patch: ``gelu_tanh_and_mul`` through the toy kernel (CONTRIBUTING.md "Adding a patch": the worked example)."""

from __future__ import annotations

from ...core.declarations import CheckResult, Patch, Target
from ...signatures import Pin

NAME = "toy_gelu_tanh"

# aiter.ops.activation.gelu_tanh_and_mul, as AITER's source spells it
PINS = (Pin("v0.1.20", "(out, input)", "ROCm/aiter v0.1.20 aiter/ops/activation.py"),)


def _wrapper(inner, site):
    def gelu_tanh_and_mul(*args, **kwargs):
        bound, problems = site.binder.bind(args, kwargs)
        if problems:
            site.counters.fallback(problems[0])
            return inner(*args, **kwargs)
        from ...kernels.toy_gelu_tanh import gelu_tanh_mul_into

        reason = gelu_tanh_mul_into(bound["out"], bound["input"])
        if reason is not None:
            site.counters.fallback(reason)
            return inner(*args, **kwargs)
        site.counters.hit()
        return None

    return gelu_tanh_and_mul


def check(device) -> CheckResult:
    import sys

    import torch

    from ... import registry

    op = sys.modules["aiter.ops.activation"].gelu_tanh_and_mul
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(device)
    patched = torch.full((4, 32), float("nan"), device=device)
    before = registry.stats()[NAME]["fast"]
    op(patched, x)
    if registry.stats()[NAME]["fast"] != before + 1:
        return CheckResult("bitwise", False, "fast path not taken")
    original = torch.full((4, 32), float("nan"), device=device)
    with registry.suspended():
        op(original, x)
    return CheckResult("bitwise", torch.equal(patched, original), "toy kernel equals AITER")


PATCH = Patch(
    name=NAME,
    summary="gelu_tanh_and_mul through a toy kernel (the worked example)",
    targets=(Target("aiter.ops.activation", "gelu_tanh_and_mul", PINS, _wrapper),),
    kernel_module="aiter_patches.kernels.toy_gelu_tanh",
    order=60,
    check=check,
)
'''

KERNEL = '''"""Toy kernel: ``out = gelu_tanh(gate) * up`` for ``input = [gate | up]`` (fp32 rows)."""

import torch

from ..reference.toy_gelu_tanh import gelu_tanh_mul_reference


def gelu_tanh_mul_into(out, x):
    """Write into ``out``, or say why not (the patch then hands the call back)."""
    if x.dtype != torch.float32 or out.shape[-1] * 2 != x.shape[-1]:
        return "not fp32 [.., 2n] -> [.., n]"
    out.copy_(gelu_tanh_mul_reference(x))
    return None
'''

REFERENCE = '''"""Torch reference of AITER's ``gelu_tanh_and_mul``: ``gelu_tanh(gate) * up`` over ``[gate | up]``, in fp32."""

import torch


def gelu_tanh_mul_reference(x):
    n = x.shape[-1] // 2
    x = x.float()
    return torch.nn.functional.gelu(x[..., :n], approximate="tanh") * x[..., n:]
'''

TOY_TEST = '''"""The toy kernel equals its reference."""

import torch

from aiter_patches.kernels.toy_gelu_tanh import gelu_tanh_mul_into
from aiter_patches.reference.toy_gelu_tanh import gelu_tanh_mul_reference


def test_toy_kernel_equals_its_reference():
    x = torch.randn(3, 8)
    out = torch.empty(3, 4)
    assert gelu_tanh_mul_into(out, x) is None and torch.equal(out, gelu_tanh_mul_reference(x))
'''

PROBE = r'''
import json
from aiter_patches import drift, registry, signatures_doc, verify
from aiter_patches_standin import ROOT as STUB_ROOT
from helpers import registry_view

out = {"package": registry.__file__, "names": registry_view.names(), "on_stand_in": registry_view.stand_in_names(),
       "modules": registry_view.modules("toy_gelu_tanh"), "signatures": "## `toy_gelu_tanh`" in signatures_doc.render()}
report = drift.check(drift.open_source(STUB_ROOT))
out["drift"] = [[t.patch, t.target, t.status] for t in report.targets if t.patch == "toy_gelu_tanh"]
rows, used = verify.run("cpu", names=["toy_gelu_tanh"])
out["verify"] = rows
out["status"] = [[p["name"], p["state"]] for p in registry.status()["patches"] if p["name"] == "toy_gelu_tanh"]
out["stats"] = "toy_gelu_tanh" in registry.stats()
import os
os.environ["AITER_PATCHES_DISABLE"] = "toy_gelu_tanh"
out["disabled"] = registry.apply(["toy_gelu_tanh"])["toy_gelu_tanh"]["state"]
print("RESULT " + json.dumps(out))
'''


def tree_files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_a_fifth_patch_of_a_new_aiter_function_touches_six_files_and_nothing_else(tmp_path):
    src = tmp_path / "src"
    copy, stand_in = src / "aiter_patches", src / STAND_IN.name
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(STAND_IN, stand_in, ignore=shutil.ignore_patterns("__pycache__"))  # beside it
    assert not (stand_in / "root" / "aiter" / "ops" / "activation.py").exists()  # a function nobody patched yet
    (stand_in / "root" / "aiter" / "ops" / "activation.py").write_text(STAND_IN_ENTRY)
    (copy / "patches" / "toy_gelu_tanh").mkdir()
    (copy / "patches" / "toy_gelu_tanh" / "__init__.py").write_text(PATCH_MODULE)
    (copy / "kernels" / "toy_gelu_tanh.py").write_text(KERNEL)
    (copy / "reference" / "toy_gelu_tanh.py").write_text(REFERENCE)
    toy_tests = tmp_path / "toy_tests"
    toy_tests.mkdir()
    (toy_tests / "test_toy_gelu_tanh.py").write_text(TOY_TEST)

    touched = []
    for name, before, after in (("aiter_patches", PACKAGE, copy), (STAND_IN.name, STAND_IN, stand_in)):
        original, edited = tree_files(before), tree_files(after)
        touched += [f"{name}/{f}" for f in sorted(set(edited) - set(original))]
        touched += [f"{name}/{f}" for f in original if f in edited and not filecmp.cmp(original[f], edited[f],
                                                                                        shallow=False)]
    assert sorted(touched) == ["aiter_patches/kernels/toy_gelu_tanh.py",
                               "aiter_patches/patches/toy_gelu_tanh/__init__.py",
                               "aiter_patches/reference/toy_gelu_tanh.py",
                               f"{STAND_IN.name}/root/aiter/ops/activation.py"]
    assert len(touched) + 1 <= 6, touched  # + SIGNATURES.md, regenerated from the pins (asserted below)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy.parent), str(TESTS)]), "TRITON_INTERPRET": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("AITER_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=240,
                          cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["package"].startswith(str(copy))
    assert "toy_gelu_tanh" in out["names"] and "toy_gelu_tanh" in out["on_stand_in"]
    assert out["modules"] == ["aiter.ops.activation"] and out["signatures"]
    assert out["drift"] == [["toy_gelu_tanh", "aiter.ops.activation.gelu_tanh_and_mul", "match"]]
    assert [(r["patch"], r["state"], r["result"]) for r in out["verify"]] == [("toy_gelu_tanh", "applied", "ok")]
    assert out["status"] == [["toy_gelu_tanh", "inactive"]]  # verify ran on the stand-in, then let it go
    assert out["stats"] and out["disabled"] == "disabled"

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(toy_tests)],
                          capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
