"""Foreign layers over and under our wrappers: found by identity, named by where their code was defined."""

import functools

import pytest
import wrapt

import aiter_patches
from aiter_patches import foreign_layers, registry
from aiter_patches.core import state as core_state
from helpers.standin import use_stub_aiter

MX = "moe_sort_mx_quant"
HERE = __name__


@pytest.fixture
def fm():
    with use_stub_aiter():
        import aiter.fused_moe as fm

        yield fm


def texts(name=MX):
    return [layer.describe() for layer in foreign_layers.for_patch(name)]


def wraps_layer(inner):
    @functools.wraps(inner)  # copies __module__, __qualname__ and our marker: must not fool the detection
    def server_wrapper(*a, **k):
        return inner(*a, **k)

    return server_wrapper


def closure_layer(inner):
    def bare_wrapper(*a, **k):  # no __wrapped__: found through its closure
        return inner(*a, **k)

    return bare_wrapper


def test_no_layers_when_only_ours(fm):
    aiter_patches.apply()
    assert texts() == [] and "foreign_layers" not in aiter_patches.stats()[MX]


@pytest.mark.parametrize("make, qualname", [
    (wraps_layer, "wraps_layer.<locals>.server_wrapper"),
    (closure_layer, "closure_layer.<locals>.bare_wrapper"),
    (lambda inner: wrapt.FunctionWrapper(inner, lambda wrapped, instance, a, k: wrapped(*a, **k)), "<lambda>.<locals>.<lambda>"),
])
def test_an_outer_layer_is_named_by_where_it_was_defined(fm, make, qualname):
    aiter_patches.apply()
    fm._moe_sorting_impl = make(fm._moe_sorting_impl)
    want = f"outer layer {HERE} ({qualname}) on aiter.fused_moe._moe_sorting_impl"
    assert want in texts()
    assert want in aiter_patches.stats()[MX]["foreign_layers"]
    rec = [p for p in aiter_patches.status()["patches"] if p["name"] == MX][0]
    assert want in [f["text"] for f in rec["foreign_layers"]]
    assert foreign_layers.outer_layer_name("aiter.fused_moe", "_moe_sorting_impl") == HERE


def test_a_known_layer_says_which_calls_it_takes(fm, monkeypatch):
    monkeypatch.setattr(foreign_layers, "_KNOWN", {(HERE, "wraps_layer.<locals>.server_wrapper"): "takes X"})
    aiter_patches.apply()
    fm.fused_moe = wraps_layer(fm.fused_moe)
    assert f"outer layer {HERE} (wraps_layer.<locals>.server_wrapper) on aiter.fused_moe.fused_moe: takes X" \
        in texts()


def test_a_binding_that_no_longer_reaches_ours_is_replaced(fm):
    aiter_patches.apply()
    fm._moe_sorting_impl = lambda *a, **k: None
    assert [t for t in texts() if t.startswith("aiter.fused_moe._moe_sorting_impl rebound to")] == [
        f"aiter.fused_moe._moe_sorting_impl rebound to {HERE} (test_a_binding_that_no_longer_reaches_ours_is_replaced"
        ".<locals>.<lambda>), which does not reach aiter_patches' wrapper"]


def test_an_inner_layer_is_what_ours_wrapped(fm):
    fm._moe_sorting_impl = wraps_layer(fm._moe_sorting_impl)
    aiter_patches.apply()
    assert f"inner layer {HERE} (wraps_layer.<locals>.server_wrapper) on aiter.fused_moe._moe_sorting_impl" in texts()
    assert not any(t.startswith("inner") and "fused_moe.fused_moe" in t for t in texts())  # AITER's own: not foreign


def test_the_unreached_sort_reason_names_the_layer_that_took_it(fm):
    aiter_patches.apply()
    assert foreign_layers.unreached_sort_reason() == foreign_layers.UNREACHED_SORT
    ours = fm._moe_sorting_impl
    fm._moe_sorting_impl = wraps_layer(ours)
    assert foreign_layers.unreached_sort_reason() == (
        f"the sort was taken by outer layer {HERE} on aiter.fused_moe._moe_sorting_impl")
    fm._moe_sorting_impl = ours
    assert foreign_layers.unreached_sort_reason() == foreign_layers.UNREACHED_SORT


def test_unwrap_foreign_restores_by_identity_only(fm):
    aiter_patches.apply()
    chain = core_state.chains[("aiter.fused_moe", "_moe_sorting_impl")]
    layer = wraps_layer(chain.current)
    fm._moe_sorting_impl = layer
    assert registry.unwrap_foreign("aiter.fused_moe", "_moe_sorting_impl", lambda v: False) == []
    assert fm._moe_sorting_impl is layer
    two_deep = wraps_layer(layer)  # not directly over ours: left alone
    fm._moe_sorting_impl = two_deep
    assert registry.unwrap_foreign("aiter.fused_moe", "_moe_sorting_impl", lambda v: True) == []
    fm._moe_sorting_impl = layer
    assert registry.unwrap_foreign("aiter.fused_moe", "_moe_sorting_impl", lambda v: v is layer) == [
        "aiter.fused_moe._moe_sorting_impl"]
    assert fm._moe_sorting_impl is chain.current
