"""Benchmark: what bounds the prefill's MX quant (issue 34), measured, not guessed.

The sort kernel's prefill time is the sort, the ``moe_buf`` fill and the quant of every activation
row. This script takes the quant apart on the GPU, CUDA-graph replay, same run:

* ``quant alone``: a kernel that does nothing but the quant of ``[M, N]`` bf16 rows into e2m1 codes and
  compact scale rows (the product's ``_mx_quant_groups``), one program per ``QG`` groups of a row;
  ``math``: ``float`` (the product's rounding), ``none`` (the same loads and stores, the math replaced by a
  shift: the memory floor of this access pattern).
  ``GB/s``: activations in, codes and scale bytes out, over the time.
* ``product``: the whole sort + fill + quant of :mod:`aiter_patches.kernels.moe_sort_mx_quant` as
  configured, without quant (sort + fill), the sort alone, without the fill (``zero_moe_buf=False``), and
  with the module constants of ``CANDIDATES``; ``rank``, ``scan`` and ``tiles``: the prescanned chain's other
  launches alone (so the sort launch alone is ``sort`` less the first two, and ``new`` less all three).
* knockouts (``KNOCKOUTS``, ``--knockouts``): the product with one part of its work taken out, each in a
  process of its own (Triton binds a kernel's callees at its first compile; bits wrong by design, times
  only): ``shift math`` (the quant math replaced by the shift), ``no data programs`` (split roles' data
  programs return at once: no codes, no compact scales, no ``moe_buf`` row), ``no sorted-row scales`` (the
  routing programs' scale bytes at each pair's sorted row, their stores predicated off; the maxima are
  still taken); ``own process``: nothing taken out, the baseline of the others (each differs from ``new``
  by a process's noise as well). A knockout whose work the row's launch does not have (no data programs
  but in split roles; sorted-row scales from the scale-tile launch in the prescanned chain) is ``–``, not
  timed. Decode rows as well as prefill: ``--tokens 48,64 --no-alone``.

    python bench/bench_quant_bandwidth.py --out /tmp/quant_bandwidth.md  # its tables: docs/bench/moe_sort_quant_candidates_h200.md

The candidates of earlier rounds (the integer rounding, the scan's 64-bin tiles, other rank chunks, the
schedules, the rank launch by histogram, the chain from 513 pairs, the scale tiles gathered byte by byte) are
gone from here; their tables name the commit that ran them.
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing
import shlex
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiter_patches.kernels import moe_sort_mx_quant as kernel  # noqa: E402
from bench import harness  # noqa: E402
from bench.bench_moe_sort_quant import MODELS, Row, constants, graph_time_us  # noqa: E402

TOKENS = [8192, 32768]
FP4 = torch.float4_e2m1fn_x2
CANDIDATES: dict[str, dict] = {}  # module constants tried in the product, each a column (none this round)


@triton.jit
def _shift_groups(x, MB: tl.constexpr, EMIN: tl.constexpr, MAXC: tl.constexpr, NANC: tl.constexpr,
                  SIGNED_ZERO: tl.constexpr, SIGN_SHIFT: tl.constexpr, INV_MAX_BITS: tl.constexpr,
                  FLOOR_BITS: tl.constexpr, G_PAD: tl.constexpr):
    """The memory floor's stand-in for ``_mx_quant_groups``: a scale from the group's largest bits, a code
    from each element's top bits (the same loads and stores, next to no math; bits wrong)."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    return (tl.max(bits, axis=1) >> 23) & 0xFF, (bits >> 28) & 0xF


