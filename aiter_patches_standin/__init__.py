"""The stand-in AITER: AITER's API surface for machines without ROCm, and its loader.

``root/aiter`` is a top-level package named ``aiter`` with the functions the patches
touch, at AITER's module paths, with AITER v0.1.20's signatures and call structure
(module-global look-ups, package re-export aliases), and torch implementations of the
HIP kernels underneath. It lets the patches, their equivalence checks and
``aiter-patches verify`` run on CPU and on NVIDIA GPUs.

No module of ``aiter_patches`` imports this package at module level: ``aiter_patches.verify``
loads it, through :func:`use`, only where no real AITER imports; the tests load it the same way.
It is never importable as ``aiter`` by accident: only :func:`use` puts :data:`ROOT` on
``sys.path``, and takes it (and every ``aiter`` module it loaded) off again.

What the stand-in differs in, it says through the seams the package offers any AITER build, at its
import (``root/aiter/ops/gemm_op_a8w8.py``): ``gemm_backend`` registers its no-memset split-K launch
(the Triton kernel of ``blockscale_gemm_splitk``, which serves only the stand-in) with the
``gemm_out_zeroed`` patch, and ``check_inputs`` tells verify's checks what it runs here.
This module imports neither torch nor ``aiter_patches`` until :func:`use` is called.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Iterator

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "root")
"""The folder that holds the stand-in's ``aiter`` package (what :func:`use` puts on ``sys.path``)."""


def has(module: str) -> bool:
    """Whether the stand-in has ``module`` (read from its files: nothing is imported)."""
    path = os.path.join(ROOT, *module.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def is_stand_in(module) -> bool:
    """Whether an imported ``aiter`` module is this stand-in."""
    return bool(getattr(module, "IS_AITER_PATCHES_STAND_IN", False))


def aiter_modules() -> list[str]:
    """The names of every imported ``aiter`` module, from a snapshot of ``sys.modules`` (other threads import)."""
    return [m for m in list(sys.modules) if m == "aiter" or m.startswith("aiter.")]


@contextlib.contextmanager
def use(*, revert_patches: bool = True) -> Iterator[object]:
    """Import the stand-in as ``aiter`` inside the scope; yields the ``aiter`` module.

    On exit it takes :data:`ROOT` off ``sys.path`` and forgets every ``aiter`` module imported
    inside the scope (reverting every patch applied to them first, unless ``revert_patches`` is
    False), so the next ``import aiter`` finds whatever is really installed. Raises
    ``RuntimeError`` if another ``aiter`` is already imported: the stand-in must not mix with a
    real AITER in one process.
    """
    present = aiter_modules()
    if present:
        mod = sys.modules.get("aiter")
        if not is_stand_in(mod):
            raise RuntimeError(
                "aiter_patches_standin.use(): a real 'aiter' is already imported "
                f"({getattr(mod, '__file__', '?')}); the stand-in cannot replace it in this process"
            )
    sys.path.insert(0, ROOT)
    importlib.invalidate_caches()
    try:
        import aiter  # noqa: F401  (the stand-in, first on sys.path)

        if not is_stand_in(aiter):  # pragma: no cover - defensive
            raise RuntimeError(f"aiter_patches_standin.use(): imported {aiter.__file__}, not the stand-in")
        yield aiter
    finally:
        if revert_patches:
            from aiter_patches import registry

            registry.revert()
        try:
            sys.path.remove(ROOT)
        except ValueError:
            pass
        for name in aiter_modules():
            del sys.modules[name]
        importlib.invalidate_caches()
