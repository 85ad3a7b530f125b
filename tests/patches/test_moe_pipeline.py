"""The MoE pipeline: one wrapper per target, declared plan fields, and every combination of the three features.

Each combination of ``moe_addend_fold``, ``sort_extension`` and ``moe_sort_mx_quant``
(2^3, with the pipeline's declaration check on) must give the bits the features
promise one at a time: the sort + quant and the extension hook never change bits
(AITER's output), the fold gives AITER's output with ``moe_buf`` started from the
addend, and without the fold the addend is added after the call. The counters say
which feature engaged.
"""

import itertools

import pytest
import torch

import aiter_patches
from aiter_patches import fused_moe_with_addend, registry
from aiter_patches.extensions import DeferredWork, PrecomputedSort
from aiter_patches.patches import moe_addend_fold
from aiter_patches.patches.moe import call as moe_call
from aiter_patches.patches.moe import pipeline as moe_pipeline
from aiter_patches.signatures import Binder
from helpers import moe_declared

from .test_addend_fold import addend_for, reference_with_accumulator_start
from .test_moe_sort_mx_quant_patch import moe_inputs, same_bits

FOLD, EXT, SORT = "moe_addend_fold", "sort_extension", "moe_sort_mx_quant"
MOE = (FOLD, EXT, SORT)
SUBSETS = [c for r in range(len(MOE) + 1) for c in itertools.combinations(MOE, r)]
M, E, TOPK, DIM, INTER, BLOCK = 6, 16, 4, 256, 128, 32
ZERO = {"fast": 0, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}


def stats():
    return aiter_patches.stats()


# ---------------------------------------------------------------- declarations


def test_declarations_name_real_fields_and_steps_name_real_methods():
    fields = moe_declared.plan_fields()
    moe_patches = {p.name for p in registry.patches()
                   if any(t.wrap.__qualname__.startswith("wrapper.") and t.wrap.__module__ == moe_pipeline.__name__
                          for t in p.targets)}
    assert moe_patches == set(MOE) == set(moe_pipeline.FEATURES)
    for f in moe_pipeline.FEATURES.values():
        for key in f.reads | f.writes:
            prefix, _, name = key.partition(".")
            assert name in fields[prefix], f"{f.name} declares {key}, which does not exist"
    for steps in moe_pipeline.STEPS.values():
        for step in steps:
            if step != moe_pipeline.AITER:
                assert callable(getattr(moe_pipeline.FEATURES[step[0]], step[1], None)), step
    doc = moe_pipeline.__doc__
    for steps in moe_pipeline.STEPS.values():  # the docstring's table names every step
        for step in steps:
            if step != moe_pipeline.AITER:
                assert step[1] in doc, step


def test_a_feature_writing_an_undeclared_field_fails(stub, device, monkeypatch):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, M, E, TOPK, DIM, INTER, "bf16")
    aiter_patches.apply([FOLD])
    fold = moe_pipeline.FEATURES[FOLD]
    monkeypatch.setattr(fold, "writes", fold.writes - {"call.moe_buf"}, raising=False)
    with pytest.raises(moe_declared.UndeclaredField, match=r"'moe_addend_fold' writes call.moe_buf"):
        fm.fused_moe(**args, moe_addend=addend_for(args))
    monkeypatch.setattr(fold, "reads", fold.reads - {"sort.extensions"}, raising=False)
    monkeypatch.setattr(fold, "writes", type(fold).writes, raising=False)
    with pytest.raises(moe_declared.UndeclaredField, match=r"'moe_addend_fold' reads sort.extensions"):
        fm.fused_moe(**args, moe_addend=addend_for(args))
    with moe_declared.checking(False):  # the check is what raised: unchecked, the same call runs
        fm.fused_moe(**args, moe_addend=addend_for(args))


# ---------------------------------------------------------------- one wrapper, one binding


