"""The sort gate's verdicts kept per call key (patches/moe_sort_mx_quant.py, aiter_patches/call_key.py).

A repeated ``_moe_sorting_impl`` call is decided once; a hit replays the reasons the gate counts
and launches (or hands the call to AITER) as the gate did. Every field the gate reads is in the
key: changing one after a hit must reach the gate again, with the gate's own reason.
"""

import pytest
import torch

import aiter_patches
from aiter_patches import call_key
from aiter_patches.kernels import moe_sort_mx_quant as k
from aiter_patches.patches.moe import call as moe_call
from aiter_patches.patches import moe_sort_mx_quant as msq
from aiter_patches.verify import suspended

from .conftest import routing
from .test_moe_sort_mx_quant_patch import assert_same_sort_and_zeroed_buf

NAME = "moe_sort_mx_quant"
E, DIM, BLOCK = 16, 256, 32


def stats():
    return aiter_patches.stats()[NAME]


def counting_calls_of(monkeypatch, function: str) -> list:
    """Fresh verdicts, the patch applied, and a list that grows by one per call of ``msq.<function>(step, call, ...)``."""
    monkeypatch.setattr(msq, "VERDICTS", call_key.GuardedVerdicts(NAME))
    calls = []
    real = getattr(msq, function)
    monkeypatch.setattr(msq, function, lambda *a: calls.append(1) or real(*a))
    aiter_patches.apply([NAME])
    return calls


@pytest.fixture
def decided(stub, monkeypatch):
    """The list grows by one per call the gate decides in full."""
    return counting_calls_of(monkeypatch, "_decide")


def sort_args(device, M=5, topk=4, **over):
    ids, w = routing(M, E, topk, device)
    a = dict(topk_ids=ids, topk_weights=w, num_experts=E, model_dim=DIM, moebuf_dtype=torch.bfloat16,
             block_size=BLOCK, expert_mask=None, num_local_tokens=None, dispatch_policy=0, use_opus=True)
    a.update(over)
    return a


def impl(a):
    import aiter.fused_moe as fm

    return fm._moe_sorting_impl(*a.values())


def test_a_repeated_sort_is_decided_once_with_the_same_bits(stub, device, decided):
    a = sort_args(device)
    with suspended():
        expected = impl(a)
    for _ in range(3):
        assert_same_sort_and_zeroed_buf(expected, impl(a), BLOCK)
    assert decided == [1] and msq.VERDICTS.hits == 2
    assert stats()["fast"] == 3 and stats()["fallback"] == {}


def test_a_hit_counts_the_gates_reason_every_call(stub, device, decided):
    a = sort_args(device, use_opus=False)
    for _ in range(3):
        impl(a)
    assert decided == [1] and stats()["fast"] == 0
    assert stats()["fallback"] == {"use_opus=False (the CK sort, AITER_USE_CK_MOE_SORTING=1)": 3}


@pytest.mark.parametrize("change, reason", [
    ("ids int64", "topk_ids not contiguous int32 [M, topk]"),
    ("weights strided", "topk_weights not contiguous fp32 shaped like topk_ids"),
    ("experts", "num_experts < topk"),
    ("block", "block_size not in 16/32/64/128"),
    ("dispatch policy", "sort only, nothing saved"),
    ("kernel limit", "topk outside 1..3"),
    ("AITER's launch count", "sort only, nothing saved"),
    ("backend", "tensors on"),
    ("keyword", None),
])
def test_a_change_of_what_the_gate_reads_is_decided_again(stub, device, decided, monkeypatch, change, reason):
    a = sort_args(device)
    impl(a)
    impl(a)
    assert decided == [1] and stats()["fast"] == 2
    ids, w = a["topk_ids"], a["topk_weights"]
    if change == "ids int64":
        a["topk_ids"] = ids.long()
    elif change == "weights strided":
        a["topk_weights"] = torch.stack([w, w], dim=2)[..., 0]
    elif change == "experts":
        a["num_experts"] = 3
    elif change == "block":
        a["block_size"] = 48
    elif change == "dispatch policy":
        a["dispatch_policy"] = 1  # the stand-in's opus sort: one launch then
    elif change == "kernel limit":
        monkeypatch.setattr(k, "MAX_TOPK", 3)
    elif change == "AITER's launch count":
        monkeypatch.setattr(msq, "aiter_sort_launches", lambda *x: 1)
    elif change == "backend":
        monkeypatch.setattr(msq.runtime, "triton_backend_reason", lambda d: f"tensors on {d}: test")
    if change == "keyword":
        import aiter.fused_moe as fm

        vals = list(a.values())
        fm._moe_sorting_impl(*vals[:-1], use_opus=vals[-1])
    else:
        try:
            impl(a)
        except Exception:  # noqa: BLE001 - AITER's own outcome for the changed call
            pass
    # a sort-only call AITER sorts in one launch is handed back before the verdict key (nothing_to_save)
    shortcut = change in ("dispatch policy", "AITER's launch count")
    assert decided == ([1] if shortcut else [1, 1]), change
    if reason is None:
        assert stats()["fast"] == 3 and stats()["fallback"] == {}
    else:
        assert stats()["fast"] == 2 and [r for r in stats()["fallback"] if r.startswith(reason)], stats()


