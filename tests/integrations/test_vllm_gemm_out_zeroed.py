"""``vllm_gemm_out_zeroed``: vLLM's own GEMM op body (from the wheel) calls the stand-in dispatcher without ``out=``;
each such call is counted with the reason, the result is bitwise the unpatched one, the asm split still memsets;
a vLLM whose op body differs is skipped; revert."""

import importlib
import sys

import pytest
import torch

import aiter_patches
from aiter_patches.verify import suspended
from patches.test_gemm_out_zeroed import make_inputs

from .vllm_tree import importable, vllm_tree, write_tree  # noqa: F401  (fixture)

NAME = "vllm_gemm_out_zeroed"
IMPL = "_rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_impl"
OPS = "vllm._aiter_ops"
M, N, K = 7, 256, 1024


def vllm_impl():
    """vLLM 0.33.0's op body, from the tree's _aiter_ops.py (the wheel's lines; it imports the dispatcher at call time)."""
    importlib.import_module("aiter.ops.gemm_op_a8w8")
    return getattr(importlib.import_module(OPS), IMPL)


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("AITER_PATCHES_INTEGRATIONS", "vllm")


def test_off_by_default(vllm_tree, stub):
    vllm_impl()
    assert aiter_patches.apply()[NAME]["state"] == "disabled"


def test_vllms_call_is_counted_and_unchanged(vllm_tree, stub, tuned, launches, device, on):
    from aiter_patches.integrations.vllm_gemm_out_zeroed import NO_OUT

    tuned[(M, N, K)] = {"libtype": "asm", "splitK": 2, "kernelName": ""}
    A, Bs, A_s, B_s, _ = make_inputs(stub, M, N, K, device, seed=11)
    with suspended():
        impl = vllm_impl()
        ref = impl(A, Bs, A_s, B_s, torch.bfloat16)
    report = aiter_patches.apply()
    assert report[NAME]["state"] == "applied", report[NAME]["reason"]
    launches.clear()
    out = impl(A, Bs, A_s, B_s, torch.bfloat16)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert launches == [("memset",), ("gemm", 2)]  # nothing zeroed to promise: the memset stays
    assert aiter_patches.stats()[NAME]["fallback"] == {NO_OUT: 1}
    given = torch.zeros(M, N, dtype=torch.bfloat16, device=device)
    sys.modules["aiter"].gemm_a8w8_blockscale_bpreshuffle(A, Bs, A_s, B_s, torch.bfloat16, out=given)
    assert aiter_patches.stats()[NAME]["fallback"] == {NO_OUT: 1}  # a caller's out= is not counted


def test_revert_gives_back_the_dispatcher(vllm_tree, stub, on):
    impl = vllm_impl()
    mod, ops = sys.modules["aiter.ops.gemm_op_a8w8"], sys.modules[OPS]
    before = mod.gemm_a8w8_blockscale_bpreshuffle
    assert aiter_patches.apply()[NAME]["state"] == "applied"
    assert mod.gemm_a8w8_blockscale_bpreshuffle is not before and getattr(ops, IMPL) is not impl
    aiter_patches.revert()
    assert mod.gemm_a8w8_blockscale_bpreshuffle is before and getattr(ops, IMPL) is impl


def test_a_vllm_whose_op_body_changed_is_skipped(tmp_path, stub, on):
    def edit(member, text):
        return text.replace("dtype=output_dtype)", "dtype=output_dtype, out=None)") if member.endswith("_aiter_ops.py") \
            else text

    with importable(write_tree(tmp_path / "drifted", edit)):
        vllm_impl()
        report = aiter_patches.apply()
        assert report[NAME]["state"] == "skipped" and f"{IMPL}: source changed" in report[NAME]["reason"]
        assert getattr(sys.modules["aiter.ops.gemm_op_a8w8"].gemm_a8w8_blockscale_bpreshuffle, "__aiter_patches__",
                       None) != NAME
