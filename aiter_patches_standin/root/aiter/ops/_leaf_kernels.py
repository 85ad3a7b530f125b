"""Torch stand-ins for AITER's HIP kernels.

The stand-in AITER calls these where real AITER launches a compiled HIP kernel.
They are the multi-launch baseline the patches' one-launch kernels are measured
against, so every function is a sequence of ordinary torch GPU ops (histogram,
cumsum, sort, gather, scatter, bmm): no Python loop over tokens or experts.
They are CUDA-graph capturable: shapes depend only on argument shapes, device
scalars (``num_valid_ids``, ``num_local_tokens``) are read by the ops that need
them and never brought to the host, and results are written in place into the
caller's buffers. Positions a kernel leaves unwritten are left untouched
(``torch.where(cond, new, old)`` then ``copy_``).

fp4/fp8 rounding and e8m0 exponents use int32 bit operations, so the bytes are
the same on every backend. Nothing here imports the rest of the stand-in, and
nothing imports ``aiter_patches.reference`` (the two cross-check each other).
"""

from __future__ import annotations

import struct

import torch

FP4X2 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)

_E8M0_OF_EMPTY_GROUP = 1e-10  # the kernels' amax starts here, so all-zero groups get a finite scale


# --------------------------------------------------------------------------- MoE sort


