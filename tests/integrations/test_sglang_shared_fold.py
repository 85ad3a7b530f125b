"""``sglang_shared_expert_fold`` on SGLang 0.5.23's own DeepseekV2MoE methods (read from the wheel) and the stand-in AITER.

The layer object is a fake with the attributes SGLang's code reads; its routed
experts call the stand-in's ``aiter.fused_moe.fused_moe`` as SGLang's AITER runner
does. Checked: within the fold's bound of SGLang's own sum, the add gone
(counted aten adds), every path that must not fold left alone with its
reason, a drifted copy skipped, revert.
"""

import importlib
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aiter_patches
from aiter_patches.checks import bf16_moe_inputs
from aiter_patches.verify import suspended

from .sglang_tree import importable, sglang_tree, write_tree  # noqa: F401  (fixture)

NAME = "sglang_shared_expert_fold"
MOD = "sglang.srt.models.deepseek_v2"


class FakeExperts:
    def __init__(self, args):
        self.args = args
        self.moe_runner_config = types.SimpleNamespace(inplace=True)
        self.quant_method = object()

    def __call__(self, hidden_states, topk_output):
        a = self.args  # SGLang's runner: `from aiter.fused_moe import fused_moe` at call time
        return sys.modules["aiter.fused_moe"].fused_moe(hidden_states, a["w1"], a["w2"], a["topk_weight"],
                                                         a["topk_ids"])


class FakeShared:
    gate_up_proj = None

    def __init__(self, w):
        self.w = w

    def __call__(self, x, gemm_output_zero_allocator=None):
        return x @ self.w


def make_layer(device, **overrides):
    ds = sys.modules[MOD]
    args = bf16_moe_inputs(device, M=6, E=8, topk=2, dim=256, inter=128, seed=7)
    g = torch.Generator().manual_seed(9)
    w_shared = (torch.randn(256, 256, generator=g) / 16).to(torch.bfloat16).to(device)
    layer = ds.DeepseekV2MoE.__new__(ds.DeepseekV2MoE)
    torch.nn.Module.__init__(layer)
    attrs = dict(
        experts=FakeExperts(args), shared_experts=FakeShared(w_shared),
        num_fused_shared_experts=0, _fuse_shared_experts_inside_sbo=False, _shared_expert_tp1=False,
        routed_scaling_factor=2.5, routed_scaling_factor_fused_in_topk=True, reduce_results=False,
        gate=lambda x: x[:, :8].float(), topk=lambda x, logits, **kw: (args["topk_weight"], args["topk_ids"]),
        _maybe_quant_moe_input_once=lambda x: None, alt_stream=None,
    )
    attrs.update(overrides)
    for k, v in attrs.items():
        object.__setattr__(layer, k, v) if k in ("experts",) else setattr(layer, k, v)
    return layer, args["hidden_states"]


