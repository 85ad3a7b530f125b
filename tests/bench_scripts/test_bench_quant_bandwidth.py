"""bench/bench_quant_bandwidth.py's own quant kernel (issue 34): the "quant alone" column is the product's
math, so it must give the reference's bytes; the memory floor's stand-in must not."""

import math

import pytest
import torch

from aiter_patches.kernels import moe_sort_mx_quant as k
from aiter_patches.reference.mx_quant import mx_quant_rows
from bench import bench_moe_sort_quant
from bench import bench_quant_bandwidth as b
from helpers.poisoned import poisoned_empty


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


def _knocked_call(monkeypatch, name, M=6, E=16, K=4, N=256):
    """The product's outputs for one call, as configured and with knockout ``name``, and its sort launch's
    constexprs (every output allocation poisoned, so unwritten bytes show)."""
    monkeypatch.setattr(k, "_empty", poisoned_empty)
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).int()
    w = torch.rand(M, K, generator=g)
    x = (torch.randn(M, N, generator=g) * 3).bfloat16()
    kept: list = []

    def call():
        return k.moe_sort_mx_quant(ids, w, E, N, torch.bfloat16, 32, quant_input=x, quant_dtype=b.FP4, kept=kept)

    real = call()
    for attr in b.KNOCKOUTS[name][0]:
        monkeypatch.setattr(k, attr, getattr(k, attr))  # undone after the test
    b.knock_out(name)
    return real, call(), kept[0].sort.kwargs


def _bytes(res):
    return [*res[:5], *(t.view(torch.uint8) for t in res.quant)]


@pytest.mark.parametrize("name", [n for n, (replaces, _) in b.KNOCKOUTS.items() if replaces])
def test_each_knockout_takes_out_what_it_names(monkeypatch, name):
    """The knockouts behind issue 34's measured limits take out their part and nothing else: on the
    interpreter, a decode call of split roles (routing and data programs) against the product's own bytes."""
    M, K, N = 6, 4, 256
    real, got, _ = _knocked_call(monkeypatch, name, M=M, K=K, N=N)
    for a, r in zip(got[:4], real[:4]):  # the sort's four tables: every knockout leaves them alone
        assert torch.equal(a, r)
    (q, s), (rq, rs) = got.quant, real.quant
    q, s, rq, rs = (t.view(torch.uint8) for t in (q, s, rq, rs))
    if name == "no data programs":
        assert (q == 0xAB).all() and (got.moe_buf.view(torch.uint8) == 0xAB).all()
        assert torch.equal(s, rs)
    elif name == "no sorted-row scales":
        assert torch.equal(q, rq) and torch.equal(got.moe_buf, real.moe_buf)
        # every pair's sorted row keeps its poison in each of the row's N / 32 groups; padding rows are written
        assert int((s == 0xAB).sum() - (rs == 0xAB).sum()) == M * K * (N // 32)
    else:
        assert not torch.equal(q, rq) and torch.equal(got.moe_buf, real.moe_buf)


@pytest.mark.parametrize("prescanned", [False, True])
@pytest.mark.parametrize("name", list(b.KNOCKOUTS))
def test_a_knockout_is_timed_only_where_the_launch_has_its_work(monkeypatch, name, prescanned):
    """A knockout's column is timed where it changes what the launch writes, and only there (else it would time
    ``new`` again and pass for a measurement): the prescanned chain has no data programs and writes its sorted-row
    scales in the scale-tile launch, so two of the knockouts take nothing out of it; ``own process`` never does."""
    if prescanned:
        # 24 pairs: the prescanned chain, with the split quant semantics prefill takes (compact scales)
        monkeypatch.setattr(k, "ONE_LAUNCH_MAX_PAIRS", 16)
        monkeypatch.setattr(k, "FUSED_QUANT_MAX_PAIRS", 16)
    real, got, sort = _knocked_call(monkeypatch, name)
    assert sort["PRESCANNED"] == sort["COMPACT_SCALES"] == prescanned
    changed = any(not torch.equal(a, r) for a, r in zip(_bytes(got), _bytes(real)))
    assert changed == (b.KNOCKOUTS[name][1](sort) and bool(b.KNOCKOUTS[name][0]))
    assert b.KNOCKOUTS[name][1](sort) == (name in ("own process", "shift math") or not prescanned)
