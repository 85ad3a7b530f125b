"""The built-in patches, one module each; this list is their declared order.

Importing this package imports no AITER module: patch modules declare targets by
module path and import their kernels lazily, on the first fast-path call.
Patches that wrap the same function chain by ``order`` (lower is outer):
``moe_addend_fold`` (10) -> ``sort_extension`` (20) -> ``moe_sort_mx_quant`` (30) -> AITER.
``sglang_takeover`` (35) patches SGLang, not AITER: it is applied after ``moe_sort_mx_quant``.
``gemm_dispatch_out_zeroed`` (40) -> ``gemm_out_zeroed`` (50) -> AITER on the asm GEMM entry point.
"""

from . import gemm_dispatch_out_zeroed, gemm_out_zeroed, moe_addend_fold, moe_sort_mx_quant, sglang_takeover, sort_extension

from ..integrations import sglang_shared_fold  # noqa: E402  (server patches, opt-in)

BUILTIN_PATCHES = [
    moe_addend_fold.PATCH,
    sort_extension.PATCH,
    moe_sort_mx_quant.PATCH,
    sglang_takeover.PATCH,
    gemm_dispatch_out_zeroed.PATCH,
    gemm_out_zeroed.PATCH,
    sglang_shared_fold.PATCH,
]