class AddCounter(TorchDispatchMode):
    """Counts aten add/add_ calls whose output has ``shape`` (the shared-expert add, not the kernels' internals)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and tuple(getattr(out, "shape", ())) == self.shape:
            self.count += 1
        return out


def import_all(stub):
    importlib.import_module(MOD)
    importlib.import_module("aiter.fused_moe")


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("AITER_PATCHES_INTEGRATIONS", "sglang")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_off_by_default(sglang_tree, stub):
    import_all(stub)
    report = aiter_patches.apply()
    assert report[NAME]["state"] == "disabled" and "AITER_PATCHES_INTEGRATIONS" in report[NAME]["reason"]


def test_fold_within_bound_and_the_add_is_gone(sglang_tree, stub, device, on):
    import_all(stub)
    layer, x = make_layer(device)
    with suspended():
        with AddCounter((6, 256)) as c0:
            ref = layer.forward_normal(x)
    with suspended():
        with AddCounter((6, 256)) as c_moe:
            layer.experts(x, None)
    assert c0.count == c_moe.count + 1  # the MoE's own adds (the stand-in's stage 2), and SGLang's `routed += shared`
    report = aiter_patches.apply()
    assert report[NAME]["state"] == "applied", report[NAME]["reason"]
    with AddCounter((6, 256)) as c1:
        out = layer.forward_normal(x)
    assert c1.count == c_moe.count  # the shared add is gone: stage 2 accumulated onto the addend
    assert rel(out, ref) <= 1e-2
    s = aiter_patches.stats()
    assert s[NAME]["fast"] == 1 and s[NAME]["fallback"] == {}
    assert s["moe_addend_fold"]["fast"] == 1


@pytest.mark.parametrize("override, reason", [
    (dict(routed_scaling_factor_fused_in_topk=False), "routed_scaling_factor is applied"),
    (dict(_shared_expert_tp1=True), "TP-1 replicated"),
    ("defer", "defer_shared"),
])
def test_paths_that_must_not_fold_run_as_shipped(sglang_tree, stub, device, on, override, reason):
    import_all(stub)
    layer, x = make_layer(device, **(override if isinstance(override, dict) else {}))
    if override == "defer":
        layer.experts.moe_runner_config.inplace = False
    with suspended():
        ref = layer.forward_normal(x)
    aiter_patches.apply()
    out = layer.forward_normal(x)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    s = aiter_patches.stats()[NAME]
    assert s["fast"] == 0 and [k for k in s["fallback"] if reason in k], s


def test_sbo_gate_reason(sglang_tree, stub, device, on):
    """SBO runs the shared experts in SGLang's dispatcher hooks (not stood in for here): the gate alone."""
    from aiter_patches.integrations.sglang_shared_fold import blocker

    import_all(stub)
    aiter_patches.apply()
    layer, x = make_layer(device, _fuse_shared_experts_inside_sbo=True)
    assert "SBO" in blocker(layer, vars(sys.modules[MOD]), False, False, False, x)


def test_a_subclass_of_a_fused_scale_method_is_not_folded(sglang_tree, stub, device, on):
    """maybe_fuse_routed_scale_and_shared_add picks its fused branch by isinstance: a subclass counts."""
    from aiter_patches.integrations.sglang_shared_fold import blocker

    import_all(stub)
    aiter_patches.apply()
    Marlin = type("Mxfp4MarlinMoEMethod", (), {})
    layer, x = make_layer(device)
    layer.experts.quant_method = type("TunedMarlin", (Marlin,), {})()
    assert "Mxfp4MarlinMoEMethod: the shared add carries the routed scale" in blocker(
        layer, vars(sys.modules[MOD]), False, False, False, x)


def test_return_moe_output_keeps_the_pieces(sglang_tree, stub, device, on):
    import_all(stub)
    layer, x = make_layer(device)
    with suspended():
        ref = layer.forward_normal(x, return_moe_output=True)
    aiter_patches.apply()
    got = layer.forward_normal(x, return_moe_output=True)
    assert torch.equal(got.routed.view(torch.int16), ref.routed.view(torch.int16))
    assert torch.equal(got.shared.view(torch.int16), ref.shared.view(torch.int16))


def test_a_drifted_copy_is_skipped(tmp_path, stub, on):
    def edit(qualname, src):
        if qualname == "DeepseekV2MoE.forward_normal":
            return src.replace("final_hidden_states *= self.routed_scaling_factor",
                               "final_hidden_states *= self.routed_scaling_factor * 1.0")
        return src

    with importable(write_tree(tmp_path / "drifted", edit)):
        import_all(stub)
        report = aiter_patches.apply()
        assert report[NAME]["state"] == "skipped"
        assert "DeepseekV2MoE.forward_normal: source changed" in report[NAME]["reason"]
        cls = sys.modules[MOD].DeepseekV2MoE
        assert getattr(cls.forward_normal, "__aiter_patches__", None) is None


def test_revert_restores_the_methods(sglang_tree, stub, on):
    import_all(stub)
    ds = sys.modules[MOD]
    before = (ds.DeepseekV2MoE.forward_normal, ds.DeepseekV2MoE._forward_shared_experts,
              ds.maybe_fuse_routed_scale_and_shared_add)
    aiter_patches.apply()
    assert ds.DeepseekV2MoE.forward_normal is not before[0]
    aiter_patches.revert()
    assert (ds.DeepseekV2MoE.forward_normal, ds.DeepseekV2MoE._forward_shared_experts,
            ds.maybe_fuse_routed_scale_and_shared_add) == before


