"""Whether the layer that takes an ``out_zeroed=True`` promise launched without AITER's memset, in this call.

Why: the layers that make or forward the promise (``gemm_dispatch_out_zeroed``, and through it
``sglang_gemm_zero_pool``) count a fast hit only when ``gemm_out_zeroed`` really skipped the memset. That
layer hands a call to AITER, memset included, for many reasons of its own (it stood down, AITER's ``.co``
cannot be launched here, one split, a launch that raised, its self-check serving AITER's result), and it
is the only one that knows. It reports here after a launch without the memset; the forwarding layer
opens a scope around its call and reads the report. A context variable: one report per call, per thread,
so another thread's call (or a stand-down in between) cannot answer for this one. Nothing else of either
patch is shared.
"""

from __future__ import annotations

import contextvars

_scope: contextvars.ContextVar["list[bool] | None"] = contextvars.ContextVar("aiter_patches_memset_skipped",
                                                                            default=None)


def expect() -> tuple[list[bool], contextvars.Token]:
    """Open a scope for one call: ``cell[0]`` turns True if the memset is skipped inside it. Close it with
    :func:`close` (token)."""
    cell = [False]
    return cell, _scope.set(cell)


def close(token: contextvars.Token) -> None:
    _scope.reset(token)


def report() -> None:
    """The taking layer launched without the memset (a no-op outside any scope)."""
    cell = _scope.get()
    if cell is not None:
        cell[0] = True
