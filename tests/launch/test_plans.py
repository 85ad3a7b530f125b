"""The kernel APIs' per-shape plans and prepared launches hand the launcher what Triton's own launch does.

Plans (kernels/moe_sort_mx_quant.py, the stand-in's blockscale_gemm_splitk.py) keep, per call shape,
the allocation sizes, grids, scalars and constexprs; their launches go through
``fast_launch.Prepared``. On the fake driver (bench/fake_triton.py) each API call is made the
ordinary way (fast launch off) and then twice with plans and direct launches on (the second
is a plan hit and a direct launch): the variants, grids and every launcher argument must agree
(same variant + same arguments = same bits). Allocations are replayed so that the pointers
match. A change of shape, dtype, stride or flag must miss (a new plan, or a new variant under
the same plan), and no plan may hold a tensor, even one made during a (simulated) capture.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch
from triton.runtime.jit import JITFunction

from aiter_patches_standin import blockscale_gemm_splitk as gemm
from aiter_patches.kernels import fast_launch as fl
from aiter_patches.kernels import moe_sort_mx_quant as k
from bench import fake_triton as ft

SORT_KERNELS = ("_sort_quant_kernel", "_chunk_rank_kernel", "_chunk_scan_kernel", "_scale_tiles_kernel")
FP4 = torch.float4_e2m1fn_x2


@pytest.fixture
def fake(monkeypatch):
    fns = []
    for mod, names in ((k, SORT_KERNELS), (gemm, ("_blockscale_gemm_kernel",))):
        for name in names:
            fn = getattr(mod, name)
            fn = fn if isinstance(fn, JITFunction) else ft.jit(fn.fn)
            monkeypatch.setattr(mod, name, fn)
            fns.append(fn)
    monkeypatch.setattr(k, "_plans", {})
    monkeypatch.setattr(gemm, "_plans", {})
    allocs: list = []
    real = k._empty

    def replayed_empty(*size, dtype, device):
        """The same buffers, in call order, on every API call (index reset by ``again``)."""
        i = replayed_empty.i
        replayed_empty.i += 1
        if i < len(allocs) and allocs[i].shape == torch.Size(size) and allocs[i].dtype == dtype:
            return allocs[i]
        t = real(*size, dtype=dtype, device=device)
        allocs[i:] = [t]
        return t

    replayed_empty.i = 0
    monkeypatch.setattr(k, "_empty", replayed_empty)
    real_torch_empty = torch.empty

    def workspace(*size, dtype=None, device=None, **kw):  # the GEMM's fp32 workspace, replayed likewise
        if dtype is torch.float32 and len(size) == 1 and not kw:
            return replayed_empty(*size, dtype=dtype, device=device)
        return real_torch_empty(*size, dtype=dtype, device=device, **kw)

    monkeypatch.setattr(torch, "empty", workspace)
    with ft.fake_triton(*fns):
        yield replayed_empty
    fl.set_mode(None)


def three_ways(empty, call):
    """(ordinary launches, direct launches on a plan hit) of ``call()``; asserts the hit was direct."""
    fl.set_mode("off")
    empty.i = 0
    n0 = len(ft.LOG)
    call()
    ordinary = ft.LOG[n0:]
    fl.set_mode("on")
    empty.i = 0
    call()  # may be the plan's and the key's first sight
    direct0 = fl.stats()["direct"]
    empty.i = 0
    n1 = len(ft.LOG)
    call()
    direct = ft.LOG[n1:]
    assert fl.stats()["direct"] == direct0 + len(direct), "the plan hit did not launch directly"
    assert len(direct) == len(ordinary)
    for d, o in zip(direct, ordinary):
        assert d.same_as(o), (o.kernel.name, d.kernel is o.kernel, d.grid, o.grid,
                              [i for i, (x, y) in enumerate(zip(d.args, o.args)) if x != y])
    assert [d.raw_types for d in direct] == [o.raw_types for o in ordinary]  # CPU tensors stay tensors, as in Triton's
    return ordinary, direct


def routing(M, K, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).contiguous()
    return ids, torch.rand(M, K, generator=g)


@pytest.mark.parametrize("M,K,E,D,quant,sem", [
    (1, 8, 256, 7168, FP4, "auto"), (1, 8, 256, 7168, None, "auto"), (4, 16, 896, 3584, FP4, "auto"),
    (16, 4, 128, 6144, torch.float8_e4m3fn, "auto"), (3, 8, 128, 4096, torch.float8_e4m3fnuz, "split"),
    (300, 8, 128, 256, FP4, "split"),  # four launches: rank, scan, sort, scale tiles
    (300, 8, 128, 256, None, "auto"),
])
def test_sort_plan_hits_launch_what_triton_launches(fake, M, K, E, D, quant, sem):
    ids, w = routing(M, K, E)
    kw = dict(quant_input=torch.randn(M, D).to(torch.bfloat16), quant_dtype=quant) if quant is not None else {}
    ordinary, _ = three_ways(fake, lambda: k.moe_sort_mx_quant(ids, w, E, D, torch.bfloat16, 32,
                                                                quant_semantics=sem, **kw))
    assert len(ordinary) == k.launch_count(M, K, E, quant is not None, sem == "fused" or (
        sem == "auto" and M * K <= k.FUSED_QUANT_MAX_PAIRS))
    assert len(k._plans) == 1


def test_sort_changed_shape_dtype_stride_or_flag_misses(fake):
    M, K, E, D = 4, 8, 64, 512
    ids, w = routing(M, K, E)
    x = torch.randn(M, D).to(torch.bfloat16)
    base = dict(quant_input=x, quant_dtype=FP4)
    wide = torch.randn(M, 2 * D).to(torch.bfloat16)[:, :D]  # same shape, another row stride
    w_off = torch.rand(M * K + 1)[1:].view(M, K)  # 4 bytes off: another alignment
    cases = [
        (ids, w, E, D, torch.bfloat16, 32, base),
        (ids[:3].contiguous(), w[:3].contiguous(), E, D, torch.bfloat16, 32, dict(base, quant_input=x[:3])),  # tokens
        (ids, w, E + 1, D, torch.bfloat16, 32, base),  # experts
        (ids, w, E, D, torch.bfloat16, 64, base),  # block size
        (ids, w, E, D, torch.bfloat16, 32, dict(base, quant_dtype=torch.float8_e4m3fn)),  # quant dtype
        (ids, w, E, D, torch.float16, 32, base),  # moe_buf dtype
        (ids, w, E, D, torch.bfloat16, 32, dict(base, quant_input=wide)),  # stride
        (ids, w, E, D, torch.bfloat16, 32, dict(base, expert_mask=torch.ones(E, dtype=torch.int32))),  # flag
        (ids, w, E, D, torch.bfloat16, 32, dict(base, zero_moe_buf=False)),  # flag
        (ids, w_off, E, D, torch.bfloat16, 32, base),  # alignment: same plan, another variant
    ]
    seen_variants = []
    for args in cases:
        *a, kw = args
        ordinary, direct = three_ways(fake, lambda: k.moe_sort_mx_quant(*a, **kw))
        seen_variants.append(direct[-1].kernel)
    assert len(k._plans) == len(cases) - 2  # the moe_buf dtype and the alignment live in the launch key
    assert seen_variants[5] is not seen_variants[0] and seen_variants[-1] is not seen_variants[0]


def test_a_changed_tunable_misses(fake, monkeypatch):
    M, K, E = 40, 2, 8
    ids, w = routing(M, K, E)
    one, _ = three_ways(fake, lambda: k.moe_sort_mx_quant(ids, w, E, 64, torch.bfloat16, 16))
    monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", 16)
    monkeypatch.setattr(k, "CHUNK_PAIRS", 16)
    four, _ = three_ways(fake, lambda: k.moe_sort_mx_quant(ids, w, E, 64, torch.bfloat16, 16))
    assert len(one) == 1 and len(four) == 3


def test_plans_past_the_limit_are_made_per_call(fake, monkeypatch):
    monkeypatch.setattr(k, "MAX_PLANS", 0)
    ids, w = routing(2, 2, 4)
    three_ways(fake, lambda: k.moe_sort_mx_quant(ids, w, 4, 64, torch.bfloat16, 16))
    assert not k._plans


def _tensors_reachable(roots, limit=20000) -> list:
    seen, stack, found = set(), list(roots), []
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, type(gc))) or isinstance(o, JITFunction):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
            continue
        if isinstance(o, types.FunctionType):  # a module's function (e.g. the GEMM's block_config): its
            stack.extend(o.__closure__ or ())  # globals are the module's caches, not the plan's; a closure's cells are
            stack.extend(o.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(o))
    return found


def _plan_roots(plans) -> list:
    """What each plan holds, less the kernels themselves (JITFunctions, which the key names by id)."""
    roots = []
    for plan in plans.values():
        for field in plan:
            if isinstance(field, fl.Prepared):
                roots += [field.grid, field.args, field.kwargs, field.tensor_at, field._kernels]
            elif isinstance(field, JITFunction):
                continue
            elif isinstance(field, tuple) and field and all(isinstance(f, JITFunction) for f in field):
                continue
            else:
                roots.append(field)
    return roots


def test_no_plan_holds_a_tensor_even_one_made_during_a_capture(fake, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_sync(*a, **kw):
        raise AssertionError("device sync on the launch path")

    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    ids, w = routing(300, 8, 128)
    x = torch.randn(300, 256).to(torch.bfloat16)
    init = torch.randn(300, 256).to(torch.bfloat16)
    mask = torch.ones(128, dtype=torch.int32)
    three_ways(fake, lambda: k.moe_sort_mx_quant(ids, w, 128, 256, torch.bfloat16, 32, quant_input=x,
                                                  quant_dtype=FP4, quant_semantics="split",
                                                  expert_mask=mask,
                                                  moe_buf_init=init))
    A, B, out, a_s, b_s = gemm_operands(4, 256, 1024)
    three_ways(fake, lambda: gemm.blockscale_gemm_splitk(A, B, out, a_s, b_s, splits=4, zero_out=False))
    assert k._plans and gemm._plans
    assert not _tensors_reachable(_plan_roots(k._plans) + _plan_roots(gemm._plans))


def gemm_operands(M, N, K):
    A = torch.zeros(M, K).to(torch.float8_e4m3fn)
    B = torch.zeros(N, K).to(torch.float8_e4m3fn)
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    return A, B, out, torch.ones(M, K // 128), torch.ones(N // 128, K // 128)


@pytest.mark.parametrize("M,splits,zero_out", [(1, 2, False), (16, 4, True), (33, 1, False), (65, 2, False)])
def test_gemm_plan_hits_launch_what_triton_launches(fake, M, splits, zero_out):
    A, B, out, a_s, b_s = gemm_operands(M, 256, 1024)
    three_ways(fake, lambda: gemm.blockscale_gemm_splitk(A, B, out, a_s, b_s, splits=splits, zero_out=zero_out))
    # another A row stride and a K-major A_scale view: new plans, same launches as Triton's
    A_wide = torch.zeros(M, 2048).to(torch.float8_e4m3fn)[:, :1024]
    a_s_t = torch.ones(1024 // 128, M).t()
    three_ways(fake, lambda: gemm.blockscale_gemm_splitk(A_wide, B, out, a_s_t, b_s, splits=splits,
                                                         zero_out=zero_out))
    assert len(gemm._plans) == 2


def test_gemm_a_replaced_block_config_misses(fake, monkeypatch):
    """A tuning sweep swaps block_config per candidate: each must launch its own tiles."""
    A, B, out, a_s, b_s = gemm_operands(16, 256, 1024)
    launched = []
    for bn in (64, 128):
        cfg = dict(BLOCK_M=16, BLOCK_N=bn, num_warps=4, num_stages=1)
        monkeypatch.setattr(gemm, "block_config", lambda m, cfg=cfg: cfg)
        ordinary, direct = three_ways(fake, lambda: gemm.blockscale_gemm_splitk(A, B, out, a_s, b_s, splits=2,
                                                                              zero_out=True))
        launched.append({d.grid for d in direct})
    assert launched[0] != launched[1], launched


def test_gemm_over_the_workspace_limit_takes_row_blocks_unplanned(fake, monkeypatch):
    M, N, K = 300, 256, 1024  # 128-row blocks: 128 + 128 + 44
    monkeypatch.setattr(gemm, "MAX_WORKSPACE_BYTES", gemm.workspace_bytes(128, N, 2))
    A, B, out, a_s, b_s = gemm_operands(M, N, K)
    ordinary, _ = three_ways(fake, lambda: gemm.blockscale_gemm_splitk(A, B, out, a_s, b_s, splits=2,
                                                                      zero_out=False))
    assert len(ordinary) == 3 and not gemm._plans


def test_prepared_refuses_a_tensor_among_the_fixed_arguments(fake):
    with pytest.raises(TypeError, match="tensor among the fixed"):
        fl.Prepared(gemm._blockscale_gemm_kernel, (1,), (0,), (None, torch.zeros(1)), {})


def test_prepared_goes_through_launch_when_a_hook_is_set(fake, monkeypatch):
    A, B, out, a_s, b_s = gemm_operands(2, 256, 1024)
    call = lambda: gemm.blockscale_gemm_splitk(A, B, out, a_s, b_s, splits=2, zero_out=False)  # noqa: E731
    three_ways(fake, call)
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: seen.append(1))
    before = fl.stats()
    call()
    after = fl.stats()
    assert after["direct"] == before["direct"] and after["ordinary"] == before["ordinary"] + 1  # Triton's own launch


def _poisoned_empty(real):
    def empty(*size, dtype, device):
        t = real(*size, dtype=dtype, device=device)
        t.view(torch.uint8).fill_(0x5A) if t.numel() else None
        return t
    return empty


def _bytes(t):
    return t.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("M,one_launch_max", [(3, None), (20, 16)])
def test_a_plan_hit_gives_the_bits_of_a_fresh_plan(monkeypatch, M, one_launch_max):
    """Triton's interpreter (tests/conftest.py): a hit and a fresh miss write the same bytes everywhere."""
    if not hasattr(k._sort_quant_kernel, "fn") or isinstance(k._sort_quant_kernel, JITFunction):
        pytest.skip("needs the interpreter (TRITON_INTERPRET=1, no GPU)")
    monkeypatch.setattr(k, "_plans", {})
    monkeypatch.setattr(k, "_empty", _poisoned_empty(k._empty))
    if one_launch_max:
        monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", one_launch_max)
        monkeypatch.setattr(k, "CHUNK_PAIRS", 16)
    ids, w = routing(M, 2, 4, seed=M)
    x = torch.randn(M, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def call():
        r = k.moe_sort_mx_quant(ids, w, 4, 64, torch.bfloat16, 16, quant_input=x, quant_dtype=FP4,
                                quant_semantics="split")
        return [r.sorted_ids, r.sorted_weights, r.sorted_expert_ids, r.num_valid_ids, r.moe_buf, *r.quant]

    call()
    assert len(k._plans) == 1
    hit = call()
    k._plans.clear()
    fresh = call()
    for a, b in zip(hit, fresh):
        assert torch.equal(_bytes(a), _bytes(b))


def test_a_gemm_plan_hit_gives_the_bits_of_a_fresh_plan(monkeypatch):
    if isinstance(gemm._blockscale_gemm_kernel, JITFunction):
        pytest.skip("needs the interpreter (TRITON_INTERPRET=1, no GPU)")
    monkeypatch.setattr(gemm, "_plans", {})
    g = torch.Generator().manual_seed(0)
    M, N, K = 2, 128, 512
    A = torch.randn(M, K, generator=g).to(torch.float8_e4m3fn)
    B = torch.randn(N, K, generator=g).to(torch.float8_e4m3fn)
    a_s, b_s = torch.rand(M, K // 128, generator=g), torch.rand(N // 128, K // 128, generator=g)
    outs = []
    for clear in (False, False, True):
        if clear:
            gemm._plans.clear()
        out = torch.zeros(M, N, dtype=torch.bfloat16)
        gemm.blockscale_gemm_splitk(A, B, out, a_s, b_s, splits=2, zero_out=False)
        outs.append(out)
    assert len(gemm._plans) == 1
    assert torch.equal(_bytes(outs[1]), _bytes(outs[2])) and torch.equal(_bytes(outs[0]), _bytes(outs[1]))


@pytest.mark.parametrize("mask,nlt,init,quant", [
    (True, False, False, None), (False, True, False, FP4), (False, False, True, None), (True, True, True, FP4),
])
def test_sort_plan_with_every_optional_tensor_launches_what_triton_launches(fake, mask, nlt, init, quant):
    """The sort launch hands each distinct tensor once (a plan's groups of positions, one per tensor
    the call builds): given optional tensors take their own place, absent ones share topk_ids'/moe_buf's."""
    M, K, E, D = 5, 4, 32, 256
    ids, w = routing(M, K, E)
    kw = {}
    if mask:
        kw["expert_mask"] = torch.ones(E, dtype=torch.int32)
    if nlt:
        kw["num_local_tokens"] = torch.tensor([M], dtype=torch.int32)
    if init:
        kw["moe_buf_init"] = torch.randn(M, D).to(torch.bfloat16)
    if quant is not None:
        kw.update(quant_input=torch.randn(M, D).to(torch.bfloat16), quant_dtype=quant)
    three_ways(fake, lambda: k.moe_sort_mx_quant(ids, w, E, D, torch.bfloat16, 32, **kw))
    (plan,) = k._plans.values()
    distinct = 7 + mask + nlt + init + 3 * (quant is not None)
    assert len(plan.sort.tensor_at) == distinct
    assert sorted(p for g in plan.sort.tensor_at for p in g) == sorted(k._SORT_TENSORS)


def test_prepared_passes_one_tensor_at_each_position_of_its_group(fake):
    """A group of positions reads its tensor once and hands it to every position, as launch() would."""
    ids, w = routing(3, 2, 8)
    plan_tensors = []
    three_ways(fake, lambda: plan_tensors.append(k.moe_sort_mx_quant(ids, w, 8, 64, torch.bfloat16, 16)))
    (plan,) = k._plans.values()
    args, _ = plan.sort.call_args(tuple(torch.zeros(i + 1) for i in range(len(plan.sort.tensor_at))))
    for j, group in enumerate(plan.sort.tensor_at):
        for pos in group:
            assert args[pos].numel() == j + 1


@pytest.mark.parametrize("case", ["plain", "mask", "nlt", "init", "fp4", "fp8", "no-zero", "given-buf",
                                  "prescanned-split", "prescanned-fused", "everything"])
def test_sort_groups_only_share_a_place_between_the_same_tensor(fake, monkeypatch, case):
    """Every group of the sort launch's positions names one tensor of the call: at each position of a
    group the API built the very same object (else the launch would get one tensor's pointer at
    another's place: a wrong address). Checked on the 17 tensors the API hands over, in every path."""
    seen = []
    real_groups = k._sort_groups

    def checked(*flags):
        groups, pick = real_groups(*flags)

        def pick_checked(tensors):
            for group in groups:
                first = tensors[k._SORT_TENSORS.index(group[0])]
                assert all(tensors[k._SORT_TENSORS.index(p)] is first for p in group), (flags, group)
            seen.append(len(groups))
            return pick(tensors)
        return groups, pick_checked

    monkeypatch.setattr(k, "_sort_groups", checked)
    M, K, E, D = 5, 4, 32, 256
    ids, w = routing(M, K, E)
    x = torch.randn(M, D).to(torch.bfloat16)
    kw = {"plain": {}, "mask": dict(expert_mask=torch.ones(E, dtype=torch.int32)),
          "nlt": dict(num_local_tokens=torch.tensor([M], dtype=torch.int32)),
          "init": dict(moe_buf_init=torch.randn(M, D).to(torch.bfloat16)),
          "fp4": dict(quant_input=x, quant_dtype=FP4), "fp8": dict(quant_input=x, quant_dtype=torch.float8_e4m3fn),
          "no-zero": dict(zero_moe_buf=False), "given-buf": dict(moe_buf=torch.empty(M, D, dtype=torch.bfloat16)),
          "prescanned-split": dict(quant_input=x, quant_dtype=FP4, quant_semantics="split"),
          "prescanned-fused": dict(quant_input=x, quant_dtype=FP4, quant_semantics="fused"),
          "everything": dict(expert_mask=torch.ones(E, dtype=torch.int32),
                             num_local_tokens=torch.tensor([M], dtype=torch.int32),
                             moe_buf_init=torch.randn(M, D).to(torch.bfloat16), quant_input=x, quant_dtype=FP4,
                             moe_buf=torch.empty(M, D, dtype=torch.bfloat16))}[case]
    if case.startswith("prescanned") or case == "everything":
        monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", 8)  # the rank tables (and, split, the compact scales)
    k.moe_sort_mx_quant(ids, w, E, D, torch.bfloat16, 32, **kw)
    k.moe_sort_mx_quant(ids, w, E, D, torch.bfloat16, 32, **kw)  # the plan's hit
    assert len(seen) == 2