def moe_sorting_opus_get_workspace_size(
    tokens: int, num_experts: int, topk: int, dispatch_policy: int = 0
) -> int:
    """Stands for ``moe_sorting_opus_get_workspace_size`` (``csrc/include/moe_sorting_opus.h``).

    Bytes of workspace AITER's opus sort asks for: 0 for the one-shot kernel
    (policy 1, or policy 0 when the tokens fit one LDS pass), else the
    multi-phase kernel's mesh + cumsum + semaphore. The LDS size is taken as
    64 KiB (gfx942). The stand-in sort itself needs no workspace.
    """
    if dispatch_policy == 1:
        return 0
    if dispatch_policy == 0 and _opus_is_oneshot(tokens, num_experts):
        return 0
    mesh_stride = -(-tokens // 32) * 32
    mesh_elem_bytes = 4 if tokens < 512 else (2 if topk >= 255 else 1)
    cumsum_bytes = -(-(num_experts + 1) // 32) * 32 * 4
    sem_bytes = 32 * 4
    return num_experts * mesh_stride * mesh_elem_bytes + cumsum_bytes + sem_bytes


def _opus_is_oneshot(tokens: int, num_experts: int, lds_bytes: int = 65536) -> bool:
    cols = num_experts + 1
    rows = lds_bytes // 4 // 2 // cols
    if rows < 2 + 8:
        sub_tokens = 0
    else:
        sub_tokens = min((rows - 2) // 8 * 8, -(-tokens // 8) * 8)
    oneshot = tokens <= sub_tokens
    return oneshot and num_experts < 512


def moe_sorting_opus_fwd(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    sorted_weights: torch.Tensor,
    sorted_expert_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    moe_buf: torch.Tensor,
    num_experts: int,
    unit_size: int,
    local_expert_mask: torch.Tensor | None = None,
    num_local_tokens: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    dispatch_policy: int = 0,
    local_topk_ids: torch.Tensor | None = None,
    m_indices: torch.Tensor | None = None,
    reverse_sorted: torch.Tensor | None = None,
) -> None:
    """Stands for ``moe_sorting_opus_fwd`` (``aiter/ops/moe_sorting_opus.py``,
    kernel ``csrc/include/moe_sorting_opus.h``). Writes, in place:

    - ``sorted_token_ids[:total]``: ``(slot << 24) | token`` grouped by expert
      (ascending id), ascending token inside an expert; each expert's segment
      padded to a multiple of ``unit_size`` with ``(topk << 24) | (T & 0xFFFFFF)``,
      where ``T`` is ``num_local_tokens[0]`` (read on the device, used as given) or ``M``. Experts with no
      routed pair get no block.
    - ``sorted_weights[:total]``: the pair's weight, ``0.0`` in padding.
    - ``sorted_expert_ids[:total // unit_size]``: the block's expert; under
      ``local_expert_mask`` the local id (exclusive cumsum of the mask), and the
      masked experts' pairs are dropped.
    - ``num_valid_ids``: ``[total, T]``.
    - ``moe_buf`` rows ``< T`` zeroed when ``moe_buf.numel() > 0`` (AITER zeroes
      ``T * row_bytes`` in 16-byte units; the same bytes whenever a row is a
      multiple of 16 bytes, which AITER requires).
    - ``local_topk_ids`` (if given), for tokens ``< T``: the global id, or under a
      mask the local id / ``-1`` for a masked expert.
    - ``m_indices`` (if given) ``[:total]``: the token of each sorted slot, ``T`` in
      padding; ``reverse_sorted`` (if given): the sorted slot of every routed pair.

    Tokens ``>= T`` are not routed. Positions past ``total`` are not written.
    ``T`` outside ``[0, M]``: below 0 nothing is routed or zeroed and ``num_valid_ids``
    is ``[0, T]``, as in AITER; above ``M`` AITER reads ``topk_ids`` and zeroes
    ``moe_buf`` past their ends (undefined), the stand-in stops at ``M``; both write
    ``T`` as given to ``num_valid_ids[1]`` and the padding ids.
    Deviations from the HIP kernel, where it is undefined: an expert id outside
    ``[0, num_experts)`` is dropped (the kernel would index out of bounds; here
    ``local_topk_ids`` gets ``-1`` for it under a mask and the id as is without);
    a token listing one expert twice routes both pairs (the kernel keeps one of
    them, racily). ``workspace`` and ``dispatch_policy`` choose AITER's kernel
    variant and do not change the result; they are ignored.
    """
    _sort_impl(
        topk_ids,
        topk_weights,
        sorted_token_ids,
        sorted_weights,
        sorted_expert_ids,
        num_valid_ids,
        moe_buf,
        num_experts,
        unit_size,
        local_expert_mask,
        num_local_tokens,
        local_topk_ids,
        m_indices,
        reverse_sorted,
    )


def moe_sorting_fwd(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    sorted_weights: torch.Tensor,
    sorted_expert_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    moe_buf: torch.Tensor,
    num_experts: int,
    unit_size: int,
    local_expert_mask: torch.Tensor | None = None,
    num_local_tokens: torch.Tensor | None = None,
    dispatch_policy: int = 0,
) -> None:
    """Stands for the CK sort ``moe_sorting_fwd`` (``aiter/ops/moe_sorting.py``):
    the same outputs as :func:`moe_sorting_opus_fwd`."""
    _sort_impl(
        topk_ids,
        topk_weights,
        sorted_token_ids,
        sorted_weights,
        sorted_expert_ids,
        num_valid_ids,
        moe_buf,
        num_experts,
        unit_size,
        local_expert_mask,
        num_local_tokens,
    )


def _sort_impl(
    topk_ids,
    topk_weights,
    sorted_token_ids,
    sorted_weights,
    sorted_expert_ids,
    num_valid_ids,
    moe_buf,
    num_experts,
    unit_size,
    local_expert_mask,
    num_local_tokens,
    local_topk_ids=None,
    m_indices=None,
    reverse_sorted=None,
) -> None:
    device = topk_ids.device
    M, topk = topk_ids.shape
    E, B = int(num_experts), int(unit_size)
    P = M * topk
    L = sorted_token_ids.shape[0]
    num_blocks = sorted_expert_ids.shape[0]

    ids = topk_ids.reshape(-1).long()
    pair = torch.arange(P, device=device)
    token, slot = pair // topk, pair % topk
    if num_local_tokens is None:
        T = torch.full((1,), M, dtype=torch.long, device=device)
    else:
        T = num_local_tokens.reshape(-1)[:1].long()

    # Launch 1: which pairs are routed, and the per-expert histogram.
    in_range = (ids >= 0) & (ids < E)
    ids_c = ids.clamp(0, E - 1)
    routed = in_range & (token < T)
    if local_expert_mask is not None:
        mask = local_expert_mask.reshape(-1)[:E].long()
        local_id = torch.cumsum(mask, 0) - mask
        routed &= mask[ids_c] != 0
    bucket = torch.where(routed, ids_c, E)
    counts = torch.zeros(E + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))

    # Launch 2: padded segment offsets.
    padded = (counts[:E] + B - 1) // B * B
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    total = seg_end[-1:]

    # Launch 3: stable rank of each pair inside its expert (flattened token*topk+slot order).
    sorted_bucket, order = torch.sort(bucket, stable=True)
    bucket_start = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(pair)
    rank.scatter_(0, order, pair - bucket_start[sorted_bucket])
    dest = torch.where(routed, seg_start[ids_c] + rank, L)  # L is a scratch slot

    # Launch 4: scatter ids/weights over a padding-filled buffer.
    pad_id = (topk << 24) | (T & 0xFFFFFF)  # AITER's MOE_SORTING_MOCK_ID
    ids_buf = pad_id.expand(L + 1).clone()
    ids_buf.scatter_(0, dest, (slot << 24) | token)
    w_buf = torch.zeros(L + 1, dtype=torch.float32, device=device)
    w_buf.scatter_(0, dest, topk_weights.reshape(-1).float())
    written = torch.arange(L, device=device) < total
    sorted_token_ids.copy_(torch.where(written, ids_buf[:L].to(torch.int32), sorted_token_ids))
    sorted_weights.copy_(torch.where(written, w_buf[:L], sorted_weights))

    # Launch 5: expert of each block.
    block_start = torch.arange(num_blocks, device=device) * B
    block_expert = torch.searchsorted(seg_end, block_start, right=True).clamp_(max=E - 1)
    if local_expert_mask is not None:
        block_expert = local_id[block_expert]
    sorted_expert_ids.copy_(
        torch.where(block_start < total, block_expert.to(torch.int32), sorted_expert_ids)
    )
    num_valid_ids.copy_(torch.cat([total, T]).to(torch.int32))

    # Launch 6: zero the stage-2 accumulator rows below the token count.
    if moe_buf.numel() > 0:
        rows = moe_buf.shape[0]
        row_live = torch.arange(rows, device=device) < T
        moe_buf.view(rows, -1).masked_fill_(row_live.view(-1, 1), 0)

    if local_topk_ids is not None:
        if local_expert_mask is None:
            local = ids
        else:
            local = torch.where(in_range & (mask[ids_c] != 0), local_id[ids_c], -1)
        live = (token < T).view(M, topk)
        local_topk_ids.copy_(
            torch.where(live, local.view(M, topk).to(local_topk_ids.dtype), local_topk_ids)
        )
    if m_indices is not None:
        m_indices.copy_(
            torch.where(written, (ids_buf[:L] & 0xFFFFFF).to(m_indices.dtype), m_indices)
        )
    if reverse_sorted is not None:
        flat = reverse_sorted.view(-1)
        flat.copy_(torch.where(routed, dest.to(flat.dtype), flat))


# --------------------------------------------------------------------------- MX formats


class _MxFormat:
    """An MX element format: its encoding parameters and the RoundUp divisor."""

    def __init__(self, name, mbits, bias, max_code, max_pos, inv_max_pos_bits, signed_zero):
        self.name = name
        self.mbits = mbits
        self.bias = bias
        self.max_code = max_code
        self.max_pos = max_pos
        # The kernels multiply amax by the fp32 constant 1/max_pos (bits below).
        self.inv_max_pos = struct.unpack("<f", struct.pack("<I", inv_max_pos_bits))[0]
        self.signed_zero = signed_zero

    @property
    def packed(self) -> bool:
        return self.name == "fp4"


_FP4_E2M1 = _MxFormat("fp4", 1, 1, 0x7, 6.0, 0x3E2AAAAB, True)
_FP8_E4M3FN = _MxFormat("fp8_e4m3fn", 3, 7, 0x7E, 448.0, 0x3B124925, True)
_FP8_E4M3FNUZ = _MxFormat("fp8_e4m3fnuz", 3, 8, 0x7F, 240.0, 0x3B888889, False)


def _mx_format(dtype: torch.dtype) -> _MxFormat:
    if dtype in (FP4X2, torch.uint8):
        return _FP4_E2M1
    if dtype == torch.float8_e4m3fn:
        return _FP8_E4M3FN
    if dtype == torch.float8_e4m3fnuz:
        return _FP8_E4M3FNUZ
    raise NotImplementedError(f"no MX format for dtype {dtype}")


def _e8m0_round_up(amax: torch.Tensor, fmt: _MxFormat) -> torch.Tensor:
    """RoundUp e8m0 exponent (``fp_f32_to_e8m0_scale<RoundUp>``): ceil_pow2(amax / max_pos)."""
    u = (amax * fmt.inv_max_pos).view(torch.int32)
    e = (u >> 23) & 0xFF
    return e + ((e < 0xFF) & ((u & 0x7FFFFF) != 0)).to(torch.int32)


def _pow2_f32(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for int32 ``k`` in [-126, 127], built from the exponent bits."""
    return ((k + 127) << 23).view(torch.float32)


def _encode(q: torch.Tensor, fmt: _MxFormat) -> torch.Tensor:
    """fp32 -> element code (int32) with round-to-nearest-even and saturation."""
    u = q.view(torch.int32)
    sign = (u >> 31) & 1
    mag = u & 0x7FFFFFFF
    exp = mag >> 23
    full = torch.where(exp > 0, (mag & 0x7FFFFF) | 0x800000, mag & 0x7FFFFF)
    e_unb = torch.where(exp > 0, exp - 127, -126)
    emin = 1 - fmt.bias
    shift = ((23 - fmt.mbits) + (emin - e_unb).clamp(min=0)).clamp(max=25)
    half_minus_one = (torch.ones_like(shift) << (shift - 1)) - 1
    r = (full + half_minus_one + ((full >> shift) & 1)) >> shift
    code = ((e_unb.clamp(min=emin) + fmt.bias - 1) << fmt.mbits) + r
    code = code.clamp(max=fmt.max_code)
    sign_bit = 0x8 if fmt.packed else 0x80
    if fmt.signed_zero:
        return code | (sign * sign_bit)
    return code | (sign * (code != 0).to(torch.int32) * sign_bit)


def _mx_quant_rows(x: torch.Tensor, fmt: _MxFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows [R, N] per 1x32 group: (data bytes [R, N/2 or N] uint8, e8m0 [R, N/32] int32)."""
    rows, n = x.shape
    if n % 32:
        raise NotImplementedError(f"MX quant needs a multiple of 32 columns, got {n}")
    g = x.float().view(rows, n // 32, 32)
    a = g.abs()
    amax = torch.where(a.isnan(), 0.0, a).amax(dim=-1).clamp_min(_E8M0_OF_EMPTY_GROUP)  # fmaxf skips NaN
    e = _e8m0_round_up(amax, fmt)
    # AITER multiplies by the reciprocal of the fp32 scale 2^(e-127): +0 for an Inf group's +Inf.
    inv_scale = torch.where(e == 0xFF, 0.0, _pow2_f32((127 - e).clamp(-126, 127))).unsqueeze(-1)
    if fmt.packed:
        # gfx950's v_cvt_scalef32_pk_fp4_f32: a non-finite element saturates with its own sign
        q = torch.where(g.isfinite(), g * inv_scale, g)
    else:
        # v_med3_f32(q, -max, +max) before v_cvt_pk_fp8_f32 (aiter_opus_plus.h): NaN gives -max
        q = g * inv_scale
        q = torch.where(q.isnan(), -fmt.max_pos, q.clamp(-fmt.max_pos, fmt.max_pos))
    code = _encode(q, fmt).view(rows, n)
    if fmt.packed:
        code = code[:, 0::2] | (code[:, 1::2] << 4)
    return code.to(torch.uint8), e


def _decode(byte: torch.Tensor, fmt: _MxFormat) -> torch.Tensor:
    """Element bytes (uint8, fp4 packed low nibble first) -> fp32 values."""
    if not fmt.packed:
        dtype = torch.float8_e4m3fn if fmt is _FP8_E4M3FN else torch.float8_e4m3fnuz
        return byte.view(dtype).float()
    b = byte.to(torch.int32)
    code = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    e, f = (code >> 1) & 0x3, code & 1
    quarter = torch.where(e == 0, 2 * f, (2 + f) << e)  # value * 4
    value = quarter.float() * 0.25
    return torch.where(code >= 8, -value, value)


def _e8m0_to_f32(e: torch.Tensor) -> torch.Tensor:
    e = e.to(torch.int32)
    bits = torch.where(e == 0, 0x400000, torch.where(e == 0xFF, 0x7FC00000, e << 23))
    return bits.view(torch.float32)


def _dequant_bytes(data: torch.Tensor, scale: torch.Tensor, fmt: _MxFormat) -> torch.Tensor:
    values = _decode(data, fmt)
    grouped = values.view(*values.shape[:-1], -1, 32)
    return (grouped * _e8m0_to_f32(scale).unsqueeze(-1)).flatten(-2)


def mx_dequant(data: torch.Tensor, scale_bytes_rowmajor: torch.Tensor) -> torch.Tensor:
    """fp32 values of MX data (fp4x2 packed or fp8, ``[..., N/2 or N]``) with a
    row-major (unswizzled) e8m0 scale ``[..., N/32]``. Element format from ``data.dtype``."""
    fmt = _mx_format(data.dtype)
    return _dequant_bytes(data.view(torch.uint8), scale_bytes_rowmajor.view(torch.uint8), fmt)


def mx_scale_swizzle_addr(rows: torch.Tensor, groups: torch.Tensor, scale_n_pad: int) -> torch.Tensor:
    """Byte offset of (sorted row, scale group) in AITER's swizzled scale
    (``mx_scale_shuffle_idx``, ``csrc/include/mx_quant_utils.h``). Broadcasts."""
    x, y = rows.long(), groups.long()
    return (
        (x // 32) * scale_n_pad * 32
        + (y // 8) * 256
        + (y % 4) * 64
        + (x % 16) * 4
        + ((y % 8) // 4) * 2
        + (x % 32) // 16
    )


def unswizzle_scale_rows(scale: torch.Tensor, rows: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The e8m0 bytes ``[len(rows), num_groups]`` (uint8) of the given sorted rows
    of a swizzled scale ``[pad32(rows), pad8(num_groups)]``."""
    flat = scale.view(torch.uint8).reshape(-1)
    groups = torch.arange(num_groups, device=rows.device)
    addr = mx_scale_swizzle_addr(rows.view(-1, 1), groups.view(1, -1), scale.shape[-1])
    return flat[addr]


def _sorted_rows(sorted_ids: torch.Tensor):
    info = sorted_ids.reshape(-1).to(torch.int32)
    return (info & 0xFFFFFF).long(), (info >> 24).long()


# --------------------------------------------------------------------------- MX quant + sort


def fused_dynamic_mx_quant_moe_sort_hip(
    out: torch.Tensor,
    scales: torch.Tensor,
    input: torch.Tensor,
    sorted_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    token_num: int,
    block_m: int,
    group_size: int = 32,
    sorted_weights: torch.Tensor | None = None,
) -> None:
    """Stands for ``fused_dynamic_mx_quant_moe_sort_hip`` (``aiter/ops/quant.py``;
    kernel ``fused_mx_quant_moe_sort_kernel`` in ``csrc/kernels/quant_kernels.cu``).

    MX quant (RoundUp e8m0, per 1x32 group) of the input rows used by the sort,
    data written in the ORIGINAL row order of ``out`` (fp4x2 ``[R, N/2]`` or fp8
    ``[R, N]``; the element format follows ``out.dtype``: fp4 max 6, e4m3fn 448,
    e4m3fnuz 240), scale bytes written at the swizzled sorted-row addresses of
    ``scales`` ``[pad32(len(sorted_ids)), pad8(N/32)]``.

    As the kernel: ``kt = input rows // token_num`` (1 at stage 1; topk at stage 2,
    rows ``token*topk+slot``). A sorted row ``s`` is processed when
    ``s < num_valid_ids[0]`` and its token ``< token_num``; it reads input row
    ``token`` (kt == 1) or ``token*kt+slot`` (a row past the input, reached only by
    padding ids when ``num_local_tokens < token_num``, is read as zeros here; AITER
    reads past the buffer) and writes its scale bytes; it writes the data row
    when ``kt == 1 or slot < kt``. A processed row with ``sorted_weights[s] == 0.0``
    writes scale byte 0 and a zero data row instead. At stage 1 several sorted
    rows share a data row; AITER races a zero write against a data write there,
    the stand-in lets the data win. Padding rows past ``num_valid_ids[0]``,
    unused data rows and padding scale columns are left unwritten. ``block_m``
    only tiles AITER's launch and is ignored.
    """
    if group_size != 32:
        raise NotImplementedError("the stand-in implements group_size 32 only")
    fmt = _mx_format(out.dtype)
    n = input.shape[-1]
    rows = input.numel() // n
    kt = rows // token_num
    x = input.reshape(rows, n)
    # Quantize every input row once, plus one zero row for reads past the input.
    data, e = _mx_quant_rows(torch.cat([x, x.new_zeros(1, n)]), fmt)

    length = sorted_ids.shape[0]
    device = input.device
    s = torch.arange(length, device=device)
    token, slot = _sorted_rows(sorted_ids)
    processed = (s < num_valid_ids[0].long()) & (token < token_num)
    src = token if kt == 1 else token * kt + slot
    src_in = processed & (src >= 0) & (src < rows)
    if sorted_weights is None:
        zero = torch.zeros_like(processed)
    else:
        zero = processed & (sorted_weights.reshape(-1)[:length] == 0.0)

    groups = n // 32
    byte = torch.where(zero.view(-1, 1), 0, e[torch.where(src_in, src, rows)])
    addr = mx_scale_swizzle_addr(s.view(-1, 1), torch.arange(groups, device=device), scales.shape[-1])
    flat = _flat_bytes(scales)
    flat[addr] = torch.where(processed.view(-1, 1), byte.to(torch.uint8), flat[addr])

    writes = src_in & ((slot < kt) | (kt == 1))
    target = torch.where(writes, src, rows)
    data_hits = _row_hits(target, writes & ~zero, rows)
    zero_hits = _row_hits(target, writes & zero, rows)
    out_bytes = out.view(torch.uint8).view(rows, -1)
    keep_or_zero = torch.where(zero_hits.view(-1, 1), 0, out_bytes)
    out_bytes.copy_(torch.where(data_hits.view(-1, 1), data[:rows], keep_or_zero))


def per_1x32_mx_quant_hip(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    quant_dtype: torch.dtype = FP4X2,
    shuffle: bool = False,
    num_rows: torch.Tensor | None = None,
    num_rows_factor: int = 1,
    scale_type: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands for ``per_1x32_mx_quant_hip`` (``aiter/ops/quant.py``; kernel
    ``dynamic_per_group_scaled_quant_kernel`` in ``csrc/kernels/quant_kernels.cu``),
    the quant half of the large-M two-launch path.

    Returns ``(out, scale)``: data in row order (fp4x2 ``[m, n/2]`` or fp8 ``[m, n]``)
    and e8m0 scale ``[m, n/32]`` row-major, or swizzled ``[pad256(m), pad8(n/32)]``
    when ``shuffle``. Rows ``>= num_rows[0] * num_rows_factor`` (device read) are
    left unwritten. fp8 is implemented for the e8m0 scale only
    (``scale_type=float8_e8m0fnu``); AITER's fp32-scale variant raises here.
    """
    if scale is not None:
        raise ValueError("unsupported: static per token quant")
    fmt = _mx_format(quant_dtype)
    if fmt.packed and scale_type not in (None, E8M0):
        raise ValueError(f"fp4x2 output requires an e8m0 scale, got scale_type={scale_type}")
    if not fmt.packed and scale_type not in (E8M0, torch.uint8):
        raise NotImplementedError("the stand-in implements the e8m0 scale for fp8 only")
    n = x.shape[-1]
    m = x.numel() // n
    data, e = _mx_quant_rows(x.reshape(m, n), fmt)
    groups = n // 32
    device = x.device
    out = torch.empty(m, data.shape[1], dtype=quant_dtype, device=device)
    out_bytes = out.view(torch.uint8)
    row = torch.arange(m, device=device)
    if num_rows is None:
        live = torch.ones_like(row, dtype=torch.bool)
    else:
        live = row < num_rows.reshape(-1)[0].long() * num_rows_factor
    out_bytes.copy_(torch.where(live.view(-1, 1), data, out_bytes))
    if shuffle:
        scale = torch.empty((-(-m // 256) * 256, -(-groups // 8) * 8), dtype=torch.uint8, device=device)
        flat = scale.view(-1)
        addr = mx_scale_swizzle_addr(row.view(-1, 1), torch.arange(groups, device=device), scale.shape[1])
        flat[addr] = torch.where(live.view(-1, 1), e.to(torch.uint8), flat[addr])
    else:
        scale = torch.empty((m, groups), dtype=torch.uint8, device=device)
        scale.copy_(torch.where(live.view(-1, 1), e.to(torch.uint8), scale))
    return out, scale.view(E8M0)


def mxfp4_moe_sort_hip(
    out_scale: torch.Tensor,
    scale: torch.Tensor,
    sorted_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    token_num: int,
    cols: int,
) -> None:
    """Stands for ``mxfp4_moe_sort_hip`` (``aiter/ops/quant.py``; kernel
    ``mxfp4_moe_sort_kernel`` in ``csrc/kernels/quant_kernels.cu``): copies the
    row-major e8m0 scale ``[rows, cols/32]`` of the quant pass to the swizzled
    sorted-row layout of ``out_scale``. ``kt = scale rows // token_num``; sorted
    row ``s < num_valid_ids[0]`` with token ``< token_num`` and (``kt == 1`` or
    ``slot < kt``) gets the bytes of row ``token`` (kt == 1) or ``token*kt+slot``.
    Other rows and padding columns are left unwritten (AITER's LDS-staged variant
    writes zeros into them in tiles that hold a valid row).
    """
    groups = -(-cols // 32)
    src_bytes = scale.view(torch.uint8).reshape(-1, groups)
    rows = src_bytes.shape[0]
    kt = rows // token_num
    length = sorted_ids.shape[0]
    device = scale.device
    s = torch.arange(length, device=device)
    token, slot = _sorted_rows(sorted_ids)
    src = token if kt == 1 else token * kt + slot
    valid = (s < num_valid_ids[0].long()) & (token < token_num) & ((kt == 1) | ((slot >= 0) & (slot < kt)))
    valid &= (src >= 0) & (src < rows)
    byte = src_bytes[torch.where(valid, src, 0)]
    addr = mx_scale_swizzle_addr(s.view(-1, 1), torch.arange(groups, device=device), out_scale.shape[-1])
    flat = _flat_bytes(out_scale)
    flat[addr] = torch.where(valid.view(-1, 1), byte, flat[addr])


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("output buffer must be contiguous")
    return t.view(torch.uint8).view(-1)


def _row_hits(target: torch.Tensor, hit: torch.Tensor, rows: int) -> torch.Tensor:
    """Bool [rows]: rows that ``target`` reaches where ``hit`` (``target == rows`` is scratch)."""
    count = torch.zeros(rows + 1, dtype=torch.int32, device=target.device)
    count.scatter_add_(0, torch.where(hit, target, rows), hit.to(torch.int32))
    return count[:rows] > 0


# --------------------------------------------------------------------------- MoE GEMM stages


def _slot_table(sorted_ids, sorted_expert_ids, num_valid_ids, topk, token_num, block_m, num_experts):
    """Per sorted slot (padded to whole blocks): validity, token, slot, block expert."""
    length = sorted_ids.shape[0]
    num_blocks = min(sorted_expert_ids.shape[0], -(-length // block_m))
    device = sorted_ids.device
    s = torch.arange(num_blocks * block_m, device=device)
    s_c = s.clamp(max=length - 1)
    token, slot = _sorted_rows(sorted_ids.reshape(-1)[s_c])
    valid = (
        (s < length)
        & (s < num_valid_ids[0].long())
        & (token < num_valid_ids[1].long())
        & (token < token_num)
        & (slot >= 0)
        & (slot < topk)
    )
    token = torch.where(valid, token, 0)
    slot = torch.where(valid, slot, 0)
    expert = sorted_expert_ids.reshape(-1)[:num_blocks].long().clamp(0, num_experts - 1)
    return num_blocks, s_c, valid, token, slot, expert


def _activation_rows(a, a_scale, row_index, sorted_row, width):
    """fp32 activation rows: ``a``'s rows ``row_index``, dequantized with the swizzled
    sorted-row scale at ``sorted_row`` when ``a_scale`` is given."""
    if a_scale is None:
        return a.reshape(-1, width)[row_index].float()
    fmt = _mx_format(a.dtype)
    data = a.view(torch.uint8).reshape(-1, width // 2 if fmt.packed else width)[row_index]
    return _dequant_bytes(data, unswizzle_scale_rows(a_scale, sorted_row, width // 32), fmt)


def _expert_weights(w, w_scale, expert, in_features):
    """fp32 weights ``[len(expert), out, in]`` of the given experts."""
    if w_scale is None:
        return w.index_select(0, expert).float()
    fmt = _mx_format(w.dtype)
    data = w.view(torch.uint8).index_select(0, expert)
    scale = w_scale.view(torch.uint8).index_select(0, expert)
    return _dequant_bytes(data, scale, fmt).view(len(expert), -1, in_features)


def _block_gemm(x, w, w_scale, expert, num_blocks, block_m, in_features):
    weights = _expert_weights(w, w_scale, expert, in_features)
    return torch.bmm(x.view(num_blocks, block_m, in_features), weights.transpose(1, 2)).flatten(0, 1)


def _scatter_rows_(dst: torch.Tensor, target: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
    """dst[target[i]] = rows[i] where valid (targets unique); other rows of dst untouched."""
    n = dst.shape[0]
    index = torch.where(valid, target, n)
    buf = torch.empty(n + 1, dst.shape[1], dtype=dst.dtype, device=dst.device)
    buf.index_copy_(0, index, rows.to(dst.dtype))
    dst.copy_(torch.where(_row_hits(index, valid, n).view(-1, 1), buf[:n], dst))


def _act_name(activation) -> str:
    return str(getattr(activation, "name", activation)).lower()


def moe_stage1(
    a1: torch.Tensor,
    w1: torch.Tensor,
    sorted_ids: torch.Tensor,
    sorted_expert_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    out: torch.Tensor,
    topk: int,
    *,
    token_num: int,
    block_m: int,
    a1_scale: torch.Tensor | None = None,
    w1_scale: torch.Tensor | None = None,
    sorted_weights: torch.Tensor | None = None,
    activation="silu",
    is_g1u1: bool = True,
) -> None:
    """Stands for AITER's MoE stage-1 GEMM (CK ``ck_moe_stage1`` / asm / FlyDSL stage 1).

    For every valid sorted slot ``s`` (``s < num_valid_ids[0]``, token
    ``< num_valid_ids[1]`` and ``< token_num``, slot ``< topk``): the token's row of
    ``a1`` (``[token_num, model_dim]`` bf16/fp16 used as is, or MX data
    fp4x2/fp8 dequantized with the swizzled sorted-row e8m0 scale ``a1_scale``)
    times ``w1[expert]^T`` in fp32, where the expert is ``sorted_expert_ids`` of the
    slot's block; then ``silu(gate) * up`` (G1U1: gate = first half of w1's rows;
    ``activation`` "silu" or "gelu", a string or an enum with that name) or plain
    silu/gelu; times ``sorted_weights[s]`` when given; written in ``out.dtype`` to
    ``out.view(token_num*topk, inter)[token*topk + slot]``. Other rows of ``out``
    are untouched.

    Weights: bf16/fp16 ``[E, 2*inter, model_dim]``, or MXFP4 fp4x2
    ``[E, 2*inter, model_dim/2]`` / MXFP8 ``[E, 2*inter, model_dim]`` with an
    UNSHUFFLED row-major e8m0 ``w1_scale [E, 2*inter, model_dim/32]`` (the
    stand-in does not model AITER's weight or weight-scale shuffles). One bmm
    over all blocks with ``w1[sorted_expert_ids]`` gathered per block (memory
    O(blocks * 2*inter * model_dim)).
    """
    num_experts, n_out = w1.shape[0], w1.shape[1]
    in_features = w1.shape[2] * (2 if _is_packed(w1, w1_scale) else 1)
    inter = n_out // 2 if is_g1u1 else n_out
    num_blocks, s, valid, token, slot, expert = _slot_table(
        sorted_ids, sorted_expert_ids, num_valid_ids, topk, token_num, block_m, num_experts
    )
    x = _activation_rows(a1, a1_scale, token, s, in_features)
    h = _block_gemm(x, w1, w1_scale, expert, num_blocks, block_m, in_features)
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}.get(_act_name(activation))
    if act is None:
        raise NotImplementedError(f"stand-in stage 1 has no activation {activation!r}")
    y = act(h[:, :inter]) * h[:, inter:] if is_g1u1 else act(h)
    if sorted_weights is not None:
        y = y * sorted_weights.reshape(-1)[s].float().view(-1, 1)
    _scatter_rows_(out.view(token_num * topk, inter), token * topk + slot, y, valid)


def moe_stage2(
    a2: torch.Tensor,
    w2: torch.Tensor,
    sorted_ids: torch.Tensor,
    sorted_expert_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    moe_out: torch.Tensor,
    topk: int,
    *,
    token_num: int,
    block_m: int,
    a2_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    sorted_weights: torch.Tensor | None = None,
    mode: str = "atomic",
) -> None:
    """Stands for AITER's MoE stage-2 GEMM (CK / FlyDSL atomic, FlyDSL reduce).

    For every valid sorted slot (as in :func:`moe_stage1`): ``a2`` row
    ``token*topk + slot`` (bf16/fp16, or MX data dequantized with the swizzled
    sorted-row scale ``a2_scale``) times ``w2[expert]^T`` in fp32 (w2 ``[E,
    model_dim, inter]``, or MX with an unshuffled ``[E, model_dim, inter/32]``
    scale), times ``sorted_weights[s]`` when given, rounded to ``moe_out.dtype``:
    ``y[t, k]``. Then, THE STAND-IN'S ORDER (a contract other code relies on):

    - ``mode="atomic"``: adds into ``moe_out``: for k = 0..topk-1 in turn,
      ``moe_out[t] = (moe_out[t].float() + y[t, k].float()).to(dtype)`` for the
      tokens whose slot k is valid; nothing else is touched.
    - ``mode="reduce"``: overwrites ``moe_out[t] = (sum of y[t, k].float() over the
      valid slots, k ascending, from +0.0).to(dtype)`` for every token
      ``t < num_valid_ids[1]`` (no valid slot gives 0); rows past it untouched.
    """
    if mode not in ("atomic", "reduce"):
        raise ValueError(f"mode must be 'atomic' or 'reduce', got {mode!r}")
    num_experts, model_dim = w2.shape[0], w2.shape[1]
    in_features = w2.shape[2] * (2 if _is_packed(w2, w2_scale) else 1)
    num_blocks, s, valid, token, slot, expert = _slot_table(
        sorted_ids, sorted_expert_ids, num_valid_ids, topk, token_num, block_m, num_experts
    )
    pair = token * topk + slot
    x = _activation_rows(a2, a2_scale, pair, s, in_features)
    y = _block_gemm(x, w2, w2_scale, expert, num_blocks, block_m, in_features)
    if sorted_weights is not None:
        y = y * sorted_weights.reshape(-1)[s].float().view(-1, 1)
    y = y.to(moe_out.dtype)

    pairs = token_num * topk
    table = torch.zeros(pairs, model_dim, dtype=moe_out.dtype, device=y.device)
    _scatter_rows_(table, pair, y, valid)
    present = _row_hits(torch.where(valid, pair, pairs), valid, pairs).view(token_num, topk)
    table = table.view(token_num, topk, model_dim)
    out = moe_out.view(-1, model_dim)[:token_num]
    if mode == "atomic":
        for k in range(topk):
            summed = (out.float() + table[:, k].float()).to(out.dtype)
            out.copy_(torch.where(present[:, k : k + 1], summed, out))
        return
    acc = torch.zeros(token_num, model_dim, dtype=torch.float32, device=y.device)
    for k in range(topk):
        acc = torch.where(present[:, k : k + 1], acc + table[:, k].float(), acc)
    live = torch.arange(token_num, device=y.device) < num_valid_ids[1].long()
    out.copy_(torch.where(live.view(-1, 1), acc.to(out.dtype), out))


def _is_packed(w: torch.Tensor, w_scale: torch.Tensor | None) -> bool:
    return w_scale is not None and _mx_format(w.dtype).packed
