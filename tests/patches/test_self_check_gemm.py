"""The self-check of gemm_out_zeroed (issue 33), at both GEMM entry points, on the stand-in AITER.

The no-memset launch into zeros is compared with AITER's memset + GEMM (run twice: its atomic
split-K adds may vary in the last bits, and the check's bound is AITER against itself).
"""

import logging
import os
import sys

import pytest
import torch

import aiter_patches
from aiter_patches import registry, self_check
from aiter_patches.patches import gemm_out_zeroed
from aiter_patches.patches.gemm_out_zeroed import first_calls

from .test_gemm_out_zeroed import bits, gemm, make_inputs, zero_out

NAME = "gemm_out_zeroed"


@pytest.fixture
def checking(monkeypatch, tmp_path):
    monkeypatch.setenv(self_check.ENV, "1")
    monkeypatch.setenv(self_check.DIR_ENV, str(tmp_path))
    yield tmp_path
    registry.revert()


def stats():
    return aiter_patches.stats()[NAME]


def _expected(A, Bs, A_scale, B_scale, M, N, device, split):
    out = zero_out(M, N, device)
    gemm(A, Bs, out, A_scale, B_scale, splitK=split)
    return out


def test_first_call_checked_then_fast(stub, device, checking):
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=3)
    expected = _expected(A, Bs, A_scale, B_scale, M, N, device, 2)
    aiter_patches.apply([NAME])
    for n in (1, 2):
        out = zero_out(M, N, device)
        assert gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True) is out
        assert torch.equal(bits(out), bits(expected))
    assert (stats()["checks_passed"], stats()["fast"]) == (1, 1)


def test_a_broken_promise_is_not_compared(stub, device, checking):
    """A non-zero out: the splits add onto it (the contract), so there is nothing to compare."""
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=3)
    aiter_patches.apply([NAME])
    out = torch.ones(M, N, dtype=torch.bfloat16, device=device)
    gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True)
    assert (stats()["checks_passed"], stats()["checks_failed"], stats()["fast"]) == (0, 0, 1)
    assert registry.state(NAME) == registry.APPLIED


def _corrupt_launches(monkeypatch):
    """Every no-memset launch flips one bit of out at (0, 5) after the stand-in's backend wrote it."""
    backend = gemm_out_zeroed.backend_for(sys.modules["aiter"])
    real = backend.launch

    def corrupted(plan, A, B, out, A_scale, B_scale):
        real(plan, A, B, out, A_scale, B_scale)
        out.view(torch.int16)[0, 5] ^= 1

    monkeypatch.setattr(backend, "launch", corrupted)


@pytest.mark.parametrize("entry", ["asm", "dispatcher"])
def test_a_corrupted_launch_stands_the_patch_down(stub, device, checking, monkeypatch, caplog, entry):
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=4)
    expected = _expected(A, Bs, A_scale, B_scale, M, N, device, 2)
    aiter_patches.apply([NAME, "gemm_dispatch_out_zeroed"])
    _corrupt_launches(monkeypatch)
    out = zero_out(M, N, device)
    with caplog.at_level(logging.ERROR, logger="aiter_patches"):
        if entry == "asm":
            gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True)
        else:  # the stand-in's tuned table pointed at the asm kernel for this shape
            monkeypatch.setattr(sys.modules["aiter.ops.gemm_op_a8w8"], "TUNED",
                                {(M, N, K): {"libtype": "asm", "splitK": 2, "kernelName": ""}})
            _via_dispatcher(A, Bs, A_scale, B_scale, out)
    assert torch.equal(bits(out), bits(expected))  # AITER's bits on the failing call
    assert registry.state(NAME) == registry.CHECK_FAILED
    assert registry.state("gemm_dispatch_out_zeroed") == registry.APPLIED  # it goes on: the layer under it hands back
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "out differs from AITER's at (0, 5)" in errors[0]
    assert len(os.listdir(checking)) == 1
    for _ in range(2):  # the promise is still taken, and served by AITER: no TypeError, AITER's bits, counted
        again = zero_out(M, N, device)
        if entry == "asm":
            gemm(A, Bs, again, A_scale, B_scale, splitK=2, out_zeroed=True)
        else:
            _via_dispatcher(A, Bs, A_scale, B_scale, again)
        assert torch.equal(bits(again), bits(expected))
    assert stats()["fallback"].get(self_check.STOOD_DOWN) == 2 and stats()["fast"] == 0
    aiter_patches.apply()  # stays down for the process's life
    assert registry.state(NAME) == registry.CHECK_FAILED
    registry.revert([NAME])  # an operator's revert takes it off (and what needs it): the next apply() starts afresh
    assert registry.state(NAME) == registry.INACTIVE


def _via_dispatcher(A, Bs, A_scale, B_scale, out):
    mod = sys.modules["aiter.ops.gemm_op_a8w8"]
    return mod.gemm_a8w8_blockscale_bpreshuffle(A, Bs, A_scale, B_scale, torch.bfloat16, out=out, out_zeroed=True)


