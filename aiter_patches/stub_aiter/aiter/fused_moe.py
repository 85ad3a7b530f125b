"""Stand-in for ``aiter/fused_moe.py`` (ROCm/aiter v0.1.20).

Kept from AITER, because the patches depend on it: the signatures of
``fused_moe``, ``moe_sorting``, ``_moe_sorting_impl`` and ``fused_moe_2stages``;
the call chain ``fused_moe -> fused_moe_ -> _fused_moe_impl -> moe_sorting ->
_moe_sorting_impl`` then ``fused_moe_2stages``; the look-ups of
``_moe_sorting_impl`` and of the MX quant helpers in this module's globals at
call time; the stage-1 activation dtype rule for ``QuantType.per_1x32``; the
``accumulate`` decision from ``stage2_uses_route_reduce``; and the allocation of
a fresh output when the sort returns the ``(0, 0)`` placeholder.

Left out: FlyDSL / CK-tile / asm kernel selection, tuned configs, biases, the
shared-expert (fhmoe) path, gfx1250, a16w4 and per-1x128 branches. The stand-in
config picks one stage-2 mode: ``atomic`` (adds into the zeroed ``moe_buf``,
AITER's default) or, with ``AITER_STUB_STAGE2_MODE=reduce``, ``reduce``
(overwrites, like FlyDSL's reduce mode).
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
    if output_aux:
        raise NotImplementedError("output_aux (the a4w4 adaptive sort) is not in the aiter_patches stand-in")
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
            None,
            None,
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
    if return_local_topk_ids:
        return (*ret, local_topk_ids)
    return ret


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
    """AITER's tiers collapse to powers of two here; only the config cache key depends on it."""
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
    fuse_quant: str = ""
    stage2_has_bias: bool = False
    flat: bool = False
    output_aux: bool = False
    prequant: bool = True
    skip_inter_quant: bool = False


def _stub_stage1(a1, w1, w2, sorted_ids, sorted_expert_ids, num_valid_ids, out, topk, *, block_m, a1_scale=None,
                 w1_scale=None, sorted_weights=None, activation=ActivationType.Silu, is_g1u1=True):
    act = "gelu" if ActivationType(activation) == ActivationType.Gelu else "silu"
    _leaf.moe_stage1(
        a1, w1, sorted_ids, sorted_expert_ids, num_valid_ids, out, topk,
        token_num=out.shape[0], block_m=block_m, a1_scale=a1_scale, w1_scale=w1_scale,
        sorted_weights=sorted_weights, activation=act, is_g1u1=is_g1u1,
    )
    return out


def _stub_stage2(a2, w1, w2, sorted_ids, sorted_expert_ids, num_valid_ids, moe_out, topk, *, block_m, w2_scale=None,
                 a2_scale=None, sorted_weights=None, mode="atomic"):
    _leaf.moe_stage2(
        a2, w2, sorted_ids, sorted_expert_ids, num_valid_ids, moe_out, topk,
        token_num=moe_out.shape[0], block_m=block_m, a2_scale=a2_scale, w2_scale=w2_scale,
        sorted_weights=sorted_weights, mode=mode,
    )
    return moe_out


def _stage2_mode() -> str:
    mode = os.environ.get("AITER_STUB_STAGE2_MODE", "atomic")
    if mode not in ("atomic", "reduce"):
        raise ValueError(f"AITER_STUB_STAGE2_MODE must be 'atomic' or 'reduce', not {mode!r}")
    return mode


