"""Stand-in for ``aiter/fused_moe.py`` (ROCm/aiter v0.1.20).

Kept from AITER, because the patches depend on it: the signatures of
``fused_moe``, ``moe_sorting``, ``_moe_sorting_impl`` and ``fused_moe_2stages``;
the call chain ``fused_moe -> fused_moe_ -> _fused_moe_impl -> moe_sorting ->
_moe_sorting_impl`` then ``fused_moe_2stages``; the look-ups of
``_moe_sorting_impl`` and of the MX quant helpers in this module's globals at
call time; the stage-1 activation dtype rule for ``QuantType.per_1x32``; the
``accumulate`` decision from ``stage2_uses_route_reduce``; and the allocation of
a fresh output when the sort returns the ``(0, 0)`` placeholder.

Kept too, so that the stand-in takes AITER's branches for the same arguments
(``tests/real_aiter`` compares the leaf-op sequences of both): ``q_dtype_a`` for
Swiglu / SiTUv2 / interleaved gates, the untuned kernel choice of
``get_2stage_cfgs`` without FlyDSL (CK 2-stage; CK-Tile for preshuffled fp4 with
``ksplit > 1`` and for Swiglu), ``get_ksplit`` / ``get_block_size_M`` on
``CU_NUM`` compute units (default 80), ``fused_moe_2stages``' stage-1 branches
(no pre-quant, bf16 stage 1, MXFP4 / MXFP8 quant, the a8w4 bypass), the FlyDSL
sort switch, ``need_local_topk_ids``, the ``output_aux`` sort branch and the
stage-2 mode read from the stage-2 kernel name (``stage2_uses_route_reduce``).
The env switches AITER reads at import are read at import here too.

Left out: tuned-CSV configs (the stand-in has none: every shape is untuned),
FlyDSL and opus kernels (``is_flydsl_available()`` is False), biases, the
shared-expert (fhmoe) path, gfx1250, a16wi4 and per-1x128 branches. With
``AITER_STUB_STAGE2_MODE=reduce`` the stand-in's config names a FlyDSL-style
reduce stage-2 kernel (overwrites ``moe_buf``, like FlyDSL's reduce mode) in place
of CK's atomic one; ``output_aux`` sorts use the opus leaf with its aux outputs.
"""

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

import aiter
from aiter import (
    ActivationType,
    QuantType,
    dtypes,
    fused_dynamic_mxfp4_quant_moe_sort,
    fused_dynamic_mxfp8_quant_moe_sort,
    logger,
    mxfp4_moe_sort_fwd,
)
from aiter import get_hip_quant as get_quant
from aiter.ops import _leaf_kernels as _leaf

BLOCK_SIZE_M = 32
_USE_CK_MOE_SORTING = os.environ.get("AITER_USE_CK_MOE_SORTING", "0") == "1"
_USE_FLYDSL_MOE_SORTING = os.environ.get("AITER_USE_FLYDSL_MOE_SORTING", "0") == "1"
_MOE_SORT_BACKEND = os.environ.get("AITER_MOE_SORT_BACKEND", "auto").lower()
_SWIGLU_MXFP4_BF16_BOUND = int(os.environ.get("GPTOSS_SWIGLU_MXFP4_BF16_BOUND", "256"))
_MOE_A8W4_BYPASS_QUANT = os.environ.get("AITER_MOE_A8W4_BYPASS_QUANT", "0") == "1"


def get_gfx():
    """AITER's chip query; the stand-in emulates ``AITER_STUB_GFX`` (default gfx950)."""
    return os.environ.get("AITER_STUB_GFX", "gfx950")


def get_cu_num():
    return int(os.environ.get("CU_NUM", "80"))


def is_flydsl_available():
    """FlyDSL is never present in the stand-in."""
    return False


class GateMode(Enum):
    SEPARATED = "separated"
    INTERLEAVE = "interleave"


