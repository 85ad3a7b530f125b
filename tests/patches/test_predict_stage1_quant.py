"""``predict_stage1_quant`` follows AITER's stage-1 decisions (issue 12 items 2-4, issue 18 items 2-5).

On the stand-in, whose ``fused_moe`` takes AITER's branches (``tests/real_aiter``
proves both take the same ones); the real-chain tests replay the same rules on
real AITER.
"""

import inspect

import pytest
import torch

from aiter_patches.patches import moe_sort_mx_quant as msq


def _bound(aiter, M, *, w="fp4", E=32, topk=1, D=512, I=128, shuffled=False, **kw):
    dt = aiter.dtypes
    if w == "fp4":
        w1 = torch.zeros(E, 2 * I, D // 2, dtype=torch.uint8).view(dt.fp4x2)
        w2 = torch.zeros(E, D, I // 2, dtype=torch.uint8).view(dt.fp4x2)
    else:
        w1 = torch.zeros(E, 2 * I, D, dtype=dt.fp8)
        w2 = torch.zeros(E, D, I, dtype=dt.fp8)
    if shuffled:
        w1.is_shuffled = w2.is_shuffled = True
    hs = torch.zeros(M, D, dtype=torch.bfloat16)
    ids = torch.zeros(M, topk, dtype=torch.int32)
    b = inspect.signature(aiter.fused_moe.fused_moe).bind(hs, w1, w2, torch.ones(M, topk), ids,
                                                          quant_type=aiter.QuantType.per_1x32, **kw)
    b.apply_defaults()
    return dict(b.arguments)


def test_preshuffled_fp4_with_ksplit_predicts_no_quant(stub):
    fm = stub.fused_moe
    b = _bound(stub, 1, shuffled=True)
    assert fm.get_ksplit(1, 1, 32, 128, 512) == 2  # the config AITER picks splits K
    assert msq.predict_stage1_quant(b) is None  # stage 1 runs on bf16 (was: fp4x2, a quant for nothing)
    assert msq.predict_stage1_quant(_bound(stub, 1, shuffled=False)) == stub.dtypes.fp4x2


@pytest.mark.parametrize("M,expected", [(255, None), (256, "fp4x2")])
def test_swiglu_separated_gates_quantize_to_fp4_from_the_bound(stub, M, expected):
    b = _bound(stub, M, E=8, topk=2, activation=stub.ActivationType.Swiglu)
    want = None if expected is None else stub.dtypes.fp4x2
    assert msq.predict_stage1_quant(b) == want


@pytest.mark.parametrize("gfx,M,expected", [("gfx950", 256, "fp8"), ("gfx950", 255, None), ("gfx942", 256, None)])
def test_swiglu_interleaved_gates_quantize_to_mxfp8_on_gfx950_from_256_tokens(stub, monkeypatch, gfx, M, expected):
    monkeypatch.setenv("AITER_STUB_GFX", gfx)
    b = _bound(stub, M, E=8, topk=2, activation=stub.ActivationType.Swiglu, gate_mode="interleave")
    want = None if expected is None else stub.dtypes.fp8
    assert msq.predict_stage1_quant(b) == want


def test_a1_scale_with_bf16_activations_still_quantizes(stub):
    b = _bound(stub, 3, E=8, topk=2, a1_scale=torch.ones(3, 16), num_local_tokens=torch.tensor([2]))
    assert msq.predict_stage1_quant(b) == stub.dtypes.fp4x2


def test_bypass_switch_is_aiters_import_time_value(stub, monkeypatch):
    b = _bound(stub, 3, w="fp8", E=8, topk=2)
    monkeypatch.setenv("AITER_MOE_A8W4_BYPASS_QUANT", "1")  # too late: AITER read it at import
    assert msq.predict_stage1_quant(b) == stub.dtypes.fp8
    monkeypatch.setattr(stub.fused_moe, "_MOE_A8W4_BYPASS_QUANT", True)  # what AITER itself would do now
    assert msq.predict_stage1_quant(b) is None


@pytest.mark.real_sort_launches
def test_sort_launch_counts_follow_aiters_opus_dispatch(stub):
    assert msq.aiter_sort_launches(16, 8, 2, 0) == 1  # one-shot (workspace 0)
    assert msq.aiter_sort_launches(16, 8, 2, 1) == 1  # policy 1 forces the single kernel
    assert msq.aiter_sort_launches(200, 64, 2, 0) == 2  # multi-phase below 2048 tokens
    assert msq.aiter_sort_launches(4096, 64, 2, 0) == 4


@pytest.mark.real_sort_launches
def test_sort_only_runs_only_where_it_saves_launches(stub):
    import aiter_patches

    fm = stub.fused_moe
    aiter_patches.apply()
    from aiter_patches import registry

    for M, E, saves in ((16, 8, False), (200, 64, True)):
        registry.reset_stats()
        ids = torch.stack([torch.randperm(E)[:2] for _ in range(M)]).to(torch.int32)
        fm.moe_sorting(ids, torch.rand(M, 2), E, 256, torch.bfloat16)
        s = registry.stats()["moe_sort_mx_quant"]
        if saves:
            assert s["fast"] == 1 and not s["fallback"], s
        else:
            assert s["fast"] == 0
            assert list(s["fallback"]) == ["sort only, nothing saved: AITER's opus sort takes 1 launch(es), "
                                           "the one-launch sort 1"]


def _counting_cfgs(monkeypatch, fm):
    calls = []
    real = fm.get_2stage_cfgs

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(fm, "get_2stage_cfgs", counted)
    return calls


@pytest.mark.parametrize("shared", [dict(shared_w1=torch.zeros(1)), dict(shared_w2=torch.zeros(1)),
                                    dict(shared_w1_scale=torch.zeros(1)), dict(shared_w2_scale=torch.zeros(1)),
                                    dict(shared_expert_id=0)])
def test_the_shared_expert_path_is_not_asked_for_a_config(stub, monkeypatch, shared):
    """fused_moe hands these calls to aiter.fhmoe: AITER never asks get_2stage_cfgs for them."""
    calls = _counting_cfgs(monkeypatch, stub.fused_moe)
    assert msq.predict_stage1_quant(_bound(stub, 3, E=8, topk=2)) == stub.dtypes.fp4x2
    assert len(calls) == 1
    assert msq.predict_stage1_quant(_bound(stub, 3, E=8, topk=2, **shared)) is None
    assert len(calls) == 1


@pytest.mark.parametrize("env", ["AITER_SITUV2_A8W4", "AITER_SITUV2_A4W4"])
def test_situv2_interleaved_with_flydsl_is_not_asked_for_a_config(stub, monkeypatch, env):
    """AITER's grouped a8w4 kernel may take interleaved calls when FlyDSL is available, before
    get_2stage_cfgs; the SiTUv2 quant switches do not change that."""
    fm = stub.fused_moe
    monkeypatch.setenv(env, "1")
    calls = _counting_cfgs(monkeypatch, fm)
    kw = dict(E=8, topk=2, activation=stub.ActivationType.Situv2, gate_mode="interleave")
    msq.predict_stage1_quant(_bound(stub, 3, **kw))
    assert len(calls) == 1  # without FlyDSL the config is asked for
    monkeypatch.setattr(fm, "is_flydsl_available", lambda: True)
    assert msq.predict_stage1_quant(_bound(stub, 3, **kw)) is None
    assert len(calls) == 1


def test_the_kernel_config_is_asked_once_per_key_and_again_for_a_changed_input(stub, monkeypatch):
    """_kernel_config keeps AITER's answer per key (issue 15): new tensors of the same metadata hit;
    another token count, a weight's is_shuffled flag set later, or AITER's function replaced, ask again."""
    fm = stub.fused_moe
    calls = _counting_cfgs(monkeypatch, fm)
    fp4 = stub.dtypes.fp4x2
    b = _bound(stub, 3, E=8, topk=2)
    assert msq.predict_stage1_quant(b) == fp4
    assert msq.predict_stage1_quant(_bound(stub, 3, E=8, topk=2)) == fp4
    assert len(calls) == 1
    assert msq.predict_stage1_quant(_bound(stub, 40, E=8, topk=2)) == fp4
    assert len(calls) == 2 and calls[-1][0] == fm.get_padded_M(40)
    b["w1"].is_shuffled = True  # AITER marks shuffled weights with an attribute, not in their metadata
    msq.predict_stage1_quant(b)
    assert len(calls) == 3 and calls[-1][14] is True
    monkeypatch.setattr(fm, "get_2stage_cfgs", lambda *a, **k: type("Cfg", (), {"run_1stage": True})())
    assert msq.predict_stage1_quant(b) is None  # the replaced function's answer: one-stage, no stage-1 quant


def test_a_config_asked_with_a_tensor_or_that_raised_is_asked_every_call(stub, monkeypatch):
    fm = stub.fused_moe
    calls = _counting_cfgs(monkeypatch, fm)
    b = _bound(stub, 3, E=8, topk=2, hidden_pad=torch.tensor(0))
    msq.predict_stage1_quant(b)
    msq.predict_stage1_quant(b)
    assert len(calls) == 2  # a tensor's value is not in a key
    counted = fm.get_2stage_cfgs
    failures = []

    def flaky(*a, **k):
        if not failures:
            failures.append(a)
            raise RuntimeError("tuned config file busy")
        return counted(*a, **k)

    monkeypatch.setattr(fm, "get_2stage_cfgs", flaky)
    b = _bound(stub, 5, E=8, topk=2)
    assert msq.predict_stage1_quant(b) is None
    assert msq.predict_stage1_quant(b) == stub.dtypes.fp4x2  # asked again, not kept as None


def test_the_environment_switches_are_read_every_call(stub, monkeypatch):
    """What the prediction reads of the environment is not kept: a switch set between calls is seen."""
    b = _bound(stub, 300, E=8, topk=2, activation=stub.ActivationType.Swiglu, gate_mode="interleave")
    assert msq.predict_stage1_quant(b) == stub.dtypes.fp8
    monkeypatch.setenv("AITER_BF16_FP8_MOE_BOUND", "512")
    assert msq.predict_stage1_quant(b) is None
    monkeypatch.setenv("AITER_STUB_GFX", "gfx942")
    monkeypatch.delenv("AITER_BF16_FP8_MOE_BOUND")
    assert msq.predict_stage1_quant(b) is None