def get_block_size_M(token, topk, expert, inter_dim):
    """AITER line 1227 with a fixed 80-CU machine: the block size that fills the CUs best."""
    cu_num = 80
    tg_n = (inter_dim + 127) // 128
    best = []
    for el in (32, 64, 128):
        max_num_tokens = token * topk + expert * el - topk
        tg_num = tg_n * (max_num_tokens + el - 1) // el
        best.append(((tg_num + cu_num - 1) // cu_num, cu_num - tg_num % cu_num, el))
    return min(best, key=lambda x: x[:2])[-1]


def get_2stage_cfgs(token, model_dim, inter_dim, expert, topk, dtype, q_dtype_a, q_dtype_w, q_type, use_g1u1,
                    activation, doweight_stage1, hidden_pad=0, intermediate_pad=0, is_shuffled=True,
                    gate_mode=GateMode.SEPARATED, **kwargs):
    """AITER line 2110, reduced to the stand-in's one kernel pair and its stage-2 mode."""
    block_m = get_block_size_M(token, topk, expert, inter_dim)
    stage1 = functools.partial(_stub_stage1, activation=activation, is_g1u1=use_g1u1)
    stage2 = functools.partial(_stub_stage2, mode=_stage2_mode())
    return MOEMetadata(stage1=stage1, stage2=stage2, block_m=block_m, ksplit=0)


def stage2_uses_route_reduce(stage2: Callable) -> bool:
    """AITER line 423: True when stage 2 overwrites (reduce) instead of adding into the zeroed moe_buf."""
    return getattr(stage2, "keywords", {}).get("mode", "atomic") == "reduce"


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
    global_E = E
    if expert_mask is not None:
        global_E = expert_mask.numel()
    dtype = hidden_states.dtype if dtype is None else dtype
    assert dtype in [dtypes.fp16, dtypes.bf16], f"Fused_moe unsupported out dtype: {dtype}"
    q_dtype_w = w1.dtype
    q_dtype_a = w1.dtype if w1.dtype != torch.uint32 else dtypes.fp8
    if quant_type == QuantType.per_1x32 and q_dtype_w == dtypes.fp8:
        q_dtype_a = dtypes.fp8
    elif quant_type == QuantType.per_1x32:
        if activation in (ActivationType.Swiglu, ActivationType.Situv2) or gate_mode == GateMode.INTERLEAVE:
            raise NotImplementedError("Swiglu / SiTUv2 / interleaved gates are not in the aiter_patches stand-in")
        q_dtype_a = dtypes.fp4x2
    metadata = get_2stage_cfgs(
        get_padded_M(M), model_dim, inter_dim, E, topk, dtype, q_dtype_a, q_dtype_w, quant_type, isG1U1,
        activation, doweight_stage1, hidden_pad, intermediate_pad, True, gate_mode,
    )
    block_size_M = metadata.block_m if block_size_M is None else int(block_size_M)
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf = moe_sorting(
        topk_ids,
        topk_weight,
        global_E,
        model_dim,
        dtype,
        block_size_M,
        expert_mask,
        num_local_tokens,
        moe_sorting_dispatch_policy,
        return_local_topk_ids=False,
        accumulate=not stage2_uses_route_reduce(metadata.stage2),
        flat=metadata.flat,
    )
    return fused_moe_2stages(
        hidden_states, w1, w2, topk, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf, isG1U1,
        block_size_M, activation=activation, quant_type=quant_type, doweight_stage1=doweight_stage1,
        q_dtype_a=q_dtype_a, q_dtype_w=q_dtype_w, w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale,
        a2_scale=a2_scale, num_local_tokens=num_local_tokens, hidden_pad=hidden_pad,
        intermediate_pad=intermediate_pad, bias1=bias1, bias2=bias2, topk_ids=topk_ids, topk_weights=topk_weight,
        swiglu_limit=swiglu_limit, beta=beta, linear_beta=linear_beta, gate_mode=gate_mode,
        expert_mask=expert_mask,
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
    """AITER line 2929: stage-1 quant (MX helpers looked up in this module's globals), stage 1,
    inter-stage quant, stage 2 into ``moe_out``."""
    quant_func = get_quant(quant_type)
    token_num, _ = hidden_states.shape
    E, model_dim, inter_dim = get_inter_dim(w1.shape, w2.shape)
    dtype = moe_out.dtype
    device = hidden_states.device
    if moe_out.numel() == 0:
        moe_out = torch.empty((token_num, model_dim), dtype=dtype, device=device)
    metadata = get_2stage_cfgs(
        get_padded_M(token_num), model_dim, inter_dim, E, topk, dtype, q_dtype_a, q_dtype_w, quant_type, isG1U1,
        activation, doweight_stage1, hidden_pad, intermediate_pad, True, GateMode(gate_mode),
    )
    if _metadata_transform is not None:
        metadata = _metadata_transform(metadata)
    mx = quant_type == QuantType.per_1x32 and dtype in [dtypes.bf16, dtypes.fp16]
    if mx and q_dtype_a == dtypes.fp8 and w1.dtype in (dtypes.fp4x2, dtypes.fp8):
        a1, a1_scale = fused_dynamic_mxfp8_quant_moe_sort(
            hidden_states,
            sorted_ids=sorted_ids,
            num_valid_ids=num_valid_ids,
            token_num=token_num,
            topk=topk,
            block_size=block_size_M,
            sorted_weights=sorted_weights,
        )
    elif quant_type == QuantType.per_1x32:
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
    a2 = metadata.stage1(
        a1, w1, w2, sorted_ids, sorted_expert_ids, num_valid_ids, a2, topk,
        block_m=block_size_M, a1_scale=a1_scale, w1_scale=w1_scale,
        sorted_weights=sorted_weights if doweight_stage1 else None,
    )
    if mx and q_dtype_a == dtypes.fp8 and w1.dtype in (dtypes.fp4x2, dtypes.fp8):
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
    elif quant_type == QuantType.per_1x32:
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
        w2_scale=w2_scale, a2_scale=a2_scale, block_m=block_size_M,
        sorted_weights=sorted_weights if not doweight_stage1 else None,
    )
    return moe_out
