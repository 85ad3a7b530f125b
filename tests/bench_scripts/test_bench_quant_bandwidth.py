"""bench/bench_quant_bandwidth.py's own quant kernel (issue 34): the "quant alone" column is the product's
math, so it must give the reference's bytes; the memory floor's stand-in must not."""

import math

import pytest
import torch

from aiter_patches.kernels import moe_sort_mx_quant as k
from aiter_patches.reference.mx_quant import mx_quant_rows
from bench import bench_moe_sort_quant
from bench import bench_quant_bandwidth as b


@pytest.mark.parametrize("math,same", [(0, False), (1, True)])
def test_quant_alone_kernel_is_the_products_math(math, same):
    g = torch.Generator().manual_seed(3)
    M, N = 3, 320  # 10 groups: one program's 32-group share masked past the row's end
    x = (torch.randn(M, N, generator=g) * 4).bfloat16()
    x[0, 5], x[1, 40], x[2, 0] = float("nan"), float("inf"), 0.0
    q = torch.full((M, N // 2), 0xAB, dtype=torch.uint8)
    s = torch.full((M, N // 32), 0xAB, dtype=torch.uint8)
    fmt = k._FP_FORMATS[b.FP4]
    b._quant_alone_kernel[(M, 1)](x, q, s, N // 32, MATH=math, QG=32, INV=fmt["INV_MAX_BITS"],
                                  FLOOR=k._AMAX_FLOOR_BITS)
    rq, rs = mx_quant_rows(x, b.FP4)
    got = torch.equal(q, rq.view(torch.uint8).reshape(M, -1)) and torch.equal(s, rs.view(torch.uint8).reshape(M, -1))
    assert got == same


@pytest.mark.slow_ci
def test_chain_launches_run_the_plans_rank_scan_and_tiles(monkeypatch):
    """The per-launch breakdown replays the product's own rank, scan and scale-tile launches (here once each, on
    the interpreter): their tables are the ones the product's sort launch reads."""
    ran = []

    def once(calls, n_calls):
        calls[0]()
        ran.append(n_calls)
        return 1.0

    monkeypatch.setattr(b.harness, "graph_us", once)
    monkeypatch.setattr(bench_moe_sort_quant, "DEV", "cpu")
    row = b.Row(300, 16, 8, 64)  # 2400 pairs: the prescanned chain
    assert b.chain_launches_us(row) == (1.0, 1.0, 1.0) and len(ran) == 3
    assert all(math.isnan(t) for t in b.chain_launches_us(b.Row(4, 16, 8, 64)))  # one launch: none of the three
    assert len(ran) == 3