def test_the_call_state_is_in_the_key(stub, device, decided):
    """Inside fused_moe the predicted quant and the activations decide too: a bf16 activation gets the
    quant; an fp32 one (same shapes) must not reuse that verdict."""
    a = sort_args(device)
    fp4 = torch.float4_e2m1fn_x2
    for dtype in (torch.bfloat16, torch.bfloat16, torch.float32):
        x = torch.randn(5, DIM).to(dtype).to(device)
        call = moe_call.MoeCall(hidden_states=x, quant_dtype=fp4)
        with moe_call.scope(call):
            impl(a)
        assert (call.stage1_quant is not None) == (dtype == torch.bfloat16)
    assert decided == [1, 1]
    assert any(r.startswith("stage-1 quant not fused: quant_input dtype torch.float32") for r in stats()["fallback"])
    assert stats()["fast"] == 3  # the fp32 call sorts without the quant


def test_without_a_predicted_quant_the_activations_are_not_in_the_key(stub, device, decided):
    """No quant predicted (bf16 or fp8 weights): the gate never reads the activations, so calls with
    other activations share one verdict (their key would cost a tensor's metadata read per call)."""
    a = sort_args(device)
    for dtype, rows in ((torch.bfloat16, 5), (torch.float32, 5), (torch.bfloat16, 9)):
        x = torch.randn(rows, DIM).to(dtype).to(device)
        call = moe_call.MoeCall(hidden_states=x, quant_dtype=None)
        with moe_call.scope(call):
            impl(a)
        assert call.stage1_quant is None
    assert decided == [1] and stats()["fast"] == 3


def test_kept_verdicts_hold_no_tensor(stub, device, decided):
    import gc
    import weakref

    a = sort_args(device)
    impl(a)
    x = torch.randn(5, DIM).to(torch.bfloat16).to(device)
    with moe_call.scope(moe_call.MoeCall(hidden_states=x, quant_dtype=torch.float4_e2m1fn_x2)):
        impl(a)
    assert len(msq.VERDICTS) == 2
    alive = [weakref.ref(t) for t in (a["topk_ids"], a["topk_weights"], x)]
    del a, x
    gc.collect()
    assert not [r for r in alive if r() is not None], "a kept key, guard or plan holds a call's tensor"
    seen, todo = set(), [msq.VERDICTS._d]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type) or callable(obj):
            continue  # classes, functions and the binder's methods hold no call's tensor
        seen.add(id(obj))
        assert not isinstance(obj, torch.Tensor), "a kept verdict holds a tensor"
        if isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (tuple, list, frozenset)):
            todo += list(obj)
        elif hasattr(obj, "__slots__"):
            todo += [getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s)]


def test_enum_members_are_remembered_as_the_enum_gives_them():
    import enum

    class Act(enum.IntEnum):
        SILU = 0
        GELU = 1

    assert msq.predict._member(Act, 1) is Act.GELU and msq.predict._member(Act, 1) is Act(1)
    assert msq.predict._member(Act, True) is Act(True)  # keyed with the value's type: same member as the enum's
    for _ in range(2):  # a refused value raises every time, nothing remembered for it
        with pytest.raises(ValueError):
            msq.predict._member(Act, 7)
    assert (Act, int, 7) not in msq.predict._MEMBERS