def test_one_wrapper_per_target_binding_once(stub, device, monkeypatch):
    import aiter.fused_moe as fm

    originals = {a: getattr(fm, a) for a in ("fused_moe", "_moe_sorting_impl", "fused_dynamic_mxfp4_quant_moe_sort")}
    args = moe_inputs(stub, device, M, E, TOPK, DIM, INTER, "fp4")
    aiter_patches.apply(list(MOE))
    for attr, original in originals.items():
        head = getattr(fm, attr)
        built = getattr(head, "__aiter_patches_moe_pipeline__")
        assert built.original is original, attr  # the head calls AITER's function itself
        walked, obj = [], head
        while getattr(obj, "__aiter_patches__", None):
            walked.append(obj.__aiter_patches__)
            obj = obj.__wrapped__
        assert obj is original and walked == [n for n, _ in reversed(built.layers)], walked  # one layer per patch
        assert walked == ([EXT, SORT] if attr.startswith("fused_dynamic") else [FOLD, EXT, SORT]), walked
    binds = []
    real_bind = Binder.bind
    monkeypatch.setattr(Binder, "bind", lambda self, a, k: binds.append(1) or real_bind(self, a, k))
    fm.fused_moe(**args, moe_addend=addend_for(args))
    assert len(binds) == 3, "one binding each: fused_moe, _moe_sorting_impl, the stage-1 quant helper"
    assert stats()[SORT]["fast"] == 2 and stats()[FOLD]["fast"] == 1


def test_a_stale_wrapper_skips_a_reverted_feature(stub, device):
    """A reference revert cannot rebind (captured before the revert) runs only the features still applied."""
    import aiter.fused_moe as fm

    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32, device=device)
    w = torch.full((3, 2), 0.5, device=device)
    impl_args = (ids, w, E, DIM, torch.bfloat16, BLOCK, None, None, 0, True)
    aiter_patches.apply(list(MOE))
    captured = fm._moe_sorting_impl
    captured(*impl_args)
    assert stats()[SORT]["fast"] == 1
    registry.revert([SORT])
    assert fm._moe_sorting_impl is not captured
    registry.reset_stats()
    seen = []

    class Watch(aiter_patches.SortExtension):
        def sort(self, call):
            seen.append(1)

    with aiter_patches.sort_extension(Watch()):
        captured(*impl_args)
    assert stats()[SORT] == ZERO and seen == [1], "the sort feature was reverted; the extension hook was not"
    registry.revert([EXT])
    with aiter_patches.sort_extension(Watch()):
        captured(*impl_args)
    assert seen == [1]


# ---------------------------------------------------------------- every combination


def _aiter_sort_args(fm, args):
    """The arguments fused_moe passes to _moe_sorting_impl (recorded from an unpatched call)."""
    seen = []
    impl = fm._moe_sorting_impl
    fm._moe_sorting_impl = lambda *a, **k: seen.append((a, k)) or impl(*a, **k)
    try:
        fm.fused_moe(**args)
    finally:
        fm._moe_sorting_impl = impl
    return impl, seen[0]


@pytest.mark.parametrize("extension", ["deferred-work", "precomputed-sort"])
@pytest.mark.parametrize("applied", SUBSETS, ids=lambda s: "+".join(s) or "none")
def test_every_combination_gives_the_promised_bits(stub, device, applied, extension):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, M, E, TOPK, DIM, INTER, "fp4", skew="hot")
    real = addend_for(args, scale=100.0)
    aiter_out = fm.fused_moe(**args)  # unpatched: the bits every combination starts from
    fold_ref = reference_with_accumulator_start(fm, args, real)
    fold, ext_on, sort_on = FOLD in applied, EXT in applied, SORT in applied
    if extension == "deferred-work":
        # the addend is produced by the extension's after-sort work: after the sort when the hook is
        # applied, at scope exit otherwise (then the fold, or the add, sees zeros)
        addend = torch.zeros_like(real)
        ext = DeferredWork(lambda: addend.copy_(real))
        value = real if ext_on else torch.zeros_like(real)
    else:
        impl, (a, k) = _aiter_sort_args(fm, args)
        ext = PrecomputedSort(args["topk_ids"], impl(*a, **k))
        addend, value = real, real
    if fold:
        expected = fold_ref if value is real else aiter_out
    else:
        expected = aiter_out.clone().add_(value)
    aiter_patches.apply(list(applied))
    registry.reset_stats()
    with aiter_patches.sort_extension(ext):
        got = fused_moe_with_addend(addend, **args)
    assert same_bits(got, expected)
    s = stats()
    assert s[FOLD] == ({"fast": 1, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0} if fold else ZERO), s[FOLD]
    took_sort = ext_on and extension == "precomputed-sort"
    assert s[EXT] == ({"fast": 1, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0} if took_sort else ZERO), s[EXT]
    if sort_on and not took_sort:  # the one-launch sort, and the hand-back of its stage-1 quant
        assert s[SORT] == {"fast": 2, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}, s[SORT]
    else:
        assert s[SORT] == ZERO, s[SORT]
    if extension == "deferred-work":
        assert (ext.ran_after_sort, ext.ran_at_exit) == ((1, 0) if ext_on else (0, 1))
    else:
        assert ext.used == int(ext_on)
    assert moe_call.current() is None
    if fold:
        assert registry.state(moe_addend_fold.NAME) == registry.APPLIED


