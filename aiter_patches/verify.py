"""`aiter-patches verify`: apply the patches, then prove each applied one equals AITER on this machine.

Each patch declares a ``check(device)`` beside it (``Patch.check``: the function, or its
"module:function") that calls AITER's public entry point
with the patch and, inside :func:`suspended`, without it, on the same inputs,
and compares: bitwise where the patch claims it, within a stated bound where it
does not. Where no real AITER imports, the stand-in (``aiter_patches_standin``, imported here
only then) is used, and the table says so; which patches run and which modules are imported for
them comes from the registry.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

from . import registry
from .core.declarations import Check, CheckResult  # noqa: F401 (re-exported)
from .registry import suspended  # noqa: F401 (re-exported: tests and checks written before it moved)


def real_aiter_problem() -> str | None:
    """None when AMD's AITER imports here; otherwise why not (it is absent, broken, or PyPI's unrelated 'aiter')."""
    if "aiter" in sys.modules:
        mod = sys.modules["aiter"]
    else:
        try:
            mod = importlib.import_module("aiter")
        except Exception as exc:  # any import failure means: no usable AITER
            return f"import aiter failed: {type(exc).__name__}: {exc}"
    if _is_stand_in(mod):
        return None
    try:
        importlib.import_module("aiter.fused_moe")
    except Exception as exc:
        origin = getattr(mod, "__file__", "?")
        return f"'aiter' at {origin} is not AMD AITER or does not load aiter.fused_moe ({type(exc).__name__}: {exc})"
    return None


def default_device() -> "object":
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def use_triton_interpreter_without_gpu() -> bool:
    """With no GPU, run Triton kernels in its interpreter (only possible before triton is imported)."""
    import os

    import torch

    if torch.cuda.is_available() or "triton" in sys.modules:
        return os.environ.get("TRITON_INTERPRET") == "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return True


def run(device: str | None = None, names: Sequence[str] | None = None) -> tuple[list[dict], str]:
    """Returns (rows, the AITER used). A row: patch, state, check, result, detail.

    Every patch is applied; ``names`` (default: all) says whose checks run and get a row.
    """
    return with_aiter(device, lambda dev: _run_all(dev, names))


def with_aiter(device: str | None, body: Callable) -> tuple:
    """``(body(device), the AITER used)``: with AMD's AITER where it imports, else inside the stand-in."""
    import torch

    use_triton_interpreter_without_gpu()
    dev = torch.device(device) if device else default_device()
    problem = real_aiter_problem()
    if problem is None:
        return body(dev), f"installed AITER ({getattr(sys.modules['aiter'], '__file__', '?')})"
    import aiter_patches_standin  # only here: no real AITER imports

    if not _is_stand_in(sys.modules.get("aiter")):
        for name in aiter_patches_standin.aiter_modules():  # what a failed import of a real AITER left
            del sys.modules[name]

    with aiter_patches_standin.use():
        import_stand_in_targets()  # the registry says which modules the patches target
        rows = body(dev)
    return rows, f"the aiter_patches stand-in (no real AITER: {problem})"


def _is_stand_in(mod) -> bool:
    """Whether ``mod`` (an imported ``aiter``) is the stand-in: it says so itself."""
    return bool(getattr(mod, "IS_AITER_PATCHES_STAND_IN", False))


def import_stand_in_targets() -> list[str]:
    """With the stand-in imported as ``aiter``: import every module a registered patch targets that the
    stand-in has (read from its files); returns them in import order."""
    import aiter_patches_standin

    modules = sorted({m for p in registry.patches() for m in p.modules if aiter_patches_standin.has(m)})
    for m in modules:
        importlib.import_module(m)
    return modules


def _run_all(dev, names: Sequence[str] | None = None) -> list[dict]:
    registry.apply()
    rows: list[dict] = []
    for p in registry.patches():
        if names is not None and p.name not in names:
            continue
        rec = next(r for r in registry.status()["patches"] if r["name"] == p.name)
        row = {"patch": p.name, "state": rec["state"], "check": "-", "result": "-", "detail": rec["reason"]}
        if rec["state"] == registry.APPLIED:
            if p.check is None:
                row.update(result="FAIL", detail="no equivalence check declared")
            else:
                try:
                    res: CheckResult = resolve_check(p.check)(dev)
                    row.update(check=res.kind, result="ok" if res.ok else "FAIL", detail=res.detail)
                except Exception as exc:
                    row.update(result="FAIL", detail=f"check raised {type(exc).__name__}: {exc}")
        rows.append(row)
    return rows


def resolve_check(check: Check) -> Callable[[object], CheckResult]:
    """A patch's declared check as a callable: itself, or the function its "module:function" names."""
    if callable(check):
        return check
    mod_name, sep, fn_name = check.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"check {check!r}: declare a callable or 'module:function'")
    return getattr(importlib.import_module(mod_name), fn_name)
