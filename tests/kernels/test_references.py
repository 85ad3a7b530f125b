"""The torch references against hand-built cases and AITER's published formulas."""

from __future__ import annotations

import math

import pytest
import torch

from aiter_patches.reference.moe_sorting import defined_sort_region, moe_sorting_reference, sort_buffer_sizes
from aiter_patches.reference.mx_quant import (
    FP4_E2M1,
    FP8_E4M3FN,
    FP8_E4M3FNUZ,
    e8m0_scale_bytes,
    mx_quant_moe_sort_reference,
    mx_quant_rows,
    mx_scale_swizzle_index,
    stage1_uses_fused_quant,
    swizzle_scale_rows,
)

FP4, FP8, FP8NUZ = torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.float8_e4m3fnuz

# Three tokens, topk 2, four experts, block 4.
IDS = torch.tensor([[0, 2], [2, 1], [0, 2]], dtype=torch.int32)
W = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])


def _pad(topk, tokens):
    return (topk << 24) | tokens


def _tid(token, slot):
    return (slot << 24) | token


def test_sort_hand_built_three_tokens():
    ids, w, e, nv = moe_sorting_reference(IDS, W, 4, 4)
    assert (ids.numel(), e.numel()) == sort_buffer_sizes(6, 2, 4, 4) == (20, 5)
    P = _pad(2, 3)
    assert ids[:12].tolist() == [_tid(0, 0), _tid(2, 0), P, P,       # expert 0
                                 _tid(1, 1), P, P, P,                 # expert 1
                                 _tid(0, 1), _tid(1, 0), _tid(2, 1), P]  # expert 2; expert 3: no block
    assert torch.allclose(w[:12], torch.tensor([.1, .5, 0, 0, .4, 0, 0, 0, .2, .3, .6, 0]))
    assert e[:3].tolist() == [0, 1, 2]
    assert nv.tolist() == [12, 3]
    assert defined_sort_region(nv, 4) == (12, 3)


def test_sort_expert_mask_gives_local_ids_and_drops_pairs():
    ids, w, e, nv = moe_sorting_reference(IDS, W, 4, 4, expert_mask=torch.tensor([1, 0, 1, 1], dtype=torch.int32))
    P = _pad(2, 3)
    assert ids[:8].tolist() == [_tid(0, 0), _tid(2, 0), P, P, _tid(0, 1), _tid(1, 0), _tid(2, 1), P]
    assert e[:2].tolist() == [0, 1]  # global experts 0 and 2 are local 0 and 1
    assert nv.tolist() == [8, 3]


def test_sort_num_local_tokens_pads_with_local_count():
    ids, w, e, nv = moe_sorting_reference(IDS, W, 4, 4, num_local_tokens=torch.tensor([2], dtype=torch.int32))
    P = _pad(2, 2)
    assert ids[:12].tolist() == [_tid(0, 0), P, P, P, _tid(1, 1), P, P, P, _tid(0, 1), _tid(1, 0), P, P]
    assert nv.tolist() == [12, 2]


def test_sort_num_local_tokens_outside_the_batch_is_written_as_given():
    """AITER's kernel stores num_local_tokens[0] as is (moe_sorting_opus.h: ``p_total_tokens_post_pad[1]
    = tokens``); it routes nothing below 0 and reads out of bounds above M, where the reference stops."""
    ids, w, e, nv = moe_sorting_reference(IDS, W, 4, 4, num_local_tokens=torch.tensor([-3], dtype=torch.int32))
    assert nv.tolist() == [0, -3]
    whole = moe_sorting_reference(IDS, W, 4, 4)
    ids, w, e, nv = moe_sorting_reference(IDS, W, 4, 4, num_local_tokens=torch.tensor([100], dtype=torch.int32))
    assert nv.tolist() == [int(whole[3][0]), 100]
    n = int(nv[0])
    pad_old, pad_new = _pad(2, 3), _pad(2, 100)
    assert ids[:n].tolist() == [pad_new if v == pad_old else v for v in whole[0][:n].tolist()]
    assert pad_new in ids[:n].tolist()


def test_sort_drops_out_of_range_ids_and_keeps_duplicates():
    bad = torch.tensor([[0, 9], [-1, 1], [1, 1]], dtype=torch.int32)
    ids, w, e, nv = moe_sorting_reference(bad, W, 4, 4)
    P = _pad(2, 3)
    assert ids[:8].tolist() == [_tid(0, 0), P, P, P, _tid(1, 1), _tid(2, 0), _tid(2, 1), P]
    assert nv.tolist() == [8, 3]


