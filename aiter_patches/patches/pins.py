"""The AITER signatures the patches were written against, one constant per function and version.

Several patches wrap the same function, so the pins live here once. Each text is
the parameter list as AITER's source spells it (defaults normalized); SIGNATURES.md
is generated from these. Sources: ROCm/aiter tag v0.1.20 and commit e4048607a5
(2026-08-22, v0.1.20-46); the ``output=None`` variants follow aiter-facts.md
("later AITER adds output=None ... to fused_moe, moe_sorting and _moe_sorting_impl").
"""

from ..signatures import Pin

_SORT_IMPL = (
    "(topk_ids, topk_weights, num_experts, model_dim, moebuf_dtype, block_size, expert_mask, "
    "num_local_tokens, dispatch_policy, use_opus, return_local_topk_ids=False, accumulate=True, "
    "output_aux=False{extra})"
)
MOE_SORTING_IMPL = (
    Pin("v0.1.20", _SORT_IMPL.format(extra=""), "ROCm/aiter v0.1.20 aiter/fused_moe.py:171; unchanged at e4048607a5 (line 175)"),
    Pin("output", _SORT_IMPL.format(extra=", output=None"), "later AITER: a caller-owned moe_buf (aiter-facts.md)"),
)

_FUSED_MOE = (
    "(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=ActivationType.Silu, "
    "quant_type=QuantType.No, doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None, "
    "a2_scale=None, block_size_M=None, num_local_tokens=None, moe_sorting_dispatch_policy=0, dtype=None, "
    "hidden_pad=0, intermediate_pad=0, bias1=None, bias2=None, splitk=0, swiglu_limit=None, beta=None, "
    "linear_beta=None, gate_mode='separated', shared_w1=None, shared_w2=None, shared_w1_scale=None, "
    "shared_w2_scale=None, shared_expert_id=-1{extra})"
)
FUSED_MOE = (
    Pin("v0.1.20", _FUSED_MOE.format(extra=""), "ROCm/aiter v0.1.20 aiter/fused_moe.py:454"),
    Pin("e4048607a5", _FUSED_MOE.format(extra=", stage2_scatter=None"),
        "ROCm/aiter e4048607a5 (v0.1.20-46) aiter/fused_moe.py:458"),
    Pin("output", _FUSED_MOE.format(extra=", stage2_scatter=None, output=None"),
        "later AITER: a caller-owned output buffer (aiter-facts.md)"),
)

_MX_QUANT_SORT = (
    "(input, sorted_ids, num_valid_ids, token_num, topk, block_size, num_rows=None, group_size=32, "
    "sorted_weights=None)"
)
MXFP4_QUANT_MOE_SORT = (
    Pin("v0.1.20", _MX_QUANT_SORT, "ROCm/aiter v0.1.20 aiter/ops/quant.py:1152; unchanged at e4048607a5"),
)
MXFP8_QUANT_MOE_SORT = (
    Pin("v0.1.20", _MX_QUANT_SORT, "ROCm/aiter v0.1.20 aiter/ops/quant.py:1183; unchanged at e4048607a5"),
)

GEMM_A8W8_BLOCKSCALE_BPRESHUFFLE_ASM = (
    Pin(
        "v0.1.20",
        "(A, B, out, A_scale, B_scale, bias=None, splitK=None, kernelName=None, bpreshuffle=True, zero_bias_buf=None)",
        "ROCm/aiter v0.1.20 aiter/ops/gemm_op_a8w8.py:404; unchanged at e4048607a5",
    ),
)

# SGLang, for the take-over of its in-tree AITER patch (a server function, not AITER's).
SGLANG_APPLY_SMALL_MOE_SORT_PATCH = (
    Pin("sglang-0.5.23", "()",
        "sglang 0.5.23 sglang/kernels/ops/moe/moe_sorting_small.py:528 (@functools.cache at 527)"),
)
