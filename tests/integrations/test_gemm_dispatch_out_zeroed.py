"""``gemm_a8w8_blockscale_bpreshuffle(..., out=buf, out_zeroed=True)`` through the stand-in's tuned dispatcher.

The promise reaches the asm kernel only when the tuned config picks asm; with
a split above one the memset launch is gone and the result is bitwise the
unpatched dispatcher's; every other kernel ignores it (counted). A poisoned
``out`` shows that a false claim is caught: the splits add onto it.
"""

import sys

import pytest
import torch

import aiter_patches
from aiter_patches.verify import suspended
from patches.test_gemm_out_zeroed import make_inputs

NAME = "gemm_dispatch_out_zeroed"
MODULE = "aiter.ops.gemm_op_a8w8"
M, N, K = 7, 256, 1024


def dispatch(*args, **kwargs):
    return getattr(sys.modules[MODULE], "gemm_a8w8_blockscale_bpreshuffle")(*args, **kwargs)


def bits(t):
    return t.view(torch.int16)


def unpatched(args, out):
    with suspended():
        return dispatch(*args, out=out)


@pytest.mark.parametrize("split", [2, 4])
def test_asm_split_gets_the_promise_bitwise(stub, tuned, launches, device, split):
    tuned[(M, N, K)] = {"libtype": "asm", "splitK": split, "kernelName": ""}
    A, Bs, A_s, B_s, _ = make_inputs(stub, M, N, K, device, seed=split)
    args = (A, Bs, A_s, B_s, torch.bfloat16)
    ref = unpatched(args, torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device))
    assert launches == [("memset",), ("gemm", split)]
    launches.clear()
    aiter_patches.apply()
    out = torch.zeros(M, N, dtype=torch.bfloat16, device=device)
    assert dispatch(*args, out=out, out_zeroed=True) is out
    assert launches == [("gemm", split)]  # one launch saved: the memset
    assert torch.equal(bits(out), bits(ref))
    s = aiter_patches.stats()
    assert s[NAME]["fast"] == 1 and s[NAME]["fallback"] == {}
    assert s["gemm_out_zeroed"]["fast"] == 1


def test_a_false_claim_is_caught_by_a_poisoned_buffer(stub, tuned, launches, device):
    """The contract: out_zeroed=True adds the splits onto out. A buffer that is not zero gives other numbers."""
    tuned[(M, N, K)] = {"libtype": "asm", "splitK": 2, "kernelName": ""}
    A, Bs, A_s, B_s, _ = make_inputs(stub, M, N, K, device, seed=3)
    args = (A, Bs, A_s, B_s, torch.bfloat16)
    ref = unpatched(args, None)
    aiter_patches.apply()
    poisoned = torch.full((M, N), 1.0, dtype=torch.bfloat16, device=device)
    dispatch(*args, out=poisoned, out_zeroed=True)
    assert not torch.equal(bits(poisoned), bits(ref))
    honest = torch.full((M, N), 1.0, dtype=torch.bfloat16, device=device)
    dispatch(*args, out=honest)  # no claim: the memset runs
    assert torch.equal(bits(honest), bits(ref))


def test_other_kernels_ignore_the_promise(stub, tuned, launches, device):
    A, Bs, A_s, B_s, _ = make_inputs(stub, M, N, K, device, seed=4)
    args = (A, Bs, A_s, B_s, torch.bfloat16)
    ref = unpatched(args, None)
    aiter_patches.apply()
    launches.clear()
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)  # CK writes every element
    dispatch(*args, out=out, out_zeroed=True)
    assert torch.equal(bits(out), bits(ref)) and launches == [("gemm", 1)]
    from aiter_patches.patches.gemm_dispatch_out_zeroed import NOT_ASM, NO_OUT

    dispatch(*args, out_zeroed=True)
    assert aiter_patches.stats()[NAME]["fallback"] == {NOT_ASM: 1, NO_OUT: 1}
    assert aiter_patches.stats()["gemm_out_zeroed"]["fast"] == 0


def test_asm_one_split_runs_the_original(stub, tuned, launches, device):
    tuned[(M, N, K)] = {"libtype": "asm", "splitK": 1, "kernelName": ""}
    A, Bs, A_s, B_s, _ = make_inputs(stub, M, N, K, device, seed=5)
    args = (A, Bs, A_s, B_s, torch.bfloat16)
    ref = unpatched(args, None)
    aiter_patches.apply()
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
    dispatch(*args, out=out, out_zeroed=True)
    assert torch.equal(bits(out), bits(ref))
    assert aiter_patches.stats()["gemm_out_zeroed"]["fallback"] == {"split count 1: the original launches no memset": 1}


def test_without_gemm_out_zeroed_the_memset_stays(stub, tuned, launches, device, monkeypatch):
    tuned[(M, N, K)] = {"libtype": "asm", "splitK": 2, "kernelName": ""}
    A, Bs, A_s, B_s, _ = make_inputs(stub, M, N, K, device, seed=6)
    args = (A, Bs, A_s, B_s, torch.bfloat16)
    monkeypatch.setenv("AITER_PATCHES_DISABLE", "gemm_out_zeroed")
    report = aiter_patches.apply()
    # declared need (issue 31): the dispatcher's patch is skipped at apply(), not a call-time fallback; the
    # dispatcher is AITER's own, which takes no out_zeroed
    assert report[NAME]["state"] == "skipped"
    assert report[NAME]["reason"] == "needs gemm_out_zeroed, which is disabled: disabled by AITER_PATCHES_DISABLE"
    out = torch.full((M, N), 1.0, dtype=torch.bfloat16, device=device)
    launches.clear()
    dispatch(*args, out=out)
    assert launches == [("memset",), ("gemm", 2)]
    assert aiter_patches.stats()[NAME]["fallback"] == {}


def test_revert_gives_back_the_dispatcher(stub):
    mod = sys.modules[MODULE]
    before = (mod.gemm_a8w8_blockscale_bpreshuffle, mod.gemm_a8w8_blockscale_bpreshuffle_asm)
    aiter_patches.apply()
    assert stub.gemm_a8w8_blockscale_bpreshuffle is mod.gemm_a8w8_blockscale_bpreshuffle is not before[0]
    aiter_patches.revert()
    assert (mod.gemm_a8w8_blockscale_bpreshuffle, mod.gemm_a8w8_blockscale_bpreshuffle_asm) == before
    assert stub.gemm_a8w8_blockscale_bpreshuffle is before[0]


def test_a_custom_op_wrapper_is_read_through_the_target_name():
    """AITER's torch_compile_guard binds a ``wrapper_custom(*args, **kwargs)``: the schema of the op named like the
    target gives the real parameters, a ScalarType default read as its dtype (the schema reports bf16 as 15)."""
    from aiter_patches.signatures import SignatureUnavailable, from_callable

    torch.library.define("aptest_h16::gemm_like", "(Tensor XQ, ScalarType dtype=15, Tensor? out=None) -> Tensor")

    def wrapper_custom(*args, **kwargs):
        raise AssertionError("not called")

    with pytest.raises(SignatureUnavailable):
        from_callable(wrapper_custom, schema_namespaces=("aptest_h16",))
    sig = from_callable(wrapper_custom, schema_namespaces=("aptest_h16",), op_names=("gemm_like",))
    assert str(sig) == "(XQ, dtype=torch.bfloat16, out=None)"
