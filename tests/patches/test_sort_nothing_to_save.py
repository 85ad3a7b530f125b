"""The sort-only hand-back decided without the verdict key (patches/moe_sort_mx_quant.py, ``nothing_to_save``).

A sort call with no stage-1 quant to make and no addend to write, whose AITER sort is one launch
already, can save nothing: it goes to AITER with that reason, before the verdict key is built
(issue 15: the plain ``fused_moe`` of bf16 and fp8 weights at decode sizes). Every call the rule
does not cover must still reach the full gate, with the gate's own reason, and a call that can
save launches must still launch.
"""

import pytest
import torch

import aiter_patches
from aiter_patches import call_key
from aiter_patches.patches.moe import call as moe_call
from aiter_patches.patches import moe_sort_mx_quant as msq
from aiter_patches.verify import suspended

from .test_moe_sort_mx_quant_patch import assert_same_sort_and_zeroed_buf
from .test_sort_verdicts import BLOCK, DIM, E, counting_calls_of, impl, sort_args

NAME = "moe_sort_mx_quant"
NOTHING_SAVED = "sort only, nothing saved: AITER's opus sort takes 1 launch(es), the one-launch sort 1"


def stats():
    return aiter_patches.stats()[NAME]


@pytest.fixture
def keyed(stub, monkeypatch):
    """The list grows by one per call that builds the verdict key (the full gate's way)."""
    return counting_calls_of(monkeypatch, "_verdict_key")


def one_launch_args(device, **over):
    """Policy 1: AITER's opus sort is its one-shot kernel (the stand-in fixture's multi-phase rule aside)."""
    over.setdefault("dispatch_policy", 1)
    return sort_args(device, **over)


def test_a_sort_only_call_aiter_sorts_in_one_launch_goes_to_aiter_without_a_key(stub, device, keyed):
    a = one_launch_args(device)
    with suspended():
        expected = impl(a)
    for _ in range(3):
        assert_same_sort_and_zeroed_buf(expected, impl(a), BLOCK)
    assert keyed == [] and len(msq.VERDICTS) == 0
    assert stats()["fast"] == 0 and stats()["fallback"] == {NOTHING_SAVED: 3}


def test_inside_fused_moe_without_a_predicted_quant_too(stub, device, keyed):
    a = one_launch_args(device)
    for quant_dtype, made in ((None, None), (torch.float4_e2m1fn_x2, "made")):
        x = torch.randn(5, DIM).to(torch.bfloat16).to(device)
        call = moe_call.MoeCall(hidden_states=x, quant_dtype=quant_dtype)
        with moe_call.scope(call):
            impl(a)
        assert (call.stage1_quant is not None) == bool(made)
    assert keyed == [1], "a predicted quant must reach the full gate (it launches the sort + quant)"
    assert stats()["fast"] == 1 and stats()["fallback"] == {NOTHING_SAVED: 1}


def test_a_quant_already_made_for_the_call_is_no_quant_to_make(stub, device, keyed):
    a = one_launch_args(device)
    x = torch.randn(5, DIM).to(torch.bfloat16).to(device)
    call = moe_call.MoeCall(hidden_states=x, quant_dtype=torch.float4_e2m1fn_x2)
    call.stage1_quant = object()  # an extension made it: the sort has none to make
    with moe_call.scope(call):
        impl(a)
    assert keyed == [] and stats()["fallback"] == {NOTHING_SAVED: 1}


@pytest.mark.parametrize("over, reason", [
    ({"use_opus": False}, "use_opus=False"),
    ({"use_opus": 0}, "use_opus=False"),
    ({"use_opus": None}, "use_opus=False"),
    ({"return_local_topk_ids": True}, "return_local_topk_ids"),
    ({"num_experts": torch.tensor(E)}, "num_experts is a tensor"),
    ({"dispatch_policy": torch.tensor(1)}, "dispatch_policy is a tensor"),
    ({"use_opus": torch.tensor(True)}, "use_opus is a tensor"),
])
def test_calls_the_rule_does_not_cover_reach_the_full_gate(stub, device, keyed, over, reason):
    a = one_launch_args(device, **over)
    try:
        impl(a)
    except Exception:  # noqa: BLE001 - AITER's own outcome for such a call
        pass
    assert keyed == [1]
    assert [r for r in stats()["fallback"] if r.startswith(reason)], stats()


def test_output_aux_reaches_the_full_gate(stub, device, keyed):
    import aiter.fused_moe as fm

    a = one_launch_args(device)
    try:
        fm._moe_sorting_impl(*a.values(), output_aux=True)
    except Exception:  # noqa: BLE001 - the stand-in's adaptive sort may not take these arguments
        pass
    assert keyed == [1] and "output_aux (the a4w4 adaptive sort)" in stats()["fallback"], stats()


