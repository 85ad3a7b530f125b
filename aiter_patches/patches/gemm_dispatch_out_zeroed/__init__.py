"""Patch: ``gemm_a8w8_blockscale_bpreshuffle(..., out=buf, out_zeroed=True)``: the servers' entry point takes the promise.

SGLang and vLLM never call the asm kernel's entry point; they call AITER's tuned
dispatcher, which picks a kernel per shape from its tuned config and, for
``libtype == "asm"``, calls ``gemm_a8w8_blockscale_bpreshuffle_asm(XQ, WQ, Y, ...)``
with ``Y`` = the caller's ``out``. So ``gemm_out_zeroed``'s ``out_zeroed=True`` is
unreachable from a server unless the dispatcher carries it. This patch adds
the keyword to the dispatcher and forwards it to the asm entry point only:

- the dispatcher's wrapper records the promise (the ``out`` tensor, by identity)
  in a context variable for the one call;
- a layer over the asm entry point (outside ``gemm_out_zeroed``'s) passes
  ``out_zeroed=True`` on when the tensor it is given is exactly that ``out``, once;
  ``gemm_out_zeroed`` then skips the memset where the split count is above one and
  runs the original call at one split (its own rule, counted there), and says per call
  whether it skipped it (``patches/memset_skipped.py``): only then is this patch's hit counted;
- every other kernel the config picks (CK, CKTile, Triton, opus, FlyDSL) writes
  every element and never sees the promise: it is ignored, counted.

Without ``out`` there is nothing zeroed to promise (the dispatcher allocates
``torch.empty``): the keyword is ignored, counted. The patch needs
``gemm_out_zeroed`` (``Patch.needs``): the layer cannot forward the keyword to
AITER's own function, so it is applied only while ``gemm_out_zeroed`` is, and
forwards only where the core says that patch's layer lies directly under its
own (``site.below``). ``out_zeroed=False`` (the default) is exactly the
original call. A layer over the dispatcher that makes the promise itself
(``sglang_gemm_zero_pool``) learns whether it reached the asm kernel through
:func:`forwarding`, a per-call hand-off.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

from ...core.declarations import Patch, SourcePin, Target
from ...signatures import Pin
from .. import memset_skipped, pins, relied_on
from ..moe import call as moe_call

NAME = "gemm_dispatch_out_zeroed"
PRODUCER = "gemm_out_zeroed"
MODULE = "aiter.ops.gemm_op_a8w8"
DISPATCHER = "gemm_a8w8_blockscale_bpreshuffle"
ASM = "gemm_a8w8_blockscale_bpreshuffle_asm"

DISPATCHER_PINS = (
    Pin("e4048607a5", "(XQ, WQ, x_scale, w_scale, dtype=dtypes.bf16, out=None)",
        "ROCm/aiter e4048607a5 (v0.1.20-46) aiter/ops/gemm_op_a8w8.py:909 (@torch_compile_guard: "
        "read through torch.ops.aiter.gemm_a8w8_blockscale_bpreshuffle's schema at run time)"),
)
DISPATCHER_SOURCE = SourcePin(
    MODULE, DISPATCHER,
    "bbcacc485b2561f9256045268d400bfc58718460fa3ecfa5153e7045cd5585e2",
    "Y is the caller's out (asserted shape/dtype/device) and reaches the asm branch untouched: "
    "gemm_a8w8_blockscale_bpreshuffle_asm(XQ, WQ, Y, x_scale, w_scale, splitK=config['splitK'], ...), "
    "looked up in the module's globals; every other branch writes every element of Y",
    "ROCm/aiter e4048607a5 aiter/ops/gemm_op_a8w8.py:909",
)

NOT_ASM = "the tuned config chose another kernel than asm (it writes every element): out_zeroed ignored"
NO_OUT = "out_zeroed without out=: the dispatcher allocates its own output"
PRODUCER_DOWN = (f"passed on to {PRODUCER}, which handed it to AITER (its reason counted there: stood down, "
                 "no launcher, one split, ...): AITER served the call, with its memset")

_promise: contextvars.ContextVar["_Promise | None"] = contextvars.ContextVar("aiter_patches_gemm_out_zeroed",
                                                                             default=None)


@dataclass
class _Promise:
    out: object
    forwarded: bool = False


@dataclass
class _Outcome:
    forwarded: bool = False


_outcome: contextvars.ContextVar["_Outcome | None"] = contextvars.ContextVar("aiter_patches_gemm_promise_outcome",
                                                                            default=None)


def forwarding(call, *args, **kwargs) -> tuple[Any, bool]:
    """``call(*args, **kwargs)`` (the dispatcher, with ``out_zeroed=True``) and whether this patch's layer
    passed the promise on to the asm kernel during it and ``gemm_out_zeroed`` launched without the memset
    (``memset_skipped``): for a layer over the dispatcher that makes the promise."""
    outcome = _Outcome()
    token = _outcome.set(outcome)
    try:
        result = call(*args, **kwargs)
    finally:
        _outcome.reset(token)
    return result, outcome.forwarded


def _dispatcher_wrapper(inner, site):
    import torch

    binder = site.binder
    counters = site.counters

    def gemm_a8w8_blockscale_bpreshuffle(*args, out_zeroed=False, **kwargs):
        if not out_zeroed or torch.compiler.is_compiling():  # traced: the memset stays (no promise through Dynamo)
            return inner(*args, **kwargs)
        bound, problems = binder.bind(args, kwargs)
        if problems:  # AITER raises its own TypeError for the same call
            counters.fallback(problems[0])
            return inner(*args, **kwargs)
        if bound.get("out") is None:
            counters.fallback(NO_OUT)
            return inner(*args, **kwargs)
        promise = _Promise(bound["out"])
        token = _promise.set(promise)
        skipped, scope = memset_skipped.expect()
        try:
            result = inner(*args, **kwargs)
        finally:
            memset_skipped.close(scope)
            _promise.reset(token)
        taken = promise.forwarded and skipped[0]  # the layer under ours says whether its launch skipped the memset
        if taken:
            counters.hit()
        else:
            counters.fallback(PRODUCER_DOWN if promise.forwarded else NOT_ASM)
        outcome = _outcome.get()
        if outcome is not None:
            outcome.forwarded = taken
        return result

    return moe_call.like(gemm_a8w8_blockscale_bpreshuffle, inner)


def _asm_wrapper(inner, site):
    import torch

    binder = site.binder
    takes_keyword = site.below == PRODUCER  # gemm_out_zeroed's layer under ours

    def gemm_a8w8_blockscale_bpreshuffle_asm(*args, **kwargs):
        if torch.compiler.is_compiling():  # Dynamo cannot trace a context variable; nothing to forward there
            return inner(*args, **kwargs)
        promise = _promise.get()
        if promise is None or promise.forwarded or not takes_keyword or "out_zeroed" in kwargs:
            return inner(*args, **kwargs)
        bound, problems = binder.bind(args, kwargs)
        if problems or bound.get("out") is not promise.out:
            return inner(*args, **kwargs)
        promise.forwarded = True
        return inner(*args, out_zeroed=True, **kwargs)

    return moe_call.like(gemm_a8w8_blockscale_bpreshuffle_asm, inner)


def check(device):
    """``aiter-patches verify``: the dispatcher with a zeroed ``out`` and the promise against the unpatched dispatcher.

    Where the AITER under test provides a way, the check's shape is routed to asm with two
    splits (so the promise is forwarded: bitwise where its splits add in a fixed order).
    Otherwise the installed tuned config decides: bitwise where the promise is ignored; where
    asm took it, AITER's splits add atomically, so within 1e-2 relative (2-norm) of the
    unpatched call (``checks.split_k_verdict``).
    """
    import sys

    import torch

    from ..checks import split_k_gemm_inputs, split_k_routed, split_k_verdict
    from ...registry import suspended
    from ... import registry

    mod = sys.modules[MODULE]
    A, Bs, a_scale, b_scale = split_k_gemm_inputs(device, seed=11)
    with split_k_routed(mod):
        before = registry.stats()[NAME]["fast"]
        out_p = torch.zeros(A.shape[0], Bs.shape[0], dtype=torch.bfloat16, device=device)
        getattr(mod, DISPATCHER)(A, Bs, a_scale, b_scale, torch.bfloat16, out=out_p, out_zeroed=True)
        forwarded = registry.stats()[NAME]["fast"] > before
        with suspended():
            out_o = getattr(mod, DISPATCHER)(A, Bs, a_scale, b_scale, torch.bfloat16)
    return split_k_verdict(
        out_p, out_o, taken=forwarded,
        missing=f"the promise was not forwarded ({registry.stats()[NAME]['fallback']})",
        taken_detail="asm split 2 without memset equals the dispatcher's memset + GEMM",
        untaken_detail="the tuned config did not choose asm here: the promise was ignored, AITER's result",
        bound_detail="asm took the promise")


PATCH = Patch(
    name=NAME,
    summary="gemm_a8w8_blockscale_bpreshuffle(..., out=buf, out_zeroed=True): the dispatcher forwards the promise "
            "to the asm kernel (split-K without memset), ignores it for every other kernel",
    targets=(
        Target(MODULE, DISPATCHER, DISPATCHER_PINS, _dispatcher_wrapper,
               "Takes the extra keyword out_zeroed (default False: the original call); with out= given and "
               "gemm_out_zeroed applied, the promise holds for that out tensor during the call."),
        Target(MODULE, ASM, pins.GEMM_A8W8_BLOCKSCALE_BPRESHUFFLE_ASM, _asm_wrapper,
               "Outside gemm_out_zeroed's layer: passes out_zeroed=True on for exactly the promised out tensor, "
               "once; any other call unchanged."),
    ),
    kernel_module=None,
    relies_on=(DISPATCHER_SOURCE, *relied_on.GEMM_OUT_ZEROED),
    order=40,
    needs=(PRODUCER,),
    check="aiter_patches.patches.gemm_dispatch_out_zeroed:check",
)
