"""`import aiter_patches` imports no torch (issue 32): the package is imported by every process of an
environment with the auto switch on (``AITER_PATCHES_AUTO=1``), most of which never touch torch; torch
costs about 1.3 s, the package about 0.1 s. Torch is imported where a patch is applied, a kernel is run
or a check is made, never at the package's import.

Both tests import the package in a fresh process. The first reads the source of every ``aiter_patches``
module that import loaded and names those that import torch at module level (outside any function):
none may but the ones :data:`KNOWN` lists. The second asserts the goal itself, ``torch`` not in
``sys.modules``; it is expected to fail while :data:`KNOWN` is not empty, and fails (strict) once it
passes with names still listed.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Modules reached from aiter_patches/__init__.py that may import torch at module level: none.
KNOWN: frozenset = frozenset()

_PROBE = ("import json, sys\n"
          "import aiter_patches\n"
          "mods = {m: getattr(sys.modules[m], '__file__', None) for m in list(sys.modules)\n"
          "        if m == 'aiter_patches' or m.startswith('aiter_patches.')}\n"
          "print(json.dumps({'torch': 'torch' in sys.modules, 'modules': mods}))\n")


def _import_in_a_fresh_process() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITER_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _imports_torch_at_module_level(source: str) -> bool:
    """A statement ``import torch[...]`` / ``from torch[...] import`` that runs when the module is imported
    (module body, class bodies, top-level ``if`` / ``try`` / ``with``), not inside a function."""

    def walk(nodes) -> bool:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
                return True
            if walk(ast.iter_child_nodes(node)):
                return True
        return False

    return walk(ast.parse(source).body)


@pytest.fixture(scope="module")
def imported():
    return _import_in_a_fresh_process()


def test_no_module_the_package_imports_imports_torch_at_module_level(imported):
    offenders = {m for m, path in imported["modules"].items()
                 if path and path.endswith(".py") and _imports_torch_at_module_level(Path(path).read_text())}
    assert offenders <= KNOWN, f"import torch inside the function that needs it: {sorted(offenders - KNOWN)}"


def test_the_helper_finds_module_level_imports_only():
    assert _imports_torch_at_module_level("import torch\n")
    assert _imports_torch_at_module_level("try:\n    from torch._C import x\nexcept ImportError:\n    x = None\n")
    assert _imports_torch_at_module_level("class A:\n    import torch.nn\n")
    assert not _imports_torch_at_module_level("def f():\n    import torch\n")
    assert not _imports_torch_at_module_level("import torchvision_like_name as t\nfrom . import torch\n")


def test_import_aiter_patches_imports_no_torch(imported):
    assert not imported["torch"]


def test_the_lazy_names_still_work():
    """``aiter_patches.sort_extension`` and ``fused_moe_with_addend`` load their modules at first use."""
    proc = subprocess.run([sys.executable, "-c", "import sys, aiter_patches\n"
                           "assert 'torch' not in sys.modules\n"
                           "f, g = aiter_patches.sort_extension, aiter_patches.fused_moe_with_addend\n"
                           "assert callable(f) and callable(g) and 'torch' in sys.modules\n"
                           "from aiter_patches import sort_extension, SortExtension\n"
                           "assert sort_extension is f and isinstance(SortExtension, type)\n"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
