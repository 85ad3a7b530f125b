"""The per-process reports read the registry through its public functions only (no lock, no private table)."""

import ast
from pathlib import Path

import pytest

import aiter_patches

ROOT = Path(aiter_patches.__file__).parent


def private_registry_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sorted({f"registry.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and isinstance(n.value, ast.Name) and n.value.id == "registry" and n.attr.startswith("_")})


@pytest.mark.parametrize("module", ["process_report.py", "stats_log.py", "verify.py", "drift/check.py", "drift/sources.py", "cli.py"])
def test_reads_no_private_of_the_registry(module):
    assert private_registry_reads(ROOT / module) == []


def test_no_module_of_the_package_reads_a_registry_private():
    offenders = {str(p.relative_to(ROOT)): private_registry_reads(p) for p in sorted(ROOT.rglob("*.py"))
                 if p.name != "registry.py"}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_scan_sees_a_private_read(tmp_path):
    src = tmp_path / "reader.py"
    src.write_text("from aiter_patches import registry\nwith registry._lock:\n    registry.status()\n", encoding="utf-8")
    assert private_registry_reads(src) == ["registry._lock"]
