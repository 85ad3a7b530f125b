"""The core knows no patch and no reporter: its imports, its events, its discovery list and entry points."""

from __future__ import annotations

import ast
import importlib.metadata
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import aiter_patches
from aiter_patches import Patch, Pin, Target, registry
from aiter_patches.core import discovery, events

CORE = Path(aiter_patches.__file__).parent / "core"
# what the core may import of the package outside itself: pure helpers below it
ALLOWED = {"runtime", "signatures", "env_flags"}


def imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 2:  # from ..x import y; from .. import x
            out.update([node.module] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("aiter_patches"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("aiter_patches"))
    return out


@pytest.mark.parametrize("module", sorted(p.name for p in CORE.glob("*.py")))
def test_a_core_module_imports_only_the_core_and_pure_helpers(module):
    assert imports_of(CORE / module) <= ALLOWED, imports_of(CORE / module)


def test_with_an_empty_discovery_list_the_core_knows_only_what_is_registered():
    """No package to discover (and no entry point): the core declares, applies and reverts a patch of its caller's."""
    code = (
        "import importlib.metadata, sys, types\n"
        "from aiter_patches.core import apply, catalog, discovery\n"
        "discovery.PACKAGES = ()\n"
        "importlib.metadata.entry_points = lambda group: []\n"
        "m = types.ModuleType('lone'); exec('def f(x):\\n    return x\\n', m.__dict__); sys.modules['lone'] = m\n"
        "from aiter_patches.core.declarations import Patch, Target\n"
        "from aiter_patches.signatures import Pin\n"
        "catalog.register(Patch('lone', 's', (Target('lone', 'f', (Pin('v', '(x)', 't'),), "
        "lambda inner, site: lambda x: ('p', inner(x))),)))\n"
        "print([p.name for p in catalog.patches()], apply.apply().applied, m.f(1), apply.revert(), m.f(1))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "['lone'] ['lone'] ('p', 1) ['lone'] 1"


def test_subscribers_hear_each_cause_and_one_that_raises_breaks_nothing():
    heard = []

    def listen(cause):
        heard.append(cause)

    def broken(cause):
        raise RuntimeError("a reporter's bug")

    events.subscribe(events.STATES_CHANGED, listen)
    events.subscribe(events.STATES_CHANGED, broken)
    try:
        aiter_patches.apply()
        registry.revert()
    finally:
        events.unsubscribe(events.STATES_CHANGED, listen)
        events.unsubscribe(events.STATES_CHANGED, broken)
    assert heard == ["apply", "revert"]


def test_a_status_field_hook_adds_to_every_record():
    def field(name, state):
        return {"extra": f"{name}:{state}"}

    events.subscribe(events.STATUS_FIELDS, field)
    try:
        recs = registry.status()["patches"]
    finally:
        events.unsubscribe(events.STATUS_FIELDS, field)
    assert all(r["extra"] == f"{r['name']}:{r['state']}" for r in recs)
    assert all(list(r)[-2:] == ["foreign_layers", "extra"] for r in recs)  # appended after the core's own keys


class _EntryPoint:
    def __init__(self, name, value, loaded):
        self.name, self.value, self._loaded = name, value, loaded

    def load(self):
        if isinstance(self._loaded, BaseException):
            raise self._loaded
        return self._loaded


def test_entry_points_add_third_party_patches_and_a_broken_one_is_left_out(monkeypatch, caplog):
    wrap = lambda inner, site: inner  # noqa: E731
    one = Patch("ep_one", "s", (Target("x", "f", (Pin("v", "(x)", "t"),), wrap),))
    two = Patch("ep_two", "s", (Target("x", "g", (Pin("v", "(x)", "t"),), wrap),))
    points = [_EntryPoint("a", "pkg:ONE", one), _EntryPoint("b", "pkg:BOTH", [two]),
              _EntryPoint("c", "pkg:BROKEN", ImportError("no such module")), _EntryPoint("d", "pkg:ODD", 42)]

    def entry_points(*, group):
        assert group == discovery.ENTRY_POINT_GROUP == "aiter_patches.patches"
        return points

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        found = discovery.find()
    names = [p.name for p in found]
    assert names[-2:] == ["ep_one", "ep_two"]
    assert {"moe_sort_mx_quant", "sglang_shared_expert_fold"} <= set(names)  # both packages of the list
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "c = pkg:BROKEN left out: ImportError" in warned and "d = pkg:ODD left out: TypeError" in warned