def test_arguments_the_pin_does_not_explain_reach_the_full_gate(stub, device, keyed):
    import aiter.fused_moe as fm

    a = one_launch_args(device)
    with pytest.raises(TypeError):
        fm._moe_sorting_impl(*a.values(), bogus=1)  # every flag set as the rule wants: only the keyword is wrong
    assert keyed == [1] and list(stats()["fallback"]) == ["unknown keyword 'bogus'"], stats()


def test_a_sort_aiter_takes_in_two_launches_still_launches(stub, device, keyed):
    a = sort_args(device)  # the stand-in fixture: policy 0 is the multi-phase sort, two launches
    with suspended():
        expected = impl(a)
    assert_same_sort_and_zeroed_buf(expected, impl(a), BLOCK)
    assert keyed == [1] and stats()["fast"] == 1 and stats()["fallback"] == {}


def test_aiters_answer_is_asked_again_when_its_function_changes(stub, device, keyed, monkeypatch):
    """The workspace function is in the remembered answer's key: AITER replaced (a reload, a test)
    is asked, and a multi-phase answer sends the call to the full gate, which launches."""
    import aiter

    a = one_launch_args(device)
    impl(a)
    monkeypatch.setattr(aiter, "moe_sorting_opus_get_workspace_size", lambda *x: 128)
    impl(a)
    assert keyed == [1] and stats()["fast"] == 1 and stats()["fallback"] == {NOTHING_SAVED: 1}


def test_a_failed_workspace_query_goes_to_aiter_and_is_asked_again(stub, device, keyed, monkeypatch):
    import aiter

    failures = []

    def flaky(*x):  # AITER's own sort asks it too: only the first question fails
        if not failures:
            failures.append(x)
            raise RuntimeError("JIT module still loading")
        return 0

    monkeypatch.setattr(aiter, "moe_sorting_opus_get_workspace_size", flaky)
    a = one_launch_args(device)
    impl(a)
    impl(a)
    assert keyed == [] and len(failures) == 1
    assert stats()["fallback"] == {msq.WORKSPACE_UNKNOWN: 1, NOTHING_SAVED: 1}


def test_under_torch_compile_tracing_the_full_gate_decides(stub, device, keyed, monkeypatch):
    monkeypatch.setattr(call_key, "_compiling", lambda: True)
    a = one_launch_args(device)
    impl(a)
    impl(a)
    assert keyed == [1, 1] and stats()["fallback"] == {NOTHING_SAVED: 2}


def test_applying_again_forgets_the_remembered_answers(stub, device, keyed):
    a = one_launch_args(device)
    impl(a)
    assert msq._NOTHING_SAVED
    aiter_patches.revert([NAME])
    aiter_patches.apply([NAME])
    assert not msq._NOTHING_SAVED and not msq._SHORTCUT_LAYOUTS


@pytest.mark.real_sort_launches
def test_an_addend_to_write_reaches_the_full_gate(stub, device):
    """At one token AITER's opus sort is one launch, but the addend written as moe_buf's fill in the
    sort's own launch saves its copy: that sort must launch, not be handed back."""
    import aiter.fused_moe as fm

    from .test_addend_fold import addend_for, reference_with_accumulator_start
    from .test_moe_sort_mx_quant_patch import moe_inputs, same_bits

    args = moe_inputs(stub, device, 1, 16, 4, 256, 128, "bf16")
    addend = addend_for(args)
    assert msq.aiter_sort_launches(1, 16, 4, 0) == 1
    expected = reference_with_accumulator_start(fm, args, addend)
    aiter_patches.apply(["moe_addend_fold", NAME])
    got = fm.fused_moe(**args, moe_addend=addend)
    assert same_bits(got, expected)
    assert stats()["fast"] == 1 and stats()["fallback"] == {}, stats()
    fm.fused_moe(**args)  # the same call without the addend: nothing to save
    assert stats()["fallback"] == {NOTHING_SAVED: 1}, stats()


@pytest.mark.parametrize("change", ["AITER's launch count", "AITER's workspace function"])
def test_a_call_the_full_gate_makes_sort_only_keys_aiters_launch_count(stub, device, keyed, monkeypatch, change):
    """A predicted quant the kernel refuses (fp32 activations) leaves the full gate a sort-only call, decided
    by AITER's launch count: that answer's functions are in the verdict key, so a changed one decides again."""
    import aiter

    a = one_launch_args(device)
    x = torch.randn(5, DIM).to(device)  # fp32: the quant is not fused, the sort alone is left

    def sort():
        with moe_call.scope(moe_call.MoeCall(hidden_states=x, quant_dtype=torch.float4_e2m1fn_x2)):
            impl(a)

    sort()
    sort()
    assert keyed == [1, 1] and stats()["fast"] == 0
    assert [r for r in stats()["fallback"] if r.startswith(NOTHING_SAVED)], stats()
    if change == "AITER's launch count":
        monkeypatch.setattr(msq, "aiter_sort_launches", lambda *x: 2)
    else:
        monkeypatch.setattr(aiter, "moe_sorting_opus_get_workspace_size", lambda *x: 128)
    sort()
    assert stats()["fast"] == 1, "a kept hand-back outlived the launch count it was decided on"
