"""Stand-in for ``aiter/ops/quant.py`` (v0.1.20): the MX quant + MoE-sort helpers and ``get_hip_quant``.

Python logic (dispatch between the fused kernel and the two-launch split path,
buffer sizes) follows AITER's lines 1036-1200; the HIP kernels underneath are
the torch stand-ins in ``_leaf_kernels``.
"""

import torch

from ..utility import dtypes
from .enum import QuantType
from ._leaf_kernels import (
    fused_dynamic_mx_quant_moe_sort_hip,
    mxfp4_moe_sort_hip,
    per_1x32_mx_quant_hip,
)

__all__ = [
    "get_hip_quant",
    "per_1x32_mx_quant_hip",
    "mxfp4_moe_sort_hip",
    "mxfp4_moe_sort_fwd",
    "fused_dynamic_mx_quant_moe_sort_hip",
    "fused_dynamic_mx_quant_moe_sort",
    "fused_dynamic_mxfp4_quant_moe_sort",
    "fused_dynamic_mxfp8_quant_moe_sort",
]


def _no_quant(x, *args, **kwargs):
    return x, None


def get_hip_quant(qType):
    """AITER line 368. The stand-in implements only the quant types the patches' paths use."""
    table = {QuantType.No.value: _no_quant, QuantType.per_1x32.value: per_1x32_mx_quant_hip}

    def unsupported(*args, **kwargs):
        raise NotImplementedError(f"unsupported quant type {qType=} (in the aiter_patches stand-in)")

    return table.get(int(qType), unsupported)


def mxfp4_moe_sort_fwd(scale, sorted_ids, num_valid_ids, token_num, cols):
    """AITER line 874."""
    scale_n_pad = ((cols + 31) // 32 + 7) // 8 * 8
    out_scale = torch.empty(
        (sorted_ids.shape[0] + 31) // 32 * 32, scale_n_pad, dtype=dtypes.fp8_e8m0, device=scale.device
    )
    mxfp4_moe_sort_hip(out_scale, scale, sorted_ids, num_valid_ids, token_num, cols)
    return out_scale


def fused_dynamic_mx_quant_moe_sort(
    input: torch.Tensor,
    sorted_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    token_num: int,
    topk: int,
    block_size: int,
    quant_dtype: torch.dtype = dtypes.fp4x2,
    num_rows: torch.Tensor | None = None,
    group_size: int = 32,
    sorted_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AITER line 1036: fused single kernel for small M, quant + scale sort (two launches) otherwise."""
    if quant_dtype not in (dtypes.fp4x2, dtypes.fp8):
        raise ValueError(f"fused_dynamic_mx_quant_moe_sort: unsupported quant_dtype {quant_dtype}")
    switch = [8 * 256 / topk, 8 * 1024 / topk]
    M, N = input.view(-1, input.shape[-1]).shape
    out_cols = N // 2 if quant_dtype == dtypes.fp4x2 else N
    is_stage1 = M == token_num
    eff_topk = 1 if is_stage1 else topk
    scale_n_pad = ((N + group_size - 1) // group_size + 7) // 8 * 8
    scale = torch.empty(
        (sorted_ids.shape[0] + 31) // 32 * 32, scale_n_pad, dtype=dtypes.fp8_e8m0, device=input.device
    )
    use_fused = (
        (is_stage1 and M <= switch[0])
        or (not is_stage1 and M <= switch[1] * eff_topk)
        or group_size != 32
    )
    if use_fused:
        out = torch.empty(M, out_cols, dtype=quant_dtype, device=input.device)
        fused_dynamic_mx_quant_moe_sort_hip(
            out, scale, input, sorted_ids, num_valid_ids, token_num, block_size, group_size, sorted_weights
        )
    else:
        scale_type = dtypes.fp8_e8m0 if quant_dtype == dtypes.fp8 else None
        out, scale_per_token = per_1x32_mx_quant_hip(
            input,
            scale=None,
            quant_dtype=quant_dtype,
            scale_type=scale_type,
            shuffle=False,
            num_rows=num_rows,
            num_rows_factor=eff_topk,
        )
        mxfp4_moe_sort_hip(scale, scale_per_token, sorted_ids, num_valid_ids, token_num, N)
    return out, scale


def fused_dynamic_mxfp4_quant_moe_sort(
    input: torch.Tensor,
    sorted_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    token_num: int,
    topk: int,
    block_size: int,
    num_rows: torch.Tensor | None = None,
    group_size: int = 32,
    sorted_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AITER line 1152."""
    return fused_dynamic_mx_quant_moe_sort(
        input=input,
        sorted_ids=sorted_ids,
        num_valid_ids=num_valid_ids,
        token_num=token_num,
        topk=topk,
        block_size=block_size,
        quant_dtype=dtypes.fp4x2,
        num_rows=num_rows,
        group_size=group_size,
        sorted_weights=sorted_weights,
    )


def fused_dynamic_mxfp8_quant_moe_sort(
    input: torch.Tensor,
    sorted_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    token_num: int,
    topk: int,
    block_size: int,
    num_rows: torch.Tensor | None = None,
    group_size: int = 32,
    sorted_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AITER line 1183."""
    return fused_dynamic_mx_quant_moe_sort(
        input=input,
        sorted_ids=sorted_ids,
        num_valid_ids=num_valid_ids,
        token_num=token_num,
        topk=topk,
        block_size=block_size,
        quant_dtype=dtypes.fp8,
        num_rows=num_rows,
        group_size=group_size,
        sorted_weights=sorted_weights,
    )
