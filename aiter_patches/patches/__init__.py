"""The built-in patches: every module (or folder) of this package that defines ``PATCH``.

Why found, not listed: a new patch is its own module here and nothing else
(README "Adding a patch"); the core finds it (``core/discovery.py`` lists this
package), and ``status()``, ``verify``, the drift check, SIGNATURES.md and the
tests take it from the registry. The order among patches that wrap the same
function is each ``Patch.order`` (lower is outer):
``moe_addend_fold`` (10) -> ``sort_extension`` (20) -> ``moe_sort_mx_quant`` (30) -> AITER; these
three share one wrapper per target, whose steps run in moe_pipeline.py's order.
``sglang_takeover`` (35) patches SGLang, not AITER, and needs ``moe_sort_mx_quant``;
``gemm_dispatch_out_zeroed`` (40) -> ``gemm_out_zeroed`` (50) -> AITER on the asm GEMM entry point,
the first needing the second. The server integrations (``aiter_patches.integrations``, opt-in) are
found the same way there. What a patch needs from another is declared (``Patch.needs``), never
read from the other's state at call time.

Importing this package imports no AITER module: patch modules declare targets by
module path and import their kernels lazily, on the first fast-path call.
"""