def test_sort_empty_batch():
    ids, w, e, nv = moe_sorting_reference(torch.empty(0, 4, dtype=torch.int32), torch.empty(0, 4), 8, 16)
    assert nv.tolist() == [0, 0] and ids.numel() == 8 * 16 - 4


def test_swizzle_formula_matches_view_permute_form():
    g = torch.Generator().manual_seed(0)
    for rows, groups in [(32, 8), (70, 12), (5, 3), (96, 224)]:
        row_scale = torch.randint(0, 256, (rows, groups), generator=g, dtype=torch.uint8)
        sm, sn = math.ceil(rows / 32) * 32, math.ceil(groups / 8) * 8
        flat = torch.zeros(sm * sn, dtype=torch.uint8)
        x = torch.arange(rows)[:, None]
        y = torch.arange(groups)[None, :]
        flat[mx_scale_swizzle_index(x, y, sn).reshape(-1)] = row_scale.reshape(-1)
        assert torch.equal(flat.view(sm, sn), swizzle_scale_rows(row_scale))


def _group(*vals):
    x = torch.zeros(1, 32)
    x[0, : len(vals)] = torch.tensor(vals)
    return x


def test_fp4_packing_low_nibble_first():
    data, scale = mx_quant_rows(_group(0.5, 1.0, 6.0), FP4)  # amax 6: scale 2^0
    assert scale.item() == 127
    assert data[0, 0].item() == 0x21
    assert data[0, 1].item() == 0x07


def test_fp4_round_to_nearest_even_and_saturation():
    vals = (6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -1e-30, -6.0, 0.3)
    data, scale = mx_quant_rows(_group(*vals), FP4)
    codes = torch.stack([data[0] & 0xF, data[0] >> 4], -1).reshape(-1)[: len(vals)].tolist()
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 8, 15, 1]


@pytest.mark.parametrize("amax,fmt,byte", [
    (6.0, FP4_E2M1, 127),            # exact power of two stays
    (6.0001, FP4_E2M1, 128),         # anything above rounds up
    (3.0, FP4_E2M1, 126),
    (12.0, FP4_E2M1, 128),
    (448.0, FP8_E4M3FN, 127),
    (449.0, FP8_E4M3FN, 128),
    (240.0, FP8_E4M3FNUZ, 127),
    (241.0, FP8_E4M3FNUZ, 128),
    (0.0, FP4_E2M1, (torch.tensor([1e-10 / 6]).view(torch.int32).item() >> 23) + 1),  # amax floor 1e-10
])
def test_roundup_scale(amax, fmt, byte):
    assert e8m0_scale_bytes(_group(amax, -amax / 2).reshape(1, 1, 32), fmt).item() == byte


@pytest.mark.parametrize("special", [float("inf"), -float("inf")])
def test_infinite_group_gets_0xff(special):
    for qd in (FP4, FP8, FP8NUZ):
        _, scale = mx_quant_rows(_group(1.0, special), qd)
        assert scale.item() == 0xFF


def test_nan_is_skipped_by_the_group_maximum():
    """AITER's per-thread ``max(absMax, abs(x))`` is fmaxf: a NaN leaves the maximum (and the scale) as is."""
    for qd in (FP4, FP8, FP8NUZ):
        plain = mx_quant_rows(_group(3.0, -1.0), qd)[1].item()
        with_nan = _group(3.0, -1.0)
        with_nan[0, 5] = float("nan")
        assert mx_quant_rows(with_nan, qd)[1].item() == plain != 0xFF
        all_nan = torch.full((1, 32), float("nan"))
        assert mx_quant_rows(all_nan, qd)[1].item() == mx_quant_rows(torch.zeros(1, 32), qd)[1].item()


def _codes(data, qd, n):
    """The first ``n`` element codes of row 0 (fp4 unpacked low nibble first)."""
    row = data[0].to(torch.int64)
    if qd == FP4:
        row = torch.stack([row & 0xF, row >> 4], -1).reshape(-1)
    return row[:n].tolist()


