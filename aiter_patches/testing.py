"""Test support: scope the stand-in AITER so it can never shadow a real one.

``use_stub_aiter()`` puts ``aiter_patches/stub_aiter`` first on ``sys.path``
and, on exit, takes it off and forgets every ``aiter`` module imported inside
the scope (reverting any patch applied to them first), so the next ``import
aiter`` finds whatever is really installed.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from typing import Iterator

from .stub_aiter import STUB_ROOT


def stand_in_has(module: str) -> bool:
    """Whether the stand-in has ``module`` (read from its files: nothing is imported)."""
    path = Path(STUB_ROOT, *module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_stand_in_targets() -> list[str]:
    """Inside ``use_stub_aiter()``: import every module a registered patch targets that the stand-in has.

    The registry says which modules (each patch's targets); returns them in import order.
    """
    from . import registry

    modules = sorted({m for p in registry.patches() for m in p.modules if stand_in_has(m)})
    for m in modules:
        importlib.import_module(m)
    return modules


def _aiter_modules() -> list[str]:
    return [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]


@contextlib.contextmanager
def use_stub_aiter(*, revert_patches: bool = True) -> Iterator[object]:
    """Import the stand-in as ``aiter`` inside the scope; yields the ``aiter`` module.

    Raises ``RuntimeError`` if another ``aiter`` is already imported: the
    stand-in must not mix with a real AITER in one process.
    """
    present = _aiter_modules()
    if present:
        mod = sys.modules.get("aiter")
        if not getattr(mod, "IS_AITER_PATCHES_STAND_IN", False):
            raise RuntimeError(
                "use_stub_aiter(): a real 'aiter' is already imported "
                f"({getattr(mod, '__file__', '?')}); the stand-in cannot replace it in this process"
            )
    sys.path.insert(0, STUB_ROOT)
    importlib.invalidate_caches()
    try:
        import aiter  # noqa: F401  (the stand-in, first on sys.path)

        if not getattr(aiter, "IS_AITER_PATCHES_STAND_IN", False):  # pragma: no cover - defensive
            raise RuntimeError(f"use_stub_aiter(): imported {aiter.__file__}, not the stand-in")
        yield aiter
    finally:
        if revert_patches:
            from . import registry

            registry.revert()
        try:
            sys.path.remove(STUB_ROOT)
        except ValueError:
            pass
        for name in _aiter_modules():
            del sys.modules[name]
        importlib.invalidate_caches()
