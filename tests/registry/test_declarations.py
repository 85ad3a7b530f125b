"""Declarations apart from state: what a patch module imports holds nothing and starts nothing."""

import ast
from pathlib import Path

import aiter_patches
from aiter_patches import registry, verify
from aiter_patches.core import declarations

SOURCE = Path(declarations.__file__).read_text(encoding="utf-8")


def test_the_registry_and_the_package_re_export_the_same_declarations():
    for name in ("Patch", "Target", "SourcePin", "Site", "PatchSkipped",
                 "APPLIED", "SKIPPED", "PENDING", "DISABLED", "INACTIVE"):
        assert getattr(registry, name) is getattr(declarations, name), name
    for name in ("Patch", "Target", "SourcePin", "PatchSkipped"):
        assert getattr(aiter_patches, name) is getattr(declarations, name), name
    assert verify.CheckResult is declarations.CheckResult


def test_the_module_imports_only_pure_modules():
    tree = ast.parse(SOURCE)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    # .runtime only under TYPE_CHECKING (it holds locks); no torch, no AITER, no registry
    assert imported == {"__future__", "dataclasses", "typing", "..signatures", "..runtime"}
    guarded = [n for n in tree.body if isinstance(n, ast.If)]
    assert [ast.unparse(n.test) for n in guarded] == ["TYPE_CHECKING"]
    assert all(isinstance(n, ast.ImportFrom) and n.module == "runtime" for n in guarded[0].body)


def test_the_module_holds_no_mutable_state():
    for node in ast.parse(SOURCE).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            assert isinstance(value, (ast.Constant, ast.Tuple, ast.Subscript)), ast.unparse(node)
            assert all(isinstance(e, ast.Constant) for e in getattr(value, "elts", [])), ast.unparse(node)
    frozen = {c: declarations.__dict__[c].__dataclass_params__.frozen for c in ("Patch", "Target", "SourcePin")}
    assert frozen == {"Patch": True, "Target": True, "SourcePin": True}


def test_a_patch_lists_its_target_modules_once_in_declared_order():
    wrap = lambda fn, site: fn  # noqa: E731
    p = declarations.Patch("p", "s", (declarations.Target("b.m", "f", (), wrap), declarations.Target("a.m", "g", (), wrap),
                                      declarations.Target("b.m", "h", (), wrap)))
    assert p.modules == ("b.m", "a.m")
