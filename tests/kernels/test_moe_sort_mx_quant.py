"""The one-launch MoE sort + moe_buf fill + MX quant kernel against the torch references.

Every output buffer is poisoned before the call, then compared bitwise with the references
over the positions AITER defines. CPU runs use the Triton interpreter on small shapes; the
``gpu`` tests run the issue's matrix natively.
"""

from __future__ import annotations

import pytest
import torch

import aiter_patches.kernels.moe_sort_mx_quant as k
from aiter_patches.reference.moe_sorting import defined_sort_region, moe_sorting_reference
from aiter_patches.aiter_contract import mx_format
from aiter_patches.reference.mx_quant import e8m0_scale_bytes, mx_quant_moe_sort_reference, mx_scale_swizzle_index, stage1_uses_fused_quant
from helpers.poisoned import poisoned_empty

FP4, FP8, FP8NUZ = torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.float8_e4m3fnuz
HAS_GPU = torch.cuda.is_available()
DEV = "cuda" if HAS_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
# the interpreter cases of tens of seconds on 2 cores whose behaviour a cheaper default-run case also meets
# (CI's second step runs them: python -m pytest -m slow_ci)
SLOW_CI = pytest.mark.slow_ci


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every buffer the launcher allocates starts as 0xAB bytes, so unwritten bytes show."""
    monkeypatch.setattr(k, "_empty", poisoned_empty)


def routing(M, K, E, kind="uniform", seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]) if M else torch.empty(0, K)
    elif kind == "one":  # every token's first slot goes to expert E-1
        rest = [torch.randperm(E - 1, generator=g)[: K - 1] for _ in range(M)]
        ids = torch.stack([torch.cat([torch.tensor([E - 1]), r]) for r in rest]) if M else torch.empty(0, K)
    elif kind == "skewed":  # most traffic on a few experts, duplicates allowed
        p = torch.pow(torch.arange(1, E + 1, dtype=torch.float64), -2.0)
        ids = torch.multinomial(p, M * K, replacement=True, generator=g).reshape(M, K)
    elif kind == "bad":  # out-of-range ids sprinkled in
        ids = torch.randint(-3, E + 3, (M, K), generator=g)
    else:
        raise ValueError(kind)
    w = torch.rand(M, K, generator=g)
    return ids.to(torch.int32).to(device), w.to(device)


def activations(M, N, kind="normal", seed=0, dtype=torch.bfloat16, device=DEV):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(M, N, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * 3)
    if kind == "special" and M:
        flat = x.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(4, flat.numel() // 50)]
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0])
        flat[idx] = specials[torch.arange(idx.numel()) % specials.numel()]
        x[0, :32] = 1e-41  # a group of denormals only
    return x.to(dtype).to(device)


def check(res, ids, w, E, B, *, x=None, qd=None, mask=None, nlt=None, moe_buf_init=None,
          semantics="auto", zero_moe_buf=True):
    M, K = ids.shape
    ref = moe_sorting_reference(ids.cpu(), w.cpu(), E, B, None if mask is None else mask.cpu(),
                                None if nlt is None else nlt.cpu())
    r_ids, r_w, r_e, r_nv = ref
    assert res.sorted_ids.shape == r_ids.shape and res.sorted_ids.dtype == torch.int32
    assert res.sorted_weights.shape == r_w.shape and res.sorted_weights.dtype == torch.float32
    assert res.sorted_expert_ids.shape == r_e.shape and res.sorted_expert_ids.dtype == torch.int32
    assert torch.equal(res.num_valid_ids.cpu(), r_nv)
    n, nb = defined_sort_region(r_nv, B)
    assert torch.equal(res.sorted_ids.cpu()[:n], r_ids[:n])
    assert torch.equal(res.sorted_weights.cpu()[:n].view(torch.int32), r_w[:n].view(torch.int32))
    assert torch.equal(res.sorted_expert_ids.cpu()[:nb], r_e[:nb])

    T = min(max(int(r_nv[1]), 0), M)  # num_valid_ids[1] holds num_local_tokens as given
    if zero_moe_buf:
        buf = res.moe_buf.cpu()
        assert buf.shape == (M, buf.shape[1])
        want = torch.zeros_like(buf[:T]) if moe_buf_init is None else moe_buf_init.cpu()[:T]
        assert torch.equal(buf[:T].view(torch.uint8), want.view(torch.uint8))
        assert (buf[T:].view(torch.uint8) == 0xAB).all(), "rows past T must stay untouched"
    else:
        assert res.moe_buf.shape == (0, 0)

    if qd is None:
        assert res.quant is None
        return
    fused = stage1_uses_fused_quant(M, K) if semantics == "auto" else semantics == "fused"
    q = mx_quant_moe_sort_reference(x.cpu(), r_ids, r_nv, r_w, M, qd, fused=fused)
    data, scale = res.quant
    assert data.dtype == qd and data.shape == q.data.shape
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == q.scale.shape
    dd, sd = q.data_defined, q.scale_defined
    assert torch.equal(data.cpu().view(torch.uint8)[dd], q.data.view(torch.uint8)[dd])
    assert torch.equal(scale.cpu().view(torch.uint8)[sd], q.scale.view(torch.uint8)[sd])


def run(M, K, E, B, N=256, qd=FP4, kind="uniform", xkind="normal", mask=None, nlt=None,
        init=False, semantics="auto", zero_moe_buf=True, seed=0, buf_dtype=torch.bfloat16):
    ids, w = routing(M, K, E, kind, seed)
    x = activations(M, N, xkind, seed) if qd is not None else None
    moe_buf_init = activations(M, 64, seed=seed + 5, dtype=buf_dtype) if init else None
    model_dim = 64 if init else 96
    assert k.unsupported_reason(ids, w, E, model_dim, B, mask, nlt, x, qd, None, moe_buf_init) is None
    res = k.moe_sort_mx_quant(ids, w, E, model_dim, buf_dtype, B, expert_mask=mask, num_local_tokens=nlt,
                              quant_input=x, quant_dtype=qd, moe_buf_init=moe_buf_init,
                              zero_moe_buf=zero_moe_buf, quant_semantics=semantics)
    check(res, ids, w, E, B, x=x, qd=qd, mask=mask, nlt=nlt, moe_buf_init=moe_buf_init,
          semantics=semantics, zero_moe_buf=zero_moe_buf)
    return res


# ---- CPU (interpreter) -------------------------------------------------------------------

@pytest.mark.parametrize("M,K,E,B,N,qd", [
    (0, 8, 256, 32, 256, FP4),
    (1, 8, 256, 32, 256, FP4),
    (3, 4, 8, 16, 256, FP8),
    pytest.param(17, 11, 513, 128, 256, FP4, marks=SLOW_CI),  # 1024 expert bins in the count: CI's second step
    (64, 8, 128, 64, 512, FP8NUZ),
    (5, 16, 896, 16, 256, FP8),
    (3, 1, 8, 64, 2048, FP4),
])
def test_kernel_matches_reference(M, K, E, B, N, qd):
    run(M, K, E, B, N, qd)


@pytest.mark.parametrize("kind", ["one", "skewed", "bad"])
def test_routing_patterns(kind):
    run(17, 4, 8, 16, qd=FP4, kind=kind)


def test_sort_only_and_no_moe_buf():
    res = run(9, 4, 128, 32, qd=None, zero_moe_buf=False)
    assert res.quant is None


def test_num_local_tokens_below_capacity():
    nlt = torch.tensor([11], dtype=torch.int32, device=DEV)
    res = run(17, 4, 8, 16, qd=FP4, nlt=nlt, semantics="fused")
    assert int(res.num_valid_ids[1]) == 11
    pads = res.sorted_ids[: int(res.num_valid_ids[0])]
    assert ((pads >> 24) == 4).any() and (pads[(pads >> 24) == 4] & 0xFFFFFF == 11).all()


@pytest.mark.parametrize("semantics", ["fused", "split"])
def test_num_local_tokens_semantics(semantics):
    run(12, 4, 16, 16, qd=FP8, nlt=torch.tensor([5], dtype=torch.int32, device=DEV), semantics=semantics)


def test_row_split_over_programs_with_local_tokens():
    # small batch, wide rows: each row is split over several programs
    run(3, 4, 16, 16, N=1024, qd=FP4, nlt=torch.tensor([2], dtype=torch.int32, device=DEV), semantics="fused")
    ids, w = routing(2, 2, 8)
    buf = torch.full((2, 4096), 7.0, dtype=torch.bfloat16, device=DEV)
    k.moe_sort_mx_quant(ids, w, 8, 4096, torch.bfloat16, 16, moe_buf=buf,
                        num_local_tokens=torch.tensor([1], dtype=torch.int32, device=DEV))
    assert not buf[0].any() and (buf[1] == 7.0).all()


def test_num_local_tokens_out_of_range_is_clamped():
    run(6, 2, 8, 16, qd=FP4, nlt=torch.tensor([100], dtype=torch.int32, device=DEV))
    run(6, 2, 8, 16, qd=FP4, nlt=torch.tensor([-3], dtype=torch.int32, device=DEV))


def test_expert_mask():
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(32, generator=g) < 0.5).to(torch.int32).to(DEV)
    res = run(9, 4, 32, 16, qd=FP4, mask=mask)
    nb = int(res.num_valid_ids[0]) // 16
    assert int(res.sorted_expert_ids[:nb].max()) < int(mask.sum())


def test_zero_weights():
    ids, w = routing(11, 4, 16, "uniform", 7)
    w[0] = 0.0  # every pair of token 0: zero data row
    w[1, 0] = -0.0  # mixed token: scale 0 on that pair only, data row undefined
    w[2, 1:] = 0.0
    x = activations(11, 256)
    for sem in ("fused", "split"):
        res = k.moe_sort_mx_quant(ids, w, 16, 64, torch.bfloat16, 16, quant_input=x, quant_dtype=FP4,
                                  quant_semantics=sem)
        check(res, ids, w, 16, 16, x=x, qd=FP4, semantics=sem)
        row0 = res.quant[0].view(torch.uint8)[0]
        assert bool((row0 == 0).all()) == (sem == "fused")


@pytest.mark.parametrize("qd", [FP4, FP8, FP8NUZ])
def test_special_values(qd):
    run(5, 2, 8, 16, N=256, qd=qd, xkind="special")


def test_moe_buf_init_copied(monkeypatch):
    run(7, 2, 8, 16, qd=None, init=True, nlt=torch.tensor([4], dtype=torch.int32, device=DEV))
    run(5, 2, 8, 16, qd=None, init=True, buf_dtype=torch.float32)


def test_caller_moe_buf_filled():
    ids, w = routing(4, 2, 8)
    buf = torch.full((4, 40), 3.0, dtype=torch.float16, device=DEV)
    res = k.moe_sort_mx_quant(ids, w, 8, 40, torch.float16, 16, moe_buf=buf)
    assert res.moe_buf is buf and not buf.any()


def test_multi_launch_path(monkeypatch):
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", 16)
    monkeypatch.setattr(k, "CHUNK_PAIRS", 16)
    monkeypatch.setattr(k, "SCAN_TILE_ELEMS", 32)  # the scan walks the chunks 2 at a time: its running sums carry
    run(23, 4, 8, 16, qd=FP4)
    run(23, 4, 64, 32, qd=FP8, kind="bad", mask=(torch.arange(64, device=DEV) % 3 != 0).to(torch.int32),
        nlt=torch.tensor([19], dtype=torch.int32, device=DEV), semantics="fused")
    # split semantics (AITER's, and so "auto", at these sizes): scales through the compact buffer
    run(23, 4, 8, 16, qd=FP4, semantics="split")
    run(31, 3, 16, 32, N=544, qd=FP8, kind="bad", semantics="split", mask=(torch.arange(16, device=DEV) % 4 != 1).to(
        torch.int32), nlt=torch.tensor([26], dtype=torch.int32, device=DEV))
    run(17, 8, 8, 64, N=224, qd=FP8NUZ, kind="skewed", xkind="special", semantics="split")
    # the scale tiles 8 groups at a time: 17 groups (SNP 24) in three steps, the last past G
    monkeypatch.setattr(k, "TILE_GROUPS", 8)
    run(19, 3, 16, 32, N=544, qd=FP4, semantics="split", nlt=torch.tensor([15], dtype=torch.int32, device=DEV))
    monkeypatch.setattr(k, "TILE_GROUPS", 256)
    # duplicates within tokens and across chunk edges; topk 11 leaves 5 dead slots in each sorted chunk
    run(29, 11, 16, 16, qd=None, kind="skewed")
    # more than one 16-bin tile of experts: without a quant, segment starts and local ids summed over the scan's
    # tiles (PRESCAN_TILE_STARTS); with one, over every bin
    monkeypatch.setattr(k, "PRESCAN_TILE_STARTS", True)
    mask200 = (torch.arange(200, device=DEV) % 3 != 0).to(torch.int32)
    for qd in (None, FP4):
        run(23, 4, 200, 32, qd=qd, semantics="split", kind="bad", mask=mask200,
            nlt=torch.tensor([19], dtype=torch.int32, device=DEV))
    run(37, 6, 130, 16, qd=None, kind="skewed")
    monkeypatch.setattr(k, "CHUNK_PAIRS", 64)
    run(41, 3, 8, 64, qd=FP4, kind="skewed", nlt=torch.tensor([0], dtype=torch.int32, device=DEV))
    run(41, 3, 8, 64, qd=None, kind="one", nlt=torch.tensor([40], dtype=torch.int32, device=DEV))


def _rank_launch(ids, E, mask, nlt):
    """The prescanned chain's first launch alone, into poisoned tables: ``(plan, hist, ranks)``."""
    kept: list = []
    w = torch.rand(ids.shape, device=DEV)
    k.moe_sort_mx_quant(ids, w, E, 96, torch.bfloat16, 16, expert_mask=mask, num_local_tokens=nlt,
                        zero_moe_buf=False, kept=kept)
    plan = kept[0]
    hist = torch.full((plan.n_chunks, plan.e_bins), -7, dtype=torch.int32, device=DEV)
    ranks = torch.full((ids.numel(),), -7, dtype=torch.int32, device=DEV)
    k._run(plan.rank, ids, ids if mask is None else mask, ids if nlt is None else nlt, hist, ranks)
    return plan, hist.cpu(), ranks.cpu()


