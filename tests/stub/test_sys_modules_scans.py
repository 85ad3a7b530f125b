"""Scans of ``sys.modules`` must survive another thread's import in the middle of them (CI saw the stand-in's
``use()`` fail with "dictionary changed size during iteration" while a scenario imported on a second thread)."""

import sys
import types

import aiter_patches_standin
from aiter_patches import verify

LATE = "_aiter_patches_test_imported_meanwhile"


class _ImportingKey(str):
    """A ``sys.modules`` key whose ``startswith`` imports a module: Python code running mid-scan, as a thread
    switch to another thread's import does."""

    def startswith(self, *args):
        sys.modules.setdefault(LATE, types.ModuleType(LATE))
        return str.startswith(self, *args)


def _plant(monkeypatch):
    monkeypatch.setitem(sys.modules, _ImportingKey("_aiter_patches_test_scan_key"), types.ModuleType("k"))
    monkeypatch.delitem(sys.modules, LATE, raising=False)


def test_the_stand_ins_scan_survives_an_import_meanwhile(monkeypatch):
    _plant(monkeypatch)
    try:
        names = aiter_patches_standin.aiter_modules()
    finally:
        sys.modules.pop(LATE, None)
    assert all(n == "aiter" or n.startswith("aiter.") for n in names)


def test_verify_survives_an_import_meanwhile(monkeypatch):
    _plant(monkeypatch)
    try:
        result, used = verify.with_aiter("cpu", lambda dev: str(dev))
    finally:
        sys.modules.pop(LATE, None)
    assert result == "cpu" and "stand-in" in used