def test_the_dispatcher_counts_what_the_stood_down_layer_under_it_handed_to_aiter(stub, device, checking, monkeypatch):
    """gemm_dispatch_out_zeroed goes on forwarding the promise after gemm_out_zeroed stood down, but AITER serves
    those calls (with its memset): counted as such, never as the dispatcher's fast path, and a layer over the
    dispatcher (forwarding(), as sglang_gemm_zero_pool) hears that the promise was not taken."""
    from aiter_patches.patches import gemm_dispatch_out_zeroed as dispatch

    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=4)
    expected = _expected(A, Bs, A_scale, B_scale, M, N, device, 2)
    A9, Bs9, A9_scale, B9_scale, _ = make_inputs(stub, 9, N, K, device, seed=5)
    aiter_patches.apply([NAME, dispatch.NAME])
    monkeypatch.setattr(sys.modules["aiter.ops.gemm_op_a8w8"], "TUNED",
                        {(m, N, K): {"libtype": "asm", "splitK": 2, "kernelName": ""} for m in (M, 9)})

    def dispatched():
        return aiter_patches.stats()[dispatch.NAME]

    for _ in range(2):  # checked (the caller gets AITER's result, memset included), then the fast path
        _via_dispatcher(A, Bs, A_scale, B_scale, zero_out(M, N, device))
    assert dispatched()["fast"] == 1 and dispatched()["fallback"] == {dispatch.PRODUCER_DOWN: 1}
    _corrupt_launches(monkeypatch)
    _via_dispatcher(A9, Bs9, A9_scale, B9_scale, zero_out(9, N, device))  # a new plan: its check fails
    assert registry.state(NAME) == registry.CHECK_FAILED and registry.state(dispatch.NAME) == registry.APPLIED
    for _ in range(2):
        again = zero_out(M, N, device)
        _via_dispatcher(A, Bs, A_scale, B_scale, again)
        assert torch.equal(bits(again), bits(expected))
    again = zero_out(M, N, device)
    mod = sys.modules["aiter.ops.gemm_op_a8w8"]
    result, forwarded = dispatch.forwarding(mod.gemm_a8w8_blockscale_bpreshuffle, A, Bs, A_scale, B_scale,
                                            torch.bfloat16, out=again, out_zeroed=True)
    assert not forwarded and torch.equal(bits(again), bits(expected))
    assert dispatched()["fast"] == 1 and dispatched()["fallback"] == {dispatch.PRODUCER_DOWN: 5}
    assert stats()["fallback"].get(self_check.STOOD_DOWN) == 3


def test_aiter_against_itself_sets_the_bound():
    a = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    b = torch.tensor([[1.0, 2.015625]], dtype=torch.bfloat16)  # AITER's second run: one ulp off
    assert first_calls.first_difference(a.clone(), a, a) is None
    assert first_calls.first_difference(b.clone(), a, b) is None  # within AITER's own spread
    assert first_calls.first_difference(b.clone(), a, a).startswith("out differs from AITER's at (0, 1)")
    c = torch.tensor([[1.0, 2.0625]], dtype=torch.bfloat16)
    assert first_calls.first_difference(c, a, b).endswith("(largest difference 0.0625; AITER against itself: "
                                                          "0.015625)")


def test_a_strided_out_is_checked_in_a_buffer_with_its_strides(stub, device, checking):
    """The plan may hold out's strides (the stand-in's backend does): the check's own buffer has the same ones."""
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=5)
    expected = _expected(A, Bs, A_scale, B_scale, M, N, device, 2)
    aiter_patches.apply([NAME])
    wide = torch.zeros(M, N + 64, dtype=torch.bfloat16, device=device)
    out = wide[:, :N]
    gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True)
    assert torch.equal(bits(out.contiguous()), bits(expected)) and not wide[:, N:].any()
    assert (stats()["checks_passed"], stats()["checks_failed"]) == (1, 0)


def test_a_non_zero_out_skips_the_plans_check_once_not_every_call(stub, device, checking):
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=3)
    aiter_patches.apply([NAME])
    for _ in range(3):
        out = torch.ones(M, N, dtype=torch.bfloat16, device=device)
        gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True)
    assert stats()["fallback"] == {first_calls.NOT_ZERO: 1} and stats()["fast"] == 3


def test_the_dispatcher_counts_a_hand_back_of_the_layer_under_it_for_any_reason(stub, device, monkeypatch):
    """Not only a stand-down: whenever gemm_out_zeroed hands the forwarded promise to AITER (here: AITER's .co
    cannot be launched), AITER's memset runs, so neither the dispatcher nor a layer over it (forwarding()) counts
    the promise as taken; the reason is counted where it arose."""
    from aiter_patches.patches import gemm_dispatch_out_zeroed as dispatch

    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=4)
    aiter_patches.apply([NAME, dispatch.NAME])
    try:
        monkeypatch.setattr(sys.modules["aiter.ops.gemm_op_a8w8"], "TUNED",
                            {(M, N, K): {"libtype": "asm", "splitK": 2, "kernelName": ""}})
        reason = "AITER's .co cannot be launched here: test"
        backend = gemm_out_zeroed.backend_for(sys.modules["aiter"])
        monkeypatch.setattr(backend, "plan", lambda *a, **k: gemm_out_zeroed.HandBack(reason))
        for _ in range(3):
            _via_dispatcher(A, Bs, A_scale, B_scale, zero_out(M, N, device))
        mod = sys.modules["aiter.ops.gemm_op_a8w8"]
        _, forwarded = dispatch.forwarding(mod.gemm_a8w8_blockscale_bpreshuffle, A, Bs, A_scale, B_scale,
                                           torch.bfloat16, out=zero_out(M, N, device), out_zeroed=True)
        counted = aiter_patches.stats()
        assert not forwarded
        assert counted[NAME]["fast"] == 0 and counted[NAME]["fallback"] == {reason: 4}
        assert counted[dispatch.NAME]["fast"] == 0 and counted[dispatch.NAME]["fallback"] == {dispatch.PRODUCER_DOWN: 4}
    finally:
        registry.revert()