def test_rank_launch_tables(monkeypatch):
    """The rank launch's per-chunk histograms and ranks (from the runs of its sorted keys) against their
    definition: a chunk's histogram counts its PC slots by expert bin, dropped and
    dead slots (past the local tokens, masked or out-of-range experts, a partial last chunk) in the last bin;
    a live pair's rank is the count of the chunk's earlier pairs of its expert; past the local tokens nothing
    is written."""
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", 16)
    monkeypatch.setattr(k, "CHUNK_PAIRS", 32)
    for M, K, E, kind, mask, nlt in ((29, 3, 16, "skewed", None, None), (23, 4, 64, "bad", 3, 19),
                                     (40, 8, 8, "one", None, 33), (9, 5, 200, "uniform", 2, None)):
        ids, _ = routing(M, K, E, kind)
        mask_t = None if mask is None else (torch.arange(E, device=DEV) % mask != 0).to(torch.int32)
        nlt_t = None if nlt is None else torch.tensor([nlt], dtype=torch.int32, device=DEV)
        plan, hist, ranks = _rank_launch(ids, E, mask_t, nlt_t)
        T = M if nlt is None else nlt
        flat = ids.cpu().flatten().long()
        kept_pair = (flat >= 0) & (flat < E) & (torch.arange(flat.numel()) < T * K)
        if mask is not None:
            kept_pair &= (torch.arange(E) % mask != 0)[flat.clamp(0, E - 1)]
        e = torch.where(kept_pair, flat, plan.e_bins - 1)
        pc = plan.rank.kwargs["PC"]
        chunk_pairs = plan.rank.kwargs["CHUNK_T"] * K
        for c in range(plan.n_chunks):
            lo = c * chunk_pairs
            ec = e[lo:lo + chunk_pairs]
            want = torch.bincount(ec, minlength=plan.e_bins)
            want[plan.e_bins - 1] += pc - ec.numel()  # the chunk's slots past its pairs
            want_ranks = torch.tensor([int((ec[:j] == ec[j]).sum()) for j in range(ec.numel())], dtype=torch.int32)
            live = min(max(T * K - lo, 0), ec.numel())
            assert torch.equal(hist[c], want.to(torch.int32)), (M, K, E, c)
            assert torch.equal(ranks[lo:lo + live], want_ranks[:live]), (M, K, E, c)
            assert (ranks[lo + live:lo + ec.numel()] == -7).all(), (M, K, E, c)
        run(M, K, E, 16, qd=FP4 if kind != "one" else None, kind=kind, mask=mask_t, nlt=nlt_t, semantics="split")


