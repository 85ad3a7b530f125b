"""Tests of the stand-in AITER's leaf kernels (torch stand-ins for HIP kernels).

The module is loaded from its file so that the test does not depend on the
rest of the stand-in package. Expected values are written out by hand or
computed by plain per-token loops here.
"""

import importlib.util
import pathlib

import pytest
import torch

_PATH = pathlib.Path(__file__).parents[2] / "aiter_patches_standin/root/aiter/ops/_leaf_kernels.py"
_SPEC = importlib.util.spec_from_file_location("_stub_leaf_kernels", _PATH)
lk = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(lk)

FP4 = lk.FP4X2
POISON_I = -7
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _pad(token, topk):
    return (topk << 24) | token


def _sort_buffers(M, topk, E, B, model_dim=8, device="cpu"):
    length = M * topk + E * B - topk
    return dict(
        sorted_token_ids=torch.full((length,), POISON_I, dtype=torch.int32, device=device),
        sorted_weights=torch.full((length,), float("nan"), device=device),
        sorted_expert_ids=torch.full((-(-length // B),), POISON_I, dtype=torch.int32, device=device),
        num_valid_ids=torch.full((2,), POISON_I, dtype=torch.int32, device=device),
        moe_buf=torch.full((M, model_dim), 3.0, dtype=torch.bfloat16, device=device),
    )


def _sort(ids, w, E, B, fn=None, **kw):
    bufs = _sort_buffers(*ids.shape, E, B, device=ids.device)
    (fn or lk.moe_sorting_opus_fwd)(
        ids,
        w,
        bufs["sorted_token_ids"],
        bufs["sorted_weights"],
        bufs["sorted_expert_ids"],
        bufs["num_valid_ids"],
        bufs["moe_buf"],
        E,
        B,
        **kw,
    )
    return bufs


# 3 tokens, 4 experts, topk 2, block 4.
IDS = torch.tensor([[0, 2], [2, 3], [0, 2]], dtype=torch.int32)
WTS = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])


def test_sort_hand_case():
    out = _sort(IDS, WTS, 4, 4)
    p = _pad(3, 2)
    expected_ids = [0, 2, p, p, (1 << 24) | 0, 1, (1 << 24) | 2, p, (1 << 24) | 1, p, p, p]
    assert out["sorted_token_ids"][:12].tolist() == expected_ids
    assert (out["sorted_token_ids"][12:] == POISON_I).all()
    w = WTS.flatten()
    expected_w = torch.stack([w[0], w[4], 0 * w[0], 0 * w[0], w[1], w[2], w[5], 0 * w[0], w[3], 0 * w[0], 0 * w[0], 0 * w[0]])
    assert torch.equal(out["sorted_weights"][:12], expected_w)
    assert out["sorted_weights"][12:].isnan().all()
    assert out["sorted_expert_ids"].tolist() == [0, 2, 3, POISON_I, POISON_I]
    assert out["num_valid_ids"].tolist() == [12, 3]
    assert (out["moe_buf"] == 0).all()


def test_sort_expert_mask_gives_local_ids_and_drops_masked_pairs():
    mask = torch.tensor([1, 1, 0, 1], dtype=torch.int32)
    local = torch.full_like(IDS, POISON_I)
    out = _sort(IDS, WTS, 4, 4, local_expert_mask=mask, local_topk_ids=local)
    p = _pad(3, 2)
    assert out["sorted_token_ids"][:8].tolist() == [0, 2, p, p, (1 << 24) | 1, p, p, p]
    assert out["sorted_expert_ids"][:2].tolist() == [0, 2]
    assert out["num_valid_ids"].tolist() == [8, 3]
    assert local.tolist() == [[0, -1], [-1, 2], [0, -1]]


def test_sort_num_local_tokens_routes_only_live_tokens():
    local_tokens = torch.tensor([2], dtype=torch.int32)
    local = torch.full_like(IDS, POISON_I)
    out = _sort(IDS, WTS, 4, 4, num_local_tokens=local_tokens, local_topk_ids=local)
    p = _pad(2, 2)
    assert out["sorted_token_ids"][:12].tolist() == [0, p, p, p, (1 << 24) | 0, 1, p, p, (1 << 24) | 1, p, p, p]
    assert out["num_valid_ids"].tolist() == [12, 2]
    assert (out["moe_buf"][:2] == 0).all() and (out["moe_buf"][2] == 3.0).all()
    assert local.tolist() == [[0, 2], [2, 3], [POISON_I, POISON_I]]


def test_sort_drops_out_of_range_ids():
    ids = torch.tensor([[0, -1], [4, 3], [0, 2]], dtype=torch.int32)
    out = _sort(ids, WTS, 4, 4)
    p = _pad(3, 2)
    assert out["sorted_token_ids"][:12].tolist() == [0, 2, p, p, (1 << 24) | 2, p, p, p, (1 << 24) | 1, p, p, p]
    assert out["sorted_expert_ids"][:3].tolist() == [0, 2, 3]
    assert out["num_valid_ids"].tolist() == [12, 3]


def _loop_sort(ids, w, E, B, mask=None, T=None):
    """Per-expert loop: the contract of aiter-facts.md, written the slow way."""
    M, topk = ids.shape
    T = M if T is None else T
    tok_ids, wts, blocks, local = [], [], [], 0
    for e in range(E):
        if mask is not None and mask[e] == 0:
            continue
        seg = [(t, k) for t in range(T) for k in range(topk) if ids[t, k] == e]
        if seg:
            n = -(-len(seg) // B) * B
            tok_ids += [(k << 24) | t for t, k in seg] + [_pad(T, topk)] * (n - len(seg))
            wts += [w[t, k].item() for t, k in seg] + [0.0] * (n - len(seg))
            blocks += [local if mask is not None else e] * (n // B)
        local += 1
    return tok_ids, wts, blocks


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("fn", ["opus", "ck"])
def test_sort_random_matches_loop(masked, fn):
    g = torch.Generator().manual_seed(1)
    M, topk, E, B = 37, 4, 16, 8
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).to(torch.int32)
    w = torch.rand(M, topk, generator=g)
    mask = (torch.rand(E, generator=g) > 0.3).to(torch.int32) if masked else None
    T = torch.tensor([30], dtype=torch.int32)
    sort_fn = lk.moe_sorting_opus_fwd if fn == "opus" else lk.moe_sorting_fwd
    out = _sort(ids, w, E, B, fn=sort_fn, local_expert_mask=mask, num_local_tokens=T)
    tok_ids, wts, blocks = _loop_sort(ids, w, E, B, mask, 30)
    n = len(tok_ids)
    assert out["num_valid_ids"].tolist() == [n, 30]
    assert out["sorted_token_ids"][:n].tolist() == tok_ids
    assert torch.equal(out["sorted_weights"][:n], torch.tensor(wts))
    assert out["sorted_expert_ids"][: n // B].tolist() == blocks


def test_sort_aux_outputs():
    length = IDS.numel() + 4 * 4 - 2
    m_idx = torch.full((length,), POISON_I, dtype=torch.int32)
    rev = torch.full((IDS.numel(),), POISON_I, dtype=torch.int32)
    out = _sort(IDS, WTS, 4, 4, m_indices=m_idx, reverse_sorted=rev)
    assert m_idx[:12].tolist() == [t & 0xFFFFFF for t in out["sorted_token_ids"][:12].tolist()]
    assert rev.tolist() == [0, 4, 5, 8, 1, 6]


def test_workspace_size():
    assert lk.moe_sorting_opus_get_workspace_size(16, 128, 8, 1) == 0
    assert lk.moe_sorting_opus_get_workspace_size(16, 128, 8, 0) == 0
    assert lk.moe_sorting_opus_get_workspace_size(16, 128, 8, 2) == 128 * 32 * 4 + 160 * 4 + 128


# --------------------------------------------------------------------------- MX quant


def _quant(x, dtype):
    out, scale = lk.per_1x32_mx_quant_hip(x, quant_dtype=dtype, scale_type=lk.E8M0)
    return out.view(torch.uint8), scale.view(torch.uint8)


def test_fp4_packing_low_nibble_first():
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :3] = torch.tensor([0.5, 1.0, 6.0])
    data, scale = _quant(x, FP4)
    assert scale.tolist() == [[127]]
    assert data[0, :2].tolist() == [0x21, 0x07]


@pytest.mark.parametrize(
    "amax, byte",
    [(3.0, 126), (3.0625, 127), (6.0, 127), (6.5, 128), (0.0, 94)],
)
def test_round_up_scale(amax, byte):
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 5] = -amax
    _, scale = _quant(x, FP4)
    u = torch.tensor([max(amax, 1e-10)], dtype=torch.float32) * torch.tensor([1 / 6], dtype=torch.float32)
    bits = u.view(torch.int32).item()
    expected = ((bits >> 23) & 0xFF) + (1 if bits & 0x7FFFFF else 0)
    assert scale.item() == expected
    if amax:
        assert scale.item() == byte


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_elements_match_torch_cast(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 128, generator=g) * 10).to(torch.bfloat16)
    data, scale = _quant(x, dtype)
    inv = torch.exp2(127.0 - scale.float()).repeat_interleave(32, dim=1)
    expected = (x.float() * inv).to(dtype).view(torch.uint8)
    assert torch.equal(data, expected)