def test_a_shared_output_from_another_stream_is_not_folded(sglang_tree, stub, device, on, monkeypatch):
    from aiter_patches.integrations import sglang_shared_fold as fold

    import_all(stub)
    layer, x = make_layer(device)
    with suspended():
        ref = layer.forward_normal(x)
    aiter_patches.apply()
    streams = iter(["main", "alt", "main", "main"])  # forward_normal opens on main; the shared experts see alt
    monkeypatch.setattr(fold, "_stream", lambda device: next(streams))
    out = layer.forward_normal(x)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert aiter_patches.stats()[NAME]["fallback"] == {fold.NO_SHARED: 1}


def test_a_routed_call_that_skips_fused_moe_is_counted(sglang_tree, stub, device, on, monkeypatch):
    from aiter_patches.integrations import sglang_shared_fold as fold

    import_all(stub)
    layer, x = make_layer(device)
    with suspended():
        ref = layer.forward_normal(x)
        routed = layer.experts(x, None)
    aiter_patches.apply()
    monkeypatch.setattr(FakeExperts, "__call__", lambda self, hs, topk: routed.clone())  # like SGLang's small-M kernel
    out = layer.forward_normal(x)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert aiter_patches.stats()[NAME]["fallback"] == {fold.NOT_REACHED: 1}


def test_the_verify_check_passes_and_fails_when_it_must(sglang_tree, stub, device, on, monkeypatch):
    from aiter_patches.integrations import sglang_shared_fold as fold

    import_all(stub)
    aiter_patches.apply()
    res = fold.check(device)
    assert res.ok, res.detail
    monkeypatch.setattr(fold, "blocker", lambda *a: "a reason")  # the fold is not taken: the check must say so
    res = fold.check(device)
    assert not res.ok and "a reason" in res.detail


def test_inside_a_compiled_region_nothing_is_folded(sglang_tree, stub, device, on, monkeypatch):
    """Dynamo may trace the add and run the routed call eagerly (a graph break, a recompile limit): no scope there."""
    from aiter_patches.integrations import compile_state

    import_all(stub)
    layer, x = make_layer(device)
    with suspended():
        ref = layer.forward_normal(x)
    aiter_patches.apply()
    monkeypatch.setattr(compile_state, "in_compiled_region", lambda: True)
    out = layer.forward_normal(x)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    s = aiter_patches.stats()
    assert s[NAME]["fast"] == 0 and s[NAME]["fallback"] == {compile_state.IN_COMPILED_REGION: 1}, s[NAME]
    assert s["moe_addend_fold"]["fast"] == 0


def test_traced_hooks_pass_straight_through(sglang_tree, stub, device, on, monkeypatch):
    """While Dynamo traces, no hook reads its context variable or counts (neither traces): SGLang's code runs."""
    from aiter_patches.integrations import compile_state

    import_all(stub)
    layer, x = make_layer(device)
    with suspended():
        ref = layer.forward_normal(x)
    aiter_patches.apply()
    monkeypatch.setattr(compile_state, "tracing", lambda: True)
    out = layer.forward_normal(x)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    s = aiter_patches.stats()
    assert s[NAME]["fast"] == 0 and s[NAME]["fallback"] == {} and s["moe_addend_fold"]["fast"] == 0


def test_a_call_short_of_an_argument_gets_pythons_type_error(sglang_tree, stub, device, on):
    """Not the hook's KeyError: the call goes to SGLang's method as given, counted with the binder's reason."""
    import_all(stub)
    layer, x = make_layer(device)
    aiter_patches.apply()
    with pytest.raises(TypeError):
        layer.forward_normal()
    s = aiter_patches.stats()[NAME]
    assert s["fast"] == 0 and list(s["fallback"]) == ["required argument not given: hidden_states"], s