def test_nan_element_byte_is_aiters_clamp_result():
    """Issue 14.3. fp8: AITER clamps with v_med3_f32(x, -max, +max) before v_cvt_pk_fp8_f32
    (aiter_opus_plus.h:50-71); med3 of a NaN is its min operand, so any NaN is -max_pos: 0xFE on
    e4m3fn (gfx950), 0xFF on e4m3fnuz (gfx942). fp4 (v_cvt_scalef32_pk_fp4_f32, no clamp): +-6
    with the NaN's sign."""
    pos_nan = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32).item()
    neg_nan = torch.tensor([-4194304], dtype=torch.int32).view(torch.float32).item()  # 0xFFC00000
    x = _group(3.0, pos_nan, neg_nan, -1.0)
    assert _codes(mx_quant_rows(x, FP8)[0], FP8, 4) == [0x7C, 0xFE, 0xFE, 0xF0]  # scale 2^-7: 384, -128
    assert _codes(mx_quant_rows(x, FP8NUZ)[0], FP8NUZ, 4) == [0x7C, 0xFF, 0xFF, 0xF0]  # 2^-6: 192, -64
    assert _codes(mx_quant_rows(x, FP4)[0], FP4, 4) == [0x7, 0x7, 0xF, 0xC]  # scale 2^-1: 6, -2


@pytest.mark.parametrize("qd,finite,nonfinite", [
    (FP8, [0x00, 0x80, 0x00], 0xFE),   # x * (1 / Inf) = +-0; Inf * 0 and NaN -> -448
    (FP8NUZ, [0x00, 0x00, 0x00], 0xFF),  # no -0 in e4m3fnuz; -240
])
def test_fp8_elements_under_an_infinite_scale(qd, finite, nonfinite):
    x = _group(1.0e30, -2.0, 0.0, float("inf"), -float("inf"), float("nan"))
    data, scale = mx_quant_rows(x, qd)
    assert scale.item() == 0xFF
    assert _codes(data, qd, 6) == finite + [nonfinite] * 3


def test_fp4_elements_under_an_infinite_scale():
    """Not settled on gfx950 hardware: modelled as CK's ``x / scale`` (finite -> +-0), +-Inf and
    NaN saturated with their sign."""
    pos_nan = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32).item()
    x = _group(3.0e38, -2.0, float("inf"), -float("inf"), pos_nan, 0.0)  # 3e38 * 2^-128 would be code 2
    data, scale = mx_quant_rows(x, FP4)
    assert scale.item() == 0xFF
    assert _codes(data, FP4, 6) == [0x0, 0x8, 0x7, 0xF, 0x7, 0x0]


def _real_aiter_on_rocm():
    import importlib.util

    if getattr(torch.version, "hip", None) is None or not torch.cuda.is_available():
        return None
    if importlib.util.find_spec("aiter") is None:
        return None
    import aiter

    return None if getattr(aiter, "IS_AITER_PATCHES_STAND_IN", False) else aiter


@pytest.mark.gpu
@pytest.mark.parametrize("mx", ["fp8", "fp4"])
def test_amd_aiters_own_quant_writes_the_reference_bytes_for_non_finite_values(mx):
    """On an AMD GPU with real AITER: AITER's HIP quant helper on NaN (both signs), +-Inf and
    finite values must give the reference's bytes. The fp8 NaN byte is derived from AITER's
    source; the fp4 negative NaN and Inf-group bytes are a model until this test has run."""
    aiter = _real_aiter_on_rocm()
    if aiter is None:
        pytest.skip("needs real AITER on a ROCm GPU (gfx942 / gfx950)")
    from aiter_patches.reference.mx_quant import stage1_uses_fused_quant

    M, topk, E, B, N = 4, 2, 4, 16, 256
    dev = torch.device("cuda")
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=torch.int32)
    w = torch.full((M, topk), 0.5)
    sorted_ids, sorted_w, _, nv = moe_sorting_reference(ids, w, E, B)
    x = torch.randn(M, N, generator=torch.Generator().manual_seed(0)) * 3
    nan_bits = torch.tensor([0x7FC00000, -4194304], dtype=torch.int32).view(torch.float32)
    x[0, 3], x[0, 70], x[1, 40], x[2, 100] = nan_bits[0], nan_bits[1], float("inf"), -float("inf")
    x[2, 101] = nan_bits[0]
    x = x.to(torch.bfloat16)
    fn = aiter.fused_dynamic_mxfp8_quant_moe_sort if mx == "fp8" else aiter.fused_dynamic_mxfp4_quant_moe_sort
    data, scale = fn(x.to(dev), sorted_ids=sorted_ids.to(dev), num_valid_ids=nv.to(dev), token_num=M, topk=topk,
                     block_size=B, sorted_weights=sorted_w.to(dev))
    qd = data.dtype if mx == "fp8" else FP4
    ref = mx_quant_moe_sort_reference(x.float(), sorted_ids, nv, sorted_w, M, qd,
                                      fused=stage1_uses_fused_quant(M, topk))
    dd, sd = ref.data_defined, ref.scale_defined
    assert torch.equal(data.cpu().view(torch.uint8)[dd], ref.data.view(torch.uint8)[dd])
    assert torch.equal(scale.cpu().view(torch.uint8)[sd], ref.scale.view(torch.uint8)[sd])


