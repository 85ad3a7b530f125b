"""Patch: AITER's MoE sort, the ``moe_buf`` zero-fill and the stage-1 MX quant in one launch.

At decode sizes AITER spends more time launching than working: the opus sort
(1-4 kernels), then the stage-1 MXFP4/MXFP8 quant + scale sort (1-2 kernels).
``fused_moe``'s wrapper predicts from its arguments whether stage 1 will quantize
the activations per 1x32; the sort wrapper then runs one Triton kernel that
sorts, zero-fills and quantizes, and the quant helper hands the result back for
exactly the stage-1 call it was made for. A wrong prediction costs time, never
bits: an unused quant is dropped and AITER quantizes as usual.
"""

from __future__ import annotations

import os

from .. import runtime
from ..registry import Patch, Target
from . import moe_call, pins, relied_on
from .moe_call import StageOneQuant, enum_value, fused_moe_scope_wrapper, stage1_quant_targets, tensor_key

NAME = "moe_sort_mx_quant"
KERNEL_MODULE = "aiter_patches.kernels.moe_sort_mx_quant"

_PER_1X32 = 3  # QuantType.per_1x32
_SWIGLU, _SITUV2 = 2, 3  # ActivationType


_KERNEL = []  # the kernel module, imported at the first call (an import statement per call costs ~1 µs)


def _kernel():
    if not _KERNEL:
        from ..kernels import moe_sort_mx_quant

        _KERNEL.append(moe_sort_mx_quant)
    return _KERNEL[0]


def predict_stage1_quant(bound: dict):
    """The MX dtype AITER's ``fused_moe_2stages`` will quantize the stage-1 activations to, or None.

    Mirrors ``_fused_moe_impl``'s ``q_dtype_a`` rule and ``fused_moe_2stages``'
    branch choice for ``QuantType.per_1x32`` (AITER fused_moe.py:755-800 and
    3030-3100 at e4048607a5), for the cases the fast path covers.
    """
    import torch

    if enum_value(bound.get("quant_type", 0)) != _PER_1X32:
        return None
    if os.environ.get("AITER_MOE_A8W4_BYPASS_QUANT", "0") == "1":
        return None
    hidden, w1 = bound.get("hidden_states"), bound.get("w1")
    if hidden is None or w1 is None or hidden.dtype not in (torch.bfloat16, torch.float16):
        return None
    if bound.get("a1_scale") is not None:
        return None
    out_dtype = bound.get("dtype") or hidden.dtype
    if out_dtype not in (torch.bfloat16, torch.float16):
        return None
    dtypes = moe_call.aiter_module().dtypes
    if w1.dtype == dtypes.fp8:
        return dtypes.fp8
    if w1.dtype != dtypes.fp4x2:
        return None
    if enum_value(bound.get("activation", 0)) in (_SWIGLU, _SITUV2):
        return None
    gate = bound.get("gate_mode", "separated")
    if getattr(gate, "value", gate) != "separated":
        return None
    return dtypes.fp4x2


def _contribute(call, bound, site) -> None:
    if call.quant_dtype is None:
        call.quant_dtype = predict_stage1_quant(bound)


def _count_unreached_sort(call, site) -> None:
    if not call.sort_reached:
        site.counters.fallback("the sort did not run through _moe_sorting_impl (flat or FlyDSL sort)")


