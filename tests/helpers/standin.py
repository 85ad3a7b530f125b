"""The stand-in AITER (``aiter_patches_standin``) as the tests use it.

``use_stub_aiter()`` puts the stand-in's ``aiter`` first on ``sys.path`` for a scope and takes it
(and every ``aiter`` module imported inside, after reverting the patches) off again, so the next
``import aiter`` finds whatever is really installed; ``import_stand_in_targets()`` imports, inside
that scope, every module a registered patch targets that the stand-in has.
"""

from __future__ import annotations

import importlib

import aiter_patches_standin
from aiter_patches_standin import ROOT as STUB_ROOT
from aiter_patches_standin import has as stand_in_has
from aiter_patches_standin import use as use_stub_aiter

__all__ = ["STUB_ROOT", "gemm_default_backend", "import_stand_in_targets", "is_stand_in", "stand_in_has", "use_stub_aiter"]

is_stand_in = aiter_patches_standin.is_stand_in


def import_stand_in_targets() -> list[str]:
    """Inside ``use_stub_aiter()``: import every module a registered patch targets that the stand-in has.

    The registry says which modules (each patch's targets); returns them in import order.
    """
    from aiter_patches import verify

    return verify.import_stand_in_targets()


def gemm_default_backend(monkeypatch) -> None:
    """For this test: the imported stand-in's ``gemm_out_zeroed`` calls are served by the patch's default
    backend (AITER's ``.co`` through HIP), as on AMD's AITER, instead of the Triton backend the stand-in
    registers at its import. Undone with the test's other monkeypatches."""
    import sys

    from aiter_patches.patches import gemm_out_zeroed

    monkeypatch.delitem(gemm_out_zeroed._BACKENDS, id(sys.modules["aiter"]))
