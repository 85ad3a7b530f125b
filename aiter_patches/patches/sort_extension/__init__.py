"""Patch: the ``SortExtension`` hook at AITER's MoE sort boundary.

Models with their own routing kernels need a way into the sort that AITER runs
deep inside ``fused_moe``, without a patch per model. An extension scoped with
``with sort_extension(ext):`` is offered every ``_moe_sorting_impl`` call in the
current thread or asyncio task; the innermost scope is asked first, then the
outer ones, then the one-launch sort, then AITER. Nothing here knows any model.
"""

from __future__ import annotations

import ast
import contextlib
import logging
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from ... import registry
from ...aiter_contract import mx_scale_shape, sort_buffer_sizes
from ...core.declarations import CheckResult, Patch
from .. import relied_on
from ..moe import pipeline as moe_pipeline
from ..moe.call import StageOneQuant

# The types an extension implements live with the extensions (no circle between them and this patch);
# re-exported here, where `aiter_patches.patches.sort_extension.SortExtension` has always been found.
from ...extensions.api import SortCall, SortExtension, SortExtensionError  # noqa: F401

log = logging.getLogger("aiter_patches")

NAME = "sort_extension"

class _Scope:
    """One ``sort_extension(...)`` scope. The context variable holds these, not the extensions: a
    scope can be exited from another context (a generator holding it, closed by another thread or
    ``Context.run``), where the variable's value cannot be reset; the flag still deactivates it in
    every context that holds it, and the extension is dropped so a stale copy keeps nothing alive."""

    __slots__ = ("ext",)

    def __init__(self, ext: "SortExtension"):
        self.ext: SortExtension | None = ext


_ACTIVE: ContextVar[tuple[_Scope, ...]] = ContextVar("aiter_patches_sort_extensions", default=())


@contextlib.contextmanager
def sort_extension(ext: SortExtension) -> Iterator[SortExtension]:
    """Make ``ext`` the innermost active extension for the current thread / asyncio task."""
    if not isinstance(ext, SortExtension):
        raise TypeError(f"sort_extension() takes a SortExtension, not {type(ext).__name__}")
    scope = _Scope(ext)
    _ACTIVE.set(_open_scopes() + (scope,))
    try:
        yield ext
    except BaseException:
        _exit(scope)
        _close(ext, unwinding=True)
        raise
    _exit(scope)
    _close(ext, unwinding=False)


def _open_scopes() -> tuple[_Scope, ...]:
    return tuple(s for s in _ACTIVE.get() if s.ext is not None)


def _exit(scope: _Scope) -> None:
    """Deactivate ``scope`` everywhere; remove it from this context's stack if it is there. No
    ``ContextVar.reset``: its token fails in another context, and out of order it would also drop
    scopes entered after this one."""
    scope.ext = None
    current = _ACTIVE.get()
    if any(s is scope for s in current):
        _ACTIVE.set(tuple(s for s in current if s is not scope))


def _close(ext: SortExtension, unwinding: bool) -> None:
    """``ext.close()``; its error is logged once and counted, and re-raised in strict mode unless
    the scope is already unwinding with another exception (which must not be masked)."""
    try:
        ext.close()
    except Exception as exc:
        try:
            registry.counters(NAME).failed(exc, f"SortExtension '{ext.name}'.close")
        except Exception:
            if not unwinding:
                raise


def active() -> tuple[SortExtension, ...]:
    """Active extensions, outermost first. Each scope's ``ext`` is read once: another thread may
    exit the scope (setting it to None) between two reads."""
    scopes = _ACTIVE.get()
    if not scopes:
        return ()
    return tuple(e for s in scopes if (e := s.ext) is not None)