def _sort_wrapper(inner, site):
    binder = site.binder
    counters = site.counters

    def _moe_sorting_impl(*args, **kwargs):
        moe_call.mark_sort_reached()
        bound, problems = binder.bind(args, kwargs)
        if problems:
            counters.fallback(problems[0])
            return inner(*args, **kwargs)
        reason = python_level_reason(bound) or runtime.triton_backend_reason(bound["topk_ids"].device)
        if reason is not None:
            counters.fallback(reason)
            return inner(*args, **kwargs)
        call = moe_call.current()
        kernel = _kernel()
        request = _request(bound, call)
        if request["quant_input"] is not None and request["quant_input"].shape[0] == 0:
            # AITER's quant launcher divides by token_num: its outcome, not an empty result
            counters.fallback("stage-1 quant not fused: 0 tokens (AITER's quant decides the outcome)")
            request.update(quant_input=None, quant_dtype=None)
        reason = kernel.unsupported_reason(**request)
        if reason is not None and request["quant_input"] is not None:
            counters.fallback(f"stage-1 quant not fused: {reason}")
            request.update(quant_input=None, quant_dtype=None)
            reason = kernel.unsupported_reason(**request)
        if reason is not None and request["moe_buf_init"] is not None:
            counters.fallback(f"addend not written in the sort launch (copied after it): {reason}")
            request.update(moe_buf_init=None)
            reason = kernel.unsupported_reason(**request)
        if reason is not None:
            counters.fallback(reason)
            return inner(*args, **kwargs)
        try:
            res = kernel.moe_sort_mx_quant(
                bound["topk_ids"], bound["topk_weights"], bound["num_experts"], bound["model_dim"],
                bound["moebuf_dtype"], bound["block_size"], zero_moe_buf=_zeroes(bound), checked=True,
                **_kernel_kwargs(request),
            )
        except Exception as exc:  # a compile or launch failure: AITER does the work
            counters.failed(exc, "moe_sort_mx_quant kernel")
            return inner(*args, **kwargs)
        counters.hit()
        if call is not None:
            if res.quant is not None:
                call.stage1_quant = StageOneQuant(
                    sorted_ids=res.sorted_ids, num_valid_ids=res.num_valid_ids, sorted_weights=res.sorted_weights,
                    quant_dtype=request["quant_dtype"], data=res.quant[0], scale=res.quant[1],
                    input_key=tensor_key(request["quant_input"]), block_size=bound["block_size"],
                    counters=counters,
                )
            if request["moe_buf_init"] is not None:
                call.addend_written_by_sort = True
        return (res.sorted_ids, res.sorted_weights, res.sorted_expert_ids, res.num_valid_ids, res.moe_buf)

    return moe_call.like(_moe_sorting_impl, inner)


def python_level_reason(bound: dict) -> str | None:
    """Arguments the one-launch sort does not cover (AITER's own path handles them)."""
    if bound.get("output_aux"):
        return "output_aux (the a4w4 adaptive sort)"
    if bound.get("return_local_topk_ids"):
        return "return_local_topk_ids"
    if not bound.get("use_opus", True):
        return "use_opus=False (the CK sort, AITER_USE_CK_MOE_SORTING=1)"
    return None


def _zeroes(bound: dict) -> bool:
    return bool(bound.get("accumulate", True)) or bound.get("expert_mask") is not None


def _request(bound: dict, call) -> dict:
    quant_input = None
    quant_dtype = None
    if call is not None and call.quant_dtype is not None and call.stage1_quant is None:
        hs = call.hidden_states
        if hs is not None and hs.dim() == 2 and hs.shape[0] == bound["topk_ids"].shape[0]:
            quant_input, quant_dtype = hs, call.quant_dtype
    init = call.addend if (call is not None and call.addend_offered and _zeroes(bound)) else None
    return {
        "topk_ids": bound["topk_ids"],
        "topk_weights": bound["topk_weights"],
        "num_experts": bound["num_experts"],
        "model_dim": bound["model_dim"],
        "block_size": bound["block_size"],
        "expert_mask": bound.get("expert_mask"),
        "num_local_tokens": bound.get("num_local_tokens"),
        "quant_input": quant_input,
        "quant_dtype": quant_dtype,
        "moe_buf": bound.get("output"),
        "moe_buf_init": init,
    }


def _kernel_kwargs(request: dict) -> dict:
    skip = ("topk_ids", "topk_weights", "num_experts", "model_dim", "block_size")
    return {k: v for k, v in request.items() if k not in skip}



PATCH = Patch(
    name=NAME,
    summary="MoE sort + moe_buf zero-fill + stage-1 MX (fp4/fp8) activation quant in one Triton launch",
    targets=(
        Target("aiter.fused_moe", "fused_moe", pins.FUSED_MOE, fused_moe_scope_wrapper(_contribute, _count_unreached_sort),
               "Predicts the stage-1 MX quant from the arguments and opens the per-call hand-off."),
        Target("aiter.fused_moe", "_moe_sorting_impl", pins.MOE_SORTING_IMPL, _sort_wrapper,
               "Looked up in aiter.fused_moe's globals by moe_sorting at call time: the one-launch sort (+ quant)."),
        *stage1_quant_targets("the sort"),
    ),
    kernel_module=KERNEL_MODULE,
    order=30,
    relies_on=relied_on.MOE_SORT_MX_QUANT,
    check="aiter_patches.checks:check_sort_mx_quant",
)
