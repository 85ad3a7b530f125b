"""AITER functions the patches rely on without wrapping them, pinned by a hash of their source.

The drift check (`aiter-patches drift`) recomputes each hash from an AITER
release and warns when one changed: the patch may still apply, but the logic it
mirrors (the stage-1 quant dtype rule, the sort routing, the quant helper calls)
must be re-read. A hash is ``aiter_patches.drift.source_hash`` of the function's
lines, decorators included. All hashes: ROCm/aiter e4048607a5 (v0.1.20-46); at
tag v0.1.20 ``_fused_moe_impl`` and ``fused_moe_2stages`` hash differently only
through the ``_metadata_config_file``/``stage2_scatter`` plumbing (read: it does
not touch what the patches rely on), so those hashes are accepted too (``also``).
Refresh with ``aiter-patches drift --propose --aiter-src DIR`` after re-reading
the new source.
"""

from ..core.declarations import SourcePin

_AT = "ROCm/aiter e4048607a5"

FUSED_MOE_IMPL_QUANT = SourcePin(
    "aiter.fused_moe", "_fused_moe_impl",
    "46fa0070a191b4fbd30e564a6bc094dde4e9096bbece98ca76b40b7ee951f3d5",
    "picks the stage-1 activation dtype (q_dtype_a) that the sort wrapper predicts, then calls moe_sorting "
    "and fused_moe_2stages with it",
    f"{_AT} aiter/fused_moe.py:698",
    also=("9f88cfd28e7fc515822129081f10bbcf623883efb2e9d3cdd02af55530f5dbeb",),  # v0.1.20
)
FUSED_MOE_IMPL_ACCUMULATE = SourcePin(
    "aiter.fused_moe", "_fused_moe_impl",
    FUSED_MOE_IMPL_QUANT.sha256,
    "passes accumulate=not stage2_uses_route_reduce(...) to moe_sorting and returns the sort's moe_buf as "
    "the output: the addend starts that buffer",
    FUSED_MOE_IMPL_QUANT.source,
    also=FUSED_MOE_IMPL_QUANT.also,
)
MOE_SORTING = SourcePin(
    "aiter.fused_moe", "moe_sorting",
    "ac8b4c9cb006473e426f23bb59cdafc9b20cf8ac7b2b5a074e3320f670a33b40",
    "routes to _moe_sorting_impl, looked up in aiter.fused_moe's globals at call time (FlyDSL and flat "
    "paths bypass it), forwarding accumulate/output_aux",
    f"{_AT} aiter/fused_moe.py:341",
)
FUSED_MOE_2STAGES_QUANT = SourcePin(
    "aiter.fused_moe", "fused_moe_2stages",
    "ff624edcc30ed6e534146bd48fd1dd1ce013663eca10fd2c61ff861e8cc0c249",
    "for QuantType.per_1x32 calls fused_dynamic_mxfp4/mxfp8_quant_moe_sort through aiter.fused_moe's "
    "globals with sorted_ids, num_valid_ids, token_num, topk, block_size, num_rows, sorted_weights",
    f"{_AT} aiter/fused_moe.py:2979",
    also=("d5d7c95082a442e2f7a1202e7e515175df8f5f4ba438f00a8fe1b1c3b84f3dc5",),  # v0.1.20
)
FUSED_MOE_2STAGES_STAGE2 = SourcePin(
    "aiter.fused_moe", "fused_moe_2stages",
    FUSED_MOE_2STAGES_QUANT.sha256,
    "stage 2 atomically adds into moe_out (the sort's moe_buf) unless its kernel runs in reduce mode",
    FUSED_MOE_2STAGES_QUANT.source,
    also=FUSED_MOE_2STAGES_QUANT.also,
)
STAGE2_USES_ROUTE_REDUCE = SourcePin(
    "aiter.fused_moe", "stage2_uses_route_reduce",
    "494a92b3a839780bc881e9ca2e00156020f6b46134a0127f0f9f04bbfa967735",
    "decides whether stage 2 overwrites (reduce) or adds (atomic): the fold is only taken when it adds",
    f"{_AT} aiter/fused_moe.py:423",
)
GEMM_ASM_CALL = SourcePin(
    "aiter.ops.gemm_op_a8w8", "gemm_a8w8_blockscale_bpreshuffle_asm",
    "27b75c3ffe18e85f1dd9dfaf428197578cb90ba157940c5f5e310610138297f3",
    "its body (zero-bias buffer when bias is None, forwarding splitK/kernelName/bpreshuffle to the launcher) "
    "is what the no-memset launch reproduces",
    f"{_AT} aiter/ops/gemm_op_a8w8.py:404",
)
GEMM_ASM_LAUNCHER = SourcePin(
    "aiter.ops.gemm_op_a8w8", "_gemm_a8w8_blockscale_bpreshuffle_asm",
    "775bf4bd9deac1c808229c7c650f03be24fbc2df0d6d3902cd816ac853967b1b",
    "the C++ launcher's declared parameters (splitK=-1 heuristic, bpreshuffle int): the kernel selection "
    "and split rule the patch mirrors sit behind it",
    f"{_AT} aiter/ops/gemm_op_a8w8.py:377",
)

MOE_SORT_MX_QUANT: tuple[SourcePin, ...] = (FUSED_MOE_IMPL_QUANT, MOE_SORTING, FUSED_MOE_2STAGES_QUANT)
MOE_ADDEND_FOLD: tuple[SourcePin, ...] = (
    FUSED_MOE_IMPL_ACCUMULATE, MOE_SORTING, FUSED_MOE_2STAGES_STAGE2, STAGE2_USES_ROUTE_REDUCE,
)
SORT_EXTENSION: tuple[SourcePin, ...] = (MOE_SORTING, FUSED_MOE_2STAGES_QUANT)
GEMM_OUT_ZEROED: tuple[SourcePin, ...] = (GEMM_ASM_CALL, GEMM_ASM_LAUNCHER)

# SGLang 0.5.23 (the PyPI wheel), for the take-over of its in-tree patch. The first is also checked at
# apply time (sglang_takeover's precheck): a changed function is not silenced.
_SGL = "sglang 0.5.23 sglang/kernels/ops/moe/moe_sorting_small.py"
SGLANG_APPLY_SMALL_MOE_SORT_PATCH = SourcePin(
    "sglang.kernels.ops.moe.moe_sorting_small", "apply_aiter_small_moe_sort_patch",
    "f194c6b5d268ef6ed1ca2e5fa734eb17e48a3c2570974714f8511a2669fb3975",
    "only installs SGLang's wrappers on aiter.fused_moe (fused_moe, _moe_sorting_impl, "
    "fused_dynamic_mxfp8_quant_moe_sort) and returns None: making it a no-op loses nothing else",
    f"{_SGL}:527",
)
SGLANG_SMALL_SORT_SUPPORTED = SourcePin(
    "sglang.kernels.ops.moe.moe_sorting_small", "_small_sort_supported",
    "4d469a6fa0feadebe6504fe958496c651097c61c5829d2a971504fd99142960d",
    "which sorts SGLang's layer takes (what status and stats say of it)",
    f"{_SGL}:370",
)
SGLANG_TAKEOVER: tuple[SourcePin, ...] = (SGLANG_APPLY_SMALL_MOE_SORT_PATCH, SGLANG_SMALL_SORT_SUPPORTED)
