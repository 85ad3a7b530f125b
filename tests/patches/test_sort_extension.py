"""The SortExtension hook on the stand-in AITER: take-over, decline, scoping, failure handling, shipped examples.

Every take-over is compared with AITER's own pipeline: the extension hands over
outputs made by the unpatched sort (and, for the sixth item, the unpatched
stage-1 quant helper), so ``fused_moe`` must return the same bits as without the
extension while AITER's own sort (the stand-in's leaf ``aiter.moe_sorting_opus_fwd``)
and, for stage 1, its quant helper are never called.
"""

import asyncio
import gc
import logging
import threading
import weakref

import pytest
import torch

import aiter_patches
from aiter_patches.extensions import DeferredWork, PrecomputedSort
from aiter_patches.patches import sort_extension as se
from aiter_patches.patches.sort_extension import SortExtension, SortExtensionError, sort_extension
from aiter_patches.verify import suspended

from .conftest import routing

NAME = "sort_extension"
E, TOPK, DIM, INTER, BLOCK = 8, 2, 256, 128, 32
BF16 = torch.bfloat16


# ---------------------------------------------------------------- helpers


def stats(name=NAME):
    return aiter_patches.stats()[name]


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def sort(fm, ids, w, dim=DIM, block=BLOCK):
    """AITER's public ``moe_sorting`` as ``_fused_moe_impl`` calls it for these inputs."""
    return fm.moe_sorting(ids, w, E, dim, BF16, block)