def expected_outputs(arguments: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """What AITER's ``_moe_sorting_impl`` allocates for these arguments: name -> (shape, dtype)."""
    import torch

    topk_ids = arguments["topk_ids"]
    M, topk = topk_ids.shape
    E, block = int(arguments["num_experts"]), int(arguments["block_size"])
    padded, blocks = sort_buffer_sizes(topk_ids.numel(), topk, E, block)
    zeroed = arguments.get("accumulate", True) or arguments.get("expert_mask") is not None
    buf_shape = (M, int(arguments["model_dim"])) if zeroed else (0, 0)
    return {
        "sorted_ids": ((padded,), torch.int32),
        "sorted_weights": ((padded,), torch.float32),
        "sorted_expert_ids": ((blocks,), torch.int32),
        "num_valid_ids": ((2,), torch.int32),
        "moe_buf": (buf_shape, arguments["moebuf_dtype"]),
    }


def validate_outputs(ext: SortExtension, arguments: Mapping[str, Any], out: Any) -> None:
    """Cheap checks (shapes, dtypes, devices; no device reads) that raise :class:`SortExtensionError`."""
    import torch

    if not isinstance(out, (tuple, list)) or len(out) not in (5, 6):
        raise SortExtensionError(f"SortExtension '{ext.name}' must return None or 5 or 6 items, got {type(out).__name__}"
                                 + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
    device = arguments["topk_ids"].device
    for (name, (shape, dtype)), t in zip(expected_outputs(arguments).items(), out[:5]):
        if not isinstance(t, torch.Tensor):
            raise SortExtensionError(f"SortExtension '{ext.name}': {name} is {type(t).__name__}, not a tensor")
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
            raise SortExtensionError(
                f"SortExtension '{ext.name}': {name} is {list(t.shape)} {t.dtype} on {t.device}; "
                f"AITER allocates {list(shape)} {dtype} on {device}"
            )
    if len(out) == 6:
        _validate_quant(ext, arguments, out[0], out[5])


def _validate_quant(ext: SortExtension, arguments: Mapping[str, Any], sorted_ids, quant) -> None:
    import torch

    if not isinstance(quant, (tuple, list)) or len(quant) != 2:
        raise SortExtensionError(f"SortExtension '{ext.name}': the sixth item must be (data, scale)")
    data, scale = quant
    for name, t in (("quant data", data), ("quant scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise SortExtensionError(f"SortExtension '{ext.name}': {name} is {type(t).__name__}, not a tensor")
        if t.device != sorted_ids.device:
            raise SortExtensionError(f"SortExtension '{ext.name}': {name} is on {t.device}, the sort on {sorted_ids.device}")
    M, model_dim = arguments["topk_ids"].shape[0], int(arguments["model_dim"])
    fp4 = data.dtype == torch.float4_e2m1fn_x2
    want_data = (M, model_dim // 2) if fp4 else (M, model_dim)
    if tuple(data.shape) != want_data or data.dtype not in (
        torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.float8_e4m3fnuz
    ):
        raise SortExtensionError(
            f"SortExtension '{ext.name}': quant data is {list(data.shape)} {data.dtype}; "
            f"stage 1 expects {list(want_data)} fp4x2 or fp8"
        )
    want_scale = mx_scale_shape(sorted_ids.shape[0], model_dim)
    if tuple(scale.shape) != want_scale or scale.dtype != torch.float8_e8m0fnu:
        raise SortExtensionError(
            f"SortExtension '{ext.name}': quant scale is {list(scale.shape)} {scale.dtype}; "
            f"stage 1 expects {list(want_scale)} float8_e8m0fnu"
        )


def pin_defaults(site) -> dict[str, Any]:
    """The matched pin's literal defaults (``False``, ``None``, numbers): what AITER fills in when not passed."""
    defaults = {}
    for p in site.pin.signature.params:
        if p.default is None:
            continue
        try:
            defaults[p.name] = ast.literal_eval(p.default)
        except (ValueError, SyntaxError):
            pass
    return defaults


def work_after_sort(extensions: tuple | None = None) -> bool:
    """Whether one of ``extensions`` (default: the active ones) runs work right after the sort
    (which may produce what the sort reads)."""
    return any(type(e).after_sort is not SortExtension.after_sort
               for e in (active() if extensions is None else extensions))


_DEFAULTS: dict[int, tuple[Any, dict]] = {}  # id(pin) -> (pin, its literal defaults)


def _defaults_of(site) -> dict[str, Any]:
    got = _DEFAULTS.get(id(site.pin))
    if got is None or got[0] is not site.pin:
        got = _DEFAULTS[id(site.pin)] = (site.pin, pin_defaults(site))
    return got[1]


class SortExtensionHook(moe_pipeline.Feature):
    """The pipeline steps of this patch (moe_pipeline.py's table: _moe_sorting_impl 1, 3 and 5)."""

    name = NAME
    reads = frozenset({"sort.extensions", "sort.sort_call", "sort.outputs"})
    writes = frozenset({"sort.extensions", "sort.sort_call", "sort.outputs", "call.stage1_quant"})

    def find_extensions(self, site, call, step) -> None:
        stack = active()
        if not stack:
            return
        bound, problems = step.bind()
        if problems:
            site.counters.fallback(problems[0])
            return
        step.extensions = stack
        step.sort_call = SortCall(MappingProxyType({**_defaults_of(site), **bound}))

    def offer_sort(self, site, call, step) -> None:
        if not step.extensions or step.outputs is not None:
            return
        bound, _ = step.bind()
        if bound.get("return_local_topk_ids") or bound.get("output_aux"):
            site.counters.fallback("return_local_topk_ids/output_aux: extensions are not offered calls with extra outputs")
            return
        out = _ask(step.extensions, step.sort_call, site.counters, call)
        if out is not None:
            step.outputs = out

    def after_sort(self, site, call, step) -> None:
        for ext in reversed(step.extensions):
            try:
                ext.after_sort(step.sort_call, step.outputs)
            except Exception as exc:
                site.counters.failed(exc, f"SortExtension '{ext.name}'.after_sort")


FEATURE = moe_pipeline.feature(SortExtensionHook())


def _ask(stack, call: SortCall, counters, plan):
    for ext in reversed(stack):
        try:
            out = ext.sort(call)
        except Exception as exc:  # counted and logged once; the next in the chain is asked
            counters.failed(exc, f"SortExtension '{ext.name}'.sort")
            continue
        if out is None:
            continue
        validate_outputs(ext, call.arguments, out)
        counters.hit()
        if len(out) == 6:
            _hand_quant_to_stage1(ext, out, counters, plan)
        return tuple(out[:5])
    return None


def _hand_quant_to_stage1(ext: SortExtension, out, counters, plan) -> None:
    if plan is None:
        log.debug("aiter_patches: SortExtension '%s' returned a stage-1 quant outside fused_moe; unused", ext.name)
        return
    data, scale = out[5]
    plan.stage1_quant = StageOneQuant(
        sorted_ids=out[0], num_valid_ids=out[3], sorted_weights=out[1], quant_dtype=data.dtype,
        data=data, scale=scale, input_key=None, counters=counters,
    )



def check(device):
    """`aiter-patches verify`: an active extension's outputs are the ones returned; with none active the sort is AITER's."""
    import torch

    from .. import checks as kit
    from ...extensions import PrecomputedSort

    _, fm = kit.aiter_modules()
    M, E, topk, dim, block = 9, 16, 4, 128, 32
    ids, w = kit.routing(M, E, topk, device)
    with registry.suspended():
        original = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, block)
    ext = PrecomputedSort(ids, original)
    with sort_extension(ext):
        taken = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, block)
    problems = []
    if ext.used != 1 or any(a is not b for a, b in zip(taken, original)):
        problems.append("the extension's outputs were not the ones returned")
    plain = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, block)
    nv = int(original[3][0])
    if not (torch.equal(plain[0][:nv], original[0][:nv]) and torch.equal(plain[3], original[3])):
        problems.append("with no extension active the sort differs from AITER's")
    ok = not problems
    return CheckResult("bitwise", ok, "extension taken over; no extension: AITER's result" if ok else "; ".join(problems))


PATCH = Patch(
    name=NAME,
    summary="SortExtension hook: scoped, model-agnostic extensions offered each MoE sort call",
    targets=(
        moe_pipeline.target(moe_pipeline.FUSED_MOE, NAME,
                            "Opens the per-call hand-off an extension's stage-1 quant travels through."),
        moe_pipeline.target(moe_pipeline.SORT, NAME, "Offers the call to the active extensions, innermost first."),
        *moe_pipeline.stage1_quant_targets(NAME, "an extension"),
    ),
    kernel_module=None,
    relies_on=relied_on.SORT_EXTENSION,
    order=20,
    check=check,
)
