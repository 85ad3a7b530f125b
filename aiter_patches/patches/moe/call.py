"""The per-call plan of one ``fused_moe`` call, and the small helpers every MoE stage shares.

``fused_moe`` knows the activations and the shared-expert addend; the sort deep
inside it (``_moe_sorting_impl``) is where one launch can use them; the stage-1
quant helper later must find what the sort produced. The pipeline
(``moe_pipeline.py``) keeps these in one :class:`MoeCall`, the plan, held by a
``ContextVar`` for the duration of the outer call, so concurrent calls in other
threads or asyncio tasks never see each other's data, and nothing outlives the
call (reset in ``finally``). Which feature reads and writes which field of the
plan is declared by the features and checked by the tests (``moe_pipeline.run_steps_through``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ...aiter_contract import MX_GROUP

_CALL: ContextVar["MoeCall | None"] = ContextVar("aiter_patches_moe_call", default=None)

PENDING, FOLDED, ADD_AFTER = "pending", "folded", "add-after"
NOT_STAGE1 = "not the stage-1 call"  # a quant-helper call the hand-back was not made for: no fallback


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
    """The plan: what the stages of one ``fused_moe`` call hand each other (see moe_pipeline.py's table)."""

    hidden_states: Any
    quant_dtype: Any = None  # predicted stage-1 MX quant dtype, None when no MX quant is predicted
    addend: Any = None
    addend_state: str = PENDING
    moe_buf: Any = None  # the sort's moe_buf, once the addend was folded into it
    stage1_quant: StageOneQuant | None = None
    sort_reached: bool = False  # this call's sort went through the pipeline's _moe_sorting_impl
    scratch: list | None = None  # opened by the fused_moe wrapper: the sort outputs it leased (sort_scratch.py)
    own_sort: bool = False  # the sort running now is this call's own: its first, from AITER's fused_moe code
    addend_check: Any = None  # the addend fold's self-check plan, when this call's fold is checked against AITER


PLAN_FIELDS = frozenset(MoeCall.__dataclass_fields__)


def current() -> MoeCall | None:
    return _CALL.get()


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


_LIKE_ASSIGNED = tuple(a for a in functools.WRAPPER_ASSIGNMENTS if a != "__annotations__")


def like(wrapper: Callable, inner: Callable) -> Callable:
    """``functools.update_wrapper(wrapper, inner)`` less ``__wrapped__`` and less the ``__dict__`` merge.

    No ``__wrapped__``: the registry sets it to the layer the wrapper was built over
    (another patch's wrapper, possibly, not the function whose name is copied here), and
    the chain walk (status, revert, the lifecycle checks, ``inspect.signature``) follows
    it. No ``__dict__`` merge: ``inner`` may be another patch's wrapper, whose
    ``__aiter_patches__`` mark must not be copied. No ``__annotations__``: a wrapper
    taking ``*args, **kwargs`` does not have the original's parameters.
    """
    functools.update_wrapper(wrapper, inner, assigned=_LIKE_ASSIGNED, updated=())
    del wrapper.__wrapped__
    return wrapper


def quant_mismatch(q: StageOneQuant, bound: dict, kind: str) -> str | None:
    """Why a quant-helper call is not the stage-1 call ``q`` was made for, or None.

    The hand-back is only for that call: same activations (storage, shape, strides,
    dtype), the same ``sorted_ids``/``num_valid_ids``/``sorted_weights`` buffers, the
    same quant dtype and group size 32, used once. "not the stage-1 call" is the
    inter-stage quant or another layer: not a fallback.
    """
    x = bound.get("input")
    if x is None or not hasattr(x, "shape") or x.dim() != 2:
        return "input is not a 2-D tensor"
    if bound.get("sorted_ids") is not q.sorted_ids:
        return NOT_STAGE1
    if x.shape[0] != bound.get("token_num"):
        return NOT_STAGE1
    if bound.get("num_valid_ids") is not q.num_valid_ids:
        return "another num_valid_ids buffer"
    if bound.get("sorted_weights") is not q.sorted_weights:
        return "another sorted_weights buffer"
    if bound.get("group_size", MX_GROUP) != MX_GROUP:
        return f"group_size {bound.get('group_size')} (fast path: {MX_GROUP})"
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