def test_fp4_elements_round_to_nearest_even():
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    vals = [6.0, 0.25, 0.75, 1.25, 2.5, 3.5, 5.0, -0.0, -1.75, -3.0, 0.3, 0.0]
    x[0, : len(vals)] = torch.tensor(vals)
    data, _ = _quant(x, FP4)
    codes = [b & 0xF for b in data[0].tolist() for b in (b, b >> 4)]
    assert codes[: len(vals)] == [7, 0, 2, 2, 4, 6, 6, 8, 12, 13, 1, 0]


def test_split_quant_shuffle_and_num_rows():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, 96, generator=g).to(torch.bfloat16)
    data, rowmajor = _quant(x, FP4)
    _, shuffled = lk.per_1x32_mx_quant_hip(x, quant_dtype=FP4, shuffle=True)
    assert shuffled.shape == (256, 8)
    addr = lk.mx_scale_swizzle_addr(torch.arange(40).view(-1, 1), torch.arange(3), 8)
    assert torch.equal(shuffled.view(torch.uint8).flatten()[addr], rowmajor)
    part, part_scale = lk.per_1x32_mx_quant_hip(x, quant_dtype=FP4, num_rows=torch.tensor([5]), num_rows_factor=3)
    assert torch.equal(part.view(torch.uint8)[:15], data[:15])
    assert torch.equal(part_scale.view(torch.uint8)[:15], rowmajor[:15])