@triton.jit
def _quant_alone_kernel(x_ptr, q_ptr, s_ptr, G, MATH: tl.constexpr, QG: tl.constexpr, INV: tl.constexpr,
                        FLOOR: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * QG
    x = kernel._load_groups(x_ptr + row * G * 32 + g0 * 32, G - g0, QG)
    if MATH == 0:
        s, code = _shift_groups(x, 1, 0, 7, -1, True, 3, INV, FLOOR, QG)
    else:
        s, code = kernel._mx_quant_groups(x, 1, 0, 7, -1, True, 3, INV, FLOOR, QG)
    kernel._store_data_row(q_ptr + row * G * 16 + g0 * 16, code, G - g0, True, QG)
    g = g0 + tl.arange(0, QG)
    tl.store(s_ptr + row * G + g, s.to(tl.uint8), mask=g < G)


_STORE_QUANT_TILE = kernel._store_quant_tile  # the product's own, which the knockout below calls


@triton.jit
def _skip_data_program(ids_ptr, w_ptr, mask_ptr, x_row, q_row, cs_row, buf_ptr, init_ptr, init_stride, row, t, cd, T,
                       M, E, D, G, D_SPLIT,
                       K: tl.constexpr, K_PAD: tl.constexpr, E_BINS: tl.constexpr, HAS_MASK: tl.constexpr,
                       QUANT: tl.constexpr, FP4: tl.constexpr, MB: tl.constexpr, EMIN: tl.constexpr,
                       MAXC: tl.constexpr, NANC: tl.constexpr, SIGNED_ZERO: tl.constexpr, SIGN_SHIFT: tl.constexpr,
                       INV_MAX_BITS: tl.constexpr, FLOOR_BITS: tl.constexpr, FUSED: tl.constexpr,
                       BUF_MODE: tl.constexpr, D_BLOCK: tl.constexpr, G_DTILE: tl.constexpr, QG_D: tl.constexpr,
                       COMPACT_SCALES: tl.constexpr):
    """``no data programs``: ``_data_program``'s arguments, none of its work."""
    return


@triton.jit
def _store_without_sorted_scales(q_row, s_ptr, cs_row, s, code, g_first, G, pos, keep_q, zero_w, all_zero,
                                 FUSED: tl.constexpr, FP4: tl.constexpr, SNP: tl.constexpr, K_PAD: tl.constexpr,
                                 GQ: tl.constexpr, COMPACT_SCALES: tl.constexpr, STORE_DATA: tl.constexpr):
    """``no sorted-row scales``: ``_store_quant_tile`` with no pair kept (``pos`` is never negative, but the
    compiler cannot know it): its codes and compact scales stored as before, its scattered stores issued with
    every lane off."""
    _STORE_QUANT_TILE(q_row, s_ptr, cs_row, s, code, g_first, G, pos, keep_q & (pos < 0), zero_w, all_zero,
                      FUSED, FP4, SNP, K_PAD, GQ, COMPACT_SCALES, STORE_DATA)


# each knockout: the product's jit helpers it replaces (by module global) in a process of its own, and whether a
# launch (its sort launch's constexprs) has that work at all: where not, the column would time `new` again
KNOCKOUTS = {
    "own process": ({}, lambda sort: True),
    "shift math": ({"_mx_quant_groups": _shift_groups}, lambda sort: True),
    "no data programs": ({"_data_program": _skip_data_program}, lambda sort: sort["ROUTE_PROGRAMS"] > 0),
    "no sorted-row scales": ({"_store_quant_tile": _store_without_sorted_scales},
                             lambda sort: not sort["COMPACT_SCALES"]),
}


def quant_alone_us(x, math: int, qg: int) -> float:
    M, N = x.shape
    G = N // 32
    q = torch.empty(M, N // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(M, G, dtype=torch.uint8, device=x.device)
    fmt = kernel._FP_FORMATS[FP4]
    grid = (M, triton.cdiv(G, qg))
    return harness.graph_us([lambda: _quant_alone_kernel[grid](x, q, s, G, MATH=math, QG=qg, INV=fmt["INV_MAX_BITS"],
                                                               FLOOR=kernel._AMAX_FLOOR_BITS,
                                                               num_warps=4 if qg <= 64 else 8)], 6)


def product_plan(row, zero: bool = True):
    """The plan the product takes for ``row`` with the quant (its launches' grids and constexprs), and the outputs of
    one call of it."""
    ids, w, x = row.sets[0]
    kept: list = []
    out = kernel.moe_sort_mx_quant(ids, w, row.E, row.N, torch.bfloat16, 32, quant_input=x, quant_dtype=FP4,
                                   zero_moe_buf=zero, kept=kept)
    return kept[0], out


def chain_launches_us(row) -> tuple[float, float, float]:
    """The prescanned chain's launches other than the sort launch, each alone (``rank``: per-chunk histograms and
    ranks; ``scan``: their prefix over chunks; ``tiles``: the sorted rows' scale bytes from the compact rows),
    replayed on its own with the buffers the product gives it: the sort launch's own time is the product's
    ``new`` less the three (``sort``, without the quant, less the first two)."""
    ids = row.sets[0][0]
    plan, out = product_plan(row, zero=False)
    if plan.rank is None:
        return float("nan"), float("nan"), float("nan")
    hist, pre = (torch.empty(plan.n_chunks, plan.e_bins, dtype=torch.int32, device=ids.device) for _ in range(2))
    tot = torch.empty(plan.tot_size, dtype=torch.int32, device=ids.device)
    ranks = torch.empty(ids.numel(), dtype=torch.int32, device=ids.device)
    rank = harness.graph_us([lambda: kernel._run(plan.rank, ids, ids, ids, hist, ranks)], row.calls)
    scan = harness.graph_us([lambda: kernel._run(plan.scan, hist, pre, tot, ids)], row.calls)
    tiles = float("nan")
    if plan.tiles is not None:
        compact = torch.randint(0, 255, (ids.shape[0], plan.G), dtype=torch.uint8, device=ids.device)
        s_u8 = out.quant[1].view(torch.uint8)
        tiles = harness.graph_us([lambda: kernel._run(plan.tiles, out.sorted_ids, out.num_valid_ids, compact, s_u8)],
                                 row.calls)
    return rank, scan, tiles


def knock_out(name: str) -> None:
    """Replace the product's helpers as knockout ``name`` says (once per process, before its first compile)."""
    for attr, fn in KNOCKOUTS[name][0].items():
        setattr(kernel, attr, fn)


def _product_knocked(job):
    """The product's time with knockout ``name`` (run in that knockout's own process)."""
    name, (M, E, K, N) = job
    knock_out(name)
    row = Row(M, E, K, N)
    return row.timer(functools.partial(row.ours, True), row.calls)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--models", default="all")
    ap.add_argument("--no-alone", action="store_true", help="only the product table")
    ap.add_argument("--knockouts", default=",".join(KNOCKOUTS),
                    help=f"knockout columns, comma-separated ('' for none; of: {', '.join(KNOCKOUTS)})")
    args = ap.parse_args()
    knockouts = [k for k in args.knockouts.split(",") if k]
    unknown = [k for k in knockouts if k not in KNOCKOUTS]
    if unknown:
        ap.error(f"--knockouts: {', '.join(unknown)} is not one of: {', '.join(KNOCKOUTS)}")
    t0 = time.time()
    bw = harness.copy_bandwidth()
    models = MODELS if args.models == "all" else [MODELS[int(i)] for i in args.models.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    ctx = multiprocessing.get_context("spawn")
    pools = {k: ctx.Pool(1) for k in knockouts}  # one process per knockout, kept for every row
    alone, product = [], []
    for E, K, N in models:
        for M in tokens:
            row = Row(M, E, K, N)
            qbytes = row.quant_bytes()
            x = row.sets[0][2]
            for qg in () if args.no_alone else (32, 64, 128):
                cells = [E, K, N, M, qg]
                for shift_or_float in (0, 1):
                    us = quant_alone_us(x, shift_or_float, qg)
                    cells += [f"{us:.1f}", f"{qbytes / us / 1e3:.0f}"]
                alone.append(cells)
            times = {}
            for name, values, quant, zero in (("new", {}, True, True), ("sort+fill", {}, False, True),
                                              ("sort", {}, False, False), ("no fill", {}, True, False),
                                              *((n, v, True, True) for n, v in CANDIDATES.items())):
                with constants(values):
                    fn = functools.partial(_call, row, quant, zero)
                    times[name] = graph_time_us(fn, row.calls)
            times["rank"], times["scan"], times["tiles"] = chain_launches_us(row)
            sort = product_plan(row)[0].sort.kwargs
            for k, pool in pools.items():
                has_it = KNOCKOUTS[k][1](sort)
                times[k] = pool.apply(_product_knocked, ((k, (M, E, K, N)),)) if has_it else float("nan")
            floor = row.byte_floor_us(bw)
            cells = ["–" if math.isnan(t) else f"{t:.1f}" for t in times.values()]  # –: no such launch or work
            product.append([E, K, N, M, f"{floor:.1f}"] + cells
                           + [f"{times['new'] / floor:.2f}x",
                              f"{qbytes / (times['new'] - times['sort+fill']) / 1e3:.0f}"])
            heads_p = list(times)
            _write(args.out, t0, bw, alone, heads_p, product)  # row by row: a run cut short keeps its rows
    for pool in pools.values():
        pool.close()
        pool.join()
    print(Path(args.out).read_text())


def _write(out, t0, bw, alone, heads_p, product):
    lines = [f"<!-- python {shlex.join(sys.argv)}; torch {torch.__version__}, Triton "
             f"{triton.__version__}, {harness.gpu_name()}, {time.time() - t0:.0f} s -->", "",
             f"Copy bandwidth {bw / 1e9:.0f} GB/s (read + write counted).", ""]
    if alone:
        lines += ["## The quant alone", "", "| experts | topk | hidden | tokens | groups per program | none us | "
                  "none GB/s | float us | float GB/s |",
                  "|" + "---:|" * 9]
        lines += ["| " + " | ".join(map(str, c)) + " |" for c in alone] + ["", "## The product", ""]
    lines += ["| experts | topk | hidden | tokens | byte floor us | "
              + " | ".join(f"{h} us" for h in heads_p) + " | new / floor | quant GB/s |",
              "|" + "---:|" * (7 + len(heads_p))]
    lines += ["| " + " | ".join(map(str, c)) + " |" for c in product]
    Path(out).write_text("\n".join(lines) + "\n")

def _call(row, quant, zero, i):
    ids, w, x = row.sets[i % len(row.sets)]
    if quant:
        return kernel.moe_sort_mx_quant(ids, w, row.E, row.N, torch.bfloat16, 32, quant_input=x, quant_dtype=FP4,
                                        zero_moe_buf=zero)
    return kernel.moe_sort_mx_quant(ids, w, row.E, row.N, torch.bfloat16, 32, zero_moe_buf=zero)


if __name__ == "__main__":
    main()