@pytest.mark.parametrize("qd,maxv", [(FP8, 448.0), (FP8NUZ, 240.0)])
def test_fp8_rounding_near_powers_of_two_matches_torch_cast(qd, maxv):
    # amax = maxv puts the scale at 2^0, so the codes are plain casts of the values
    vals = torch.tensor([maxv, 15.5, 31.6, 31.9, 0.9999, 1.0625, 1.0626, 2 ** -10, 3 * 2 ** -11,
                         -7.75, 2 ** -6 * 1.0625, 17.0, 18.0, 19.0, -maxv])
    x = torch.zeros(1, 32)
    x[0, : vals.numel()] = vals
    data, scale = mx_quant_rows(x, qd)
    assert scale.item() == 127
    want = x.clamp(-maxv, maxv).to(qd).view(torch.uint8)
    assert torch.equal(data, want)


def test_fp8_random_rows_match_torch_cast():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 256, generator=g) * torch.exp(torch.randn(16, 1, generator=g) * 4)
    for qd, maxv in ((FP8, 448.0), (FP8NUZ, 240.0)):
        data, scale = mx_quant_rows(x, qd)
        q = (x.double() / torch.pow(2.0, scale.double() - 127).repeat_interleave(32, 1)).float()
        assert torch.equal(data, q.clamp(-maxv, maxv).to(qd).view(torch.uint8))


def test_fnuz_negative_zero_is_zero():
    data, _ = mx_quant_rows(_group(1.0, -0.0, -1e-30), FP8NUZ)
    assert data[0, 1].item() == 0 and data[0, 2].item() == 0


def test_quant_moe_sort_hand_built():
    x = torch.zeros(3, 64)
    x[0, 0], x[1, 0], x[2, 0], x[2, 32] = 6.0, 3.0, 12.0, 0.75
    w = W.clone()
    w[1, 1] = 0.0  # token 1, slot 1 (expert 1) zero weight; token 1 also has a nonzero pair
    ids, sw, _, nv = moe_sorting_reference(IDS, w, 4, 4)
    r = mx_quant_moe_sort_reference(x, ids, nv, sw, 3, FP4, fused=True)
    assert r.scale.shape == (32, 8) and r.data.shape == (3, 32) and r.data.dtype == FP4
    s = r.scale.view(torch.uint8).reshape(-1)
    sd = r.scale_defined.reshape(-1)
    row_bytes = {0: (127, 0), 1: (126, 0), 2: (128, 124)}  # e8m0 of each token's two groups (0.75 / 6 = 2^-3)
    expect = {0: 0, 1: 2, 4: None, 8: 0, 9: 1, 10: 2}  # sorted row -> token (None: zero weight)
    for r_, tok in expect.items():
        for g_ in range(2):
            a = mx_scale_swizzle_index(r_, g_, 8)
            assert sd[a]
            if tok is None:
                assert s[a] == 0
            elif g_ == 0 or tok == 2:
                assert s[a] == row_bytes[tok][g_]
    assert int(sd.sum()) == len(expect) * 2  # padding rows, pad columns: undefined
    assert r.data_defined.tolist() == [True, False, True]  # token 1: mixed weights race in AITER
    assert r.data.view(torch.uint8)[0, 0].item() == 0x07
    split = mx_quant_moe_sort_reference(x, ids, nv, sw, 3, FP4, fused=False)
    assert split.data_defined.tolist() == [True, True, True]
    assert split.scale.view(torch.uint8).reshape(-1)[mx_scale_swizzle_index(4, 0, 8)] == 126


def test_stage1_fused_threshold():
    assert stage1_uses_fused_quant(256, 8) and not stage1_uses_fused_quant(257, 8)
    assert stage1_uses_fused_quant(682, 3) and not stage1_uses_fused_quant(683, 3)
