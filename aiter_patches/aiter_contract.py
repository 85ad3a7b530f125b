"""AITER's contract constants, written once: what kernels/, reference/ and patches/ must agree on.

Why one module: the replacement kernels, their torch references and the patches'
gates each depend on the same facts about AITER (how big the sort's buffers are,
how an MX format encodes, which split counts AITER's block-scale GEMM accepts).
Written three times, one copy drifts and a bitwise test compares two wrong
copies. The stand-in AITER (``aiter_patches_standin``) keeps its own copies by design: it
plays AITER, so a slip here shows up as a difference against it.

Sources: aiter-facts.md ("Sort output contract", "MX quant contract", the
block-scale GEMM), AITER at e4048607a5. This module imports neither torch nor
AITER, so a patch module may import it at no cost.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

# ---------------------------------------------------------------- the MoE sort

TOKEN_BITS = 24  # sorted_ids entries are (slot << 24) | token: tokens and padding ids keep 24 bits


# AITER's opus sort (moe_sorting_opus.h): with a workspace, two launches below this many tokens, four from it
SORT_FOUR_LAUNCHES_MIN_TOKENS = 2048


def sort_buffer_sizes(num_pairs: int, topk: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """``(max_num_tokens_padded, max_num_m_blocks)`` for ``num_pairs = topk_ids.numel()``: the lengths AITER
    allocates for ``sorted_ids`` and ``sorted_expert_ids`` (``num_pairs + num_experts * block_size - topk``,
    then in blocks rounded up)."""
    padded = num_pairs + num_experts * block_size - topk
    return padded, (padded + block_size - 1) // block_size


# ---------------------------------------------------------------- MX quant (e8m0 scale per 1x32 group)

MX_GROUP = 32  # values per e8m0 scale
# AITER's stage-1 quant takes its fused single kernel when token_num * topk <= 8 * 256 ("auto" semantics)
STAGE1_FUSED_MAX_PAIRS = 2048
AMAX_FLOOR_BITS = struct.unpack("<I", struct.pack("<f", 1e-10))[0]  # amax = max(1e-10, max |x|)
SCALE_ROWS_ALIGN = 32  # the swizzled scale tensor: sorted rows padded to 32, groups padded to 8
SCALE_GROUPS_ALIGN = 8


class MxFormat(NamedTuple):
    """Integer description of an MX element format (e2m1 or e4m3)."""

    mant_bits: int
    min_exp: int  # unbiased exponent of the smallest normal
    max_code: int  # magnitude code of the largest finite value
    nan_code: int | None  # byte of a non-finite element (NaN; +-Inf); None: saturate, sign kept
    neg_zero: bool  # whether a negative zero keeps its sign bit
    sign_shift: int
    inv_max_pos_bits: int  # fp32 bits of 1 / max_pos, as AITER's constant


# fp8 NaN is -max_pos whatever its sign: AITER clamps with v_med3_f32(x, -max, max) before
# v_cvt_pk_fp8_f32 (aiter_opus_plus.h:51-75 at e4048607a5), and med3 of a NaN is its min operand.
FP4_E2M1 = MxFormat(1, 0, 0x7, None, True, 3, 0x3E2AAAAB)
FP8_E4M3FN = MxFormat(3, -6, 0x7E, 0xFE, True, 7, 0x3B124925)  # NaN -> -448
FP8_E4M3FNUZ = MxFormat(3, -7, 0x7F, 0xFF, False, 7, 0x3B888889)  # NaN -> -240
MX_FORMATS = {"float4_e2m1fn_x2": FP4_E2M1, "float8_e4m3fn": FP8_E4M3FN, "float8_e4m3fnuz": FP8_E4M3FNUZ}


def mx_format(quant_dtype) -> MxFormat:
    """The format of a torch quant dtype (``torch.float4_e2m1fn_x2``, ...); ValueError for any other."""
    fmt = MX_FORMATS.get(str(quant_dtype).removeprefix("torch."))
    if fmt is None:
        raise ValueError(f"unsupported MX quant dtype {quant_dtype}")
    return fmt


def stage1_uses_fused_quant(token_num: int, topk: int) -> bool:
    """Whether AITER's stage-1 ``fused_dynamic_mx_quant_moe_sort`` takes its fused single kernel."""
    return token_num * topk <= STAGE1_FUSED_MAX_PAIRS


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def mx_scale_shape(num_sorted: int, model_dim: int) -> tuple[int, int]:
    """AITER's swizzled e8m0 scale tensor shape for ``len(sorted_ids) = num_sorted`` and a row of ``model_dim``."""
    groups = (model_dim + MX_GROUP - 1) // MX_GROUP
    return round_up(num_sorted, SCALE_ROWS_ALIGN), round_up(groups, SCALE_GROUPS_ALIGN)


# ---------------------------------------------------------------- block-scale fp8 GEMM (1x128 / 128x128 scales)

SCALE_BLOCK = 128  # A_scale per 1x128, B_scale per 128x128; AITER's asm kernel's K tile is the same 128


def k_tiles_per_split(K: int, splits: int) -> int:
    """128-wide K tiles per split under AITER's rule: each split rounded up to whole tiles (the last takes the rest)."""
    return math.ceil(math.ceil(K / splits) / SCALE_BLOCK)


def aligned_split(K: int, splits: int) -> int:
    """The split count AITER's tile alignment yields for a requested ``splits``."""
    return math.ceil(K / (k_tiles_per_split(K, splits) * SCALE_BLOCK))


def valid_split(K: int, splits: int) -> bool:
    """AITER's alignment check: rounding each split up to whole K tiles keeps ``splits`` splits."""
    return splits >= 1 and aligned_split(K, splits) == splits