def test_disabling_one_feature_leaves_the_others_on_the_shared_wrappers(stub, device, monkeypatch):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, M, E, TOPK, DIM, INTER, "fp4")
    addend = addend_for(args)
    expected = fm.fused_moe(**args).add_(addend)
    monkeypatch.setenv("AITER_PATCHES_DISABLE", FOLD)
    report = aiter_patches.apply(list(MOE))
    assert (report[FOLD]["state"], report[EXT]["state"], report[SORT]["state"]) == ("disabled", "applied", "applied")
    with pytest.raises(TypeError, match="moe_addend"):  # AITER's own error: the keyword is the fold's
        fm.fused_moe(**args, moe_addend=addend)
    registry.reset_stats()
    assert same_bits(fused_moe_with_addend(addend, **args), expected)
    assert stats()[SORT]["fast"] == 2 and stats()[FOLD] == ZERO
    assert [getattr(fm.fused_moe, "__aiter_patches__", None), fm.fused_moe.__wrapped__.__aiter_patches__] == [EXT, SORT]


def test_disabling_the_three_moe_features_leaves_aiters_own_functions(stub, monkeypatch):
    """What README tells a host-bound eager server: with all three off, no MoE call passes a wrapper."""
    import aiter
    import aiter.fused_moe as fm

    names = ("fused_moe", "_moe_sorting_impl", "fused_dynamic_mxfp4_quant_moe_sort", "fused_dynamic_mxfp8_quant_moe_sort")
    before = {n: vars(fm)[n] for n in names}
    monkeypatch.setenv("AITER_PATCHES_DISABLE", ",".join(MOE))
    report = aiter_patches.apply()
    assert all(report[n]["state"] == "disabled" for n in MOE)
    assert report["gemm_out_zeroed"]["state"] == "applied"  # the GEMM patches stay
    assert all(vars(fm)[n] is before[n] for n in names)
    assert aiter.fused_dynamic_mxfp4_quant_moe_sort is before["fused_dynamic_mxfp4_quant_moe_sort"]


def test_a_foreign_wrapper_over_the_pipeline_stays_in_the_chain_after_reapply(stub, device):
    """A server's functools.wraps wrapper over our fused_moe copies our mark with __dict__: a later
    apply() must build over that wrapper, not past it to AITER's function."""
    import functools

    fm = stub.fused_moe
    args = moe_inputs(stub, device, M, E, TOPK, DIM, INTER, "bf16")
    aiter_patches.apply(["moe_sort_mx_quant"])
    ours, calls = fm.fused_moe, []

    @functools.wraps(ours)
    def third_party(*a, **k):  # a tracing or profiling wrapper
        calls.append(1)
        return ours(*a, **k)

    fm.fused_moe = third_party
    registry.revert()
    aiter_patches.apply(["moe_addend_fold"])
    fm.fused_moe(**args)
    assert calls, "the third party's wrapper was dropped from the chain"


@pytest.mark.parametrize("where", ["moe_sorting", "fused_moe_2stages"])
def test_a_call_that_raises_inside_aiter_leaves_no_plan_open(stub, device, monkeypatch, where):
    """The plan's scope is reset in ``finally``: an exception from AITER's own code (at the sort, or after
    it) must not leave this call's plan open for the next call on the thread."""
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, M, E, TOPK, DIM, INTER, "fp4")
    aiter_patches.apply(list(MOE))
    seen = []

    def broken(*a, **k):
        seen.append(moe_call.current())
        raise RuntimeError("injected")

    monkeypatch.setattr(fm, where, broken)  # looked up in aiter.fused_moe's globals at call time
    with pytest.raises(RuntimeError, match="injected"):
        fm.fused_moe(**args)
    assert len(seen) == 1 and seen[0] is not None, "the plan was not open inside the call"
    assert moe_call.current() is None
