"""On a GPU: plan hits with prepared direct launches ("on" mode) give the bits of ordinary launches.

Run with ``pytest -m gpu tests/launch``. Verify mode sends every prepared launch through
``fast_launch.launch`` (test_fast_launch_gpu.py checks that path); this file checks the prepared
path itself: the sort (+ quant) at the four target models' decode shapes and a prescanned batch,
aligned and misaligned weights, the split-K GEMM, eagerly and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from aiter_patches_standin import blockscale_gemm_splitk as gemm
from aiter_patches.kernels import fast_launch as fl
from aiter_patches.kernels import moe_sort_mx_quant as k

pytestmark = pytest.mark.gpu

SHAPES = [(1, 8, 256, 7168), (64, 16, 896, 3584), (16, 4, 128, 6144), (4, 8, 128, 4096), (300, 8, 128, 4096)]


@pytest.fixture(autouse=True)
def _zeroed_outputs(monkeypatch):
    real = k._empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        t.view(torch.uint8).zero_()
        return t

    monkeypatch.setattr(k, "_empty", empty)
    yield
    fl.set_mode(None)


def _inputs(M, K, E, D, offset):
    g = torch.Generator().manual_seed(M * 31 + K)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).cuda()
    w = torch.rand(M * K + offset, generator=g).cuda()[offset:].view(M, K)
    x = torch.randn(M, D, generator=g).to(torch.bfloat16).cuda()
    return ids, w, x


def _sort(ids, w, x, E, D):
    r = k.moe_sort_mx_quant(ids, w, E, D, torch.bfloat16, 32, quant_input=x, quant_dtype=torch.float4_e2m1fn_x2)
    return [t.view(torch.uint8) for t in (r.sorted_ids, r.sorted_weights, r.sorted_expert_ids, r.num_valid_ids,
                                          r.moe_buf, *r.quant)]


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("M,K,E,D", SHAPES)
def test_sort_plan_hits_equal_ordinary_launches(M, K, E, D, offset):
    ids, w, x = _inputs(M, K, E, D, offset)
    fl.set_mode("off")
    ref = _sort(ids, w, x, E, D)
    fl.set_mode("on")
    before = fl.stats()["direct"]
    for _ in range(3):
        assert _same(ref, _sort(ids, w, x, E, D))
    assert fl.stats()["direct"] > before


@pytest.mark.parametrize("M,splits", [(1, 4), (16, 2), (64, 1)])
def test_gemm_plan_hits_equal_ordinary_launches(M, splits):
    g = torch.Generator().manual_seed(M)
    N, K = 1024, 2048
    A = torch.randn(M, K, generator=g).to(torch.float8_e4m3fn).cuda()
    B = torch.randn(N, K, generator=g).to(torch.float8_e4m3fn).cuda()
    a_s = torch.rand(M, K // 128, generator=g).cuda()
    b_s = torch.rand(N // 128, K // 128, generator=g).cuda()

    def run():
        out = torch.zeros(M, N, dtype=torch.bfloat16, device="cuda")
        return gemm.blockscale_gemm_splitk(A, B, out, a_s, b_s, splits=splits, zero_out=False)

    fl.set_mode("off")
    ref = run()
    fl.set_mode("on")
    before = fl.stats()["direct"]
    for _ in range(3):
        assert torch.equal(ref.view(torch.uint8), run().view(torch.uint8))
    assert fl.stats()["direct"] > before


def test_a_plan_hit_inside_a_cuda_graph():
    M, K, E, D = SHAPES[0]
    ids, w, x = _inputs(M, K, E, D, 0)
    fl.set_mode("off")
    ref = _sort(ids, w, x, E, D)
    fl.set_mode("on")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _sort(ids, w, x, E, D)
        _sort(ids, w, x, E, D)  # plan and kernel kept outside the capture
    torch.cuda.current_stream().wait_stream(s)
    before = fl.stats()["direct"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _sort(ids, w, x, E, D)
    assert fl.stats()["direct"] > before
    graph.replay()
    torch.cuda.synchronize()
    assert _same(ref, out)