@pytest.mark.parametrize("groups,one_step,defer", [pytest.param(1, 0, False, marks=SLOW_CI), (2, 0, True),
                                                   (8, 128, True), (8, 128, False)])
def test_row_quantized_in_group_tiles(monkeypatch, groups, one_step, defer):
    """The wide-row loop (QUANT_GROUPS groups at a time: no one-step share), with 7 groups per row so
    the last tile is partial, and a row quantized in one step, its math before or after the routing
    (DEFER_QUANT_MATH)."""
    monkeypatch.setattr(k, "QUANT_GROUPS", groups)
    monkeypatch.setattr(k, "QUANT_ONE_STEP_GROUPS", one_step)
    monkeypatch.setattr(k, "DEFER_QUANT_MATH", defer)
    assert k._batch_params(3, 4, 16, 4, 8, True, 224)["QG"] == groups
    run(3, 4, 8, 16, N=224, qd=FP4)
    run(37, 2, 8, 32, N=224, qd=FP8, semantics="fused", nlt=torch.tensor([30], dtype=torch.int32, device=DEV))
    run(9, 3, 16, 16, N=224, qd=FP8NUZ, xkind="special", semantics="split")
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", 16)
    monkeypatch.setattr(k, "CHUNK_PAIRS", 16)
    run(23, 4, 8, 16, N=224, qd=FP4, semantics="fused", nlt=torch.tensor([21], dtype=torch.int32, device=DEV))


ROLES = {  # the row work in the routing programs (off), in data programs of its own (on), and their shares
    "off": dict(ROLES_MAX_PAIRS=0, ROLES_PRESCANNED=False),
    "on": dict(ROLES_MAX_PAIRS=2048, ROLES_PRESCANNED=True),
    "div": dict(ROLES_MAX_PAIRS=2048, ROLES_PRESCANNED=True, ROUTE_SPLIT_DIV=4, DATA_MAX_GROUPS=2),
    "loop": dict(ROLES_MAX_PAIRS=2048, ROLES_PRESCANNED=True, DATA_MAX_GROUPS=1 << 20, QUANT_ONE_STEP_GROUPS=0,
                 QUANT_GROUPS=2),
}


def set_constants(monkeypatch, values):
    for name, val in values.items():
        monkeypatch.setattr(k, name, val)


# the default run's (slices, roles, defer) of the one-step shares: each slicing and each (roles, defer) pair once
ONE_STEP_DEFAULT = {("3200-2-64", "on", True), ("3200-2-64", "off", False), ("4128-2-128", "off", True),
                    ("4128-4-64", "on", False)}


def _one_step_cases():
    cases = []
    for N, split, g_tile in ((3200, 2, 64), (4128, 2, 128), (4128, 4, 64)):
        for defer in (True, False):
            for roles in ("on", "off"):
                slices = f"{N}-{split}-{g_tile}"
                cases.append(pytest.param(roles, defer, N, split, g_tile, id=f"{slices}-{defer}-{roles}",
                                          marks=() if (slices, roles, defer) in ONE_STEP_DEFAULT else SLOW_CI))
    return cases


