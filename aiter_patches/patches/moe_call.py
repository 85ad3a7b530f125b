"""Per-call hand-off between the wrappers of one ``fused_moe`` call.

``fused_moe`` knows the activations and the shared-expert addend; the sort deep
inside it (``_moe_sorting_impl``) is where one launch can use them; the stage-1
quant helper later must find what the sort produced. These live in one
:class:`MoeCall` held by a ``ContextVar`` for the duration of the outer call, so
concurrent calls in other threads or asyncio tasks never see each other's data,
and nothing outlives the call (reset in ``finally``).
"""

from __future__ import annotations

import contextlib
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator

_CALL: ContextVar["MoeCall | None"] = ContextVar("aiter_patches_moe_call", default=None)

PENDING, FOLDED, ADD_AFTER = "pending", "folded", "add-after"


@dataclass(eq=False)
class StageOneQuant:
    """A stage-1 MX quant made at sort time, for exactly one later quant-helper call."""

    sorted_ids: Any
    num_valid_ids: Any
    sorted_weights: Any
    quant_dtype: Any
    data: Any
    scale: Any
    input_key: tuple | None  # tensor_key() of the activations it was made from; None: declared by an extension
    block_size: int | None = None
    consumed: bool = False
    counters: Any = None  # the producing patch's counters: a hand-back is its fast-path hit


@dataclass(eq=False)
class MoeCall:
    hidden_states: Any
    quant_dtype: Any = None  # predicted stage-1 MX quant dtype, None when no MX quant is predicted
    addend: Any = None
    addend_state: str = PENDING
    addend_offered: bool = False  # the addend layer lets the sort write the addend in its own launch
    addend_written_by_sort: bool = False
    moe_buf: Any = None
    stage1_quant: StageOneQuant | None = None
    sort_reached: bool = False  # some wrapper of _moe_sorting_impl saw this call's sort


def current() -> MoeCall | None:
    return _CALL.get()


def mark_sort_reached() -> MoeCall | None:
    """Called by every wrapper of ``_moe_sorting_impl``: this call's sort went through it."""
    call = _CALL.get()
    if call is not None:
        call.sort_reached = True
    return call


@contextlib.contextmanager
def scope(call: MoeCall) -> Iterator[MoeCall]:
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


def tensor_key(t: Any) -> tuple:
    """Identity of a tensor's view: same storage address, shape, strides, dtype, device."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def aiter_module(name: str = "aiter") -> Any:
    """An AITER module that is already imported (wrappers only run after AITER is)."""
    return sys.modules[name]


def enum_value(x: Any) -> int:
    """AITER passes its enums as members (fused_moe) or as ints (the custom op): compare by value."""
    return int(getattr(x, "value", x))


def joined_or_new(bound: dict) -> tuple[MoeCall, bool]:
    """The open :class:`MoeCall` of this same ``fused_moe`` call (an outer patch opened it), or a new one."""
    call = current()
    if call is not None and call.hidden_states is bound.get("hidden_states"):
        return call, False
    return MoeCall(hidden_states=bound.get("hidden_states")), True


def like(wrapper: Callable, inner: Callable) -> Callable:
    """Give a wrapper its original's name and doc (no ``__wrapped__``: the registry records the chain)."""
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:
            setattr(wrapper, attr, getattr(inner, attr))
        except (AttributeError, TypeError):
            pass
    return wrapper


def fused_moe_scope_wrapper(contribute: Callable[[MoeCall, dict, Any], None],
                            after: Callable[[MoeCall, Any], None] | None = None):
    """A wrapper factory for ``fused_moe`` that opens (or joins) the call's :class:`MoeCall`.

    ``contribute(call, arguments, site)`` adds this patch's part (e.g. a quant
    prediction); ``after(call, site)`` runs once ``fused_moe`` returned. Arguments the
    pin does not explain send the call inward untouched.
    """

    def factory(inner, site):
        binder = site.binder

        def fused_moe(*args, **kwargs):
            bound, problems = binder.bind(args, kwargs)
            if problems:
                site.counters.fallback(f"fused_moe: {problems[0]}")
                return inner(*args, **kwargs)
            call, new = joined_or_new(bound)
            contribute(call, bound, site)
            if not new:
                out = inner(*args, **kwargs)
            else:
                with scope(call):
                    out = inner(*args, **kwargs)
            if after is not None:
                after(call, site)
            return out

        return like(fused_moe, inner)

    return factory


