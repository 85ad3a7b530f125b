"""A patched call runs each kernel API's gate once (the wrapper's check; the API is told it is done)."""

from __future__ import annotations

import pytest
import torch

import aiter_patches
from aiter_patches_standin import blockscale_gemm_splitk as gemm
from aiter_patches.kernels import moe_sort_mx_quant as k
from helpers.standin import import_stand_in_targets, use_stub_aiter


@pytest.fixture
def stub():
    with use_stub_aiter() as aiter:
        import_stand_in_targets()
        yield aiter


def counting(monkeypatch, module, name="unsupported_reason"):
    calls = []
    real = getattr(module, name)

    def gate(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, gate)
    return calls


def test_the_sort_gate_runs_once_per_patched_call(stub, monkeypatch):
    import aiter.fused_moe as fm

    calls = counting(monkeypatch, k)
    # AITER's multi-phase sort (two launches): the sort alone saves one there, so it takes the fast path
    monkeypatch.setattr(stub, "moe_sorting_opus_get_workspace_size", lambda *a, **kw: 128)
    aiter_patches.apply(["moe_sort_mx_quant"])
    ids = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    fm.moe_sorting(ids, torch.rand(2, 2), 4, 64, torch.bfloat16, 16)
    assert aiter_patches.stats()["moe_sort_mx_quant"]["fast"] == 1
    assert len(calls) == 1


def test_the_gemm_gate_runs_once_per_patched_call(stub, monkeypatch):
    calls = counting(monkeypatch, gemm)
    aiter_patches.apply(["gemm_out_zeroed"])
    M, N, K = 2, 128, 512
    A = torch.zeros(M, K).to(torch.float8_e4m3fn)
    B = torch.zeros(N, K).to(torch.float8_e4m3fn)
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    A_scale = torch.ones(K // 128, M).t()
    B_scale = torch.ones(N // 128, K // 128)
    stub.gemm_a8w8_blockscale_bpreshuffle_asm(A, B, out, A_scale, B_scale, splitK=2, out_zeroed=True)
    assert aiter_patches.stats()["gemm_out_zeroed"]["fast"] == 1
    assert len(calls) == 1


def test_the_kernel_api_still_checks_by_default():
    ids = torch.tensor([[0, 3]], dtype=torch.int64)  # not int32: refused
    with pytest.raises(ValueError, match="topk_ids"):
        k.moe_sort_mx_quant(ids, torch.rand(1, 2), 4, 64, torch.bfloat16, 16)
