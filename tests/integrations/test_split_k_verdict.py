"""checks.split_k_verdict: the verdict both skipped-memset GEMM checks return (bitwise where it must be, else a bound)."""

import pytest
import torch

from aiter_patches.checks import Provided, split_k_verdict

DETAILS = dict(missing="not taken", taken_detail="taken, same bits", untaken_detail="not taken, AITER's result",
               bound_detail="asm took it")


def outputs():
    ref = torch.linspace(-3, 3, 64, dtype=torch.float32).reshape(4, 16).to(torch.bfloat16)
    one_ulp = ref.clone()
    one_ulp.view(torch.int16)[1, 3] += 1  # the next bfloat16 after one element
    return ref, one_ulp


# what the stand-in provides (its fast paths required, its splits added in a fixed order) and AMD's AITER (neither)
STAND_IN, AITER = Provided(split_k_in_order=True, fast_paths_required=True), Provided()


def verdict(patched, original, stand_in, taken):
    return split_k_verdict(patched, original, aiter=STAND_IN if stand_in else AITER, taken=taken, **DETAILS)


@pytest.mark.parametrize("stand_in, taken", [(True, True), (False, False)])
def test_bitwise_cases_pass_on_the_same_bits_and_fail_on_one_ulp(stand_in, taken):
    ref, one_ulp = outputs()
    same = verdict(ref.clone(), ref, stand_in, taken)
    assert (same.kind, same.ok) == ("bitwise", True)
    assert same.detail == (DETAILS["taken_detail"] if taken else DETAILS["untaken_detail"])
    off = verdict(one_ulp, ref, stand_in, taken)
    assert (off.kind, off.ok, off.detail) == ("bitwise", False, "outputs differ")


def test_a_negative_zero_is_a_difference_where_bits_are_compared():
    ref = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert not verdict(-ref, ref, True, True).ok


def test_the_stand_in_must_take_the_fast_path():
    ref, _ = outputs()
    r = verdict(ref.clone(), ref, True, False)
    assert (r.kind, r.ok, r.detail) == ("bitwise", False, "not taken")


def test_real_aiter_taken_is_held_to_the_bound_not_to_bits():
    ref, one_ulp = outputs()
    near = verdict(one_ulp, ref, False, True)
    assert near.ok and near.kind.startswith("bound: 2-norm rel. error <= 1e-2")
    assert near.detail.startswith("asm took it; relative error ")
    far = ref.float().clone()
    far[0] += 1.0  # about 0.3 relative in 2-norm: far past 1e-2
    r = verdict(far.to(torch.bfloat16), ref, False, True)
    assert r.kind.startswith("bound") and not r.ok