@pytest.mark.parametrize("roles,defer,N,split,g_tile", _one_step_cases())
def test_one_step_shares_over_column_slices(monkeypatch, roles, defer, N, split, g_tile):
    """One-step shares of 64-128 groups (the default path of 16-64 token decode at 7168 columns) over
    column slices: a partial last slice (100 groups in two 64-group shares; 129 groups: one group in
    the second 128-group share) and slices wholly past the row (129 groups in four 64-group shares),
    with the math before or after the routing; the routing programs' shares, with the data in
    programs of its own or not (split roles: the grid's column count adds the data programs)."""
    set_constants(monkeypatch, ROLES[roles])
    monkeypatch.setattr(k, "ROW_SPLIT_PROGRAMS", 1)
    monkeypatch.setattr(k, "MIN_ROW_SPLIT", split)
    monkeypatch.setattr(k, "DEFER_QUANT_MATH", defer)
    p = k._batch_params(3, 4, 16, 4, k._next_pow2(N // 32), True, 96)
    assert (p["ROUTE_PROGRAMS"] or p["split"], p["G_TILE"], p["QG"]) == (split, g_tile, g_tile)
    assert p["split"] == split + (p["fill_split"] if roles == "on" else 0)
    run(3, 4, 16, 16, N=N, qd=FP4, xkind="special")
    run(3, 4, 16, 32, N=N, qd=FP8, semantics="fused", nlt=torch.tensor([2], dtype=torch.int32, device=DEV))
    run(3, 4, 16, 16, N=N, qd=FP8NUZ, semantics="split", nlt=torch.tensor([9], dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("groups,step", [(128, 128), (256, 32)])
def test_wide_data_programs(monkeypatch, groups, step):
    """``DATA_MAX_GROUPS`` 128 and 256 (issue 34; 256 ships): two data programs of one row whose second holds one
    real group, beside two routing programs: one 128-group step, or 256 groups in ``QUANT_GROUPS`` (32) steps."""
    set_constants(monkeypatch, ROLES["on"])
    monkeypatch.setattr(k, "DATA_MAX_GROUPS", groups)
    monkeypatch.setattr(k, "ROW_SPLIT_PROGRAMS", 1)
    monkeypatch.setattr(k, "MIN_ROW_SPLIT", 2)
    N = (groups + 1) * 32
    p = k._batch_params(3, 4, 16, 4, 2 * groups, True, N)
    assert (p["ROUTE_PROGRAMS"], p["fill_split"], p["G_DTILE"], p["QG_D"]) == (2, 2, groups, step)
    run(3, 4, 16, 16, N=N, qd=FP4, xkind="special")
    run(3, 4, 16, 32, N=N, qd=FP8, semantics="fused", nlt=torch.tensor([2], dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("roles", list(ROLES))
def test_split_roles(monkeypatch, roles):
    """The row work in data programs of its own (``ROUTE_PROGRAMS`` > 0) or in the routing programs, with
    several programs per row for each role, one-step and looped data shares: fewer local tokens (row ``T``'s
    zero data row and the padding rows' zero scales, fused semantics), zero-weight tokens, special values,
    ``moe_buf_init`` rows, and the prescanned launches (compact scales under split semantics)."""
    set_constants(monkeypatch, ROLES[roles])
    p = k._batch_params(3, 4, 16, 4, 32, True, 1024)
    assert (p["ROUTE_PROGRAMS"] > 0) == (roles != "off")
    run(3, 4, 16, 16, N=1024, qd=FP4, nlt=torch.tensor([2], dtype=torch.int32, device=DEV), semantics="fused")
    run(5, 2, 8, 32, N=224, qd=FP8, xkind="special", init=True, nlt=torch.tensor([4], dtype=torch.int32, device=DEV))
    ids, w = routing(6, 4, 16, "uniform", 7)
    w[0] = 0.0
    w[2, 1:] = 0.0
    x = activations(6, 256)
    for sem in ("fused", "split"):
        res = k.moe_sort_mx_quant(ids, w, 16, 64, torch.bfloat16, 16, quant_input=x, quant_dtype=FP8NUZ,
                                  quant_semantics=sem)
        check(res, ids, w, 16, 16, x=x, qd=FP8NUZ, semantics=sem)
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", 16)
    monkeypatch.setattr(k, "CHUNK_PAIRS", 16)
    run(23, 4, 8, 16, N=224, qd=FP4, kind="bad", nlt=torch.tensor([19], dtype=torch.int32, device=DEV))
    run(21, 3, 16, 32, N=224, qd=FP8, semantics="fused", init=True,
        nlt=torch.tensor([17], dtype=torch.int32, device=DEV))


DECODE_PATHS = {  # module constants that force each one-launch position method (name: path-variant)
    # the count on one launch up to ONE_LAUNCH_MAX_PAIRS whatever the experts (not the pair-bins' bound)
    "count": dict(DECODE_MAX_PAIRS=0, DECODE_PAIRS_PER_BIN=0, COUNT_GATHER=True, ONE_LAUNCH_MAX_PAIR_BINS=1 << 30),
    "count-onehot": dict(DECODE_MAX_PAIRS=0, DECODE_PAIRS_PER_BIN=0, COUNT_GATHER=False,
                         ONE_LAUNCH_MAX_PAIR_BINS=1 << 30),
    "compare": dict(DECODE_MAX_PAIRS=2048, DECODE_COMPARE_MAX_PAIRS=2048, DECODE_COMPARE_TILE=16384,
                    DECODE_COMPARE_T_MIN_PAIRS=1 << 30),
    "compare-tiled": dict(DECODE_MAX_PAIRS=2048, DECODE_COMPARE_MAX_PAIRS=2048, DECODE_COMPARE_TILE=64,
                          DECODE_COMPARE_T_MIN_PAIRS=1 << 30),
    "compare-t": dict(DECODE_MAX_PAIRS=2048, DECODE_COMPARE_MAX_PAIRS=2048, DECODE_COMPARE_TILE=16384,
                      DECODE_COMPARE_T_MIN_PAIRS=0),
    "compare-t-tiled": dict(DECODE_MAX_PAIRS=2048, DECODE_COMPARE_MAX_PAIRS=2048, DECODE_COMPARE_TILE=64,
                            DECODE_COMPARE_T_MIN_PAIRS=0),
    "sort": dict(DECODE_MAX_PAIRS=2048, DECODE_COMPARE_MAX_PAIRS=0, DECODE_SORT_SELECT=True),
    "sort-reload": dict(DECODE_MAX_PAIRS=2048, DECODE_COMPARE_MAX_PAIRS=0, DECODE_SORT_SELECT=False),
}
METHODS = list(DECODE_PATHS)


def force_path(monkeypatch, path, M, K):
    for name, val in DECODE_PATHS[path].items():
        monkeypatch.setattr(k, name, val)
    assert {k.decode_path(M, K, E) for E in (1, 256, 896, 2048)} == {path.split("-")[0]}


def dup_routing(M, K, E, seed=0):
    """Duplicates within tokens (a token naming one expert in every slot, or two experts
    alternately), out-of-range ids (-1, E, 2**20) and ordinary tokens."""
    ids, w = routing(M, K, E, "uniform", seed)
    ids[0] = 7 % E
    if M > 1:
        ids[1] = torch.tensor([E - 1, 3 % E] * K, dtype=torch.int32)[:K]
    if M > 2:
        ids[2, ::3] = torch.tensor([-1, E, 1 << 20], dtype=torch.int32).repeat(K)[: ids[2, ::3].numel()]
    return ids, w


@pytest.mark.parametrize("path", METHODS)
def test_decode_paths_adversarial(monkeypatch, path):
    """Every decode method on 896 experts, topk 16 (the shape whose expert count the decode sort
    removes from the work), against the reference bit for bit."""
    force_path(monkeypatch, path, 3, 16)
    ids, w = dup_routing(3, 16, 896)
    x = activations(3, 64)
    res = k.moe_sort_mx_quant(ids, w, 896, 64, torch.bfloat16, 16, quant_input=x, quant_dtype=FP4)
    check(res, ids, w, 896, 16, x=x, qd=FP4)
    assert int(res.num_valid_ids[0]) == 16 * 13  # 13 distinct kept experts, one block each
    # EP mask (raw values summed, some > 1) and fewer local tokens; out-of-range and masked ids dropped
    mask = ((torch.arange(896) % 3) * (torch.arange(896) % 2)).to(torch.int32).to(DEV)
    nlt = torch.tensor([2], dtype=torch.int32, device=DEV)
    res = k.moe_sort_mx_quant(ids, w, 896, 64, torch.bfloat16, 64, expert_mask=mask, num_local_tokens=nlt,
                              quant_input=x, quant_dtype=FP8, quant_semantics="fused")
    check(res, ids, w, 896, 64, x=x, qd=FP8, mask=mask, nlt=nlt, semantics="fused")


@pytest.mark.parametrize("path", [pytest.param(m, marks=SLOW_CI) if m.endswith(("-tiled", "-reload")) else m
                                  for m in METHODS if not m.startswith("count")])
def test_decode_paths_sizes(monkeypatch, path):
    """Segments that straddle block edges (skewed routing: long runs of one expert), a batch whose
    pairs are not a power of two, topk 1, no token at all (num_local_tokens 0) and
    num_local_tokens past the batch."""
    force_path(monkeypatch, path, 13, 5)
    run(13, 5, 16, 16, N=64, qd=FP4, kind="skewed", seed=4)
    run(13, 5, 40, 32, N=64, qd=None, kind="bad", seed=5, mask=(torch.arange(40, device=DEV) % 5 != 2).to(torch.int32))
    run(7, 1, 8, 16, N=64, qd=FP8NUZ, kind="skewed", semantics="split")
    run(6, 4, 8, 16, N=64, qd=FP4, nlt=torch.tensor([0], dtype=torch.int32, device=DEV), semantics="fused")
    run(6, 2, 8, 16, N=64, qd=FP4, nlt=torch.tensor([100], dtype=torch.int32, device=DEV))  # past M: as given


@pytest.mark.parametrize("path", [pytest.param(m, marks=SLOW_CI) if m.endswith("-tiled") else m for m in METHODS])
def test_decode_methods_block_sizes(monkeypatch, path):
    """Each method at every block size on the routings that stress its bookkeeping: every pair on
    one expert (a segment over several blocks), every pair on its own expert (a padded block per
    pair), and out-of-range ids with an expert mask and fewer local tokens (dropped pairs inside
    the sorted range)."""
    M, K, E = 6, 4, 32
    force_path(monkeypatch, path, M, K)
    ids, w = routing(M, K, E)
    one = torch.full_like(ids, 5)
    distinct = torch.randperm(E, generator=torch.Generator().manual_seed(3))[: M * K].reshape(M, K)
    bad = torch.tensor([-1, E, 1 << 20, 7], dtype=torch.int32).repeat(M, 1)
    bad[1:3] = ids[1:3]
    mask = (torch.arange(E) % 4 != 1).to(torch.int32).to(DEV)
    x = activations(M, 64)
    for B, routed, m, nlt in ((16, one, None, None), (128, distinct, None, None),
                              (32, bad, mask, 4), (64, one, mask, 2), (128, bad, None, 5)):
        r = routed.to(torch.int32).to(DEV)
        nlt_t = None if nlt is None else torch.tensor([nlt], dtype=torch.int32, device=DEV)
        res = k.moe_sort_mx_quant(r, w, E, 64, torch.bfloat16, B, expert_mask=m, num_local_tokens=nlt_t,
                                  quant_input=x, quant_dtype=FP4)
        check(res, r, w, E, B, x=x, qd=FP4, mask=m, nlt=nlt_t)


def test_decode_method_constants(monkeypatch):
    """What each decode constant selects (the constexprs the sort kernel gets), and that a
    comparison tile splits into row chunks, so the benchmark's candidates are what they say."""
    monkeypatch.setattr(k, "DECODE_MAX_PAIRS", 1024)
    monkeypatch.setattr(k, "DECODE_COMPARE_MAX_PAIRS", 128)
    monkeypatch.setattr(k, "DECODE_COMPARE_TILE", 4096)
    p = k._sort_params(100, 1024, 16, False)
    assert (p["DECODE"], p["PAIRS_PAD"], p["CMP_CHUNK"], p["SORT_SELECT"]) == (2, 128, 32, False)
    monkeypatch.setattr(k, "DECODE_SORT_SELECT", True)
    p = k._sort_params(129, 1024, 16, False)
    assert (p["DECODE"], p["PAIRS_PAD"], p["CMP_CHUNK"], p["SORT_SELECT"]) == (1, 256, 1, True)
    monkeypatch.setattr(k, "DECODE_SORT_SELECT", False)
    assert k._sort_params(129, 1024, 16, False)["CMP_CHUNK"] == k.DECODE_TILE // 16
    monkeypatch.setattr(k, "DECODE_NUM_WARPS", 2)
    assert k._sort_params(129, 1024, 16, False)["warps"] == 2
    assert k._sort_params(2000, 1024, 16, False)["warps"] == 0  # the count keeps the row work's warps
    monkeypatch.setattr(k, "_plans", {})
    ids, w = routing(3, 16, 896)
    k.moe_sort_mx_quant(ids, w, 896, 64, torch.bfloat16, 32)
    assert [p.sort.kwargs["num_warps"] for p in k._plans.values()] == [2]


def test_transposed_comparison_from_its_threshold(monkeypatch):
    """The comparison takes the [pairs, chunk] tile and its own warps from DECODE_COMPARE_T_MIN_PAIRS padded
    pairs on; DECODE_NUM_WARPS, when set, still decides; the sort and the count never take the tile."""
    monkeypatch.setattr(k, "DECODE_COMPARE_MAX_PAIRS", 64)
    monkeypatch.setattr(k, "DECODE_COMPARE_T_MIN_PAIRS", 64)
    monkeypatch.setattr(k, "DECODE_COMPARE_T_WARPS", 8)
    pick = lambda pairs: (lambda p: (p["DECODE"], p["COMPARE_T"], p["warps"]))(k._sort_params(pairs, 1024, 16, False))
    assert [pick(n) for n in (32, 33, 64, 65)] == [(2, False, 0), (2, True, 8), (2, True, 8), (1, False, 0)]
    assert k._sort_params(4000, 1024, 16, False)["COMPARE_T"] is False
    monkeypatch.setattr(k, "DECODE_NUM_WARPS", 2)
    assert pick(64) == (2, True, 2)
    monkeypatch.setattr(k, "DECODE_NUM_WARPS", 0)
    monkeypatch.setattr(k, "DECODE_COMPARE_T_MIN_PAIRS", 1 << 30)
    assert pick(64) == (2, False, 0)
    monkeypatch.setattr(k, "_plans", {})
    monkeypatch.setattr(k, "DECODE_COMPARE_T_MIN_PAIRS", 64)
    ids, w = routing(4, 16, 896)  # 64 pairs
    k.moe_sort_mx_quant(ids, w, 896, 64, torch.bfloat16, 32)
    assert [(p.sort.kwargs["COMPARE_T"], p.sort.kwargs["num_warps"]) for p in k._plans.values()] == [(True, 8)]


def test_decode_path_choice(monkeypatch):
    monkeypatch.setattr(k, "DECODE_MAX_PAIRS", 1024)
    monkeypatch.setattr(k, "DECODE_COMPARE_MAX_PAIRS", 64)
    assert [k.decode_path(M, 16) for M in (1, 4, 5, 64, 65, 128, 129)] == [
        "compare", "compare", "sort", "sort", "count", "count", "prescanned"]
    assert k.decode_path(0, 8) == "compare"
    monkeypatch.setattr(k, "DECODE_MAX_PAIRS", 0)
    monkeypatch.setattr(k, "DECODE_PAIRS_PER_BIN", 0)
    assert k.decode_path(1, 8) == "count"


def test_decode_threshold_grows_with_expert_bins(monkeypatch):
    """The count's work grows with E, the decode methods' does not: with DECODE_PAIRS_PER_BIN
    they also take buckets of up to that many pairs per expert bin."""
    monkeypatch.setattr(k, "DECODE_MAX_PAIRS", 512)
    monkeypatch.setattr(k, "DECODE_PAIRS_PER_BIN", 1)
    monkeypatch.setattr(k, "DECODE_COMPARE_MAX_PAIRS", 0)
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIR_BINS", 1 << 22)  # the one-launch path to 2048 pairs at 1024 bins
    # 64 tokens x topk 16: 1024 pairs; bins: the next power of two above E
    assert [k.decode_path(64, 16, E) for E in (128, 511, 512, 896)] == ["count", "count", "sort", "sort"]
    assert k.decode_path(64, 8, 128) == "sort" and k.decode_path(33, 16, 896) == "sort"  # 512; 1024 pairs
    assert k.decode_path(65, 8, 896) == "count"  # 2048 pairs
    monkeypatch.setattr(k, "DECODE_PAIRS_PER_BIN", 0)
    assert k.decode_path(64, 16, 896) == "count"


def test_the_one_launch_path_ends_where_the_count_passes_its_pair_bins(monkeypatch):
    """The per-program count reads every pair into every expert bin: past ONE_LAUNCH_MAX_PAIR_BINS
    (pairs x bins) the prescanned launches take the batch, never below the decode methods' pairs. The
    one-launch buckets still end at ONE_LAUNCH_MAX_PAIRS, so the count's variants are those of every
    expert count (a lower ceiling would turn the split roles on at 65-128 tokens, topk 8: slower)."""
    monkeypatch.setattr(k, "DECODE_MAX_PAIRS", 32)
    monkeypatch.setattr(k, "DECODE_PAIRS_PER_BIN", 0.5)
    monkeypatch.setattr(k, "DECODE_PER_BIN_MIN_BINS", 512)
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", 2048)
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIR_BINS", 1 << 20)
    assert [k.decode_path(M, 16, 896) for M in (32, 33, 64, 65, 128)] == [
        "sort", "count", "count", "prescanned", "prescanned"]  # 1024 bins: 1024 pairs
    assert [k.decode_path(M, 8, 256) for M in (256, 257)] == ["count", "prescanned"]  # 512 bins: 2048 pairs
    assert [k.decode_path(M, 8, 128) for M in (256, 257)] == ["count", "prescanned"]  # 256 bins: capped at 2048
    # 2048 bins: one launch up to the sort's 1024 pairs (the count there: the bucket of 256 tokens is 2048 pairs)
    assert [k.decode_path(M, 8, 2047) for M in (64, 128, 129)] == ["sort", "count", "prescanned"]
    assert k._bucket_tokens(33, 16, 1024) == 64 and k._bucket_tokens(65, 16, 1024) == 256
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIR_BINS", 1 << 19)
    assert [k.decode_path(M, 8, 256) for M in (128, 129)] == ["count", "prescanned"]  # 512 bins: 1024 pairs
    assert k._bucket_tokens(96, 8, 512) == 256  # the count's bucket as with fewer experts: no split roles
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIR_BINS", 1 << 21)
    assert k.decode_path(65, 16, 896) == "count" and k._bucket_tokens(65, 16, 1024) == 128


def test_small_prescanned_batches_take_short_rank_chunks(monkeypatch):
    """Prescanned batches in token buckets up to SMALL_BATCH_MAX_TOKENS rank chunks of SMALL_BATCH_CHUNK_PAIRS
    pairs (more rank programs), never more than CHUNK_PAIRS; larger ones CHUNK_PAIRS. The shipped constants at
    896 experts, 40 tokens: prescanned, 10 chunks of 4 tokens, the same bits as the reference."""
    assert (k._chunk_tokens(40, 16, 1024), k._chunk_tokens(256, 16, 1024), k._chunk_tokens(257, 16, 1024)) == (
        k.SMALL_BATCH_CHUNK_PAIRS // 16, k.SMALL_BATCH_CHUNK_PAIRS // 16, k.CHUNK_PAIRS // 16)
    monkeypatch.setattr(k, "_plans", {})
    for qd, sem in ((FP4, "auto"), (FP8, "split")):
        run(40, 16, 896, 32, qd=qd, kind="skewed", semantics=sem)
    plans = list(k._plans.values())
    assert [p.rank.grid for p in plans] == [(10,), (10,)] and plans[1].tiles is not None
    monkeypatch.setattr(k, "CHUNK_PAIRS", 32)
    assert k._chunk_tokens(40, 16, 1024) == 2  # never more pairs than CHUNK_PAIRS


def test_wide_topk_small_batches_rank_at_least_four_tokens_a_chunk(monkeypatch):
    """topk 40 in a small bucket: 64 pairs would be one token a chunk (a row of the rank tables per
    token); SMALL_BATCH_MIN_CHUNK_TOKENS keeps 4. 30 tokens x 300 experts: prescanned (1200 pairs x 512
    bins), 8 chunks, the same bits as the reference, fused and split."""
    assert k._chunk_tokens(30, 40, 512) == k.SMALL_BATCH_MIN_CHUNK_TOKENS == 4
    assert k._chunk_tokens(300, 40, 512) == 8  # above the small buckets: 512 pairs
    monkeypatch.setattr(k, "_plans", {})
    run(30, 40, 300, 32, qd=FP4, kind="skewed")
    run(30, 40, 300, 64, qd=FP8, semantics="split", mask=(torch.arange(300, device=DEV) % 5 != 2).to(torch.int32),
        nlt=torch.tensor([27], dtype=torch.int32, device=DEV))
    assert [p.rank.grid for p in k._plans.values()] == [(8,), (8,)]


def test_few_expert_bins_take_the_count_from_64_pairs(monkeypatch):
    """Below DECODE_PER_BIN_MIN_BINS expert bins the per-bin threshold does not apply: the count (cheap
    over 256 bins) takes buckets past DECODE_MAX_PAIRS; with more bins the decode methods keep them."""
    monkeypatch.setattr(k, "DECODE_MAX_PAIRS", 32)
    monkeypatch.setattr(k, "DECODE_PAIRS_PER_BIN", 0.5)
    monkeypatch.setattr(k, "DECODE_COMPARE_MAX_PAIRS", 64)
    monkeypatch.setattr(k, "DECODE_PER_BIN_MIN_BINS", 512)
    assert [k.decode_path(M, 8, 128) for M in (4, 8, 16)] == ["compare", "count", "count"]  # 256 bins
    assert [k.decode_path(M, 8, 256) for M in (4, 8, 16)] == ["compare", "compare", "sort"]  # 512 bins
    monkeypatch.setattr(k, "DECODE_PER_BIN_MIN_BINS", 256)
    assert [k.decode_path(M, 8, 128) for M in (4, 8, 16)] == ["compare", "compare", "sort"]


def test_unsupported_reason_reads_metadata_only():
    ids, w = routing(4, 2, 8)
    x = activations(4, 256)
    ok = dict(topk_ids=ids, topk_weights=w, num_experts=8, model_dim=64, block_size=16, expert_mask=None,
              num_local_tokens=None, quant_input=x, quant_dtype=FP4, moe_buf=None, moe_buf_init=None)
    assert k.unsupported_reason(**ok) is None
    bad = {
        "topk_ids": ids.to(torch.int64),
        "block_size": 24,
        "num_experts": 1,
        "quant_input": activations(4, 48),
        "quant_dtype": torch.float8_e5m2,
        "moe_buf": torch.empty(4, 65, dtype=torch.bfloat16, device=DEV),
    }
    for key, val in bad.items():
        assert k.unsupported_reason(**{**ok, key: val}) is not None, key
    assert "contiguous" in k.unsupported_reason(**{**ok, "topk_ids": ids.t().contiguous().t()})
    # past the int32 offsets: metadata on the meta device, nothing allocated
    meta = dict(device="meta")
    big = {**ok, "topk_ids": torch.empty(1 << 24, 2, dtype=torch.int32, **meta),
           "topk_weights": torch.empty(1 << 24, 2, **meta), "quant_input": None, "quant_dtype": None}
    assert "24-bit token field" in k.unsupported_reason(**big)
    wide = {**ok, "topk_ids": torch.empty(4096, 2, dtype=torch.int32, **meta),
            "topk_weights": torch.empty(4096, 2, **meta), "quant_input": None, "quant_dtype": None,
            "model_dim": 1 << 20}
    assert "int32 offset limit" in k.unsupported_reason(**wide)
    assert "contiguous" in k.unsupported_reason(**{**ok, "quant_input": activations(4, 512)[:, ::2]})


# ---- GPU: the matrix ---------------------------------------------------------------

DECODE_TOKENS = [0, 1, 2, 3, 7, 16, 31, 64, 127, 256, 509, 1024]
PREFILL_TOKENS = [2048, 4099, 8192, 32768]
MODELS = [(256, 8, 7168), (128, 4, 6144), (896, 16, 3584), (128, 8, 2048), (513, 11, 2048), (8, 1, 2048)]


def _gpu_cases(tokens):
    out = []
    for i, M in enumerate(tokens):
        for j, (E, K, N) in enumerate(MODELS):
            if M * K > 140000:
                continue
            B = (16, 32, 64, 128)[(i + j) % 4]
            qd = (FP4, FP8, FP4, FP8NUZ)[(i + 2 * j) % 4]
            out.append((M, K, E, B, N, qd))
    return out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M,K,E,B,N,qd", _gpu_cases(DECODE_TOKENS))
def test_gpu_decode_matrix(M, K, E, B, N, qd):
    run(M, K, E, B, N, qd, seed=M + E)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M,K,E,B,N,qd", _gpu_cases(PREFILL_TOKENS))
def test_gpu_prefill_matrix(M, K, E, B, N, qd):
    run(M, K, E, B, N, qd, seed=M + E)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("K,E,B,N,qd", [(8, 256, 32, 7168, FP4), (16, 896, 64, 3584, FP8)])
def test_gpu_largest_prefill(K, E, B, N, qd):
    """32768 tokens at topk 8 and 16: the four-launch path with its scale tiles, at the shapes benchmarked."""
    run(32768, K, E, B, N, qd, seed=K)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M,K,E,B,mask_every", [(4099, 1, 8, 16, 0), (8192, 8, 256, 32, 3), (4096, 16, 896, 64, 0),
                                                (3000, 8, 2048, 128, 5), (20000, 16, 896, 32, 7)])
def test_gpu_prefill_sort_only_tile_starts(monkeypatch, M, K, E, B, mask_every):
    """Prescanned launches without a quant with the scan's per-tile segment starts (PRESCAN_TILE_STARTS, what
    ships): one tile (8 experts) to 64 (2048), with and without an expert mask and local tokens; 625 chunks
    (20000 tokens, topk 16): the scan walks them in 3 steps."""
    monkeypatch.setattr(k, "PRESCAN_TILE_STARTS", True)  # the bits of the tile tables, whatever the default
    mask = (torch.arange(E, device=DEV) % mask_every != 0).to(torch.int32) if mask_every else None
    nlt = torch.tensor([M - 7], dtype=torch.int32, device=DEV) if mask_every else None
    run(M, K, E, B, 2048, qd=None, mask=mask, nlt=nlt, kind="bad" if mask_every else "uniform", seed=M)


@pytest.mark.parametrize("kind", ["one", "skewed", "bad"])
@pytest.mark.parametrize("M", [1, 64, 1024, 8192])
@pytest.mark.gpu
@needs_gpu
def test_gpu_routing_patterns(kind, M):
    run(M, 8, 256, 32, 2048, FP4, kind=kind, xkind="special", seed=M)


@pytest.mark.parametrize("M", [1, 37, 1024, 4096])
@pytest.mark.gpu
@needs_gpu
def test_gpu_ep_and_local_tokens(M):
    mask = (torch.arange(256, device=DEV) % 4 == 1).to(torch.int32)
    nlt = torch.tensor([max(M - 5, 0)], dtype=torch.int32, device=DEV)
    run(M, 8, 256, 64, 2048, FP8, mask=mask, nlt=nlt, init=True, seed=M)


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_capture():
    ids, w = routing(16, 8, 256)
    x = activations(16, 7168)
    nlt = torch.tensor([16], dtype=torch.int32, device=DEV)
    k.moe_sort_mx_quant(ids, w, 256, 7168, torch.bfloat16, 32, quant_input=x, quant_dtype=FP4,
                        num_local_tokens=nlt)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = k.moe_sort_mx_quant(ids, w, 256, 7168, torch.bfloat16, 32, quant_input=x, quant_dtype=FP4,
                                  num_local_tokens=nlt)
    new_ids, new_w = routing(16, 8, 256, seed=9)
    ids.copy_(new_ids)
    w.copy_(new_w)
    nlt.fill_(9)
    graph.replay()
    torch.cuda.synchronize()
    check(res, ids, w, 256, 32, x=x, qd=FP4, nlt=nlt)



@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("path", METHODS)
@pytest.mark.parametrize("M", [1, 2, 5, 8, 16, 33, 64])
def test_gpu_decode_paths(monkeypatch, path, M):
    """Each decode method at (896, 16, 3584) and (256, 8, 7168), adversarial routing, EP and local tokens."""
    if path.startswith("compare") and M * 16 > 512:
        pytest.skip("the comparison is meant for a handful of tokens")
    force_path(monkeypatch, path, M, 16)
    ids, w = dup_routing(M, 16, 896, seed=M)
    x = activations(M, 3584, "special", seed=M)
    res = k.moe_sort_mx_quant(ids, w, 896, 3584, torch.bfloat16, 32, quant_input=x, quant_dtype=FP4)
    check(res, ids, w, 896, 32, x=x, qd=FP4)
    mask = (torch.arange(896, device=DEV) % 7 != 3).to(torch.int32)
    nlt = torch.tensor([max(M - 1, 0)], dtype=torch.int32, device=DEV)
    run(M, 16, 896, 64, 3584, FP8, kind="skewed", mask=mask, nlt=nlt, init=True, seed=M)
    run(M, 8, 256, 32, 7168, FP4, kind="bad", nlt=nlt, seed=M)
    run(M, 8, 256, 16, 7168, None, kind="skewed", seed=M)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("groups", [128, 256])
@pytest.mark.parametrize("M,K,E,N", [(33, 8, 256, 7168), (64, 8, 256, 7168), (64, 4, 128, 6144),
                                     (200, 4, 128, 6144), (60, 8, 256, 9216)])
def test_gpu_wide_data_programs(monkeypatch, groups, M, K, E, N):
    """``DATA_MAX_GROUPS`` 128 and 256 at full size: the 64-token bucket past 4096 and 8192 hidden and the
    one-launch 256-token bucket past 2048 and 4096, data programs of up to that many groups a row."""
    monkeypatch.setattr(k, "DATA_MAX_GROUPS", groups)
    g_pad = k._next_pow2(N // 32)
    assert 64 < k._batch_params(M, K, k.expert_bin_count(E), k._next_pow2(K), g_pad, True, N)["G_DTILE"] <= groups
    mask = (torch.arange(E, device=DEV) % 5 != 2).to(torch.int32)
    nlt = torch.tensor([M - 3], dtype=torch.int32, device=DEV)
    run(M, K, E, 32, N, FP4, kind="skewed", xkind="special", seed=M)
    run(M, K, E, 64, N, FP8, kind="bad", mask=mask, nlt=nlt, init=True, seed=M + 1)
    run(M, K, E, 16, N, FP8NUZ, semantics="split", seed=M + 2)


def test_split_scales_never_read_past_the_compact_rows(monkeypatch):
    """``num_local_tokens`` >= 2**24 (as given, AITER's undefined range) makes padding ids name token
    ``T & 0xFFFFFF``: the scale-tile launch must not read that compact row of an ``M``-row buffer.
    The compact buffer sits at the front of poisoned memory, so a read past it shows as 0xAB."""
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", 16)
    monkeypatch.setattr(k, "CHUNK_PAIRS", 16)
    M, K, E, B, N = 20, 2, 4, 16, 64
    G = N // 32
    T = (1 << 24) + 1000
    backing = torch.full((((T & 0xFFFFFF) + 64) * G,), 0xAB, dtype=torch.uint8)
    poisoned = k._empty

    def empty(*size, dtype, device):
        if size == (M, G) and dtype == torch.uint8:
            return backing[: M * G].view(M, G)
        return poisoned(*size, dtype=dtype, device=device)

    monkeypatch.setattr(k, "_empty", empty)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, E, (M, K), generator=g, dtype=torch.int32)
    x = torch.randn(M, N, generator=g).to(torch.bfloat16)
    res = k.moe_sort_mx_quant(ids, torch.rand(M, K, generator=g), E, 96, torch.bfloat16, B,
                              num_local_tokens=torch.tensor([T], dtype=torch.int32),
                              quant_input=x, quant_dtype=torch.float4_e2m1fn_x2, quant_semantics="split")
    nv = int(res.num_valid_ids[0])
    sid = res.sorted_ids[:nv]
    padding = ((sid >> 24) == K).nonzero().flatten()
    assert len(padding) > 0
    scales = res.quant[1].view(torch.uint8).reshape(-1)
    snp = res.quant[1].shape[1]
    for r in padding.tolist():
        for grp in range(G):
            assert scales[mx_scale_swizzle_index(r, grp, snp)] != 0xAB, f"padding row {r} read past the compact rows"


# the span below a group's amax where a bf16 magnitude can still round to a nonzero code: e2m1 rounds to one
# from 0.25 up against a max of 6 (2^-7 kept), e4m3 from 2^-10 (fn) or 2^-11 (fnuz) against 448 or 240
_ROUNDING_SPAN = {FP4: 2.0 ** -7, FP8: 2.0 ** -19, FP8NUZ: 2.0 ** -19}


def _rounding_rows(qd) -> torch.Tensor:
    """Rows of 32-groups that put every bf16 magnitude a group's scale can round to a nonzero code of
    ``qd`` under that scale: per level (amax = m * 2^e, from the amax floor to the largest finite
    bf16), element 0 sets the amax and the rest sweep every bf16 pattern of either sign in
    [amax * span, amax], so each (pattern, scale) pair whose code is not 0 is met once."""
    mags = torch.arange(0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()  # 0..max finite
    groups = []
    for e in (-33, -20, -5, -1, 0, 1, 2, 3, 10, 60, 120, 125, 126, 127):
        for m in (1.0, 1.0078125, 1.5, 1.75, 1.875, 1.9921875):  # 1.75, 1.875: e4m3's largest codes and their ties
            amax = m * 2.0 ** e
            vals = mags[(mags <= amax) & (mags >= amax * _ROUNDING_SPAN[qd])]
            vals = torch.cat([vals, -vals])
            vals = torch.cat([vals, vals.new_zeros((-len(vals)) % 31)]).reshape(-1, 31)
            groups.append(torch.cat([torch.full((len(vals), 1), amax), vals], dim=1))
    g = torch.cat(groups)
    g = torch.cat([g, g.new_zeros((-len(g)) % 1024, 32)])
    return g.reshape(-1, 1024 * 32).to(torch.bfloat16)


@pytest.mark.parametrize("qd", [FP4, FP8, FP8NUZ])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_scaled_group_max_is_at_most_max_pos(qd, src):
    """The float rounding saturates by no min (e2m1 keeps the low 3 bits, e4m3 the low 22): for every
    finite amax an input dtype can hold, the group's largest magnitude under its scale is at most the
    format's max_pos. A scale one binade too small (the e8m0 round-up missed) fails here."""
    amax = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(src).float().abs()
    amax = amax[torch.isfinite(amax)]
    s = e8m0_scale_bytes(torch.cat([amax[:, None], amax.new_zeros(len(amax), 31)], dim=1), mx_format(qd))
    v = amax.double() * torch.pow(2.0, (127 - s).double())
    assert float(v.max()) == {FP4: 6.0, FP8: 448.0, FP8NUZ: 240.0}[qd]


@pytest.mark.parametrize("semantics", ["fused", pytest.param("split", marks=SLOW_CI)])
def test_fp4_rounding_every_pattern_and_scale(semantics):
    """The kernel's e2m1 rounding against the reference's, for every bf16 magnitude under every
    scale that rounds it to a nonzero code, both signs (data bytes and scale bytes, bit for bit; on
    the GPU, the compiled rounding)."""
    _rounding_case(FP4, semantics)


@pytest.mark.parametrize("qd", [FP8, pytest.param(FP8NUZ, marks=SLOW_CI)])
def test_fp8_rounding_every_pattern_and_scale(qd):
    """The same for e4m3fn and e4m3fnuz: subnormal codes, the largest
    codes (0x7E, 0x7F) and their ties, ties to even in every binade, fnuz's unsigned zero."""
    _rounding_case(qd, "fused")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qd,semantics", [(FP4, "fused"), (FP4, "split"), (FP8, "fused"), (FP8, "split"),
                                          (FP8NUZ, "fused")])
def test_gpu_rounding_every_pattern_and_scale(qd, semantics):
    """The same on the GPU (``-m gpu`` runs only marked tests): the compiled rounding."""
    _rounding_case(qd, semantics)


def _rounding_case(qd, semantics):
    x = _rounding_rows(qd).to(DEV)
    M = x.shape[0]
    ids, w = routing(M, 1, 4)
    res = k.moe_sort_mx_quant(ids, w, 4, x.shape[1], torch.bfloat16, 32, quant_input=x, quant_dtype=qd,
                              quant_semantics=semantics)
    check(res, ids, w, 4, 32, x=x, qd=qd, semantics=semantics)