def quant_helper_wrapper(kind: str):
    """Wrapper factory for ``fused_dynamic_mx{fp4,fp8}_quant_moe_sort``: hand back the sort's quant.

    Only for the stage-1 call it was made for: same activations (storage, shape,
    strides, dtype), the same ``sorted_ids``/``num_valid_ids``/``sorted_weights``
    buffers, the same quant dtype and group size 32, used once. Every other call
    (the inter-stage quant, another layer) goes to AITER untouched.
    """

    def factory(inner, site):
        binder = site.binder

        def quant_moe_sort(*args, **kwargs):
            call = current()
            q = call.stage1_quant if call is not None else None
            if q is None or q.consumed:
                return inner(*args, **kwargs)
            bound, problems = binder.bind(args, kwargs)
            reason = problems[0] if problems else _mismatch(q, bound, kind)
            if reason is None:
                q.consumed = True
                (q.counters or site.counters).hit()
                return q.data, q.scale
            if reason != "not the stage-1 call":
                site.counters.fallback(f"stage-1 quant not taken from the sort: {reason}")
            return inner(*args, **kwargs)

        return like(quant_moe_sort, inner)

    return factory


def stage1_quant_targets(producer: str) -> tuple:
    """The two MX quant-sort helpers ``fused_moe_2stages`` looks up in ``aiter.fused_moe``'s globals,
    as targets that hand back a stage-1 quant made by ``producer`` (the sort, or an extension)."""
    from ..registry import Target
    from . import pins

    return tuple(
        Target("aiter.fused_moe", f"fused_dynamic_mx{kind}_quant_moe_sort", pin, quant_helper_wrapper(kind),
               f"Looked up in aiter.fused_moe's globals by fused_moe_2stages: returns {producer}'s "
               f"MX{kind.upper()} stage-1 quant.")
        for kind, pin in (("fp4", pins.MXFP4_QUANT_MOE_SORT), ("fp8", pins.MXFP8_QUANT_MOE_SORT))
    )


def _mismatch(q: StageOneQuant, bound: dict, kind: str) -> str | None:
    x = bound.get("input")
    if x is None or not hasattr(x, "shape") or x.dim() != 2:
        return "input is not a 2-D tensor"
    if bound.get("sorted_ids") is not q.sorted_ids:
        return "not the stage-1 call"
    if x.shape[0] != bound.get("token_num"):
        return "not the stage-1 call"
    if bound.get("num_valid_ids") is not q.num_valid_ids:
        return "another num_valid_ids buffer"
    if bound.get("sorted_weights") is not q.sorted_weights:
        return "another sorted_weights buffer"
    if bound.get("group_size", 32) != 32:
        return f"group_size {bound.get('group_size')} (fast path: 32)"
    if q.block_size is not None and bound.get("block_size") != q.block_size:
        return f"block_size {bound.get('block_size')} != the sort's {q.block_size}"
    import torch

    want_fp4 = kind == "fp4"
    is_fp4 = q.quant_dtype == torch.float4_e2m1fn_x2
    if want_fp4 != is_fp4:
        return f"the sort quantized to {q.quant_dtype}, this helper makes {'fp4x2' if want_fp4 else 'fp8'}"
    if not want_fp4:
        fp8 = getattr(getattr(aiter_module(), "dtypes", None), "fp8", None)
        if fp8 is not None and q.quant_dtype != fp8:
            return f"the sort quantized to {q.quant_dtype}, AITER's fp8 here is {fp8}"
    if q.input_key is not None and tensor_key(x) != q.input_key:
        return "other activations than the sort quantized"
    return None
