"""Torch reference of AITER's per-1x32 MX quant and its fused MoE-sort scale writeback.

Why integer arithmetic: the result must be bit-exact on every backend (CPU, Triton
interpreter, NVIDIA, AMD), and float casts to fp8/fp4 or out-of-range float->int casts differ
between them. Every rounding below is done on the fp32 bit pattern.

Per group of 32 consecutive values of a row (aiter-facts.md "MX quant contract",
`csrc/include/mx_quant_utils.h`, RoundUp):

* ``amax = max(1e-10, max |x|)`` over the group's non-NaN values (AITER's ``max(absMax, abs(x))``
  is fmaxf, which skips NaN; ``quant_kernels.cu``); ``u = bits(fp32(amax * fp32(1 / max_pos)))``;
  ``e = (u >> 23) & 0xFF``, plus one when the mantissa of ``u`` is nonzero and ``e < 0xFF``.
  ``max_pos`` is 6 (fp4 e2m1), 448 (fp8 e4m3fn), 240 (fp8 e4m3fnuz, gfx942).
* A group holding +-Inf gets scale byte ``0xFF`` (e8m0 NaN); a NaN only counts as absent from
  the maximum.
* Non-finite elements, as AITER's element store (``quant_kernels.cu`` -> ``scaled_quant_vgpr_impl``
  -> ``aiter_opus_plus.h`` at e4048607a5):

  - fp8 (``fp32_to_fp8_scaled_x2``, aiter_opus_plus.h:51-75): ``v_pk_mul_f32`` by the inverse
    scale (``__builtin_amdgcn_rcpf``: ``+0`` for an Inf group's ``+Inf`` scale), then
    ``v_med3_f32 x, -max_pos, +max_pos`` and ``v_cvt_pk_fp8_f32``. med3 with a NaN first operand
    returns ``min(-max_pos, +max_pos)`` (AMD ISA: ``V_MED3_F32`` of a NaN is ``V_MIN3_F32``, and
    ``V_MIN_F32`` returns the non-NaN operand; LLVM's ``amdgcn_fmed3`` fold says the same). So
    a NaN element, whatever its sign, becomes ``-max_pos``: byte ``0xFE`` (e4m3fn, gfx950) or
    ``0xFF`` (e4m3fnuz, gfx942). Under an Inf group every finite element is ``x * 0 = +-0``
    and every +-Inf element ``Inf * 0 = NaN``, so ``-max_pos`` too.
  - fp4 (gfx950 ``v_cvt_scalef32_pk_fp4_f32``, no clamp before it): a NaN saturates to
    ``+-6`` with its sign (codes ``0x7`` / ``0xF``). CK's device test of that instruction
    expects ``+6`` for a positive NaN; the negative case follows CK's software model of it.
    Under an Inf group (scale operand ``+Inf``): finite elements ``+-0``, +-Inf saturated with
    their sign, CK's ``x / scale`` model; not checked on gfx950 hardware.
* ``q = x * 2^(127 - e)`` rounded to nearest-even on the target grid, saturated at +-max_pos,
  sign kept (``-0`` stays ``-0``; e4m3fnuz has no ``-0`` and writes ``0x00``).
* fp4 packs element ``2i`` in the low nibble of byte ``i`` (``[0.5, 1.0] -> 0x21``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..aiter_contract import (  # re-exported: the formats and AITER's rules are the contract's, written once
    AMAX_FLOOR_BITS,
    FP4_E2M1,
    FP8_E4M3FN,
    FP8_E4M3FNUZ,
    MX_GROUP,
    STAGE1_FUSED_MAX_PAIRS,
    MxFormat,
    mx_format,
    mx_scale_shape,
    round_up,
    stage1_uses_fused_quant,
)

GROUP = MX_GROUP


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def e8m0_scale_bytes(groups: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """RoundUp e8m0 scale byte (int64 0..255) per row of ``groups`` ``[..., 32]``."""
    abs_bits = _f32_bits(groups) & 0x7FFFFFFF
    amax_bits = torch.where(abs_bits > 0x7F800000, 0, abs_bits).amax(dim=-1)  # NaN skipped
    nonfinite = amax_bits >= 0x7F800000
    amax = amax_bits.clamp(min=AMAX_FLOOR_BITS).to(torch.int32).view(torch.float32)
    inv = torch.full((1,), fmt.inv_max_pos_bits, dtype=torch.int32, device=groups.device).view(torch.float32)
    u = _f32_bits(amax * inv)
    e = (u >> 23) & 0xFF
    e = torch.where(((u & 0x7FFFFF) != 0) & (e < 0xFF), e + 1, e)
    return torch.where(nonfinite, torch.full_like(e, 0xFF), e)


def mx_element_codes(groups: torch.Tensor, scale: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """Code (int64, sign included) of every element of ``groups`` ``[..., 32]`` under ``scale``."""
    bits = _f32_bits(groups)
    sign = (bits >> 31) & 1
    biased = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    sig = torch.where(biased > 0, mant | 0x800000, mant)
    # value = sig * 2^(exp_q - 23), with exp_q the unbiased exponent of x / 2^(scale - 127)
    exp_q = torch.where(biased > 0, biased, torch.ones_like(biased)) - scale.unsqueeze(-1)
    ulp_exp = exp_q.clamp(min=fmt.min_exp) - fmt.mant_bits
    shift = (ulp_exp - (exp_q - 23)).clamp(max=30)
    n = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    n = n + ((rem > half) | ((rem == half) & ((n & 1) == 1))).to(torch.int64)
    normal = exp_q >= fmt.min_exp
    code = torch.where(normal, ((exp_q - fmt.min_exp + 1) << fmt.mant_bits) + n - (1 << fmt.mant_bits), n)
    code = code.clamp(max=fmt.max_code)
    nonfinite = biased == 0xFF
    code = torch.where(nonfinite, torch.full_like(code, fmt.max_code), code)
    code = torch.where((scale.unsqueeze(-1) == 0xFF) & ~nonfinite, torch.zeros_like(code), code)
    if fmt.neg_zero:
        code = code | (sign << fmt.sign_shift)
    else:
        code = torch.where(code == 0, code, code | (sign << fmt.sign_shift))
    if fmt.nan_code is not None:
        code = torch.where(nonfinite, torch.full_like(code, fmt.nan_code), code)
    return code


def mx_quant_rows(x: torch.Tensor, quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize every row of ``x`` ``[M, N]`` (N % 32 == 0).

    Returns ``(data, scale)``: data bytes as uint8 (``[M, N // 2]`` fp4, ``[M, N]`` fp8) and
    the unswizzled e8m0 bytes ``[M, N // 32]`` as uint8.
    """
    fmt = mx_format(quant_dtype)
    M, N = x.shape
    if N % GROUP:
        raise ValueError("N must be a multiple of 32")
    groups = x.reshape(M, N // GROUP, GROUP)
    scale = e8m0_scale_bytes(groups, fmt)
    codes = mx_element_codes(groups, scale, fmt).reshape(M, N)
    if fmt is FP4_E2M1:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes.to(torch.uint8), scale.to(torch.uint8)


def mx_scale_swizzle_index(row, group, scale_n_pad: int):
    """Byte offset of e8m0 scale (sorted row, group) in AITER's swizzled layout (ints or tensors)."""
    return ((row // 32) * scale_n_pad * 32 + (group // 8) * 256 + (group % 4) * 64
            + (row % 16) * 4 + ((group % 8) // 4) * 2 + (row % 32) // 16)


pad_to = round_up
scale_shape = mx_scale_shape  # AITER's scale tensor shape for len(sorted_ids) and N


class MxQuantSortResult(NamedTuple):
    """``(data, scale)`` as AITER returns them plus masks of the positions AITER defines.

    ``data``: ``[M, N // 2]`` float4_e2m1fn_x2 or ``[M, N]`` fp8, original row order.
    ``scale``: ``[pad32(len(sorted_ids)), pad8(N // 32)]`` float8_e8m0fnu, swizzled by sorted row.
    ``data_defined``: bool ``[M]``, rows AITER writes deterministically.
    ``scale_defined``: bool, ``scale``'s shape, bytes AITER writes deterministically.
    Undefined positions hold 0 here and must be masked in comparisons.
    """

    data: torch.Tensor
    scale: torch.Tensor
    data_defined: torch.Tensor
    scale_defined: torch.Tensor


def mx_quant_moe_sort_reference(
    input: torch.Tensor,
    sorted_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    sorted_weights: torch.Tensor | None,
    token_num: int,
    quant_dtype: torch.dtype,
    *,
    fused: bool = True,
) -> MxQuantSortResult:
    """Stage-1 ``fused_dynamic_mx_quant_moe_sort(input, ..., token_num=M)`` (input has ``M`` rows).

    ``fused=True`` models AITER's fused kernel (``fused_mx_quant_moe_sort_kernel``, taken when
    ``M * topk <= 2048``, see :func:`stage1_uses_fused_quant`); ``fused=False`` the split path
    (per-row quant, then ``mxfp4_moe_sort_kernel`` moves scales to sorted rows).

    Defined positions, fused path (``nv = num_valid_ids[0]``, ``T = num_valid_ids[1]``):

    * Sorted rows ``r < nv`` whose token ``t = sorted_ids[r] & 0xFFFFFF < token_num``: scale
      bytes ``(r, g)`` for ``g < N/32`` are the token row's scales, or ``0`` when
      ``sorted_weights[r] == 0.0`` (also ``-0.0``). With ``T < token_num`` the padding rows name
      token ``T`` with weight 0, so they get scale 0 and zero data row ``T``.
    * Data row ``t``: the quantized row if every sorted row naming ``t`` has a nonzero weight,
      all zero bytes if every one has weight 0; undefined if none names it (not written) or the
      weights are mixed (AITER's threads race on the row).
    * Padding rows with token ``>= token_num``, rows ``>= nv``, scale columns
      ``[N/32, pad8(N/32))`` and scale rows past ``len(sorted_ids)``: not written.

    Split path: the scale of a real pair's row is its token row's scale whatever its weight;
    data rows ``< T`` are quantized; padding rows and rows ``>= T`` are treated as undefined
    (AITER writes zeros or a row-``T`` scale there depending on a performance heuristic).
    """
    dev = input.device
    M, N = input.shape
    data_rows, row_scale = mx_quant_rows(input.to(torch.float32), quant_dtype)
    n_rows, scale_n_pad = scale_shape(sorted_ids.numel(), N)
    r, tok, zero_w = _live_rows(sorted_ids, num_valid_ids, sorted_weights, token_num, fused)
    row_bytes = row_scale.to(torch.int64)[tok]  # [R, G]
    row_bytes = torch.where(zero_w.unsqueeze(1), torch.zeros_like(row_bytes), row_bytes)
    addr = _scale_addresses(r, N, scale_n_pad)
    scale = torch.zeros(n_rows * scale_n_pad, dtype=torch.uint8, device=dev)
    scale[addr.reshape(-1)] = row_bytes.reshape(-1).to(torch.uint8)
    data_defined, quantized = _data_rows(M, tok, zero_w, num_valid_ids, token_num, fused)
    data = torch.zeros_like(data_rows)
    data[quantized] = data_rows[quantized]
    return MxQuantSortResult(
        data=data.view(quant_dtype),
        scale=scale.view(n_rows, scale_n_pad).view(torch.float8_e8m0fnu),
        data_defined=data_defined,
        scale_defined=mx_quant_defined(sorted_ids, num_valid_ids, sorted_weights, token_num, M, N, fused=fused)[1],
    )


def mx_quant_defined(sorted_ids: torch.Tensor, num_valid_ids: torch.Tensor, sorted_weights: torch.Tensor | None,
                     token_num: int, M: int, N: int, *, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data_defined [M], scale_defined [scale rows, scale columns])``: the positions AITER's stage-1 quant
    writes deterministically (:func:`mx_quant_moe_sort_reference` says which), computed without quantizing,
    on the tensors' device: what a comparison of two quants masks by (the self-check's, on the GPU)."""
    n_rows, scale_n_pad = scale_shape(sorted_ids.numel(), N)
    r, tok, zero_w = _live_rows(sorted_ids, num_valid_ids, sorted_weights, token_num, fused)
    scale_defined = torch.zeros(n_rows * scale_n_pad, dtype=torch.bool, device=sorted_ids.device)
    scale_defined[_scale_addresses(r, N, scale_n_pad).reshape(-1)] = True
    data_defined, _ = _data_rows(M, tok, zero_w, num_valid_ids, token_num, fused)
    return data_defined, scale_defined.view(n_rows, scale_n_pad)


def _live_rows(sorted_ids, num_valid_ids, sorted_weights, token_num: int, fused: bool):
    """The sorted rows AITER quantizes ``r``, their tokens ``tok``, and which of them it zeroes (weight 0)."""
    nv, T = (int(v) for v in num_valid_ids[:2].tolist())
    dev = sorted_ids.device
    r = torch.arange(nv, device=dev)
    tok = sorted_ids[:nv].to(torch.int64) & 0xFFFFFF
    live = tok < (token_num if fused else min(T, token_num))
    r, tok = r[live], tok[live]
    if sorted_weights is not None and fused:
        zero_w = sorted_weights[:nv][live] == 0.0
    else:
        zero_w = torch.zeros_like(tok, dtype=torch.bool)
    return r, tok, zero_w


def _scale_addresses(r: torch.Tensor, N: int, scale_n_pad: int) -> torch.Tensor:
    g = torch.arange(N // GROUP, device=r.device)
    return mx_scale_swizzle_index(r.unsqueeze(1), g.unsqueeze(0), scale_n_pad)


def _data_rows(M: int, tok, zero_w, num_valid_ids, token_num: int, fused: bool):
    """``(defined, quantized)`` bool ``[M]``: the data rows AITER defines, and those it quantizes (the
    others defined are zero)."""
    dev = tok.device
    if fused:
        zero_seen = torch.zeros(M, dtype=torch.bool, device=dev)
        quant_seen = torch.zeros(M, dtype=torch.bool, device=dev)
        zero_seen[tok[zero_w]] = True
        quant_seen[tok[~zero_w]] = True
        return zero_seen ^ quant_seen, quant_seen & ~zero_seen
    T = int(num_valid_ids[1])
    defined = torch.arange(M, device=dev) < min(T, token_num)
    return defined, defined


def swizzle_scale_rows(row_scale: torch.Tensor) -> torch.Tensor:
    """AITER's ``shuffle_scale`` form: pad ``[R, G]`` to (pad32, pad8) and permute (used by tests)."""
    R, G = row_scale.shape
    sm, sn = mx_scale_shape(R, G * GROUP)
    padded = torch.zeros(sm, sn, dtype=row_scale.dtype, device=row_scale.device)
    padded[:R, :G] = row_scale
    return padded.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)