def _sort_case(M, topk, E, B, seed, T=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).to(torch.int32)
    w = torch.rand(M, topk, generator=g) + 0.1
    kw = {} if T is None else {"num_local_tokens": torch.tensor([T], dtype=torch.int32)}
    return ids, w, _sort(ids, w, E, B, **kw)


def _fused(x, sort, token_num, dtype, sorted_weights=None):
    n = x.shape[-1]
    length = sort["sorted_token_ids"].shape[0]
    rows = x.numel() // n
    out = torch.full((rows, n // 2 if dtype == FP4 else n), 0xAB, dtype=torch.uint8).view(dtype)
    scale = torch.full((-(-length // 32) * 32, -(-(n // 32) // 8) * 8), 0xAB, dtype=torch.uint8).view(lk.E8M0)
    lk.fused_dynamic_mx_quant_moe_sort_hip(
        out, scale, x, sort["sorted_token_ids"], sort["num_valid_ids"], token_num, 8, 32, sorted_weights
    )
    return out.view(torch.uint8), scale.view(torch.uint8)


def _split(x, sort, token_num, dtype):
    n = x.shape[-1]
    length = sort["sorted_token_ids"].shape[0]
    data, per_row = lk.per_1x32_mx_quant_hip(x, quant_dtype=dtype, scale_type=lk.E8M0)
    scale = torch.full((-(-length // 32) * 32, -(-(n // 32) // 8) * 8), 0xCD, dtype=torch.uint8)
    lk.mxfp4_moe_sort_hip(scale, per_row, sort["sorted_token_ids"], sort["num_valid_ids"], token_num, n)
    return data.view(torch.uint8), scale


def _defined(sort, token_num, topk, n, stage):
    """Scale addresses and data rows that AITER's fused kernel writes."""
    nv = sort["num_valid_ids"][0].item()
    info = sort["sorted_token_ids"][:nv]
    tok, slot = info & 0xFFFFFF, info >> 24
    rows = torch.arange(nv)[tok < token_num]
    data_rows = tok[tok < token_num] if stage == 1 else (tok * topk + slot)[(tok < token_num) & (slot < topk)]
    addr = lk.mx_scale_swizzle_addr(rows.view(-1, 1), torch.arange(n // 32), -(-(n // 32) // 8) * 8)
    return addr.flatten(), torch.unique(data_rows)


@pytest.mark.parametrize("dtype", [FP4, torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("stage", [1, 2])
def test_fused_and_split_quant_agree_on_defined_bytes(dtype, stage):
    M, topk, E, B, n = 21, 3, 8, 8, 96
    ids, w, sort = _sort_case(M, topk, E, B, seed=3)
    g = torch.Generator().manual_seed(4)
    rows = M if stage == 1 else M * topk
    x = (torch.randn(rows, n, generator=g) * 4).to(torch.bfloat16)
    f_data, f_scale = _fused(x, sort, M, dtype)
    s_data, s_scale = _split(x, sort, M, dtype)
    addr, data_rows = _defined(sort, M, topk, n, stage)
    assert torch.equal(f_scale.flatten()[addr], s_scale.flatten()[addr])
    assert torch.equal(f_data[data_rows], s_data[data_rows])
    untouched = torch.ones(f_scale.numel(), dtype=torch.bool)
    untouched[addr] = False
    assert (f_scale.flatten()[untouched] == 0xAB).all()
    assert (s_scale.flatten()[untouched] == 0xCD).all()
    # Scale bytes sit at the swizzled address of the sorted row: check one by hand.
    s0 = 0
    t0, k0 = sort["sorted_token_ids"][s0].item() & 0xFFFFFF, sort["sorted_token_ids"][s0].item() >> 24
    src = t0 if stage == 1 else t0 * topk + k0
    _, per_row = _quant(x[src : src + 1], dtype)
    assert f_scale.flatten()[lk.mx_scale_swizzle_addr(torch.tensor([0]), torch.arange(3), 8)].tolist() == per_row[0].tolist()


def test_fused_quant_zero_weight_rows():
    M, topk, E, B, n = 6, 2, 4, 8, 64
    ids, w, sort = _sort_case(M, topk, E, B, seed=5)
    g = torch.Generator().manual_seed(6)
    x2 = (torch.randn(M * topk, n, generator=g) + 1).to(torch.bfloat16)
    sw = sort["sorted_weights"].clone()
    sw[0] = 0.0
    info = sort["sorted_token_ids"][0].item()
    t, k = info & 0xFFFFFF, info >> 24
    data, scale = _fused(x2, sort, M, FP4, sorted_weights=sw)
    zero_addr = lk.mx_scale_swizzle_addr(torch.tensor([0]), torch.arange(2), 8)
    assert (scale.flatten()[zero_addr] == 0).all()
    assert (data[t * topk + k] == 0).all()
    # Stage 1: the token's other slot writes data, and the data wins.
    x1 = (torch.randn(M, n, generator=g) + 1).to(torch.bfloat16)
    data1, scale1 = _fused(x1, sort, M, FP4, sorted_weights=sw)
    expected, _ = _quant(x1[t : t + 1], FP4)
    assert torch.equal(data1[t], expected[0])
    assert (scale1.flatten()[zero_addr] == 0).all()


# --------------------------------------------------------------------------- stages


def _naive_stage1(x, w1, ids, w, inter, doweight):
    out = torch.empty(ids.shape[0] * ids.shape[1], inter)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            h = x[t] @ w1[ids[t, k]].T
            y = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t * ids.shape[1] + k] = y * (w[t, k] if doweight else 1.0)
    return out


def _stage_case(seed=7):
    M, topk, E, B, D, inter = 9, 2, 4, 8, 64, 32
    ids, w, sort = _sort_case(M, topk, E, B, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    a1 = torch.randn(M, D, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * inter, D, generator=g) / 8).to(torch.bfloat16)
    w2 = (torch.randn(E, D, inter, generator=g) / 8).to(torch.bfloat16)
    return M, topk, E, B, D, inter, ids, w, sort, a1, w1, w2


def _stage1(a1, w1, sort, topk, M, B, inter, **kw):
    out = torch.full((M, topk, inter), float("nan"), dtype=torch.bfloat16)
    lk.moe_stage1(
        a1, w1, sort["sorted_token_ids"], sort["sorted_expert_ids"], sort["num_valid_ids"], out, topk,
        token_num=M, block_m=B, **kw,
    )
    return out


@pytest.mark.parametrize("doweight", [False, True])
def test_stage1_bf16_matches_loop(doweight):
    M, topk, E, B, D, inter, ids, w, sort, a1, w1, w2 = _stage_case()
    sw = sort["sorted_weights"] if doweight else None
    out = _stage1(a1, w1, sort, topk, M, B, inter, sorted_weights=sw)
    expected = _naive_stage1(a1.float(), w1.float(), ids, w, inter, doweight)
    torch.testing.assert_close(out.view(-1, inter).float(), expected, atol=1e-2, rtol=1e-2)


def test_stage1_mxfp4_matches_loop():
    M, topk, E, B, D, inter, ids, w, sort, a1, w1, w2 = _stage_case(seed=9)
    a1_q, a1_scale = _fused(a1, sort, M, FP4)
    w1_q, w1_scale = lk.per_1x32_mx_quant_hip(w1.view(-1, D), quant_dtype=FP4)
    w1_q, w1_scale = w1_q.view(E, 2 * inter, D // 2), w1_scale.view(E, 2 * inter, D // 32)
    out = _stage1(a1_q.view(FP4), w1_q, sort, topk, M, B, inter, a1_scale=a1_scale.view(lk.E8M0), w1_scale=w1_scale)
    _, a1_rows = lk.per_1x32_mx_quant_hip(a1, quant_dtype=FP4)
    x = lk.mx_dequant(a1_q.view(FP4), a1_rows)
    wf = lk.mx_dequant(w1_q, w1_scale)
    expected = _naive_stage1(x, wf, ids, w, inter, False)
    torch.testing.assert_close(out.view(-1, inter).float(), expected, atol=1e-2, rtol=1e-2)


def test_stage1_invalid_slots_write_nothing():
    M, topk, E, B, D, inter, ids, w, sort, a1, w1, w2 = _stage_case()
    _, _, sort5 = _sort_case(M, topk, E, B, seed=7, T=5)
    out = _stage1(a1, w1, sort5, topk, M, B, inter)
    assert out[5:].isnan().all() and not out[:5].isnan().any()


def _naive_stage2(a2, w2, ids, w, moe_out, mode):
    out = moe_out.clone()
    M, topk = ids.shape
    y = [[((a2[t, k].float() @ w2[ids[t, k]].float().T) * w[t, k]).to(out.dtype) for k in range(topk)] for t in range(M)]
    for t in range(M):
        if mode == "atomic":
            for k in range(topk):
                out[t] = (out[t].float() + y[t][k].float()).to(out.dtype)
        else:
            acc = torch.zeros(out.shape[1])
            for k in range(topk):
                acc = acc + y[t][k].float()
            out[t] = acc.to(out.dtype)
    return out


@pytest.mark.parametrize("mode", ["atomic", "reduce"])
def test_stage2_modes(mode):
    M, topk, E, B, D, inter, ids, w, sort, a1, w1, w2 = _stage_case(seed=11)
    a2 = torch.randn(M, topk, inter, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    start = torch.randn(M, D, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    moe_out = start.clone()
    lk.moe_stage2(
        a2, w2, sort["sorted_token_ids"], sort["sorted_expert_ids"], sort["num_valid_ids"], moe_out, topk,
        token_num=M, block_m=B, sorted_weights=sort["sorted_weights"], mode=mode,
    )
    expected = _naive_stage2(a2, w2, ids, w, start, mode)
    torch.testing.assert_close(moe_out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    far = _naive_stage2(a2, w2, ids, w, start, "reduce" if mode == "atomic" else "atomic")
    assert (moe_out.float() - far.float()).abs().max() > 0.5


def test_stage2_atomic_is_exact_slot_order():
    """A token whose slots are all valid gets start + y0 + y1 rounded after each add, bit for bit."""
    M, topk, E, B, D, inter, ids, w, sort, a1, w1, w2 = _stage_case(seed=14)
    a2 = torch.randn(M, topk, inter, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)
    start = torch.randn(M, D, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    moe_out = start.clone()
    lk.moe_stage2(
        a2, w2, sort["sorted_token_ids"], sort["sorted_expert_ids"], sort["num_valid_ids"], moe_out, topk,
        token_num=M, block_m=B, mode="atomic",
    )
    # y per (token, slot) from the stage itself, recovered with a zero start and one slot live.
    ys = []
    for k in range(topk):
        only = dict(sort)
        keep = (sort["sorted_token_ids"] >> 24) == k
        only["sorted_token_ids"] = torch.where(keep, sort["sorted_token_ids"], _pad(M, topk))
        y = torch.zeros(M, D, dtype=torch.bfloat16)
        lk.moe_stage2(
            a2, w2, only["sorted_token_ids"], sort["sorted_expert_ids"], sort["num_valid_ids"], y, topk,
            token_num=M, block_m=B, mode="reduce",
        )
        ys.append(y)
    expected = start
    for y in ys:
        expected = (expected.float() + y.float()).to(torch.bfloat16)
    assert torch.equal(moe_out.view(torch.int16), expected.view(torch.int16))


def test_stage2_reduce_leaves_rows_past_token_count():
    M, topk, E, B, D, inter, ids, w, _, a1, w1, w2 = _stage_case(seed=17)
    _, _, sort = _sort_case(M, topk, E, B, seed=17, T=4)
    a2 = torch.randn(M, topk, inter).to(torch.bfloat16)
    moe_out = torch.full((M, D), 7.0, dtype=torch.bfloat16)
    lk.moe_stage2(
        a2, w2, sort["sorted_token_ids"], sort["sorted_expert_ids"], sort["num_valid_ids"], moe_out, topk,
        token_num=M, block_m=B, mode="reduce",
    )
    assert (moe_out[4:] == 7.0).all() and (moe_out[:4] != 7.0).any()


# --------------------------------------------------------------------------- CUDA graph


@pytest.mark.gpu
@gpu
def test_cuda_graph_capture_and_replay():
    dev = "cuda"
    M, topk, E, B, D, inter = 16, 4, 8, 16, 256, 128
    g = torch.Generator(device=dev).manual_seed(0)

    def inputs():
        ids = torch.rand(M, E, device=dev, generator=g).argsort(dim=1)[:, :topk].to(torch.int32)
        return ids, torch.rand(M, topk, device=dev, generator=g), torch.randn(M, D, device=dev, generator=g).to(torch.bfloat16)

    w1 = (torch.randn(E, 2 * inter, D, device=dev, generator=g) / 16).to(torch.bfloat16)
    w2 = (torch.randn(E, D, inter, device=dev, generator=g) / 16).to(torch.bfloat16)
    w1_q, w1_s = lk.per_1x32_mx_quant_hip(w1.view(-1, D), quant_dtype=FP4)
    w2_q, w2_s = lk.per_1x32_mx_quant_hip(w2.view(-1, inter), quant_dtype=FP4)
    w1_q, w1_s = w1_q.view(E, 2 * inter, D // 2), w1_s.view(E, 2 * inter, D // 32)
    w2_q, w2_s = w2_q.view(E, D, inter // 2), w2_s.view(E, D, inter // 32)
    static_ids, static_w, static_x = inputs()
    local_tokens = torch.tensor([M - 3], dtype=torch.int32, device=dev)

    def step():
        bufs = _sort_buffers(M, topk, E, B, model_dim=D, device=dev)
        st, sw, se, nv, mb = bufs.values()
        lk.moe_sorting_opus_fwd(static_ids, static_w, st, sw, se, nv, mb, E, B, num_local_tokens=local_tokens)
        length = st.shape[0]
        a1 = torch.empty(M, D // 2, dtype=FP4, device=dev)
        a1_s = torch.empty(-(-length // 32) * 32, D // 32, dtype=torch.uint8, device=dev).view(lk.E8M0)
        lk.fused_dynamic_mx_quant_moe_sort_hip(a1, a1_s, static_x, st, nv, M, B, 32, sw)
        h = torch.zeros(M, topk, inter, dtype=torch.bfloat16, device=dev)
        lk.moe_stage1(a1, w1_q, st, se, nv, h, topk, token_num=M, block_m=B, a1_scale=a1_s, w1_scale=w1_s)
        a2 = torch.empty(M * topk, inter // 2, dtype=FP4, device=dev)
        a2_s = torch.empty(-(-length // 32) * 32, 8, dtype=torch.uint8, device=dev).view(lk.E8M0)
        lk.fused_dynamic_mx_quant_moe_sort_hip(a2, a2_s, h.view(-1, inter), st, nv, M, B, 32, sw)
        lk.moe_stage2(a2, w2_q, st, se, nv, mb, topk, token_num=M, block_m=B, a2_scale=a2_s, w2_scale=w2_s, sorted_weights=sw)
        return mb

    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    for _ in range(3):
        ids, w, x = inputs()
        static_ids.copy_(ids)
        static_w.copy_(w)
        static_x.copy_(x)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        assert torch.equal(graph_out[: M - 3].view(torch.int16), eager[: M - 3].view(torch.int16))
        assert graph_out[: M - 3].abs().sum() > 0


@pytest.mark.parametrize("fmt,qd", [(lk._FP4_E2M1, torch.float4_e2m1fn_x2), (lk._FP8_E4M3FN, torch.float8_e4m3fn),
                                    (lk._FP8_E4M3FNUZ, torch.float8_e4m3fnuz)])
def test_non_finite_elements_match_the_reference(fmt, qd):
    """Issue 14.3: the stand-in wrote 0x7E (e4m3fn) for a NaN, the kernel and the reference 0x7F;
    AITER's clamp gives -max_pos (0xFE / 0xFF). Inf groups: finite elements +-0."""
    from aiter_patches.reference.mx_quant import mx_quant_rows

    bits = torch.tensor([0x7FC00000, -4194304, 0x7F800001, 0x7F800000, -8388608], dtype=torch.int32)
    specials = bits.view(torch.float32)  # +NaN, -NaN, a signalling NaN, +Inf, -Inf
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=g) * 3
    x[0, 3], x[1, 5:7], x[2, 0] = specials[0], specials[1:3], specials[0]
    x[2, 1:32] = specials[0]  # a group of NaN but one value
    x[3, 40], x[4, 7], x[4, 9] = specials[3], specials[4], specials[0]  # Inf groups, one with a NaN
    x[5, :32] = specials[0]  # a group of NaN only
    data, scale = lk._mx_quant_rows(x, fmt)
    want_data, want_scale = mx_quant_rows(x, qd)
    assert torch.equal(scale.to(torch.uint8), want_scale)
    assert torch.equal(data, want_data)