def defined_equal(a, b, block=BLOCK):
    """Sort outputs equal over every position AITER defines (the rest is ``torch.empty``)."""
    if not torch.equal(a[3], b[3]):
        return False
    nv, T = (int(v) for v in a[3])
    return (
        torch.equal(a[0][:nv], b[0][:nv])
        and torch.equal(a[1][:nv].view(torch.int32), b[1][:nv].view(torch.int32))
        and torch.equal(a[2][: nv // block], b[2][: nv // block])
        and same_bits(a[4][:T], b[4][:T])
    )


def moe_inputs(stub, device, M=5, quant="bf16", seed=3):
    """fused_moe arguments for the stand-in: bf16 weights, or MXFP4 weights with row-major e8m0 scales."""
    g = torch.Generator().manual_seed(seed)
    ids, w = routing(M, E, TOPK, device, seed=seed)
    x = torch.randn(M, DIM, generator=g).to(BF16).to(device)
    args = dict(hidden_states=x, topk_weight=w, topk_ids=ids, block_size_M=BLOCK)
    if quant == "bf16":
        args["w1"] = (torch.randn(E, 2 * INTER, DIM, generator=g) / DIM**0.5).to(BF16).to(device)
        args["w2"] = (torch.randn(E, DIM, INTER, generator=g) / INTER**0.5).to(BF16).to(device)
        return args
    fp4, e8m0 = stub.dtypes.fp4x2, stub.dtypes.fp8_e8m0
    args["w1"] = torch.randint(0, 256, (E, 2 * INTER, DIM // 2), generator=g, dtype=torch.uint8).to(device).view(fp4)
    args["w2"] = torch.randint(0, 256, (E, DIM, INTER // 2), generator=g, dtype=torch.uint8).to(device).view(fp4)
    args["w1_scale"] = torch.randint(120, 124, (E, 2 * INTER, DIM // 32), generator=g,
                                     dtype=torch.uint8).to(device).view(e8m0)
    args["w2_scale"] = torch.randint(120, 124, (E, DIM, INTER // 32), generator=g,
                                     dtype=torch.uint8).to(device).view(e8m0)
    args["quant_type"] = stub.QuantType.per_1x32
    return args


class Spy:
    """A counting pass-through, installed where the caller looks the function up."""

    def __init__(self, fn, log=None, tag=None):
        self.fn, self.calls, self.log, self.tag = fn, [], log, tag

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.log is not None:
            self.log.append(self.tag)
        return self.fn(*args, **kwargs)


@pytest.fixture
def fm(stub):
    import aiter.fused_moe

    return aiter.fused_moe


@pytest.fixture
def aiter_sort(stub, monkeypatch):
    """Counts calls of AITER's sort kernel: ``_moe_sorting_impl`` calls it as ``aiter.moe_sorting_opus_fwd``."""
    spy = Spy(stub.moe_sorting_opus_fwd)
    monkeypatch.setattr(stub, "moe_sorting_opus_fwd", spy)
    return spy


class Fixed(SortExtension):
    """Hands over the given outputs for every call (or declines with ``outputs=None``); records what it saw."""

    def __init__(self, outputs=None, tag=None, log=None):
        self.outputs, self.tag, self.log = outputs, tag, log
        self.asked, self.after, self.closed = [], [], 0

    @property
    def name(self):
        return f"Fixed[{self.tag}]"

    def sort(self, call):
        self.asked.append(call.arguments["topk_ids"])
        if self.log is not None:
            self.log.append(("sort", self.tag))
        return self.outputs

    def after_sort(self, call, outputs):
        self.after.append(outputs)
        if self.log is not None:
            self.log.append(("after", self.tag))

    def close(self):
        self.closed += 1


class Boom(SortExtension):
    def sort(self, call):
        raise RuntimeError("boom in the extension")


# ---------------------------------------------------------------- take-over


@pytest.mark.parametrize("all_patches", [False, True], ids=["alone", "all-patches"])
def test_takes_over_sort_and_fused_moe_bits_unchanged(stub, fm, device, aiter_sort, all_patches):
    args = moe_inputs(stub, device)
    baseline = fm.fused_moe(**args)
    outputs = sort(fm, args["topk_ids"], args["topk_weight"])
    aiter_sort.calls.clear()
    ext = Fixed(outputs, tag="x")
    report = aiter_patches.apply(None if all_patches else [NAME])
    assert NAME in report.applied
    with sort_extension(ext):
        out = fm.fused_moe(**args)
    assert aiter_sort.calls == []
    assert len(ext.asked) == 1 and ext.asked[0] is args["topk_ids"]
    assert out is outputs[4]  # stage 2 accumulated into the extension's moe_buf
    assert same_bits(out, baseline)
    assert stats()["fast"] == 1 and stats()["errors"] == {}
    if all_patches:
        assert aiter_patches.stats()["moe_sort_mx_quant"]["fast"] == 0  # the one-launch sort was not run either


def test_sixth_item_is_the_stage1_quant(stub, fm, device, aiter_sort, monkeypatch):
    import aiter.ops.quant as quant

    args = moe_inputs(stub, device, quant="fp4")
    M = args["hidden_states"].shape[0]
    baseline = fm.fused_moe(**args)
    outputs = sort(fm, args["topk_ids"], args["topk_weight"])
    q = fm.fused_dynamic_mxfp4_quant_moe_sort(  # the unpatched helper, called as fused_moe_2stages calls it
        args["hidden_states"], sorted_ids=outputs[0], num_valid_ids=outputs[3], token_num=M, topk=TOPK,
        block_size=BLOCK, sorted_weights=outputs[1])
    aiter_sort.calls.clear()
    helper = Spy(quant.fused_dynamic_mx_quant_moe_sort)  # what the fp4 helper calls, via quant's globals
    monkeypatch.setattr(quant, "fused_dynamic_mx_quant_moe_sort", helper)
    aiter_patches.apply([NAME])
    ext = PrecomputedSort(args["topk_ids"], outputs, quant=q)
    with sort_extension(ext):
        out = fm.fused_moe(**args)
    rows = [(a[0] if a else k["input"]).shape[0] for a, k in helper.calls]
    assert M not in rows, "AITER's quant helper ran for stage 1"
    assert rows == [M * TOPK]  # the inter-stage quant is still AITER's
    assert aiter_sort.calls == [] and ext.used == 1
    assert same_bits(out, baseline)
    assert stats()["fast"] == 2  # the sort and the stage-1 hand-back


def test_sixth_item_is_not_used_for_another_quant_call(stub, fm, device):
    """Outside fused_moe the quant has nowhere to go; the helper then quantizes as usual."""
    ids, w = routing(5, E, TOPK, device)
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(1)).to(BF16).to(device)
    outputs = sort(fm, ids, w)
    q = fm.fused_dynamic_mxfp4_quant_moe_sort(x, sorted_ids=outputs[0], num_valid_ids=outputs[3], token_num=5,
                                               topk=TOPK, block_size=BLOCK, sorted_weights=outputs[1])
    poison = (torch.full_like(q[0].view(torch.uint8), 0xAB).view(q[0].dtype), q[1])
    aiter_patches.apply([NAME])
    with sort_extension(Fixed((*outputs, poison))):
        taken = sort(fm, ids, w)
        data, _ = fm.fused_dynamic_mxfp4_quant_moe_sort(x, sorted_ids=taken[0], num_valid_ids=taken[3], token_num=5,
                                                        topk=TOPK, block_size=BLOCK, sorted_weights=taken[1])
    assert taken[0] is outputs[0]
    assert torch.equal(data.view(torch.uint8), q[0].view(torch.uint8))


# ---------------------------------------------------------------- declining, nesting, scoping


def test_decline_runs_aiter(stub, fm, device, aiter_sort):
    ids, w = routing(6, E, TOPK, device)
    expected = sort(fm, ids, w)
    aiter_sort.calls.clear()
    aiter_patches.apply([NAME])
    ext = Fixed(None)
    with sort_extension(ext):
        got = sort(fm, ids, w)
    assert len(ext.asked) == 1 and len(aiter_sort.calls) == 1
    assert defined_equal(got, expected)
    assert len(ext.after) == 1 and ext.after[0] is got  # after_sort sees whoever produced the sort
    assert stats() == {"fast": 0, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}


def test_decline_runs_the_next_patch_in_the_chain(stub, fm, device, aiter_sort):
    ids, w = routing(6, E, TOPK, device)
    expected = sort(fm, ids, w)
    aiter_sort.calls.clear()
    aiter_patches.apply()
    with sort_extension(Fixed(None)):
        got = sort(fm, ids, w)
    assert aiter_patches.stats()["moe_sort_mx_quant"]["fast"] == 1 and aiter_sort.calls == []
    assert defined_equal(got, expected)


def test_nested_scopes_innermost_first(stub, fm, device):
    ids, w = routing(4, E, TOPK, device)
    outer_out, inner_out = sort(fm, ids, w), sort(fm, ids, w)
    aiter_patches.apply([NAME])
    log = []
    outer = Fixed(outer_out, "outer", log)
    inner = Fixed(None, "inner", log)
    with sort_extension(outer):
        assert se.active() == (outer,)
        with sort_extension(inner):
            assert se.active() == (outer, inner)
            got = sort(fm, ids, w)
            assert got[0] is outer_out[0]  # inner declined, outer took it
            assert log == [("sort", "inner"), ("sort", "outer"), ("after", "inner"), ("after", "outer")]
            log.clear()
            inner.outputs = inner_out
            got = sort(fm, ids, w)
            assert got[0] is inner_out[0] and log == [("sort", "inner"), ("after", "inner"), ("after", "outer")]
        assert se.active() == (outer,) and inner.closed == 1 and outer.closed == 0
    assert se.active() == () and outer.closed == 1


def test_threads_are_isolated(stub, fm, device):
    n = 4
    inputs = [routing(3 + i, E, TOPK, device, seed=i) for i in range(n)]
    outs = [sort(fm, ids, w) for ids, w in inputs]
    aiter_patches.apply([NAME])
    barrier = threading.Barrier(n)
    results, errors = [None] * n, []

    def worker(i):
        try:
            ext = Fixed(outs[i], tag=i)
            ids, w = inputs[i]
            with sort_extension(ext):
                barrier.wait()  # every thread is inside its own scope now
                seen = se.active()
                got = sort(fm, ids, w)
                barrier.wait()
            results[i] = (ext, seen, got, se.active())
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert se.active() == ()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i, (ext, seen, got, after) in enumerate(results):
        assert seen == (ext,) and after == ()
        assert len(ext.asked) == 1 and ext.asked[0] is inputs[i][0]
        assert got[0] is outs[i][0]
    assert stats()["fast"] == n


def test_asyncio_tasks_are_isolated(stub, fm, device):
    inputs = [routing(3 + i, E, TOPK, device, seed=i) for i in range(3)]
    outs = [sort(fm, ids, w) for ids, w in inputs]
    aiter_patches.apply([NAME])

    async def task(i, barrier):
        ext = Fixed(outs[i], tag=i)
        with sort_extension(ext):
            await barrier.wait()  # every task is inside its own scope now
            seen = se.active()
            got = sort(fm, *inputs[i])
            await asyncio.sleep(0)
            still = se.active()
        return ext, seen, still, got, se.active()

    async def main():
        barrier = asyncio.Barrier(len(inputs))
        return await asyncio.gather(*(task(i, barrier) for i in range(len(inputs))))

    for i, (ext, seen, still, got, after) in enumerate(asyncio.run(main())):
        assert seen == (ext,) and still == (ext,) and after == ()
        assert got[0] is outs[i][0] and ext.asked == [inputs[i][0]]


def test_nothing_active_or_alive_after_scope(stub, fm, device):
    args = moe_inputs(stub, device)
    outputs = sort(fm, args["topk_ids"], args["topk_weight"])
    aiter_patches.apply([NAME])
    ext, declining = Fixed(outputs), Fixed(None)
    with sort_extension(declining), sort_extension(ext):
        fm.fused_moe(**args)
    assert len(ext.asked) == 1 and len(declining.asked) == 0
    assert se.active() == ()
    refs = [weakref.ref(ext), weakref.ref(declining)]
    del ext, declining
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_close_runs_on_exception(stub):
    ext = Fixed(None)
    with pytest.raises(KeyError):
        with sort_extension(ext):
            raise KeyError("inside the scope")
    assert ext.closed == 1 and se.active() == ()


def _scope_in_generator(ext):
    """A generator that holds ``sort_extension(ext)`` open between its first ``next`` and its close."""

    def gen():
        with sort_extension(ext):
            yield

    g = gen()
    next(g)
    return g


@pytest.mark.parametrize("where", ["another thread", "another Context"])
def test_scope_closed_from_another_context_deactivates_and_closes_once(stub, fm, device, aiter_sort, where):
    """Issue 14.12: ``ContextVar.reset`` raised ValueError there, ``close()`` never ran and the
    extension stayed active for every later sort of the thread that opened the scope."""
    import contextvars

    ids, w = routing(4, E, TOPK, device)
    aiter_patches.apply([NAME])
    ext = Fixed(None, "held")
    g = _scope_in_generator(ext)
    assert se.active() == (ext,)
    errors = []

    def close():
        try:
            g.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    if where == "another thread":
        t = threading.Thread(target=close)
        t.start()
        t.join(30)
    else:
        contextvars.Context().run(close)
    assert errors == [] and ext.closed == 1
    assert se.active() == ()
    before = len(aiter_sort.calls)
    sort(fm, ids, w)  # an unrelated later sort in the thread that opened the scope
    assert ext.asked == [] and ext.after == [] and len(aiter_sort.calls) == before + 1
    refs = weakref.ref(ext)
    del ext, g
    gc.collect()
    assert refs() is None, "a stale copy of the context must not keep the extension alive"


def test_scopes_closed_out_of_order_leave_the_other_open(stub):
    first, second = Fixed(None, "first"), Fixed(None, "second")
    g1 = _scope_in_generator(first)
    g2 = _scope_in_generator(second)
    assert se.active() == (first, second)
    g1.close()
    assert se.active() == (second,) and first.closed == 1 and second.closed == 0
    with sort_extension(Fixed(None, "third")) as third:
        assert se.active() == (second, third)
    g2.close()
    assert se.active() == () and second.closed == 1 and first.closed == 1


def test_only_sort_extensions_can_be_scoped():
    with pytest.raises(TypeError, match="SortExtension"):
        with sort_extension(object()):
            pass
    assert se.active() == ()


def test_calls_with_extra_outputs_are_not_offered(stub, fm, device, aiter_sort):
    ids, w = routing(4, E, TOPK, device)
    aiter_patches.apply([NAME])
    ext = Fixed(sort(fm, ids, w))
    aiter_sort.calls.clear()
    with sort_extension(ext):
        got = fm.moe_sorting(ids, w, E, DIM, BF16, BLOCK, return_local_topk_ids=True)
    assert len(got) == 6 and ext.asked == [] and len(aiter_sort.calls) == 1
    assert len(stats()["fallback"]) == 1 and stats()["fast"] == 0


# ---------------------------------------------------------------- failures


def test_raising_extension_falls_back_logs_once_and_counts(stub, fm, device, aiter_sort, caplog):
    ids, w = routing(5, E, TOPK, device)
    expected = sort(fm, ids, w)
    aiter_sort.calls.clear()
    aiter_patches.apply([NAME])
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        with sort_extension(Boom()):
            first = sort(fm, ids, w)
            second = sort(fm, ids, w)
    assert len(aiter_sort.calls) == 2
    assert defined_equal(first, expected) and defined_equal(second, expected)
    warnings = [r for r in caplog.records if r.name == "aiter_patches" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "Boom" in warnings[0].getMessage()
    assert stats()["errors"] == {"SortExtension 'Boom'.sort: RuntimeError": 2}
    assert stats()["fast"] == 0


@pytest.mark.parametrize("how", ["set_strict", "apply"])
def test_raising_extension_reraises_in_strict_mode(stub, fm, device, aiter_sort, how):
    ids, w = routing(5, E, TOPK, device)
    if how == "apply":
        aiter_patches.apply([NAME], strict=True)
    else:
        aiter_patches.apply([NAME])
        aiter_patches.runtime.set_strict(True)
    with sort_extension(Boom()):
        with pytest.raises(RuntimeError, match="boom in the extension"):
            sort(fm, ids, w)
    assert aiter_sort.calls == []


def test_a_raising_extension_passes_the_call_to_the_next_one_out(stub, fm, device, aiter_sort):
    ids, w = routing(5, E, TOPK, device)
    outputs = sort(fm, ids, w)
    aiter_sort.calls.clear()
    aiter_patches.apply([NAME])
    outer = Fixed(outputs, tag="outer")
    with sort_extension(outer), sort_extension(Boom()):
        got = sort(fm, ids, w)
    assert got == tuple(outputs) and len(outer.asked) == 1 and aiter_sort.calls == []
    assert stats()["fast"] == 1 and list(stats()["errors"]) == ["SortExtension 'Boom'.sort: RuntimeError"]


class AfterBoom(SortExtension):
    def after_sort(self, call, outputs):
        raise RuntimeError("boom after the sort")

    def close(self):
        raise RuntimeError("boom at close")


def test_after_sort_and_close_raising_are_counted_not_fatal(stub, fm, device, caplog):
    ids, w = routing(5, E, TOPK, device)
    expected = sort(fm, ids, w)
    aiter_patches.apply([NAME])
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        with sort_extension(AfterBoom()):
            got = sort(fm, ids, w)
            sort(fm, ids, w)
    assert defined_equal(got, expected)
    assert stats()["errors"] == {"SortExtension 'AfterBoom'.after_sort: RuntimeError": 2,
                                 "SortExtension 'AfterBoom'.close: RuntimeError": 1}
    assert sum("AfterBoom" in r.getMessage() for r in caplog.records) == 2  # once per place


def test_after_sort_and_close_raising_reraise_in_strict_mode(stub, fm, device):
    ids, w = routing(5, E, TOPK, device)
    aiter_patches.apply([NAME], strict=True)
    with pytest.raises(RuntimeError, match="boom after the sort"):
        with sort_extension(AfterBoom()):
            sort(fm, ids, w)
    with pytest.raises(RuntimeError, match="boom at close"):
        with sort_extension(AfterBoom()):
            pass


def test_call_arguments_hold_every_parameter_and_are_read_only(stub, fm, device):
    import inspect

    seen = []

    class Look(SortExtension):
        def sort(self, call):
            seen.append(call.arguments)

    ids, w = routing(5, E, TOPK, device)
    params = set(inspect.signature(fm._moe_sorting_impl).parameters)  # the stand-in's, unpatched
    aiter_patches.apply([NAME])
    with sort_extension(Look()):
        sort(fm, ids, w)
    assert set(seen[0]) == params
    assert seen[0]["output_aux"] is False
    with pytest.raises(TypeError):
        seen[0]["topk_ids"] = None


def test_outputs_on_another_device_raise_naming_the_tensor(stub, fm, device):
    ids, w = routing(5, E, TOPK, device)
    outputs = list(sort(fm, ids, w))
    outputs[1] = torch.empty(outputs[1].shape, dtype=outputs[1].dtype, device="meta")
    aiter_patches.apply([NAME])
    with sort_extension(Fixed(tuple(outputs), tag="elsewhere")):
        with pytest.raises(SortExtensionError, match="sorted_weights .* on meta"):
            sort(fm, ids, w)


def _quant_for(fm, x, outputs):
    return fm.fused_dynamic_mxfp4_quant_moe_sort(x, sorted_ids=outputs[0], num_valid_ids=outputs[3],
                                                 token_num=x.shape[0], topk=TOPK, block_size=BLOCK,
                                                 sorted_weights=outputs[1])


MALFORMED = {
    "count": (lambda o, q: o[:4], "5 or 6 items"),
    "sorted_ids shape": (lambda o, q: (o[0][:-1], *o[1:]), "sorted_ids"),
    "sorted_weights dtype": (lambda o, q: (o[0], o[1].double(), *o[2:]), "sorted_weights"),
    "sorted_expert_ids not a tensor": (lambda o, q: (*o[:2], o[2].tolist(), *o[3:]), "sorted_expert_ids is list"),
    "num_valid_ids dtype": (lambda o, q: (*o[:3], o[3].long(), o[4]), "num_valid_ids"),
    "moe_buf shape": (lambda o, q: (*o[:4], o[4][:-1]), "moe_buf"),
    "moe_buf dtype": (lambda o, q: (*o[:4], o[4].half()), "moe_buf"),
    "sixth not a pair": (lambda o, q: (*o, q[0]), "sixth item"),
    "quant data shape": (lambda o, q: (*o, (q[0][:-1], q[1])), "quant data"),
    "quant scale shape": (lambda o, q: (*o, (q[0], q[1][:-32])), "quant scale"),
    "quant scale dtype": (lambda o, q: (*o, (q[0], q[1].view(torch.uint8))), "quant scale"),
}
MALFORMED_NOT_TENSORS = {
    "quant data not a tensor": (lambda o, q: (*o, (None, q[1])), "quant data"),
    "quant scale not a tensor": (lambda o, q: (*o, (q[0], q[1].tolist())), "quant scale"),
}


@pytest.mark.parametrize(
    "case",
    list(MALFORMED) + list(MALFORMED_NOT_TENSORS),
)
def test_malformed_outputs_raise_naming_the_tensor(stub, fm, device, case):
    make, words = {**MALFORMED, **MALFORMED_NOT_TENSORS}[case]
    ids, w = routing(5, E, TOPK, device)
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(2)).to(BF16).to(device)
    outputs = sort(fm, ids, w)
    bad = make(outputs, _quant_for(fm, x, outputs))
    aiter_patches.apply([NAME])
    with sort_extension(Fixed(bad, tag="bad")):
        with pytest.raises(SortExtensionError, match=words) as info:
            sort(fm, ids, w)
    assert "Fixed[bad]" in str(info.value)
    assert stats()["fast"] == 0


# ---------------------------------------------------------------- the shipped examples


def test_precomputed_sort_only_for_the_same_tensor_once(stub, fm, device, aiter_sort):
    ids, w = routing(6, E, TOPK, device)
    outputs = sort(fm, ids, w)
    aiter_sort.calls.clear()
    aiter_patches.apply([NAME])
    ext = PrecomputedSort(ids, outputs)
    with sort_extension(ext):
        copy = sort(fm, ids.clone(), w)  # equal values, another tensor: declined
        assert ext.used == 0 and len(aiter_sort.calls) == 1
        got = sort(fm, ids, w)
        assert ext.used == 1 and len(aiter_sort.calls) == 1
        assert all(a is b for a, b in zip(got, outputs))
        again = sort(fm, ids, w)  # once: a second layer gets AITER's sort
        assert ext.used == 1 and len(aiter_sort.calls) == 2
    assert defined_equal(copy, outputs) and defined_equal(again, outputs)
    assert again[0] is not outputs[0]


def test_precomputed_sort_declines_another_view_of_the_same_storage(stub, fm, device):
    ids, w = routing(6, E, TOPK, device)
    outputs = sort(fm, ids, w)
    aiter_patches.apply([NAME])
    ext = PrecomputedSort(ids, outputs)
    with sort_extension(ext):
        sort(fm, ids[:3], w[:3])
    assert ext.used == 0


def test_precomputed_sort_is_not_fooled_by_a_recycled_address(stub, fm, device):
    args = moe_inputs(stub, device)
    M = args["topk_ids"].shape[0]
    ids_a, w_a = routing(M, E, TOPK, device, seed=7)
    memory = torch.empty(M * TOPK, dtype=torch.int32, device=device)  # a block the allocator hands out twice
    first = memory.view(M, TOPK)
    first.copy_(ids_a)
    ext = PrecomputedSort(first, sort(fm, first, w_a))
    del first  # the router's topk_ids is freed ...
    memory.copy_(args["topk_ids"].reshape(-1))  # ... and the next layer's topk_ids lands at the same address
    second = memory.view(M, TOPK)
    expected = fm.fused_moe(**{**args, "topk_ids": second})
    aiter_patches.apply([NAME])
    with sort_extension(ext):
        got = fm.fused_moe(**{**args, "topk_ids": second})
    assert ext.used == 0
    assert same_bits(got, expected)


def test_precomputed_sort_rejects_a_wrong_number_of_outputs(stub, fm, device):
    ids, w = routing(6, E, TOPK, device)
    with pytest.raises(ValueError, match="five"):
        PrecomputedSort(ids, sort(fm, ids, w)[:4])


@pytest.mark.parametrize("used", [False, True])
def test_precomputed_sort_discards_unused_state_at_exit(stub, fm, device, caplog, used):
    ids, w = routing(6, E, TOPK, device)
    outputs = sort(fm, ids, w)
    aiter_patches.apply([NAME])
    ext = PrecomputedSort(ids, outputs)
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        with sort_extension(ext):
            if used:
                sort(fm, ids, w)
    discarded = [r for r in caplog.records if r.levelno == logging.DEBUG and "discarded" in r.getMessage()]
    assert len(discarded) == (0 if used else 1)
    assert ext._outputs is None and ext._quant is None  # nothing held after the scope
    ref = weakref.ref(outputs[0])
    del outputs
    gc.collect()
    assert ref() is None


def test_deferred_work_runs_once_right_after_the_sort(stub, fm, device, aiter_sort, monkeypatch):
    import aiter.ops._leaf_kernels as leaf

    order = []
    aiter_sort.log, aiter_sort.tag = order, "sort"
    monkeypatch.setattr(leaf, "moe_stage1", Spy(leaf.moe_stage1, order, "stage1"))
    args = moe_inputs(stub, device)
    baseline = fm.fused_moe(**args)
    order.clear()
    aiter_patches.apply([NAME])

    def work():
        order.append("work")
        return "done"

    ext = DeferredWork(work)
    with sort_extension(ext):
        out = fm.fused_moe(**args)
        out2 = fm.fused_moe(**args)
    assert order == ["sort", "work", "stage1", "sort", "stage1"]
    assert (ext.ran_after_sort, ext.ran_at_exit, ext.result) == (1, 0, "done")
    assert same_bits(out, baseline) and same_bits(out2, baseline)


def test_deferred_work_runs_at_exit_without_a_sort(stub):
    aiter_patches.apply([NAME])
    calls = []
    ext = DeferredWork(lambda: calls.append(1) or 42)
    with sort_extension(ext):
        assert calls == []
    assert calls == [1] and (ext.ran_after_sort, ext.ran_at_exit, ext.result) == (0, 1, 42)


# ---------------------------------------------------------------- no extension


def test_no_extension_is_aiter_bit_for_bit(stub, fm, device, aiter_sort):
    ids, w = routing(9, E, TOPK, device, skew="hot")
    expected = sort(fm, ids, w)
    args = moe_inputs(stub, device, quant="fp4")
    baseline = fm.fused_moe(**args)
    aiter_sort.calls.clear()
    aiter_patches.apply([NAME])
    got = sort(fm, ids, w)
    assert len(aiter_sort.calls) == 1 and defined_equal(got, expected)
    assert same_bits(fm.fused_moe(**args), baseline)
    assert stats() == {"fast": 0, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}


# ---------------------------------------------------------------- CUDA graphs


class RecomputedSort(SortExtension):
    """Takes over every sort with AITER's unpatched sort into its own buffers: device work inside the capture."""

    def __init__(self, original_impl):
        self.original_impl = original_impl
        self.used = 0

    def sort(self, call):
        self.used += 1
        return self.original_impl(**call.arguments)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("extension", ["recomputed", "deferred"])
def test_cuda_graph_capture_with_an_active_extension(stub, fm, extension):
    """Capture fused_moe inside a scope; replays with new routing and activations equal eager AITER."""
    device = torch.device("cuda")
    M = 8
    static = moe_inputs(stub, device, M=M)
    fresh = [moe_inputs(stub, device, M=M, seed=s) for s in (11, 12)]
    varying = ("hidden_states", "topk_weight", "topk_ids")
    original_impl = fm._moe_sorting_impl
    shared_w = (torch.randn(DIM, DIM, device=device) / DIM**0.5).to(BF16)
    shared_out = torch.zeros(M, DIM, dtype=BF16, device=device)
    # the extension takes the sort over: every patch may be on; DeferredWork declines: this patch alone
    aiter_patches.apply(None if extension == "recomputed" else [NAME])

    def make_ext():
        if extension == "recomputed":
            return RecomputedSort(original_impl)
        return DeferredWork(lambda: torch.matmul(static["hidden_states"], shared_w, out=shared_out))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            with sort_extension(make_ext()):
                fm.fused_moe(**static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    ext = make_ext()
    with torch.cuda.graph(graph):
        with sort_extension(ext):
            static_out = fm.fused_moe(**static)
    assert (ext.used if extension == "recomputed" else ext.ran_after_sort) == 1
    for args in fresh:
        for key in varying:
            static[key].copy_(args[key])
        shared_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        with suspended():
            eager = fm.fused_moe(**static)
        assert same_bits(static_out, eager)
        if extension == "deferred":
            torch.testing.assert_close(shared_out, static["hidden_states"] @ shared_w, rtol=1e-2, atol=1e-2)
            assert shared_out.abs().sum() > 0


def test_active_reads_each_scope_once():
    """A scope exited by another thread between two reads of its ``ext`` must not yield None."""

    class ExitedAfterOneRead:
        def __init__(self, ext):
            self._ext = ext

        @property
        def ext(self):
            ext, self._ext = self._ext, None
            return ext

    marker = object()
    token = se._ACTIVE.set((ExitedAfterOneRead(marker),))
    try:
        assert se.active() == (marker,)
    finally:
        se._ACTIVE.reset(token)


def test_the_patch_imports_the_registry_once_at_module_level_and_imports_first_in_a_fresh_process():
    """No import cycle left to work around (issue 35): the registry is imported with the module, not inside a
    function at each call, and the module imports on its own, before the package's other modules."""
    import ast
    import subprocess
    import sys

    tree = ast.parse(open(se.__file__, encoding="utf-8").read())
    late = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            late += [node.lineno for node in ast.walk(fn) if isinstance(node, ast.ImportFrom)
                     and ((node.module or "").endswith("registry") or any(a.name == "registry" for a in node.names))]
    assert late == [], f"the registry imported inside a function at line(s) {late}"
    proc = subprocess.run([sys.executable, "-c", "import aiter_patches.patches.sort_extension as s; print(s.NAME)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == NAME, proc.stderr[-2000:]
