"""The real kernels' launches, as the kernel APIs make them, are the same direct and ordinary.

The sort (+ quant) and split-K GEMM APIs run on CPU tensors with their kernels as real
JITFunctions over the fake driver (bench/fake_triton.py). Every launch they make is replayed
three times: the ordinary way, then direct (twice: the first may be the key's first sight);
the variant, grid and launcher arguments must agree. The shapes flip the specializations that
matter there: pair counts (one launch vs four), ints that are 1 or multiples of 16, quant
formats, optional tensors present or absent, a misaligned (offset) weights view.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.jit import JITFunction

from aiter_patches_standin import blockscale_gemm_splitk as gemm
from aiter_patches.kernels import fast_launch as fl
from aiter_patches.kernels import moe_sort_mx_quant as k
from bench import fake_triton as ft

SORT_KERNELS = ("_sort_quant_kernel", "_chunk_rank_kernel", "_chunk_scan_kernel", "_scale_tiles_kernel")


def _compiled(fn):
    return fn if isinstance(fn, JITFunction) else ft.jit(fn.fn)


@pytest.fixture
def replayed(monkeypatch):
    """Kernels as JITFunctions on the fake driver; each launch() checked both ways. Yields the check count."""
    fns = {}
    for mod, names in ((k, SORT_KERNELS), (gemm, ("_blockscale_gemm_kernel",))):
        for name in names:
            fn = _compiled(getattr(mod, name))
            monkeypatch.setattr(mod, name, fn)
            fns[name] = fn
    checked = []

    def compare(fn, grid, *args, **kwargs):
        fl.set_mode("off")
        fl.launch(fn, grid, *args, **kwargs)
        ordinary = ft.LOG[-1]
        fl.set_mode("verify")
        fl.launch(fn, grid, *args, **kwargs)
        fl.launch(fn, grid, *args, **kwargs)
        direct = ft.LOG[-1]
        assert direct.same_as(ordinary), (fn.__name__, grid)
        checked.append((fn.__name__, ordinary.kernel))

    monkeypatch.setattr(k, "launch", compare)
    monkeypatch.setattr(gemm, "launch", compare)
    with ft.fake_triton(*fns.values()):
        yield checked
    fl.set_mode(None)


def _routing(M, K, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).contiguous()
    return ids, torch.rand(M, K, generator=g)


@pytest.mark.parametrize("M,K,E,D,quant", [
    (1, 8, 256, 7168, None), (1, 8, 256, 7168, torch.float4_e2m1fn_x2), (4, 16, 896, 3584, torch.float4_e2m1fn_x2),
    (16, 4, 128, 6144, torch.float8_e4m3fn), (3, 8, 128, 4096, torch.float8_e4m3fnuz),
    (300, 8, 128, 256, torch.float4_e2m1fn_x2),  # above ONE_LAUNCH_MAX_PAIRS: four launches
    (300, 8, 128, 256, None),
])
def test_sort_launches_are_the_same_direct(replayed, M, K, E, D, quant):
    ids, w = _routing(M, K, E)
    kw = {}
    if quant is not None:
        kw = dict(quant_input=torch.randn(M, D).to(torch.bfloat16), quant_dtype=quant)
    k.moe_sort_mx_quant(ids, w, E, D, torch.bfloat16, 32, **kw)
    # optional tensors present, and a weights view 4 bytes off its allocation (misaligned)
    w_off = torch.rand(M * K + 1)[1:].view(M, K)
    assert w_off.data_ptr() % 16 != 0
    k.moe_sort_mx_quant(ids, w_off, E, D, torch.bfloat16, 32, expert_mask=torch.ones(E, dtype=torch.int32),
                        num_local_tokens=torch.tensor([M], dtype=torch.int32),
                        moe_buf_init=torch.randn(M, D).to(torch.bfloat16), **kw)
    names = [n for n, _ in replayed]
    assert "_sort_quant_kernel" in names and (M * K <= k.ONE_LAUNCH_MAX_PAIRS or "_chunk_rank_kernel" in names)
    variants = {id(v) for n, v in replayed if n == "_sort_quant_kernel"}
    assert len(variants) == 2  # the second call is another specialization (mask, nlt, init, misaligned w)


@pytest.mark.parametrize("M,splits", [(1, 2), (16, 4), (33, 1)])
def test_gemm_launches_are_the_same_direct(replayed, M, splits):
    N, K = 256, 1024
    A = torch.zeros(M, K).to(torch.float8_e4m3fn)
    B = torch.zeros(N, K).to(torch.float8_e4m3fn)
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    A_scale = torch.ones(M, K // 128)
    B_scale = torch.ones(N // 128, K // 128)
    gemm.blockscale_gemm_splitk(A, B, out, A_scale, B_scale, splits=splits, zero_out=False)
    assert [n for n, _ in replayed] == ["_blockscale_gemm_kernel"]
