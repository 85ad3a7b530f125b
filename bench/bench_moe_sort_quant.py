"""Benchmark: patched MoE sort + moe_buf zero + MXFP4 quant, its decode methods, and AITER's own Triton chain.

GPU time per call from CUDA-graph replay of back-to-back calls, median of several replays, inputs
rotated over several sets; the byte floor (bytes that must move over the copy bandwidth measured in
the same run) per row, the launch floor (an empty Triton kernel's replay time) in the header. Columns:

* ``new``: the kernel as configured (module constants); ``path`` says which position method
  the row took (``compare``/``sort``: the E-independent decode methods, ``count``: the
  per-program expert count, ``prescanned``: four launches).
* ``old``: ``DECODE_MAX_PAIRS = 0`` (the code before the decode methods), ``sort`` and
  ``compare``: each decode method forced over the whole one-launch range (``compare`` only
  up to ``--compare-max-pairs``), so one run sets the thresholds.
* ``sort+zero``: the sort and ``moe_buf`` zero-fill alone (no quant), new and old.
* ``AITER chain``: AITER's Triton path per MoE layer (bench/aiter_triton.py: id fill, the
  four-launch aligner, an id conversion, the ``moe_buf`` zero-fill, the Triton MXFP4 sort-quant);
  ``AITER quant``: its quant launch alone on the chain's sorted ids. Timed only: on NVIDIA its
  scale bytes are not AITER's HIP bytes (design.md). Needs ``--aiter-src`` (or ``AITER_SRC``):
  a folder holding AITER's ``aiter/`` package, or at least ``aiter/ops/triton``.
* ``quant GB/s``: the quant part's bytes (activations in, codes and scale bytes out) over its time,
  ``new`` less ``sort+zero new`` (the same launches without the quant).

With ``--sglang`` (SGLang 0.5.23's wheel, or its ``moe_sorting_small.py`` taken out of it) a second table
times SGLang's one-launch decode sort + MXFP8 quant (``_run_small_sort``) beside ours, same inputs, same
run, wherever SGLang takes the shape (its quant where ``hidden % 2048 == 0``, as its ``fused_moe`` wrapper
decides, else the sort and zero-fill alone), and compares both kernels' outputs bit for bit. The module
is read from the wheel at run time (``sglang.srt.utils.is_gfx95_supported`` stubbed), never vendored.

    python bench/bench_moe_sort_quant.py --aiter-src .aiter_src --sglang .sglang/moe_sorting_small.py \
        --prefill --out docs/bench/moe_sort_quant_h200.md
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import multiprocessing
import os
import shlex
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiter_patches.kernels import moe_sort_mx_quant as kernel  # noqa: E402
from aiter_patches.kernels.moe_sort_mx_quant import moe_sort_mx_quant  # noqa: E402
from aiter_patches.reference.mx_quant import mx_scale_swizzle_index  # noqa: E402
from bench import harness  # noqa: E402

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DECODE = TOKENS  # the name bench/bench_vs_aiter_rocm.py reads the decode token counts by
PREFILL = [2048, 8192, 32768]
MODELS = [(256, 8, 7168), (896, 16, 3584), (128, 4, 6144), (128, 8, 4096)]
BLOCK = 32
SETS = 3
FP4 = torch.float4_e2m1fn_x2
FP8 = torch.float8_e4m3fn
SGLANG_MEMBER = "sglang/kernels/ops/moe/moe_sorting_small.py"
SGLANG_SHAPES = [(128, 4, 6144), (128, 8, 4096), (256, 8, 4096), (256, 8, 7168), (896, 16, 3584)]
SGLANG_TOKENS = [1, 2, 4, 8, 16, 32]
DEV = "cuda"  # tests run the whole table on CPU (interpreter) with graph_us replaced
_ALL = kernel.ONE_LAUNCH_MAX_PAIRS
FORCED = {  # module constants per measured method (the rest as configured)
    "old": dict(DECODE_MAX_PAIRS=0, DECODE_PAIRS_PER_BIN=0, ONE_LAUNCH_MAX_PAIR_BINS=1 << 30),
    "sort": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=0),
    "sort-16w": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=0, DECODE_NUM_WARPS=16),
    "compare": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=_ALL),
    # issue 16's candidates (--candidates): each decides one constant, see the table's notes
    "main": dict(TOKEN_BUCKETS=(4, 16, 64, 256, 1024), DECODE_MAX_PAIRS=256, DECODE_PAIRS_PER_BIN=0,
                 DECODE_COMPARE_MAX_PAIRS=0,
                 DECODE_SORT_SELECT=False, DECODE_NUM_WARPS=0, COUNT_GATHER=False,
                 DEFER_QUANT_MATH=False, QUANT_ONE_STEP_GROUPS=32),  # the constants before issue 16's round
    "coarse": dict(TOKEN_BUCKETS=(4, 16, 64, 256, 1024)),
    "sort-reload": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=0, DECODE_SORT_SELECT=False),
    "sort-8w": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=0, DECODE_NUM_WARPS=8),
    "compare-8w": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=_ALL, DECODE_NUM_WARPS=8),
    "compare-16k": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=_ALL, DECODE_COMPARE_TILE=16384),
    "old-onehot": dict(DECODE_MAX_PAIRS=0, DECODE_PAIRS_PER_BIN=0, COUNT_GATHER=False, ONE_LAUNCH_MAX_PAIR_BINS=1 << 30),
    # the buckets of one and two tokens (git show 7977657:docs/bench/moe_sort_quant_buckets_h200.md)
    "prev": dict(TOKEN_BUCKETS=(4, 8, 16, 32, 64, 256, 1024)),
    # fewer warps, and the row work's split (more programs per row)
    "w1": dict(DECODE_NUM_WARPS=1),
    "w2": dict(DECODE_NUM_WARPS=2),
    "compare-1w": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=_ALL, DECODE_NUM_WARPS=1),
    "compare-2w": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=_ALL, DECODE_NUM_WARPS=2),
    "sort-2w": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=0, DECODE_NUM_WARPS=2),
    "old-2w": dict(DECODE_MAX_PAIRS=0, DECODE_PAIRS_PER_BIN=0, COUNT_NUM_WARPS=2),
    "old-8w": dict(DECODE_MAX_PAIRS=0, DECODE_PAIRS_PER_BIN=0, COUNT_NUM_WARPS=8),
    "split512": dict(ROW_SPLIT_PROGRAMS=512),
    # the row quant's schedule (DEFER_QUANT_MATH, QUANT_ONE_STEP_GROUPS): the constants before it, and each half
    "prev-quant": dict(DEFER_QUANT_MATH=False, QUANT_ONE_STEP_GROUPS=32),
    "no-defer": dict(DEFER_QUANT_MATH=False),
    "one-step-32": dict(QUANT_ONE_STEP_GROUPS=32),
    "loop-128": dict(QUANT_GROUPS=128),
    # the transposed comparison: off, with 4 or 16 warps, and up to 128 padded pairs in one 16384-element tile
    "no-compare-t": dict(DECODE_COMPARE_T_MIN_PAIRS=_ALL * 2),
    "compare-t-4w": dict(DECODE_COMPARE_T_WARPS=4),
    "compare-t-16w": dict(DECODE_COMPARE_T_WARPS=16),
    "compare-t-128": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=128, DECODE_COMPARE_TILE=16384),
    "compare-t-128-16w": dict(DECODE_MAX_PAIRS=_ALL, DECODE_COMPARE_MAX_PAIRS=128, DECODE_COMPARE_TILE=16384,
                              DECODE_COMPARE_T_WARPS=16),
    # issue 34: the row work in data programs of its own (split roles), and its shares
    "no-roles": dict(ROLES_MAX_PAIRS=0, ROLES_PRESCANNED=False),
    "roles-decode": dict(ROLES_MAX_PAIRS=64, ROLES_PRESCANNED=False),
    "roles-one": dict(ROLES_MAX_PAIRS=_ALL, ROLES_PRESCANNED=False),
    "route-div2": dict(ROUTE_SPLIT_DIV=2),
    "route-div4": dict(ROUTE_SPLIT_DIV=4),
    "route-div16": dict(ROUTE_SPLIT_DIV=16),
    "data-16": dict(DATA_MAX_GROUPS=16),
    "data-32": dict(DATA_MAX_GROUPS=32),
    "data-64": dict(DATA_MAX_GROUPS=64),
    "data-128": dict(DATA_MAX_GROUPS=128),
    "split256": dict(ROW_SPLIT_PROGRAMS=256),
    "split64": dict(ROW_SPLIT_PROGRAMS=64),
    "w8": dict(DECODE_NUM_WARPS=8),
    "count-8w": dict(COUNT_NUM_WARPS=8),  # the one-launch count only
    "wide512": dict(WIDE_ROW_ELEMS=512),  # 8 warps for every quant step
    # the prescanned launches (rank, scan, sort) from 17 pairs on, with rank chunks of 512, 128 and 64 pairs (more
    # rank programs at a few thousand pairs); `one`: the one-launch path to 2048 pairs whatever the experts;
    # `bins20`: to 2^20 pair-bins; `c512`, `c128`: the small batches' rank chunks of 512, 128 pairs
    "pre": dict(ONE_LAUNCH_MAX_PAIRS=16, SMALL_BATCH_CHUNK_PAIRS=512),
    "pre-c128": dict(ONE_LAUNCH_MAX_PAIRS=16, SMALL_BATCH_CHUNK_PAIRS=128),
    "pre-c64": dict(ONE_LAUNCH_MAX_PAIRS=16, SMALL_BATCH_CHUNK_PAIRS=64),
    "one": dict(ONE_LAUNCH_MAX_PAIR_BINS=1 << 30),
    "bins20": dict(ONE_LAUNCH_MAX_PAIR_BINS=1 << 20),
    "c512": dict(SMALL_BATCH_CHUNK_PAIRS=512),
    "c128": dict(SMALL_BATCH_CHUNK_PAIRS=128),
    "chunk1024": dict(CHUNK_PAIRS=1024),  # prefill's rank chunks
    "chunk256": dict(CHUNK_PAIRS=256),
}
CANDIDATES = "main,coarse,old,old-onehot,sort,sort-reload,sort-8w,sort-16w,compare,compare-8w,compare-16k,prev"


@contextlib.contextmanager
def constants(values: dict):
    saved = {k: getattr(kernel, k) for k in values}
    for k, v in values.items():
        setattr(kernel, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(kernel, k, v)


def graph_time_us(fn, calls: int, replays: int = 7) -> float:
    """Median per-call time of ``calls`` back-to-back ``fn(i)`` captured in one CUDA graph."""
    return harness.graph_us([functools.partial(fn, i) for i in range(calls)], calls, replays)


def make_inputs(M, K, E, N, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.argsort(torch.rand(M, E, device=DEV, generator=g), dim=1)[:, :K].int().contiguous()
    w = torch.rand(M, K, device=DEV, generator=g) + 0.01
    x = (torch.randn(M, N, device=DEV, generator=g) + 0.1).bfloat16()
    return ids, w, x


def warm_call(fn, calls: int) -> float:
    """A warm-up worker's stand-in for the timer: one call, so that Triton compiles (and caches)."""
    fn(0)
    if DEV == "cuda":
        torch.cuda.synchronize()
    return 0.0


