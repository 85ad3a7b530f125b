"""Disarming a reverted wrapper: its code swapped in place for a pass-through to what it wrapped.

Revert unbinds our wrappers everywhere it can see (module-level names). A
reference it cannot see (a third party's wrapper around ours, a dispatch table,
a captured local) would still run the patch: swapping the wrapper's code for a
generated pass-through makes those calls take the original's path too, at no
cost to calls made while the patch is applied.
"""

from __future__ import annotations

import types
from typing import Any

from . import state
from .state import Layer

_PASSTHROUGH_ARG = "__aiter_patches_call__"
_passthrough_codes: dict[int, types.CodeType] = {}


def _passthrough_code(nfree: int) -> types.CodeType:
    """Code that calls ``__aiter_patches_call__`` (a keyword default) with its arguments, for a function with ``nfree`` closure cells."""
    code = _passthrough_codes.get(nfree)
    if code is None:
        names = [f"_cell{i}" for i in range(nfree)]
        src = "def _outer():\n" + "".join(f"    {n} = None\n" for n in names)
        src += f"    def passthrough(*args, {_PASSTHROUGH_ARG}=None, **kwargs):\n"
        if names:  # never called: makes the cells free variables of passthrough, so the closure still fits
            src += f"        lambda: ({', '.join(names)},)\n"
        src += f"        return {_PASSTHROUGH_ARG}(*args, **kwargs)\n    return passthrough\n"
        ns: dict[str, Any] = {}
        exec(compile(src, "<aiter_patches passthrough>", "exec"), ns)
        code = _passthrough_codes[nfree] = ns["_outer"]().__code__
    return code


def disarm(layer: Layer) -> list[str]:
    """Make every wrapper built for a reverted layer pass its calls to what it wraps; returns the ones that could not be."""
    failed = []
    originals = {id(c.original) for c in state.chains.values()}
    for ref, over in layer.built:
        fn = ref()
        if fn is None or fn is over or id(fn) in originals or getattr(fn, "__aiter_patches__", None) is None:
            continue
        try:
            if type(fn) is not types.FunctionType:
                raise TypeError(f"a {type(fn).__name__}, not a function")
            code = _passthrough_code(len(fn.__closure__ or ()))
            # the defaults first: a call between the two assignments must find its keyword default (free-threaded builds)
            kwdefaults = fn.__kwdefaults__
            fn.__kwdefaults__ = {**(kwdefaults or {}), _PASSTHROUGH_ARG: over}
            try:
                fn.__code__ = code
            except BaseException:
                fn.__kwdefaults__ = kwdefaults
                raise
            fn.__aiter_patches_reverted__ = fn.__dict__.pop("__aiter_patches__", layer.patch.name)
        except Exception as exc:
            failed.append(f"{getattr(fn, '__qualname__', fn)!s}: {exc}")
    layer.built = []
    layer.fn = layer.over = None
    return failed