@pytest.mark.parametrize("n_keywords", [0, 4, 8])
def test_a_hit_launches_on_this_calls_arguments(stub, device, decided, n_keywords):
    """The kept verdict says where the launch's arguments are; a hit with other routing (same
    shapes) must sort that routing, however the arguments are given (the last ``n_keywords`` by name)."""
    import aiter.fused_moe as fm

    def call(a):
        names = list(a)
        cut = len(names) - n_keywords
        return fm._moe_sorting_impl(*[a[n] for n in names[:cut]], **{n: a[n] for n in names[cut:]})

    mask = torch.ones(E, dtype=torch.int32, device=device)
    mask[3] = 0
    cases = []
    for seed in (0, 1, 2):
        ids, w = routing(5, E, 4, device, seed)
        cases.append(sort_args(device, topk_ids=ids, topk_weights=w, expert_mask=mask if seed else None))
    with suspended():  # (suspending re-applies: a new binder, so new keys)
        expected = [call(a) for a in cases]
    for a, exp in zip(cases, expected):
        assert_same_sort_and_zeroed_buf(exp, call(a), BLOCK)
    assert decided == [1, 1] and stats()["fast"] == 3 and msq.VERDICTS.hits == 1


def test_applying_again_decides_afresh(stub, device, decided):
    """A user who reverts, changes AITER and applies again must not get the old verdicts replayed."""
    a = sort_args(device)
    impl(a)
    impl(a)
    assert decided == [1] and len(msq.VERDICTS) == 1
    aiter_patches.revert([NAME])
    aiter_patches.apply([NAME])
    assert len(msq.VERDICTS) == 0
    impl(a)
    assert decided == [1, 1]


def test_a_failed_workspace_query_is_asked_again_next_call(stub, device, decided, monkeypatch):
    """AITER's workspace size unknown this time (the sort-only rule cannot say): that call goes to
    AITER, counted; the verdict is not kept, so the next call asks again and may launch."""
    import aiter

    real = aiter.moe_sorting_opus_get_workspace_size
    failures = []

    def flaky(*a):
        if not failures:
            failures.append(a)
            raise RuntimeError("JIT module still loading")
        return real(*a)

    monkeypatch.setattr(aiter, "moe_sorting_opus_get_workspace_size", flaky)
    a = sort_args(device)
    impl(a)
    assert stats()["fast"] == 0 and list(stats()["fallback"]) == [msq.WORKSPACE_UNKNOWN]
    impl(a)
    assert stats()["fast"] == 1 and len(msq.VERDICTS) == 1


class CountingPlans(dict):
    """The kernel API's plan cache, counting its lookups (a lookup is a plan key built and hashed)."""

    lookups = 0

    def get(self, key, default=None):
        CountingPlans.lookups += 1
        return super().get(key, default)


@pytest.fixture
def plans(monkeypatch):
    monkeypatch.setattr(k, "_plans", CountingPlans())
    CountingPlans.lookups = 0
    made = []
    real = k._make_plan
    monkeypatch.setattr(k, "_make_plan", lambda key: made.append(key) or real(key))
    return made


def poisoned_empty(*size, **kw):
    t = torch.empty(*size, **kw)
    t.view(torch.uint8).fill_(0x7F)  # every output byte the launch leaves unwritten reads as garbage
    return t


@pytest.mark.parametrize("quant", [False, True])
def test_a_hit_launches_the_verdicts_kept_plan_without_a_second_key(stub, device, decided, plans, monkeypatch, quant):
    """One key per sort hit (issue 15): the verdict keeps the kernel plan of its first launch; a hit
    builds no plan key and launches that plan, with the same bits into poisoned outputs."""
    a = sort_args(device)
    x = torch.randn(5, DIM).to(torch.bfloat16).to(device)

    def sort():
        call = moe_call.MoeCall(hidden_states=x, quant_dtype=torch.float4_e2m1fn_x2) if quant else None
        if call is None:
            return impl(a), None
        with moe_call.scope(call):
            return impl(a), call.stage1_quant

    monkeypatch.setattr(k, "_empty", poisoned_empty)
    first, q0 = sort()  # the API in full (its plan key built once)
    assert CountingPlans.lookups == 1 and len(plans) == 1
    for _ in range(2):
        got, q = sort()
        for g, f in zip(got, first):  # every byte, the undefined ones poisoned alike
            assert torch.equal(g.view(torch.uint8), f.view(torch.uint8))
        if quant:
            assert torch.equal(q.data.view(torch.uint8), q0.data.view(torch.uint8))
            assert torch.equal(q.scale.view(torch.uint8), q0.scale.view(torch.uint8))
    assert decided == [1] and stats()["fast"] == 3
    assert CountingPlans.lookups == 1 and len(plans) == 1, "a hit built the plan key again"
    with suspended():
        assert_same_sort_and_zeroed_buf(impl(a), first, BLOCK)  # and that is AITER's sort