class Row:
    """Every timing of one (model, tokens); kernels of the same method are timed once."""

    def __init__(self, M, E, K, N, timer=graph_time_us, qd=FP4):
        self.M, self.E, self.K, self.N, self.qd = M, E, K, N, qd
        self.sets = [make_inputs(M, K, E, N, s) for s in range(SETS)]
        self.calls = 40 if M <= 1024 else 6
        self.timer = timer
        self._seen: dict[tuple[str, bool], float] = {}

    def variant(self, quant: bool) -> tuple:
        """What the module constants choose for this row (the launch's batch-derived constexprs,
        grid split and warps): candidates that choose the same are timed once."""
        M, K, E, N = self.M, self.K, self.E, self.N
        g_pad = kernel._next_pow2(N // 32) if quant else 1
        batch = kernel._batch_params(M, K, kernel.expert_bin_count(E), kernel._next_pow2(K), g_pad, quant, N)
        path = kernel.decode_path(M, K, E)
        chunk = kernel._chunk_tokens(M, K, kernel.expert_bin_count(E)) if path == "prescanned" else 0  # the rank launch's
        return (path, quant and self.qd, tuple(sorted(batch.items())), kernel.DEFER_QUANT_MATH, chunk,
                kernel.sort_warps(batch))

    def pairs_pad(self) -> int:
        """The decode methods' padded pair count for this row (0 on the other paths)."""
        batch = kernel._batch_params(self.M, self.K, kernel.expert_bin_count(self.E), kernel._next_pow2(self.K),
                                     1, False, self.N)
        return batch["PAIRS_PAD"] if batch["DECODE"] else 0

    def patched(self, values: dict, quant: bool) -> tuple[str, float]:
        with constants(values):
            key = self.variant(quant)
            path = key[0]
            if key not in self._seen:
                self._seen[key] = self.timer(functools.partial(self.ours, quant), self.calls)
            return path, self._seen[key]

    def ours(self, quant: bool, i: int):
        ids, w, x = self.sets[i % SETS]
        if quant:
            return moe_sort_mx_quant(ids, w, self.E, self.N, torch.bfloat16, BLOCK, quant_input=x, quant_dtype=self.qd)
        return moe_sort_mx_quant(ids, w, self.E, self.N, torch.bfloat16, BLOCK)

    def aiter(self, ops) -> tuple[float, float]:
        from bench import aiter_triton

        E, N = self.E, self.N

        def chain(i):
            ids, w, x = self.sets[i % SETS]
            aiter_triton.chain(ops, ids, x, E, BLOCK, N)

        sorted_sets = [aiter_triton.sort(ops, ids, E, BLOCK) for ids, _, _ in self.sets]

        def quant(i):
            sid, _, post_pad = sorted_sets[i % SETS]
            aiter_triton.stage1_quant(ops, self.sets[i % SETS][2], sid, post_pad, BLOCK)

        calls = max(self.calls // 2, 4)
        return self.timer(chain, calls), self.timer(quant, calls)

    def quant_bytes(self, quant: bool = True) -> int:
        """Bytes the quant part must move: activations in, codes and scale bytes out."""
        MN = self.M * self.N
        if not quant or self.qd is None:
            return 0
        return MN * 2 + (MN // 2 if self.qd == FP4 else MN) + self.M * self.K * self.N // 32

    def byte_floor_us(self, bandwidth, quant: bool = True):
        pairs, MN = self.M * self.K, self.M * self.N
        moved = (pairs * 8  # ids + weights in
                 + pairs * 8  # sorted ids + weights out (padding not counted)
                 + MN * 2  # moe_buf zeroed (bf16, model_dim = N)
                 + self.quant_bytes(quant))
        return moved / bandwidth * 1e6


def _fmt(x):
    return "–" if x is None else f"{x:.2f}"


def row_cells(row: Row, methods, compare_max_pairs: int, ops, bandwidth: float) -> list[str]:
    E, K, N, M = row.E, row.K, row.N, row.M
    path, t_new = row.patched({}, True)
    cells = [str(E), str(K), str(N), str(M), path, _fmt(t_new)]
    for m in methods:
        skip = m.startswith("compare") and M * K > compare_max_pairs
        cells.append("–" if skip else _fmt(row.patched(FORCED[m], True)[1]))
    t_sz = row.patched({}, False)[1]
    cells += [_fmt(t_sz), _fmt(row.patched(FORCED["old"], False)[1])]
    if ops is not None:
        t_chain, t_quant = row.aiter(ops)
        cells += [_fmt(t_chain), _fmt(t_quant), f"{t_chain / max(t_new, 1e-9):.1f}x"]
    floor = row.byte_floor_us(bandwidth)
    cells += [_fmt(floor), f"{t_new / max(floor, 1e-9):.1f}x"]
    cells.append(f"{row.quant_bytes() / max(t_new - t_sz, 1e-3) / 1e3:.0f}" if t_new > t_sz else "–")
    with constants(FORCED["sort"]):
        cells.append(str(row.pairs_pad()))
    return cells


def verdict(lines: list[str], heads: list[str], methods: list[str]) -> list[str]:
    """Which constant each candidate column decides, read off the table: per padded pair count
    (the forced methods' ``PAIRS_PAD``), the fastest forced method in most rows."""
    col = {h: i for i, h in enumerate(heads)}
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    need = [m for m in ("compare", "sort", "old") if m in methods]
    if len(need) < 2:
        return []
    by_pp: dict[int, list[str]] = {}
    for r in rows:
        pp = int(r[col["pairs pad"]])
        times = {m: float(r[col[f"{m} us"]]) for m in need if r[col[f"{m} us"]] != "–"}
        if pp and times:
            by_pp.setdefault(pp, []).append(min(times, key=times.get))
    out = ["", "Fastest forced method per padded pair count (rows won): "
           + "; ".join(f"{pp}: " + ", ".join(f"{m} {v.count(m)}" for m in need if v.count(m))
                       for pp, v in sorted(by_pp.items())) + "."]

    def wins(a, b):  # rows where column a is faster than column b, of rows timing both
        both = [(float(r[col[f"{a} us"]]), float(r[col[f"{b} us"]])) for r in rows
                if r[col[f"{a} us"]] != "–" and r[col[f"{b} us"]] != "–"]
        return sum(x < y for x, y in both), len(both)

    methods = ["new", *methods]  # `new us` is a column of every table
    for a, b, what in (("sort", "sort-reload", "DECODE_SORT_SELECT True (sort) vs False (sort-reload)"),
                       ("sort-8w", "sort", "DECODE_NUM_WARPS 8 vs 0, sort"),
                       ("sort-16w", "sort", "DECODE_NUM_WARPS 16 vs 0, sort"),
                       ("compare-8w", "compare", "DECODE_NUM_WARPS 8 vs 0, compare"),
                       ("compare-16k", "compare", "DECODE_COMPARE_TILE 16384 vs the default"),
                       ("old", "old-onehot", "COUNT_GATHER True (old) vs False (old-onehot), the count"),
                       ("coarse", "main", "coarse buckets with this round's methods vs main"),
                       ("new", "prev", "TOKEN_BUCKETS from 1 token (new) vs from 4 (prev)")):
        if a in methods and b in methods:
            n, of = wins(a, b)
            out.append(f"`{a}` faster than `{b}` in {n} of {of} rows ({what}).")
    return out


# ------------------------------------------------------------------ SGLang 0.5.23's one-launch decode sort

def load_sglang(path: str):
    """SGLang's ``moe_sorting_small`` module from its wheel (or that one file taken out of it), under a
    minimal ``sglang`` package in a temporary folder whose ``sglang.srt.utils.is_gfx95_supported`` is
    a stub (the only other name the file imports): read at run time, never installed or vendored."""
    path = Path(path)
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            src = z.read(SGLANG_MEMBER).decode()
    else:
        src = path.read_text()
    root = Path(tempfile.mkdtemp(prefix="sglang_small_"))
    for pkg in ("sglang", "sglang/srt", "sglang/kernels", "sglang/kernels/ops", "sglang/kernels/ops/moe"):
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "sglang/srt/utils.py").write_text("def is_gfx95_supported():\n    return True\n")
    (root / SGLANG_MEMBER).write_text(src)
    sys.path.insert(0, str(root))
    return importlib.import_module("sglang.kernels.ops.moe.moe_sorting_small")


def sglang_qd(N: int):  # what SGLang's fused_moe wrapper hands its sort: MXFP8 where hidden % 2048 == 0
    return FP8 if N % 2048 == 0 else None


def sglang_takes(sg, row: Row) -> bool:
    ids = row.sets[0][0]
    return bool(sg._small_sort_supported(ids, BLOCK, None, None, row.E, emit_mx=row.qd is not None))


def sglang_call(sg, row: Row, i: int):
    """One call as SGLang's ``_moe_sorting_impl`` wrapper makes it: AITER-sized outputs, then ``_run_small_sort``."""
    ids, w, x = row.sets[i % SETS]
    M, K = ids.shape
    n_sorted, n_blocks = kernel.sort_sizes(M, K, row.E, BLOCK)
    sid = torch.empty(n_sorted, dtype=torch.int32, device=ids.device)
    sw = torch.empty(n_sorted, dtype=torch.float32, device=ids.device)
    seid = torch.empty(n_blocks, dtype=torch.int32, device=ids.device)
    nv = torch.empty(2, dtype=torch.int32, device=ids.device)
    buf = torch.empty(M, row.N, dtype=torch.bfloat16, device=ids.device)
    q = sg._run_small_sort(ids, w, sid, sw, seid, nv, buf, BLOCK, x if row.qd is not None else None, row.E)
    return kernel.SortQuantResult(sid, sw, seid, nv, buf, q)


def same_bits(a, b, K: int, N: int) -> bool:
    """Both results equal over the bytes AITER defines: ``num_valid_ids``, the sorted range and its
    block experts, ``moe_buf``, the codes, and the scale bytes of every real pair's sorted row."""
    if not torch.equal(a.num_valid_ids, b.num_valid_ids):
        return False
    nv = int(a.num_valid_ids[0])
    same = (torch.equal(a.sorted_ids[:nv], b.sorted_ids[:nv])
            and torch.equal(a.sorted_weights[:nv].view(torch.int32), b.sorted_weights[:nv].view(torch.int32))
            and torch.equal(a.sorted_expert_ids[:nv // BLOCK], b.sorted_expert_ids[:nv // BLOCK])
            and torch.equal(a.moe_buf.view(torch.int16), b.moe_buf.view(torch.int16)))
    if a.quant is None or b.quant is None:
        return same and a.quant is None and b.quant is None
    rows = torch.arange(nv, device=a.sorted_ids.device)[(a.sorted_ids[:nv] >> 24) < K]
    idx = mx_scale_swizzle_index(rows[:, None], torch.arange(N // 32, device=rows.device)[None, :],
                                 a.quant[1].shape[1])
    sa, sb = a.quant[1].view(torch.uint8).reshape(-1), b.quant[1].view(torch.uint8).reshape(-1)
    return (same and torch.equal(a.quant[0].view(torch.uint8), b.quant[0].view(torch.uint8))
            and torch.equal(sa[idx], sb[idx]))


def sglang_cells(sg, row: Row, methods, bandwidth: float) -> list[str] | None:
    """One row of the SGLang table, or None where SGLang does not take the shape."""
    if not sglang_takes(sg, row):
        return None
    quant = row.qd is not None
    path = row.patched({}, quant)[0]
    ours, theirs = functools.partial(row.ours, quant), functools.partial(sglang_call, sg, row)
    times = [row.timer(f, row.calls) for f in (ours, theirs, ours, theirs)]  # alternated: each timed twice
    t_new, t_sg = (times[0] + times[2]) / 2, (times[1] + times[3]) / 2
    spread = max(abs(times[0] - times[2]), abs(times[1] - times[3]))
    same = all(same_bits(row.ours(quant, i), sglang_call(sg, row, i), row.K, row.N) for i in range(SETS))
    cells = [str(row.E), str(row.K), str(row.N), "MXFP8" if quant else "sort only", str(row.M), path,
             _fmt(t_new), _fmt(t_sg), f"{t_new / max(t_sg, 1e-9):.2f}", _fmt(spread)]
    cells += [_fmt(row.patched(FORCED[m], quant)[1]) for m in methods]
    return cells + ["same" if same else "DIFFER", _fmt(row.byte_floor_us(bandwidth, quant))]


def _warm(job):
    """Worker: run every call of its rows once (no timing), filling Triton's cache for the timer."""
    global DEV
    shapes, sg_shapes, aiter_src, sglang, methods, sg_methods, compare_max_pairs, DEV = job
    ops = aiter_triton_ops(aiter_src)
    for E, K, N, M in shapes:
        row_cells(Row(M, E, K, N, timer=warm_call), methods, compare_max_pairs, ops, 1e12)
    sg = load_sglang(sglang) if sglang else None
    for E, K, N, M in sg_shapes:
        row = Row(M, E, K, N, timer=warm_call, qd=sglang_qd(N))
        if sglang_takes(sg, row):
            sglang_cells(sg, row, sg_methods, 1e12)


def sglang_table(sg, sg_shapes, methods, bandwidth) -> list[str]:
    heads = ["experts", "topk", "hidden", "quant", "tokens", "path", "ours us", "SGLang us", "ours / SGLang",
             "spread us"]
    heads += [f"{m} us" for m in methods] + ["bits", "byte floor us"]
    out = ["", "## Beside SGLang 0.5.23's `_run_small_sort`", "",
           "Same inputs, same run, wherever SGLang takes the shape (MXFP8 where hidden % 2048 == 0, else the sort "
           "and moe_buf zero-fill alone). `ours` and `SGLang`: the mean of two timings each, alternated (ours, SGLang, "
           "ours, SGLang); `spread`: the larger difference between a kernel's two timings. `bits`: both kernels' "
           "outputs compared over every input set. Columns after `spread`: ours with those constants.", "",
           "| " + " | ".join(heads) + " |", "|" + "---:|" * len(heads)]
    print(out[-2], flush=True)
    for E, K, N, M in sg_shapes:
        cells = sglang_cells(sg, Row(M, E, K, N, qd=sglang_qd(N)), methods, bandwidth)
        if cells is not None:
            out.append("| " + " | ".join(cells) + " |")
            print(out[-1], flush=True)
    return out


def aiter_triton_ops(aiter_src):
    from bench import aiter_triton

    return aiter_triton.load(aiter_src) if aiter_src else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--aiter-src", default=os.environ.get("AITER_SRC"),
                    help="folder with AITER's aiter/ package (or aiter/ops/triton); default $AITER_SRC; "
                         "without it the AITER columns are left out")
    ap.add_argument("--methods", default="old,sort,compare", help="forced methods to time besides `new`")
    ap.add_argument("--candidates", action="store_true",
                    help=f"time issue 16's candidate constants (--methods {CANDIDATES}) and add a verdict")
    ap.add_argument("--compare-max-pairs", type=int, default=512,
                    help="time the forced comparison only up to this many routing pairs")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--prefill", action="store_true", help=f"also {PREFILL} tokens")
    ap.add_argument("--models", default="all", help="indices into MODELS, e.g. 0,1")
    ap.add_argument("--warm-jobs", type=int, default=8,
                    help="processes that compile every variant before the timing (1: compile while timing)")
    ap.add_argument("--sglang", help="SGLang 0.5.23's wheel or its moe_sorting_small.py: add the SGLang table")
    ap.add_argument("--sglang-tokens", default=",".join(map(str, SGLANG_TOKENS)))
    ap.add_argument("--sglang-methods", default="", help="forced constants to time for ours in the SGLang table")
    args = ap.parse_args()
    t_start = time.time()

    ops = aiter_triton_ops(args.aiter_src)
    methods = [m for m in (CANDIDATES if args.candidates else args.methods).split(",") if m]
    sg_methods = [m for m in args.sglang_methods.split(",") if m]
    models = MODELS if args.models == "all" else [MODELS[int(i)] for i in args.models.split(",")]
    tokens = [int(t) for t in args.tokens.split(",") if t] + (PREFILL if args.prefill else [])
    sg_shapes = [(E, K, N, M) for E, K, N in SGLANG_SHAPES for M in map(int, args.sglang_tokens.split(","))
                 ] if args.sglang else []
    floor_us = harness.launch_floor_us()
    bandwidth = harness.copy_bandwidth()

    heads = ["experts", "topk", "hidden", "tokens", "path", "new us"] + [f"{m} us" for m in methods]
    heads += ["sort+zero new us", "sort+zero old us"]
    if ops is not None:
        heads += ["AITER chain us", "AITER quant us", "AITER chain / new"]
    heads += ["byte floor us", "new / floor", "quant GB/s", "pairs pad"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---:|" * len(heads)]
    print(lines[0], flush=True)
    shapes = [(E, K, N, M) for E, K, N in models for M in tokens]
    if args.warm_jobs > 1:  # compile every variant in parallel processes first (Triton's disk cache)
        t0 = time.time()
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(args.warm_jobs) as pool:
            pool.map(_warm, [(shapes[i::args.warm_jobs], sg_shapes[i::args.warm_jobs], args.aiter_src, args.sglang,
                              methods, sg_methods, args.compare_max_pairs, DEV) for i in range(args.warm_jobs)])
        print(f"compiled in {time.time() - t0:.0f} s by {args.warm_jobs} processes", flush=True)
    for E, K, N, M in shapes:
        row = Row(M, E, K, N)
        lines.append("| " + " | ".join(row_cells(row, methods, args.compare_max_pairs, ops, bandwidth)) + " |")
        print(lines[-1], flush=True)
        del row
    notes = verdict(lines, heads, methods)
    if args.sglang:
        notes += sglang_table(load_sglang(args.sglang), sg_shapes, sg_methods, bandwidth)
    wall = time.time() - t_start
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    header = [
        f"<!-- Produced by: {command}",
        f"     torch {torch.__version__}, Triton {__import__('triton').__version__}, {wall:.0f} s wall."
        f" Kernel constants: DECODE_MAX_PAIRS {kernel.DECODE_MAX_PAIRS}, DECODE_PAIRS_PER_BIN "
        f"{kernel.DECODE_PAIRS_PER_BIN}, DECODE_COMPARE_MAX_PAIRS "
        f"{kernel.DECODE_COMPARE_MAX_PAIRS}, DECODE_COMPARE_TILE {kernel.DECODE_COMPARE_TILE}, DECODE_SORT_SELECT "
        f"{kernel.DECODE_SORT_SELECT}, DECODE_NUM_WARPS {kernel.DECODE_NUM_WARPS}, TOKEN_BUCKETS "
        f"{kernel.TOKEN_BUCKETS}, ONE_LAUNCH_MAX_PAIRS {kernel.ONE_LAUNCH_MAX_PAIRS}, ONE_LAUNCH_MAX_PAIR_BINS "
        f"{kernel.ONE_LAUNCH_MAX_PAIR_BINS}, CHUNK_PAIRS {kernel.CHUNK_PAIRS}, SMALL_BATCH_CHUNK_PAIRS "
        f"{kernel.SMALL_BATCH_CHUNK_PAIRS}, DEFER_QUANT_MATH "
        f"{kernel.DEFER_QUANT_MATH}, QUANT_ONE_STEP_GROUPS {kernel.QUANT_ONE_STEP_GROUPS}, QUANT_GROUPS "
        f"{kernel.QUANT_GROUPS}, ROLES_MAX_PAIRS {kernel.ROLES_MAX_PAIRS}, PRESCAN_TILE_STARTS "
        f"{kernel.PRESCAN_TILE_STARTS}. -->",
        "",
        f"# MoE sort + zero + MXFP4 quant on {harness.gpu_name()}",
        "",
        f"CUDA-graph replay, median per call (us); block_size {BLOCK}; launch floor (empty Triton kernel) "
        f"{floor_us:.2f} us; copy bandwidth {bandwidth / 1e9:.0f} GB/s. `new`: the kernel as configured, "
        "`path` the method it took; `old`: DECODE_MAX_PAIRS = 0 (per-program expert count); `sort`, "
        "`compare`: that decode method forced; `sort+zero`: no quant. AITER chain: AITER's Triton "
        "aligner + id conversion + moe_buf zero + Triton MXFP4 sort-quant (timed, bytes not compared). "
        "`pairs pad`: the decode methods' padded pair count (`PAIRS_PAD`, from the token bucket's ceiling; "
        "0: not a decode row). `new / floor`: `new` over the byte floor; `quant GB/s`: see the script's docstring. "
        "Candidates (module constants, the rest as configured): "
        + "; ".join(f"`{m}`: " + ", ".join(f"{k} = {v}" for k, v in FORCED[m].items()) for m in methods) + ".",
        "",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(header + lines + notes) + "\n")
    print(f"wrote {args.out} in {wall:.0f} s")


if __name__ == "__main__":
    main()
