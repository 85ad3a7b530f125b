"""The built-in patches: every module of this package that defines ``PATCH``.

Why found, not listed: a new patch is its own module here and nothing else
(README "Adding a patch"); the registry, ``status()``, ``verify``, the drift
check, SIGNATURES.md and the tests take it from the registry. The order among
patches that wrap the same function is each ``Patch.order`` (lower is outer):
``moe_addend_fold`` (10) -> ``sort_extension`` (20) -> ``moe_sort_mx_quant`` (30) -> AITER; these
three share one wrapper per target, whose steps run in moe_pipeline.py's order.
``sglang_takeover`` (35) patches SGLang, not AITER, and is applied after ``moe_sort_mx_quant``;
``gemm_dispatch_out_zeroed`` (40) -> ``gemm_out_zeroed`` (50) -> AITER on the asm GEMM entry point.
The server integrations (``aiter_patches.integrations``, opt-in) are found the same way there.

Importing this package imports no AITER module: patch modules declare targets by
module path and import their kernels lazily, on the first fast-path call.
"""

import importlib
import pkgutil
import sys

from ..declarations import Patch


def _discover() -> list[Patch]:
    from .. import integrations

    found = []
    for package in (sys.modules[__name__], integrations):
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            patch = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "PATCH", None)
            if isinstance(patch, Patch):
                found.append(patch)
    return sorted(found, key=lambda p: (p.order, p.name))


BUILTIN_PATCHES = _discover()