@pytest.mark.parametrize("name, value", [("DECODE_MAX_PAIRS", 0), ("ROW_SPLIT_PROGRAMS", 1), ("TILE", 64)])
def test_a_changed_tunable_gives_a_new_verdict_and_a_new_plan(stub, device, decided, plans, monkeypatch, name, value):
    """The verdict key holds the module constants the plan is derived from: a benchmark or test that
    changes one gets a plan made with it at the next call, never the kept one."""
    a = sort_args(device)
    with suspended():  # AITER's sort (suspending re-applies: done first, as it drops the verdicts)
        expected = impl(a)
    impl(a)
    impl(a)
    assert decided == [1] and len(plans) == 1
    monkeypatch.setattr(k, name, value)
    got = impl(a)
    assert_same_sort_and_zeroed_buf(expected, got, BLOCK)
    assert decided == [1, 1] and len(plans) == 2 and plans[0] != plans[1]
    assert plans[1][-1] == k._tunables() and plans[0][-1] != plans[1][-1]
    impl(a)
    assert decided == [1, 1] and len(plans) == 2


def test_a_replaced_kernel_api_takes_every_call_even_with_a_kept_plan(stub, device, decided, plans, monkeypatch):
    """A kept plan skips the kernel API only while the API is the module's own: a wrapper or an
    injected failure put in place after the plan was kept gets every call, with the same bits."""
    a = sort_args(device)
    with suspended():
        expected = impl(a)
    impl(a)
    impl(a)  # a hit through the kept plan
    assert len(plans) == 1
    seen, real = [], k.moe_sort_mx_quant
    monkeypatch.setattr(k, "moe_sort_mx_quant", lambda *args, **kw: seen.append(kw.get("kept")) or real(*args, **kw))
    for _ in range(2):
        assert_same_sort_and_zeroed_buf(expected, impl(a), BLOCK)
    assert seen == [None, None], "a kept plan bypassed the replaced API, or the wrapper was handed one to keep"
    monkeypatch.setattr(k, "moe_sort_mx_quant", lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("injected")))
    assert_same_sort_and_zeroed_buf(expected, impl(a), BLOCK)  # AITER did the work
    assert sum(stats()["errors"].values()) == 1
    monkeypatch.setattr(k, "moe_sort_mx_quant", real)
    lookups = CountingPlans.lookups
    impl(a)
    assert seen == [None, None] and CountingPlans.lookups == lookups, "the restored API's kept plan was not used"
    assert decided == [1]


def test_a_plan_the_api_does_not_keep_is_not_kept_by_the_verdict(stub, device, decided, plans, monkeypatch):
    """Past the plan cache's limit (or under torch.compile) the API makes a plan per call; a verdict
    then keeps none either and every hit goes through the API (the plan key built each time)."""
    monkeypatch.setattr(k, "MAX_PLANS", 0)
    a = sort_args(device)
    for _ in range(3):
        impl(a)
    assert decided == [1] and stats()["fast"] == 3
    assert CountingPlans.lookups == 3 and len(plans) == 3


def test_the_addend_written_by_the_sort_is_in_the_verdicts_guard(stub, device):
    """The one-launch sort writes the addend as moe_buf's fill with its row stride: a kept verdict (and its
    kernel plan) made for a contiguous addend must not serve a row-strided one of the same shape."""
    import aiter.fused_moe as fm

    from .test_addend_fold import addend_for, reference_with_accumulator_start
    from .test_moe_sort_mx_quant_patch import moe_inputs, same_bits

    args = moe_inputs(stub, device, 5, E, 4, DIM, 128, "bf16")
    addend = addend_for(args)
    wide = torch.zeros(addend.shape[0], 2 * addend.shape[1], dtype=addend.dtype, device=addend.device)
    strided = wide[:, : addend.shape[1]]
    strided.copy_(addend_for(args, seed=3))
    expected = [reference_with_accumulator_start(fm, args, a) for a in (addend, strided)]
    aiter_patches.apply(["moe_addend_fold", NAME])
    for _ in range(2):
        for a, exp in zip((addend, strided), expected):
            assert same_bits(fm.fused_moe(**args, moe_addend=a), exp)
    assert stats()["fast"] == 4 and len(msq.VERDICTS) == 2, (stats(), len(msq.VERDICTS))