def _moe_sorting_impl(
    topk_ids,
    topk_weights,
    num_experts,
    model_dim,
    moebuf_dtype,
    block_size,
    expert_mask,
    num_local_tokens,
    dispatch_policy,
    use_opus,
    return_local_topk_ids=False,
    accumulate=True,
    output_aux=False,
):
    """AITER line 171: allocate the five outputs with ``torch.empty`` and run the opus (or CK) sort."""
    device = topk_ids.device
    M, topk = topk_ids.shape
    if output_aux and _MOE_SORT_BACKEND not in ("opus", "ck"):
        return _adaptive_moe_sort(topk_ids, topk_weights, num_experts, topk, block_size, model_dim,
                                  atomic=accumulate, emit_aux=True, moebuf_dtype=moebuf_dtype)
    max_num_tokens_padded = int(topk_ids.numel() + num_experts * block_size - topk)
    max_num_m_blocks = int((max_num_tokens_padded + block_size - 1) // block_size)
    sorted_ids = torch.empty(max_num_tokens_padded, dtype=dtypes.i32, device=device)
    sorted_weights = torch.empty(max_num_tokens_padded, dtype=dtypes.fp32, device=device)
    sorted_expert_ids = torch.empty(max_num_m_blocks, dtype=dtypes.i32, device=device)
    num_valid_ids = torch.empty(2, dtype=dtypes.i32, device=device)
    if (expert_mask is not None) or accumulate:
        moe_buf = torch.empty((M, model_dim), dtype=moebuf_dtype, device=device)
    else:
        moe_buf = torch.empty((0, 0), dtype=moebuf_dtype, device=device)
    local_topk_ids = torch.empty_like(topk_ids) if return_local_topk_ids else None
    if return_local_topk_ids:
        use_opus = True
    aux_m_indices = aux_reverse_sorted = None
    if output_aux:
        use_opus = True
        dispatch_policy = 1
        aux_m_indices = torch.empty(max_num_tokens_padded, dtype=dtypes.i32, device=device)
        aux_reverse_sorted = torch.empty(M * topk, dtype=dtypes.i32, device=device)
    if use_opus:
        ws_size = aiter.moe_sorting_opus_get_workspace_size(M, num_experts, topk, dispatch_policy)
        workspace = torch.empty(ws_size, dtype=torch.uint8, device=device) if ws_size > 0 else None
        aiter.moe_sorting_opus_fwd(
            topk_ids,
            topk_weights,
            sorted_ids,
            sorted_weights,
            sorted_expert_ids,
            num_valid_ids,
            moe_buf,
            num_experts,
            int(block_size),
            expert_mask,
            num_local_tokens,
            workspace,
            dispatch_policy,
            local_topk_ids,
            aux_m_indices,
            aux_reverse_sorted,
        )
    else:
        aiter.moe_sorting_fwd(
            topk_ids,
            topk_weights,
            sorted_ids,
            sorted_weights,
            sorted_expert_ids,
            num_valid_ids,
            moe_buf,
            num_experts,
            int(block_size),
            expert_mask,
            num_local_tokens,
            dispatch_policy,
        )
    ret = (sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf)
    if output_aux:
        return (*ret, aux_m_indices, aux_reverse_sorted)
    if return_local_topk_ids:
        return (*ret, local_topk_ids)
    return ret


def _adaptive_moe_sort(topk_ids, topk_weights, num_experts, topk, block_size, model_dim, *, atomic=False,
                       emit_aux=False, moebuf_dtype=dtypes.bf16):
    """AITER line 118 (the a4w4 ``mxfp4_moe_sort``): its buffer sizes, the opus leaf's layout."""
    device = topk_ids.device
    M = topk_ids.shape[0]
    BM = block_size
    active = min(num_experts, M * topk)
    max_sorted = (((M * topk + active * (BM - 1)) + BM - 1) // BM) * BM
    sorted_token_ids = torch.empty(max_sorted, dtype=dtypes.i32, device=device)
    sorted_expert_ids = torch.empty(max_sorted // BM, dtype=dtypes.i32, device=device)
    num_valid_ids = torch.empty(2, dtype=dtypes.i32, device=device)
    sorted_weights = torch.empty(max_sorted, dtype=dtypes.fp32, device=device)
    reverse_sorted = torch.empty(M * topk, dtype=dtypes.i32, device=device)
    m_indices = torch.empty(max_sorted, dtype=dtypes.i32, device=device)
    if atomic:
        moe_buf = torch.empty((M, model_dim), dtype=moebuf_dtype, device=device)
    else:
        moe_buf = torch.empty((0, 0), dtype=moebuf_dtype, device=device)
    aiter.moe_sorting_opus_fwd(topk_ids, topk_weights, sorted_token_ids, sorted_weights, sorted_expert_ids,
                               num_valid_ids, moe_buf, num_experts, int(BM), None, None, None, 1, None, m_indices,
                               reverse_sorted)
    std = (sorted_token_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf)
    if emit_aux:
        return (*std, m_indices, reverse_sorted)
    return std


def _moe_prepare_unsorted_input(topk_ids, topk_weights, model_dim, moebuf_dtype):
    """AITER line 89: the FLAT kernels' pass-through (no sort, no zeroing)."""
    M = topk_ids.shape[0]
    moe_buf = torch.empty((M, model_dim), dtype=moebuf_dtype, device=topk_ids.device)
    ids = topk_ids if topk_ids.dtype == dtypes.i32 and topk_ids.is_contiguous() else topk_ids.to(dtypes.i32).contiguous()
    w = (
        topk_weights
        if topk_weights.dtype == dtypes.fp32 and topk_weights.is_contiguous()
        else topk_weights.to(dtypes.fp32).contiguous()
    )
    return ids, w, ids, ids, moe_buf


def moe_sorting(
    topk_ids,
    topk_weights,
    num_experts,
    model_dim,
    moebuf_dtype,
    block_size=BLOCK_SIZE_M,
    expert_mask=None,
    num_local_tokens=None,
    dispatch_policy=0,
    return_local_topk_ids=False,
    accumulate=True,
    flat=False,
    output_aux=False,
):
    """AITER line 337. ``_moe_sorting_impl`` is looked up in this module's globals at call time."""
    if (
        not _USE_CK_MOE_SORTING
        and _USE_FLYDSL_MOE_SORTING
        and is_flydsl_available()
        and not return_local_topk_ids
        and not flat
        and not output_aux
        and dispatch_policy == 0
    ):
        raise NotImplementedError("the FlyDSL sort is not in the aiter_patches stand-in")  # unreachable: no FlyDSL
    if flat:
        return _moe_prepare_unsorted_input(topk_ids, topk_weights, model_dim, moebuf_dtype)
    try:
        return _moe_sorting_impl(
            topk_ids,
            topk_weights,
            num_experts,
            model_dim,
            moebuf_dtype,
            block_size,
            expert_mask,
            num_local_tokens,
            dispatch_policy,
            use_opus=not _USE_CK_MOE_SORTING,
            return_local_topk_ids=return_local_topk_ids,
            accumulate=accumulate,
            output_aux=output_aux,
        )
    except Exception as e:
        logger.error(f"Error in moe_sorting: {e}")
        raise


@functools.lru_cache(maxsize=2048)
def get_inter_dim(w1_shape, w2_shape):
    """AITER line 449 (fp4x2 weights pack two values per element of the last dim)."""
    E, _, model_dim = w1_shape
    E, model_dim, inter_dim = w2_shape
    int4_war = model_dim // w1_shape[-1]
    inter_dim *= int4_war
    return E, model_dim, inter_dim


def get_padded_M(M):
    """AITER line 1340 (below its 32768-token tiers: the next power of two)."""
    return 1 << max(0, (int(M) - 1).bit_length())


@dataclass
class MOEMetadata:
    """AITER line 1349, the fields the 2-stage path reads."""

    stage1: Callable | None
    stage2: Callable | None
    block_m: int
    ksplit: int
    run_1stage: bool = False
    has_bias: bool = False
    use_non_temporal_load: bool = True
    fuse_quant: str = ""
    stage2_has_bias: bool = False
    flat: bool = False
    output_aux: bool = False
    prequant: bool = True
    skip_inter_quant: bool = False


def _act_value(activation):
    return ActivationType(int(getattr(activation, "value", activation)))


def ck_moe_stage1(hidden_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk, block_m,
                  a1_scale, w1_scale, kernelName="", sorted_weights=None, quant_type=QuantType.No,
                  activation=ActivationType.Gelu, splitk=1, use_non_temporal_load=False, dtype=None):
    """AITER line 3814 (the per_1x128 split-K branch left out)."""
    aiter.ck_moe_stage1_fwd(hidden_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                            kernelName, w1_scale, a1_scale, block_m, sorted_weights, quant_type, activation, 0,
                            use_non_temporal_load, out.dtype)
    return out


def cktile_moe_stage1(hidden_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk, block_m,
                      a1_scale, w1_scale, sorted_weights=None, n_pad_zeros=0, k_pad_zeros=0, bias1=None,
                      topk_ids=None, activation=ActivationType.Silu, split_k=1, dtype=torch.bfloat16,
                      kernel_name="", post_activation_layout="auto"):
    """AITER line 3873: CK-Tile gate/up GEMM; with ``split_k > 1`` the activation runs after it."""
    token_num = hidden_states.shape[0]
    k1, (k2, n2) = w1.shape[2], w2.shape[1:]
    D = n2 if k2 == k1 else n2 * 2  # bit4 format
    expected = (token_num, topk, D)
    if out is None or tuple(out.shape) != expected or out.dtype != dtype:
        out = torch.empty(expected, dtype=dtype, device=hidden_states.device)
    split = split_k > 1
    tmp_out = torch.zeros((token_num * topk, w1.shape[1]), dtype=dtype, device=out.device) if split else out
    aiter.moe_cktile2stages_gemm1(hidden_states, w1, tmp_out, sorted_token_ids, sorted_expert_ids, num_valid_ids,
                                  topk, n_pad_zeros, k_pad_zeros, sorted_weights, a1_scale, w1_scale,
                                  None if split else bias1, activation, block_m, split_k, kernel_name)
    if split:
        act = _act_value(activation)
        interleaved = post_activation_layout == "interleaved" or (
            post_activation_layout == "auto" and w1.dtype == dtypes.fp4x2)
        if interleaved and act == ActivationType.Swiglu:
            aiter.flydsl_swiglu_and_mul_interleaved(tmp_out.view(-1, D * 2), out.view(-1, D))
        elif interleaved and act == ActivationType.Silu:
            aiter.flydsl_silu_and_mul_interleaved(tmp_out.view(-1, D * 2), out.view(-1, D), sorted_token_ids,
                                                  num_valid_ids, token_num, topk)
        elif act == ActivationType.Silu:
            aiter.silu_and_mul(out, tmp_out)
        elif act == ActivationType.Swiglu:
            aiter.swiglu_and_mul(out, tmp_out)
        else:
            aiter.gelu_and_mul(out, tmp_out)
    return out


def cktile_moe_stage2(a2, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk, w2_scale, a2_scale,
                      block_m, activation=ActivationType.Swiglu, sorted_weights=None, zeros_out=False, n_pad_zeros=0,
                      k_pad_zeros=0, bias2=None, kernel_name=""):
    """AITER line 4015."""
    aiter.moe_cktile2stages_gemm2(a2, w2, out, sorted_token_ids, sorted_expert_ids, num_valid_ids, topk,
                                  n_pad_zeros, k_pad_zeros, sorted_weights, a2_scale, w2_scale, bias2, activation,
                                  block_m, kernel_name=kernel_name)
    return out


def _flydsl_stage2_wrapper(inter_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                           kernelName="", w2_scale=None, a2_scale=None, sorted_weights=None, block_m=None, **_kwargs):
    """Stands for AITER's FlyDSL stage 2 (line 1477): its mode comes from the kernel name."""
    _leaf.moe_stage2(inter_states, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                     token_num=out.shape[0], block_m=block_m, a2_scale=a2_scale, w2_scale=w2_scale,
                     sorted_weights=sorted_weights, mode=_flydsl_mode(kernelName))
    return out


def _flydsl_mode(kernel_name: str) -> str:
    return "reduce" if "_reduce" in kernel_name else "atomic"


def _stage2_mode() -> str:
    mode = os.environ.get("AITER_STUB_STAGE2_MODE", "atomic")
    if mode not in ("atomic", "reduce"):
        raise ValueError(f"AITER_STUB_STAGE2_MODE must be 'atomic' or 'reduce', not {mode!r}")
    return mode


@functools.lru_cache(maxsize=2048)
def get_block_size_M(token, topk, expert, inter_dim):
    """AITER line 1227."""
    cu_num = get_cu_num()
    tg_n = (inter_dim + 127) // 128
    best = []
    for el in (32, 64, 128):
        max_num_tokens = token * topk + expert * el - topk
        tg_num = tg_n * (max_num_tokens + el - 1) // el
        best.append(((tg_num + cu_num - 1) // cu_num, cu_num - tg_num % cu_num, el))
    return min(best, key=lambda x: x[:2])[-1]


@functools.lru_cache(maxsize=2048)
def get_ksplit(token, topk, expert, inter_dim, model_dim):
    """AITER line 1252: split-K for decode shapes that leave CUs idle."""
    aiter_ksplit = int(os.environ.get("AITER_KSPLIT", "0"))
    if aiter_ksplit != 0:
        return aiter_ksplit
    if token * topk > expert:
        return 0
    cu_num = get_cu_num()
    tg_num = ((inter_dim + 127) // 128) * token * topk
    if tg_num >= cu_num:
        return 0
    split_max = (cu_num + tg_num - 1) // tg_num
    for i in reversed(range(2, split_max + 1)):
        if model_dim % i == 0 and (model_dim // i) % 256 == 0:
            return i
    return 0


def _cktile_block_m(token):
    return 16 if token < 2048 else 32 if token < 16384 else 64


@functools.lru_cache(maxsize=2048)
def get_2stage_cfgs(token, model_dim, inter_dim, expert, topk, dtype, q_dtype_a, q_dtype_w, q_type, use_g1u1,
                    activation, doweight_stage1, hidden_pad=0, intermediate_pad=0, is_shuffled=True,
                    gate_mode=GateMode.SEPARATED.value, is_ep=False, has_stage2_bias=False,
                    opus_weights_shuffled=None, config_file=None):
    """AITER line 2110 for an untuned shape without FlyDSL: CK 2-stage, or CK-Tile for preshuffled
    fp4 weights with ``ksplit > 1``, for Swiglu, and for interleaved gates."""
    gate_mode = GateMode(gate_mode)
    activation = _act_value(activation)
    mx = q_type == QuantType.per_1x32
    block_m = get_block_size_M(token, topk, expert, inter_dim)
    ksplit = get_ksplit(token, topk, expert, inter_dim, model_dim) if mx else 0
    half = dtype in (dtypes.bf16, dtypes.fp16)
    swiglu = activation == ActivationType.Swiglu
    cktile2 = functools.partial(cktile_moe_stage2, n_pad_zeros=hidden_pad // 64 * 64,
                                k_pad_zeros=intermediate_pad // 128 * 128, activation=activation)

    def cktile1(split_k, **kw):
        return functools.partial(cktile_moe_stage1, n_pad_zeros=intermediate_pad // 64 * 64 * (2 if use_g1u1 else 1),
                                 k_pad_zeros=hidden_pad // 128 * 128, activation=activation, split_k=split_k,
                                 dtype=dtype, **kw)

    if gate_mode != GateMode.SEPARATED and half and mx and swiglu and q_dtype_w != dtypes.fp8:
        return MOEMetadata(cktile1(1), cktile2, 32 if q_dtype_a == dtypes.fp8 else _cktile_block_m(token), ksplit,
                           has_bias=True, stage2_has_bias=True)
    swiglu_bf16_cktile = mx and swiglu and q_dtype_a in (dtypes.bf16, dtypes.fp16) and q_dtype_w == dtypes.fp4x2 \
        and is_shuffled
    if half and mx and q_dtype_w == dtypes.fp4x2 and is_shuffled and not (swiglu and q_dtype_a == dtypes.fp4x2) \
            and (ksplit > 1 or swiglu_bf16_cktile):
        split_k = max(int(ksplit), 2 if swiglu_bf16_cktile else 1)
        return MOEMetadata(cktile1(split_k, post_activation_layout="standard" if swiglu_bf16_cktile else "auto"),
                           cktile2, _cktile_block_m(token), split_k, has_bias=swiglu, stage2_has_bias=swiglu)
    if swiglu and q_dtype_w == dtypes.fp4x2 and mx and half:
        split_k = max(int(ksplit), 2)
        return MOEMetadata(cktile1(split_k), cktile2, _cktile_block_m(token), split_k, has_bias=True,
                           stage2_has_bias=True)
    stage1 = functools.partial(ck_moe_stage1, kernelName="", activation=activation, quant_type=q_type, dtype=dtype,
                               splitk=int(ksplit), use_non_temporal_load=False)
    if _stage2_mode() == "reduce":
        stage2 = functools.partial(_flydsl_stage2_wrapper, kernelName="flydsl_moe2_stub_reduce")
    else:
        stage2 = functools.partial(aiter.ck_moe_stage2_fwd, kernelName="", activation=activation, quant_type=q_type,
                                   use_non_temporal_load=False)
    return MOEMetadata(stage1, stage2, block_m, int(ksplit))


def stage2_uses_route_reduce(stage2: Callable) -> bool:
    """AITER line 423: True when stage 2 overwrites (reduce) instead of adding into the zeroed moe_buf;
    read from the stage-2 kernel's name, as AITER does."""
    func = getattr(stage2, "func", stage2)
    kernel_name = getattr(stage2, "keywords", {}).get("kernelName", "")
    if func is _flydsl_stage2_wrapper:
        return _flydsl_mode(kernel_name) == "reduce"
    return False


def _needs_swiglu_bias_support(dtype, quant_type):
    return dtype in [dtypes.bf16, dtypes.fp16] and quant_type == QuantType.per_1x32


def fused_moe(
    hidden_states,
    w1,
    w2,
    topk_weight,
    topk_ids,
    expert_mask=None,
    activation=ActivationType.Silu,
    quant_type=QuantType.No,
    doweight_stage1=False,
    w1_scale=None,
    w2_scale=None,
    a1_scale=None,
    a2_scale=None,
    block_size_M=None,
    num_local_tokens=None,
    moe_sorting_dispatch_policy=0,
    dtype=None,
    hidden_pad=0,
    intermediate_pad=0,
    bias1=None,
    bias2=None,
    splitk=0,
    swiglu_limit=None,
    beta=None,
    linear_beta=None,
    gate_mode=GateMode.SEPARATED.value,
    shared_w1=None,
    shared_w2=None,
    shared_w1_scale=None,
    shared_w2_scale=None,
    shared_expert_id=-1,
):
    """AITER line 454: the public entry. Shared-expert arguments divert to fhmoe (not in the stand-in)."""
    if any(t is not None for t in (shared_w1, shared_w2, shared_w1_scale, shared_w2_scale)) or shared_expert_id != -1:
        raise NotImplementedError("the fhmoe shared-expert path is not in the aiter_patches stand-in")
    if not block_size_M:
        block_size_M = -1
    return fused_moe_(
        hidden_states=hidden_states,
        w1=w1,
        w2=w2,
        topk_weight=topk_weight,
        topk_ids=topk_ids,
        expert_mask=expert_mask,
        activation=activation.value,
        quant_type=quant_type.value,
        doweight_stage1=doweight_stage1,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        block_size_M=block_size_M,
        num_local_tokens=num_local_tokens,
        moe_sorting_dispatch_policy=moe_sorting_dispatch_policy,
        dtype=dtype,
        hidden_pad=hidden_pad,
        intermediate_pad=intermediate_pad,
        bias1=bias1,
        bias2=bias2,
        swiglu_limit=swiglu_limit,
        beta=beta,
        linear_beta=linear_beta,
        gate_mode=gate_mode,
    )


def fused_moe_(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=ActivationType.Silu.value,
               quant_type=QuantType.No.value, doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None,
               a2_scale=None, block_size_M=-1, num_local_tokens=None, moe_sorting_dispatch_policy=0, dtype=None,
               hidden_pad=0, intermediate_pad=0, bias1=None, bias2=None, swiglu_limit=None, beta=None,
               linear_beta=None, gate_mode=GateMode.SEPARATED.value):
    """AITER line 623 (a torch custom op there; a plain function here)."""
    return _fused_moe_impl(
        hidden_states, w1, w2, topk_weight, topk_ids, expert_mask, activation, quant_type, doweight_stage1,
        w1_scale, w2_scale, a1_scale, a2_scale, block_size_M, num_local_tokens, moe_sorting_dispatch_policy,
        dtype, hidden_pad, intermediate_pad, bias1, bias2, swiglu_limit, beta, linear_beta, gate_mode,
    )


def _fused_moe_impl(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None,
                    activation=ActivationType.Silu.value, quant_type=QuantType.No.value, doweight_stage1=False,
                    w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None, block_size_M=-1,
                    num_local_tokens=None, moe_sorting_dispatch_policy=0, dtype=None, hidden_pad=0,
                    intermediate_pad=0, bias1=None, bias2=None, swiglu_limit=None, beta=None, linear_beta=None,
                    gate_mode=GateMode.SEPARATED.value):
    """AITER line 698: stage-1 activation dtype, config, sort, then the two stages."""
    activation = ActivationType(activation)
    quant_type = QuantType(quant_type)
    gate_mode = GateMode(gate_mode)
    if bias1 is not None or bias2 is not None:
        raise NotImplementedError("biases are not in the aiter_patches stand-in")
    if block_size_M == -1:
        block_size_M = None
    M, topk = topk_ids.shape
    E, model_dim, inter_dim = get_inter_dim(w1.shape, w2.shape)
    assert w1.shape[1] in [inter_dim, inter_dim * 2], f"Invalid MoE weight: {w1.shape=} {w2.shape=}"
    isG1U1 = inter_dim != w1.shape[1]
    isShuffled = getattr(w1, "is_shuffled", False) or getattr(w2, "is_shuffled", False)
    global_E = E
    if expert_mask is not None:
        global_E = expert_mask.numel()
    dtype = hidden_states.dtype if dtype is None else dtype
    assert dtype in [dtypes.fp16, dtypes.bf16], f"Fused_moe unsupported out dtype: {dtype}"
    q_dtype_w = w1.dtype
    q_dtype_a = w1.dtype if w1.dtype != torch.uint32 else dtypes.fp8
    bf16_fp8_bound = int(os.environ.get("AITER_BF16_FP8_MOE_BOUND", "256"))
    if quant_type == QuantType.per_1x32 and q_dtype_w == dtypes.fp8:
        q_dtype_a = dtypes.fp8
    elif quant_type == QuantType.per_1x32:
        if activation == ActivationType.Situv2:
            if os.environ.get("AITER_SITUV2_A8W4", "0") == "1":
                q_dtype_a = dtypes.fp8
            elif os.environ.get("AITER_SITUV2_A4W4", "0") == "1":
                q_dtype_a = dtypes.fp4x2
            else:
                q_dtype_a = dtypes.bf16
        elif activation == ActivationType.Swiglu and gate_mode == GateMode.SEPARATED:
            q_dtype_a = dtypes.bf16 if M < _SWIGLU_MXFP4_BF16_BOUND else dtypes.fp4x2
        elif activation == ActivationType.Swiglu or gate_mode == GateMode.INTERLEAVE:
            q_dtype_a = dtypes.bf16 if get_gfx() != "gfx950" or M < bf16_fp8_bound else dtypes.fp8
        else:
            q_dtype_a = dtypes.fp4x2
    metadata = get_2stage_cfgs(
        get_padded_M(M), model_dim, inter_dim, E, topk, dtype, q_dtype_a, q_dtype_w, quant_type, isG1U1,
        activation, doweight_stage1, hidden_pad, intermediate_pad, isShuffled, gate_mode,
        is_ep=expert_mask is not None, has_stage2_bias=bias2 is not None,
        opus_weights_shuffled=getattr(w1, "is_shuffled", False) and getattr(w2, "is_shuffled", False),
        config_file=None,
    )
    block_size_M = metadata.block_m if block_size_M is None else int(block_size_M)
    stage1_func = getattr(metadata.stage1, "func", metadata.stage1)
    need_local_topk_ids = (
        not metadata.run_1stage
        and _needs_swiglu_bias_support(dtype, quant_type)
        and metadata.has_bias
        and metadata.ksplit > 1
        and stage1_func is cktile_moe_stage1
        and expert_mask is not None
    )
    sort_m_indices = sort_reverse_sorted = None
    local_topk_ids = None
    if metadata.output_aux:
        if expert_mask is not None:
            raise NotImplementedError("MXFP4 a4w4 FlyDSL port does not support expert-parallel yet")
        (sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf, sort_m_indices,
         sort_reverse_sorted) = moe_sorting(topk_ids, topk_weight, global_E, model_dim, dtype, block_size_M,
                                            accumulate=not stage2_uses_route_reduce(metadata.stage2), output_aux=True)
    else:
        sorting_ret = moe_sorting(
            topk_ids, topk_weight, global_E, model_dim, dtype, block_size_M, expert_mask, num_local_tokens,
            moe_sorting_dispatch_policy, return_local_topk_ids=need_local_topk_ids,
            accumulate=not stage2_uses_route_reduce(metadata.stage2), flat=metadata.flat,
        )
        if need_local_topk_ids:
            sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf, local_topk_ids = sorting_ret
        else:
            sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf = sorting_ret
    return fused_moe_2stages(
        hidden_states, w1, w2, topk, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf, isG1U1,
        block_size_M, activation=activation, quant_type=quant_type, doweight_stage1=doweight_stage1,
        q_dtype_a=q_dtype_a, q_dtype_w=q_dtype_w, w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale,
        a2_scale=a2_scale, num_local_tokens=num_local_tokens, hidden_pad=hidden_pad,
        intermediate_pad=intermediate_pad, bias1=bias1, bias2=bias2,
        topk_ids=local_topk_ids if local_topk_ids is not None else topk_ids, topk_weights=topk_weight,
        swiglu_limit=swiglu_limit, beta=beta, linear_beta=linear_beta, gate_mode=gate_mode,
        expert_mask=expert_mask, m_indices=sort_m_indices, reverse_sorted=sort_reverse_sorted,
    )


def fused_moe_2stages(
    hidden_states,
    w1,
    w2,
    topk,
    sorted_ids,
    sorted_weights,
    sorted_expert_ids,
    num_valid_ids,
    moe_out,
    isG1U1,
    block_size_M,
    activation=ActivationType.Silu,
    quant_type=QuantType.No,
    doweight_stage1=False,
    q_dtype_a=None,
    q_dtype_w=None,
    w1_scale=None,
    w2_scale=None,
    a1_scale=None,
    a2_scale=None,
    num_local_tokens=None,
    hidden_pad=0,
    intermediate_pad=0,
    bias1=None,
    bias2=None,
    topk_ids=None,
    topk_weights=None,
    swiglu_limit=None,
    beta=None,
    linear_beta=None,
    gate_mode=GateMode.SEPARATED.value,
    expert_mask=None,
    m_indices=None,
    reverse_sorted=None,
    _metadata_transform=None,
    _stage1_extra_args=None,
    _stage2_extra_args=None,
):
    """AITER line 2979: stage-1 quant (MX helpers looked up in this module's globals), stage 1,
    inter-stage quant, stage 2 into ``moe_out``. The same branches as AITER's for per_1x32."""
    quant_func = get_quant(quant_type)
    gate_mode = GateMode(gate_mode)
    token_num, _ = hidden_states.shape
    E, model_dim, inter_dim = get_inter_dim(w1.shape, w2.shape)
    dtype = moe_out.dtype
    device = hidden_states.device
    if moe_out.numel() == 0:
        moe_out = torch.empty((token_num, model_dim), dtype=dtype, device=device)
    is_shuffled = getattr(w1, "is_shuffled", False) or getattr(w2, "is_shuffled", False)
    metadata = get_2stage_cfgs(
        get_padded_M(token_num), model_dim, inter_dim, E, topk, dtype, q_dtype_a, q_dtype_w, quant_type, isG1U1,
        activation, doweight_stage1, hidden_pad, intermediate_pad, is_shuffled, gate_mode,
        is_ep=expert_mask is not None, has_stage2_bias=bias2 is not None,
        opus_weights_shuffled=getattr(w1, "is_shuffled", False) and getattr(w2, "is_shuffled", False),
        config_file=None,
    )
    if _metadata_transform is not None:
        metadata = _metadata_transform(metadata)
    half = dtype in [dtypes.bf16, dtypes.fp16]
    mx = quant_type == QuantType.per_1x32
    gated = activation in (ActivationType.Swiglu, ActivationType.Situv2)
    if not metadata.prequant:
        a1, a1_scale = hidden_states, None
    elif mx and half and w1.dtype == dtypes.fp4x2 and (
        q_dtype_a in [dtypes.bf16, dtypes.fp16] and (gated or gate_mode == GateMode.INTERLEAVE)
        or (q_dtype_a == dtypes.fp4x2 and metadata.ksplit > 1 and is_shuffled)
    ):
        a1, a1_scale = hidden_states.to(dtype), None
    elif mx and half and q_dtype_a == dtypes.fp8 and w1.dtype in (dtypes.fp4x2, dtypes.fp8):
        if _MOE_A8W4_BYPASS_QUANT:
            a1 = hidden_states.to(dtypes.fp8)
            a1_scale = torch.ones([sorted_ids.shape[0], a1.shape[-1] // 32], dtype=dtypes.fp8_e8m0, device=device)
        else:
            a1, a1_scale = fused_dynamic_mxfp8_quant_moe_sort(
                hidden_states,
                sorted_ids=sorted_ids,
                num_valid_ids=num_valid_ids,
                token_num=token_num,
                topk=topk,
                block_size=block_size_M,
                sorted_weights=sorted_weights,
            )
    elif mx:
        if hidden_states.dtype == dtypes.fp4x2 and a1_scale is not None:
            a1 = hidden_states
            a1_scale = mxfp4_moe_sort_fwd(a1_scale, sorted_ids=sorted_ids, num_valid_ids=num_valid_ids,
                                          token_num=token_num, cols=model_dim)
        else:
            a1, a1_scale = fused_dynamic_mxfp4_quant_moe_sort(
                hidden_states,
                sorted_ids=sorted_ids,
                num_valid_ids=num_valid_ids,
                token_num=token_num,
                topk=topk,
                block_size=block_size_M,
                num_rows=num_local_tokens,
                sorted_weights=sorted_weights,
            )
    elif hidden_states.dtype != q_dtype_a:
        a1, a1_scale = quant_func(hidden_states, scale=a1_scale, quant_dtype=q_dtype_a, num_rows=num_local_tokens)
    else:
        assert a1_scale is not None or quant_type == QuantType.No, "a1_scale must be provided for quantized input"
        a1 = hidden_states
    a2 = torch.empty((token_num, topk, inter_dim), dtype=dtype, device=device)
    extra_stage1_args = dict(_stage1_extra_args or {})
    if not metadata.run_1stage and _needs_swiglu_bias_support(dtype, quant_type) and metadata.has_bias:
        extra_stage1_args["bias1"] = bias1
        if getattr(metadata.stage1, "func", metadata.stage1) is cktile_moe_stage1:
            extra_stage1_args["topk_ids"] = topk_ids
    a2 = metadata.stage1(
        a1, w1, w2, sorted_ids, sorted_expert_ids, num_valid_ids, None if metadata.fuse_quant else a2, topk,
        block_m=block_size_M, a1_scale=a1_scale,
        w1_scale=w1_scale.view(dtypes.fp8_e8m0)
        if w1.dtype in (dtypes.fp4x2, dtypes.fp8) and w1_scale is not None and w1_scale.element_size() == 1
        else w1_scale,
        sorted_weights=sorted_weights if doweight_stage1 else None,
        **extra_stage1_args,
    )
    if mx and half and w1.dtype == dtypes.fp4x2 and (
        q_dtype_a in [dtypes.bf16, dtypes.fp16] and gated or (metadata.ksplit > 1 and is_shuffled)
    ):
        a2_scale = None
    elif mx and half and q_dtype_a == dtypes.fp8 and w1.dtype in (dtypes.fp4x2, dtypes.fp8):
        if not _MOE_A8W4_BYPASS_QUANT:
            a2 = a2.view(-1, inter_dim)
            a2, a2_scale = fused_dynamic_mxfp8_quant_moe_sort(
                a2,
                sorted_ids=sorted_ids,
                num_valid_ids=num_valid_ids,
                token_num=token_num,
                topk=topk,
                block_size=block_size_M,
                sorted_weights=sorted_weights,
            )
            a2 = a2.view(token_num, topk, -1)
        else:
            a2 = a2.to(dtypes.fp8)
            a2_scale = a1_scale
    elif mx:
        a2 = a2.view(-1, inter_dim)
        a2, a2_scale = fused_dynamic_mxfp4_quant_moe_sort(
            a2,
            sorted_ids=sorted_ids,
            num_valid_ids=num_valid_ids,
            token_num=token_num,
            topk=topk,
            block_size=block_size_M,
            num_rows=num_local_tokens,
            sorted_weights=sorted_weights,
        )
        a2 = a2.view(token_num, topk, -1)
    else:
        a2, a2_scale = quant_func(a2, scale=a2_scale, quant_dtype=q_dtype_a, num_rows=num_local_tokens,
                                  num_rows_factor=topk)
        a2 = a2.view(token_num, topk, inter_dim)
    metadata.stage2(
        a2, w1, w2, sorted_ids, sorted_expert_ids, num_valid_ids, moe_out, topk,
        w2_scale=w2_scale.view(dtypes.fp8_e8m0)
        if w2.dtype in (dtypes.fp4x2, dtypes.fp8) and w2_scale is not None and w2_scale.element_size() == 1
        else w2_scale,
        a2_scale=a2_scale, block_m=block_size_M,
        sorted_weights=sorted_weights if not doweight_stage1 else None,
    )
    return moe_out
