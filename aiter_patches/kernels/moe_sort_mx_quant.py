"""MoE sort + moe_buf fill + stage-1 MX quant in one Triton launch (four for large batches).

Why: at decode sizes AITER spends a sort launch (two below 2048 tokens), a zero-fill inside it
and one or two quant launches on a few hundred bytes of routing data. Here one grid does it all:
program ``t`` owns token ``t``. It counts every expert's pairs (one-hot sums over all routing
ids, read from L2) to get each padded segment's start, counts the pairs of its own experts
before its token, and writes its ``topk`` entries of ``sorted_ids``/``sorted_weights``/
``sorted_expert_ids``, the padding after an expert's last pair (when it owns that pair), its
e8m0 scale bytes at the swizzled sorted-row addresses, its quantized data row and its
``moe_buf`` row. No program waits for another.

Decode (a token bucket whose ceiling has at most ``DECODE_MAX_PAIRS`` pairs, or
``DECODE_PAIRS_PER_BIN`` per expert bin where that is more, from ``DECODE_PER_BIN_MIN_BINS`` bins: the
count below grows with ``E``)
costs nothing per expert: each program works on all pairs itself, and its cost is one program's latency (every
program repeats it: no program waits for another). Two methods, judged on the bucket ceiling's
pair count padded to a power of two (``PAIRS_PAD``):

* compare (up to ``DECODE_COMPARE_MAX_PAIRS``): every pair against every other in
  ``[CH, PAIRS_PAD]`` tiles (one tile up to ``DECODE_COMPARE_TILE`` elements), two reductions
  per tile that each sum packed fields: per pair its expert's count and later pairs (so its
  padding, on its expert's last pair), then per own slot the rows before it and its padding.
  No sort stages, no ``E``; ALU grows with the pairs squared. From ``DECODE_COMPARE_T_MIN_PAIRS`` the
  per-pair tile is ``[PAIRS_PAD, CH]``, reduced over its rows, so that its sums come out in the layout
  the own-slot tile broadcasts (no conversion between the two reductions), with its own warps.
* sort: ``tl.sort`` of all pairs by ``(expert << bits) | pair``; segment starts and last pairs
  from adjacent differences of the sorted experts; segments start at multiples of the block
  size, so a pair's row is its sorted index plus the padding of the segments before it. A
  program's own slots then take their row and padding from the sorted vectors by one
  select (``DECODE_SORT_SELECT``; a sorted key's low bits name its pair), or by counting the
  keys below theirs over reloaded ids.

Empty experts get no block, so nothing is ``E`` wide but the EP local-id prefix of
``expert_mask``, done only when a mask is given. ``DECODE_NUM_WARPS`` sets a decode launch's
warps (0: those the row work picks). Above that, each program counts the pairs of
every expert bin (one-hot sums or a histogram), which grows with ``E``, and reads its own
experts' segment starts with ``tl.gather`` (``COUNT_GATHER``; else one-hot sums).
bench/bench_moe_sort_quant.py ``--candidates`` times every choice of these constants.

Variants: every constexpr derived from the batch is chosen for the ceiling of the token count's
bucket (``TOKEN_BUCKETS``, ``_batch_params``), the token count and the block size are runtime
arguments (padding is written in a loop of ``PAD_STEP``-wide masked tiles), so one model configuration
compiles a fixed few variants whatever batch sizes and block sizes a server runs.

Large batches (more than ``ONE_LAUNCH_MAX_PAIRS`` pairs, or fewer with many experts:
``ONE_LAUNCH_MAX_PAIR_BINS``) take three launches (four with the split-semantics quant,
``launch_count``), so that no
program counts anything: per chunk of tokens, the expert counts and each pair's rank among the
chunk's earlier pairs of its expert (a sort of the chunk by expert); an exclusive scan of the
counts over chunks; the same per-token kernel, now reading those tables (one cumsum over the
experts per program for the segment starts); and, for AITER's split quant semantics, a launch
that moves each token's compact scale row to its sorted rows in whole 32-row tiles of the
swizzled layout (one-byte scattered stores from every token were the prefill's bottleneck).

Semantics are those of ``aiter_patches.reference.moe_sorting`` and ``...reference.mx_quant``
(out-of-range expert ids dropped; ``num_local_tokens`` read on the device, clamped to
``[0, M]`` for routing and zeroing, written as given to ``num_valid_ids[1]`` and the padding
ids). ``moe_buf`` rows ``< T`` are zeroed (or take ``moe_buf_init``'s rows), rows past ``T``
are untouched. Quant semantics (``quant_semantics``): "fused" = AITER's fused stage-1
kernel (zero-weight pairs get scale 0 and, when all of a token's pairs have weight 0, a zero
data row; with ``T < M`` the padding rows get scale 0 and data row ``T`` is zeroed), "split" =
AITER's split path (every real pair gets its token's scales); "auto" picks like AITER does
(fused when ``M * topk <= 2048``).

Split roles (up to ``ROLES_MAX_PAIRS`` pairs): the grid's columns from ``ROUTE_PROGRAMS`` on are data
programs, each one slice of a token's row (``G_DTILE`` groups: codes, and ``moe_buf``'s columns), which
read no routing, so their stores wait for no routing math; the routing programs before them write the
sort outputs and the scale bytes at the sorted rows (their own ``G_TILE`` share of the group maxima).
Without split roles, a program does both for its share. In a routing program the row work (``moe_buf``
fill and the quant of a program's share of a row, ``G_TILE`` groups) comes first so that its loads
overlap the routing math; a share of up to ``QUANT_ONE_STEP_GROUPS`` groups is
loaded before the routing and quantized after it (``DEFER_QUANT_MATH``), a wider one ``QUANT_GROUPS`` at
a time after it.

Everything is integer arithmetic on fp32 bit patterns, or float operations whose results are exact
under round-to-nearest-even whatever the flush mode (products by powers of two, a max, an add that rounds to an
integer: ``_mx_quant_groups``), so results are bit-exact on NVIDIA, AMD and the Triton
interpreter. The launch path never syncs: no ``.item()``, only
``torch.empty`` allocations, so it can be captured in a CUDA graph.

Host time (issue 15): what a call derives from its shape (sizes, grids, scalars, constexprs) is
kept per shape in a plan (``_plans``, keyed on exactly what that derivation reads, the tuning
constants included), and its launches are ``fast_launch.Prepared`` ones; a plan holds Python
values only, never a tensor.
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from .. import aiter_contract as contract
from ..reasons import with_values
from .fast_launch import Prepared, launch, run_prepared


# One launch while each program's redundant count of all pairs stays short; above it three
# small launches build the tables first, per chunk of ~CHUNK_PAIRS pairs.
ONE_LAUNCH_MAX_PAIRS = 2048
# ... and while the count's work, pairs x expert bins, stays within this (past the decode methods' pairs): the count
# reads every pair into every bin. H100, same run, against the prescanned launches with 64-pair rank chunks (below):
# (896, 16) 128 tokens (2048 pairs x 1024 bins) 17.9 -> 11.1 µs, 64 tokens (1024 x 1024) 9.9 -> 9.1, (256, 8) 256
# tokens (2048 x 512) 16.8 -> 15.6; 1024 x 512 ((256, 8) 128 tokens) keeps the count, 10.4 against 12.4
# (docs/bench/moe_sort_quant_candidates_h200.md, issue 34)
ONE_LAUNCH_MAX_PAIR_BINS = 1 << 19
FUSED_QUANT_MAX_PAIRS = contract.STAGE1_FUSED_MAX_PAIRS  # AITER fuses the stage-1 quant up to it ("auto")
CHUNK_PAIRS = 512
# ... of at most this many pairs in token buckets up to SMALL_BATCH_MAX_TOKENS: more rank programs where a few
# thousand pairs would make 4-8 chunks (H100, same run: (896, 16) 128 and 256 tokens 12.3 -> 11.1 and 12.6 -> 11.5 µs;
# 128-pair chunks 11.2 and 11.7); prefill keeps CHUNK_PAIRS, whose scan walks chunks one after another
SMALL_BATCH_CHUNK_PAIRS = 64
SMALL_BATCH_MAX_TOKENS = 256
SMALL_BATCH_MIN_CHUNK_TOKENS = 4  # ... and never fewer tokens than this (measured: topk 8, 9, 16: 8, 4, 4 tokens)
# Decode: up to DECODE_MAX_PAIRS pairs every program sorts all pairs itself (work independent of
# the expert count), by comparing every pair with every other up to DECODE_COMPARE_MAX_PAIRS
# (padded) pairs, by tl.sort above; 0 turns either off. Judged on the bucket's ceiling (padded to a
# power of two). bench/bench_moe_sort_quant.py --candidates times each choice (issue 16).
DECODE_MAX_PAIRS = 32  # decode methods up to max(this, DECODE_PAIRS_PER_BIN x E_BINS) pairs (H200 table below)
DECODE_PAIRS_PER_BIN = 0.5  # the count grows with E: the sort beat it up to E_BINS / 2 pairs (docs/bench/moe_sort_quant_candidates_h200.md)
# ... from this many bins: with fewer the count is cheap and beat both decode methods from 64 pairs
# (256 bins, 128 experts: 0.2-0.4 µs in three H200 runs; docs/bench/moe_sort_quant_h200.md, `old` column)
DECODE_PER_BIN_MIN_BINS = 512
DECODE_COMPARE_MAX_PAIRS = 64  # packed one-tile comparison: ALU ~ pairs^2 / threads; at 128 pairs 2x the sort on the H200
DECODE_COMPARE_TILE = 4096  # elements of a comparison tile [CH, PAIRS_PAD] (16384: 754 SGPRs spilled on AMD at 128)
# compare from this many padded pairs: the per-pair tile as [pairs, chunk] (reduced over its rows, so its sums
# come out in the layout the own-slot tile broadcasts) and DECODE_COMPARE_T_WARPS warps. H200, same run, at 64:
# 3.54 -> 3.17 µs (256 experts, 8 tokens), 3.64 -> 3.23 (896, 4 tokens); at 16-32 both cost 0.1-0.3 µs
# (docs/bench/moe_sort_quant_defer_h200.md)
DECODE_COMPARE_T_MIN_PAIRS = 64
DECODE_COMPARE_T_WARPS = 8
DECODE_SORT_SELECT = True  # sort: own slots select their rows from the sorted vectors (else reload + count)
DECODE_NUM_WARPS = 0  # warps of a decode-method launch (0: as the row work picks, 4 or 8)
COUNT_NUM_WARPS = 0  # warps of a per-program-count launch (0: as the row work picks, 4 or 8)
COUNT_GATHER = True  # per-program count: own experts' starts by tl.gather (else [K_PAD, E_BINS] one-hot sums)
DECODE_MIN_PAIRS_PAD = 16  # fewer variants at tiny batches
DECODE_TILE = 1024  # elements of the sort's reload-and-count tile (4096 spilled SGPRs on gfx950: bench/amd_spills_sort.py)
TILE = 8192  # elements of a one-hot counting tile
ROW_SPLIT_PROGRAMS = 128  # small batches split each row over programs until about this many
MIN_ROW_SPLIT = 1  # programs per row at any batch size (bench/sweep_moe_sort_quant.py tunes these)
# A program's share of a row up to QUANT_ONE_STEP_GROUPS groups is quantized in one step, its load
# issued first and (DEFER_QUANT_MATH) its math after the routing, so the load's latency hides under the
# routing math; wider shares go QUANT_GROUPS at a time after it. H200, same run: 0.1-0.6 µs off every
# row at 1-64 tokens (docs/bench/moe_sort_quant_h200.md, `prev-quant`); 128-group loop steps were slower
# (docs/bench/moe_sort_quant_defer_h200.md; one step of 256 groups: not measured)
DEFER_QUANT_MATH = True
QUANT_ONE_STEP_GROUPS = 128
# Split roles (issue 34): the row work (data codes, compact scales, moe_buf) goes to data programs of its
# own (grid columns from ROUTE_PROGRAMS on), so that no routing math stands before their stores, and the
# routing programs keep the sort outputs and the scale bytes at sorted rows (for which they read x for
# the group maxima). Up to ROLES_MAX_PAIRS pairs (a bucket's ceiling) in the one-launch path, and in the
# prescanned path when ROLES_PRESCANNED. A data program takes at most DATA_MAX_GROUPS groups of a row;
# there are ROW_SPLIT / ROUTE_SPLIT_DIV routing programs per row. H200, same run (`no-roles` columns of
# docs/bench/moe_sort_quant_roles_h200.md): 0.1-0.5 µs off every row at 1-64 tokens (MXFP8 (128, 4,
# 6144) 1 token 2.33 -> 1.99, (256, 8, 7168) MXFP4 64 tokens 7.41 -> 6.77); mixed at 2048-pair buckets
# ((896, 16) 128 tokens 17.41 -> 21.19, (128, 8) 128 tokens 7.82 -> 6.98); slower in prefill ((256, 8, 7168)
# 8192 tokens 160.98 -> 181.13; with 128-group data shares 169.89); ROUTE_SPLIT_DIV 4 or 16 and
# DATA_MAX_GROUPS 16 or 32 no better at 1-32 tokens. Launch counts unchanged (one grid, more columns).
# DATA_MAX_GROUPS 256 (issue 34; H100, docs/bench/moe_sort_quant_h200.md "Data programs of up to 256 groups"): fewer
# data programs where a one-launch row-split program has more than 64 groups (the 8-, 16-, 32- and 64-token buckets
# past 32768, 16384, 8192 and 4096 hidden; the 256-token bucket at topk <= 4, 1024 at topk 1, past 2048). Against
# 64: (256, 8, 7168) 48 and 64 tokens 6.28 -> 5.55 and 6.69 -> 6.04 µs, (128, 4, 6144) 128 and 256 tokens 6.84 ->
# 5.97 and 8.15 -> 7.87, other rows at 1-256 tokens within 0.1. 128 was as fast at 48-64 tokens but slower than 64 at
# (128, 4, 6144) 65, 100, 200 and 256 tokens (65: 6.09 against 5.81), where 256 gives one looped data program a row.
ROLES_MAX_PAIRS = 1024
ROLES_PRESCANNED = False
ROUTE_SPLIT_DIV = 1
DATA_MAX_GROUPS = 256
WIDE_ROW_ELEMS = 8192  # a program quantizing more elements at once than this gets 8 warps, else 4
QUANT_GROUPS = 32  # a program quantizes its share of a row this many 32-groups at a time
TILE_GROUPS = 256  # the scale-tile launch reorders this many groups of its 32 rows at a time (8 KB of LDS)
# Prefill (prescanned) without a quant: the scan launch also writes per-tile segment starts (its tiles of expert
# bins, below), so that every program of the sort launch sums the tiles' counts (up to 64 values) instead of reading
# and summing every expert bin's. H200, same run (docs/bench/moe_sort_quant_candidates_h200.md): the sort
# alone 10-18% faster at 32768 tokens (72.0 -> 57.7 µs (256, 8), 140.7 -> 115.4 (896, 16)), 1-9% at 8192; with the quant
# in the same launch no faster anywhere and 5-10% slower at (896, 16) and (128, 8), so there it is not taken.
# Its bits on the H200: test_gpu_prefill_sort_only_tile_starts (1 to 64 tiles, masks, local tokens)
PRESCAN_TILE_STARTS = True
# The scan launch's tiles: each program owns max(SCAN_MIN_TILE_BINS, E_BINS / 64) expert bins (a tile of the
# tables above) and walks the chunks SCAN_TILE_ELEMS / bins at a time, a serial chain of dependent steps. H200
# (docs/bench/moe_sort_quant_candidates_h200.md): with 64-bin tiles, 64 chunks a step, the scan alone took 7.7
# and 23.4 µs at (896, 16) 8192 and 32768 tokens (256 and 1024 chunks: 4 and 16 steps), for 2 MB and 8 MB of tables;
# with these, 3.7 and 8.9 (4x fewer steps from 32 to 1024 bins, 2x at 2048)
SCAN_MIN_TILE_BINS = 16
SCAN_TILE_ELEMS = 4096
# Token-count buckets: every constexpr the launch derives from the batch comes from the ceiling of
# the token count's bucket (``_batch_params``), so one model configuration compiles a fixed few
# variants whatever batch sizes a server runs (each new variant is a JIT compile of ~2 s on AMD).
# 1 and 2: below 4 tokens a comparison sized for 4 tokens' pairs cost 896-expert decode ~1 µs on the H200
# (docs/bench/moe_sort_quant_buckets_h200.md)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)
MAX_EXPERTS = 2048
MAX_BLOCK = 128  # block sizes 16..128 (powers of two) are a runtime argument
PAD_STEP = 16  # padding is written in [K_PAD, PAD_STEP] tiles, BLOCK // PAD_STEP of them (a runtime loop)
MAX_TOPK = 64
MAX_MODEL_DIM = 32768
INT32_LIMIT = 2**31 - 1


def _kernel_format(fmt: contract.MxFormat) -> dict:
    """An element format as the kernels' constexprs (NANC -1: saturate, sign kept)."""
    return dict(FP4=fmt is contract.FP4_E2M1, MB=fmt.mant_bits, EMIN=fmt.min_exp, MAXC=fmt.max_code,
                NANC=-1 if fmt.nan_code is None else fmt.nan_code, SIGNED_ZERO=fmt.neg_zero,
                SIGN_SHIFT=fmt.sign_shift, INV_MAX_BITS=fmt.inv_max_pos_bits)


_FP_FORMATS = {dtype: _kernel_format(contract.mx_format(dtype))
               for dtype in (torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.float8_e4m3fnuz)}
_AMAX_FLOOR_BITS = contract.AMAX_FLOOR_BITS
_empty = torch.empty  # every output allocation goes through here (tests poison it)
_MOE_BUF_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INPUT_DTYPES = (torch.bfloat16, torch.float16)


class SortQuantResult(NamedTuple):
    sorted_ids: torch.Tensor
    sorted_weights: torch.Tensor
    sorted_expert_ids: torch.Tensor
    num_valid_ids: torch.Tensor
    moe_buf: torch.Tensor
    quant: tuple[torch.Tensor, torch.Tensor] | None


@triton.jit
def _swizzle(row, group, SNP: tl.constexpr):
    return ((row // 32) * (SNP * 32) + (group // 8) * 256 + (group % 4) * 64
            + (row % 16) * 4 + ((group % 8) // 4) * 2 + (row % 32) // 16)


@triton.jit
def _token_count(nlt_ptr, M, HAS_NLT: tl.constexpr):
    if HAS_NLT:
        T = tl.minimum(tl.maximum(tl.load(nlt_ptr), 0), M)
    else:
        T = M
    return T


@triton.jit
def _token_count_as_given(nlt_ptr, M, HAS_NLT: tl.constexpr):
    """``num_local_tokens[0]`` unclamped: AITER's kernel writes it as is into ``num_valid_ids[1]``
    and the padding ids (``moe_sorting_opus.h``: ``p_total_tokens_post_pad[1] = tokens``)."""
    if HAS_NLT:
        T = tl.load(nlt_ptr)
    else:
        T = M
    return T


@triton.jit
def _expert_bins(ids_ptr, mask_ptr, p, n_pairs, E, E_BINS: tl.constexpr, HAS_MASK: tl.constexpr):
    """Expert id of pairs ``p`` or the dummy bin ``E_BINS - 1`` (>= E) for dropped pairs."""
    live = p < n_pairs
    e = tl.load(ids_ptr + p, mask=live, other=-1)
    keep = live & (e >= 0) & (e < E)
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + e, mask=keep, other=0) != 0)
    return tl.where(keep, e, E_BINS - 1), keep


@triton.jit
def _mx_quant_row(x_row_ptr, G, MB: tl.constexpr, EMIN: tl.constexpr, MAXC: tl.constexpr,
                  NANC: tl.constexpr, SIGNED_ZERO: tl.constexpr, SIGN_SHIFT: tl.constexpr,
                  INV_MAX_BITS: tl.constexpr, FLOOR_BITS: tl.constexpr, G_PAD: tl.constexpr):
    """Scale bytes ``[G_PAD]`` and element codes ``[G_PAD, 32]`` (int32, sign included)."""
    return _mx_quant_groups(_load_groups(x_row_ptr, G, G_PAD), MB, EMIN, MAXC, NANC, SIGNED_ZERO, SIGN_SHIFT,
                            INV_MAX_BITS, FLOOR_BITS, G_PAD)


@triton.jit
def _load_groups(x_row_ptr, G, G_PAD: tl.constexpr):
    gi = tl.arange(0, G_PAD)[:, None]
    ei = tl.arange(0, 32)[None, :]
    return tl.load(x_row_ptr + gi * 32 + ei, mask=gi < G, other=0.0)


@triton.jit
def _mx_quant_groups(x, MB: tl.constexpr, EMIN: tl.constexpr, MAXC: tl.constexpr,
                     NANC: tl.constexpr, SIGNED_ZERO: tl.constexpr, SIGN_SHIFT: tl.constexpr,
                     INV_MAX_BITS: tl.constexpr, FLOOR_BITS: tl.constexpr, G_PAD: tl.constexpr):
    """:func:`_mx_quant_row` of loaded groups ``x`` (``[G_PAD, 32]``, as stored).

    The group maximum by a float max (which skips NaN, as AITER's ``fmaxf``); each code by float arithmetic on
    the scaled magnitude ``v = |x| / 2^(s - 127)`` (exact): ``rint(v * 2^(MB - e)) + 2^MB (e - EMIN)`` for its
    binade ``e = max(floor(log2 v), EMIN)``, the rint by adding ``1.5 * 2^23`` (and the even ``2^MB (e - EMIN)``
    in the same add: ties still go to even), e2m1 and e4m3 alike. About half the operations per element of the
    integer shift-and-round it replaced, which the H200 was bound by in prefill (1.2-1.4 TB/s against 2.2-2.6:
    docs/bench/moe_sort_quant_candidates_h200.md)."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    abits = bits & 0x7FFFFFFF
    amax_bits = tl.max(abits.to(tl.float32, bitcast=True), axis=1).to(tl.int32, bitcast=True)
    amax_bits = tl.where(amax_bits > 0x7F800000, 0, amax_bits)  # a group of NaN only has no amax
    nonfinite = amax_bits >= 0x7F800000
    amax = tl.maximum(amax_bits, FLOOR_BITS).to(tl.float32, bitcast=True)
    inv = tl.full([G_PAD], INV_MAX_BITS, tl.int32).to(tl.float32, bitcast=True)
    u = (amax * inv).to(tl.int32, bitcast=True)
    s = (u >> 23) & 0xFF
    s = tl.where(((u & 0x7FFFFF) != 0) & (s < 0xFF), s + 1, s)
    s = tl.where(nonfinite, 0xFF, s)

    # v = |x| / 2^(s - 127): exact (a power-of-two factor, normal for every finite scale; a v too small to be
    # normal rounds to code 0 whether or not it is flushed). An Inf scale: factor 0, finite -> +-0.
    f = (tl.maximum(254 - s, 0) << 23).to(tl.float32, bitcast=True)
    v = abits.to(tl.float32, bitcast=True) * f[:, None]
    nonfinite_x = abits >= 0x7F800000  # NaN, +-Inf (v is NaN for them under an Inf scale: replaced below)
    # eb: the biased max(e, EMIN); v * 2^(MB - e) < 2^(MB + 1), so y < 2^24 and the code in its low bits is exact
    eb = tl.maximum(v.to(tl.int32, bitcast=True) >> 23, 127 + EMIN)
    y = (v * ((254 + MB - eb) << 23).to(tl.float32, bitcast=True)
         + ((eb << MB) + (0x4B400000 - ((127 + EMIN) << MB))).to(tl.float32, bitcast=True))
    # no min(MAXC): v <= max_pos for every finite bf16/fp16 group (test_scaled_group_max_is_at_most_max_pos)
    code = tl.where(nonfinite_x, MAXC, y.to(tl.int32, bitcast=True) & 0x3FFFFF)  # NaN, +-Inf: saturate
    if SIGNED_ZERO:
        code = code | (((bits >> 31) & 1) << SIGN_SHIFT)
    else:
        code = tl.where(code == 0, code, code | (((bits >> 31) & 1) << SIGN_SHIFT))
    if NANC >= 0:
        code = tl.where(nonfinite_x, NANC, code)  # NaN, and +-Inf (times the Inf scale's 1/Inf = 0)
    return s, code


@triton.jit
def _store_data_row(q_row_ptr, code, G, FP4: tl.constexpr, G_PAD: tl.constexpr):
    gi = tl.arange(0, G_PAD)[:, None]
    if FP4:
        lo, hi = tl.split(tl.reshape(code, [G_PAD, 16, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        bi = tl.arange(0, 16)[None, :]
        tl.store(q_row_ptr + gi * 16 + bi, packed, mask=gi < G)
    else:
        ei = tl.arange(0, 32)[None, :]
        tl.store(q_row_ptr + gi * 32 + ei, code.to(tl.uint8), mask=gi < G)


@triton.jit
def _store_quant_tile(q_row, s_ptr, cs_row, s, code, g_first, G, pos, keep_q, zero_w, all_zero,
                      FUSED: tl.constexpr, FP4: tl.constexpr, SNP: tl.constexpr, K_PAD: tl.constexpr,
                      GQ: tl.constexpr, COMPACT_SCALES: tl.constexpr, STORE_DATA: tl.constexpr):
    """Data bytes of groups ``[g_first, g_first + GQ)`` of one row (``STORE_DATA``; else the data
    programs write them), and their scale bytes: at each of the token's sorted rows ``pos``, or once
    in the token's compact row (split semantics, moved to the sorted rows by ``_scale_tiles_kernel``)."""
    g = g_first + tl.arange(0, GQ)
    if STORE_DATA:
        if FUSED:
            code = tl.where(all_zero, 0, code)
        _store_data_row(q_row + g_first * (16 if FP4 else 32), code, G - g_first, FP4, GQ)
    if COMPACT_SCALES:
        tl.store(cs_row + g, s.to(tl.uint8), mask=g < G)
    else:
        if FUSED:
            sbytes = tl.where(zero_w[:, None], 0, s[None, :]).to(tl.uint8)
        else:
            sbytes = tl.broadcast_to(s[None, :], [K_PAD, GQ]).to(tl.uint8)
        tl.store(s_ptr + _swizzle(pos[:, None], g[None, :], SNP), sbytes,
                 mask=keep_q[:, None] & (g[None, :] < G))


@triton.jit
def _fill_moe_buf(buf_ptr, init_ptr, init_stride, row, cs, D, D_SPLIT, BUF_MODE: tl.constexpr, D_BLOCK: tl.constexpr):
    """Columns ``[cs * D_SPLIT, (cs + 1) * D_SPLIT)`` of ``moe_buf`` row ``row``: zeros (``BUF_MODE`` 1)
    or the init row's (2)."""
    d_lo = cs * D_SPLIT
    d_hi = tl.minimum(d_lo + D_SPLIT, D)
    for d0 in range(d_lo, d_hi, D_BLOCK):
        d = d0 + tl.arange(0, D_BLOCK)
        if BUF_MODE == 1:
            val = tl.zeros([D_BLOCK], buf_ptr.dtype.element_ty)
        else:
            val = tl.load(init_ptr + row * init_stride + d, mask=d < d_hi)
        tl.store(buf_ptr + row * D + d, val, mask=d < d_hi)


@triton.jit
def _data_program(ids_ptr, w_ptr, mask_ptr, x_row, q_row, cs_row, buf_ptr, init_ptr, init_stride, row, t, cd, T, M,
                  E, D, G, D_SPLIT,
                  K: tl.constexpr, K_PAD: tl.constexpr, E_BINS: tl.constexpr, HAS_MASK: tl.constexpr,
                  QUANT: tl.constexpr, FP4: tl.constexpr, MB: tl.constexpr, EMIN: tl.constexpr, MAXC: tl.constexpr,
                  NANC: tl.constexpr, SIGNED_ZERO: tl.constexpr, SIGN_SHIFT: tl.constexpr,
                  INV_MAX_BITS: tl.constexpr, FLOOR_BITS: tl.constexpr, FUSED: tl.constexpr,
                  BUF_MODE: tl.constexpr, D_BLOCK: tl.constexpr, G_DTILE: tl.constexpr, QG_D: tl.constexpr,
                  COMPACT_SCALES: tl.constexpr):
    """A data program (``ROUTE_PROGRAMS`` > 0): slice ``cd`` of row ``t``'s data codes (groups
    ``[cd * G_DTILE, ...)``), of its compact scale row (split semantics) and of its ``moe_buf`` row. It
    reads no routing but its own token's ids and weights (fused semantics: a token whose kept pairs
    all weigh 0 gets a zero data row), so no routing math stands before its stores."""
    gd = cd * G_DTILE
    if QUANT:
        if QG_D == G_DTILE:
            x_tile = _load_groups(x_row + gd * 32, tl.where(t < M, G - gd, 0), G_DTILE)
    if BUF_MODE != 0:
        if t < T:
            _fill_moe_buf(buf_ptr, init_ptr, init_stride, row, cd, D, D_SPLIT, BUF_MODE, D_BLOCK)
    if QUANT:
        if FUSED:
            slot = tl.arange(0, K_PAD)
            q = t * K + slot
            _, keep_q = _expert_bins(ids_ptr, mask_ptr, q, tl.where(t < T, t * K + K, 0), E, E_BINS, HAS_MASK)
            keep_q = keep_q & (slot < K)
            wq = tl.load(w_ptr + q, mask=keep_q, other=0.0)
            n_keep = tl.sum(keep_q.to(tl.int32), 0)
            all_zero = (n_keep > 0) & (tl.sum((keep_q & (wq == 0.0)).to(tl.int32), 0) == n_keep)
        if t < T:
            if QG_D == G_DTILE:
                s, code = _mx_quant_groups(x_tile, MB, EMIN, MAXC, NANC, SIGNED_ZERO, SIGN_SHIFT, INV_MAX_BITS,
                                           FLOOR_BITS, G_DTILE)
                if FUSED:
                    code = tl.where(all_zero, 0, code)
                _store_data_row(q_row + gd * (16 if FP4 else 32), code, G - gd, FP4, G_DTILE)
                if COMPACT_SCALES:
                    g = gd + tl.arange(0, G_DTILE)
                    tl.store(cs_row + g, s.to(tl.uint8), mask=g < G)
            else:
                for gq in range(gd, tl.minimum(gd + G_DTILE, G), QG_D):
                    s, code = _mx_quant_row(x_row + gq * 32, G - gq, MB, EMIN, MAXC, NANC, SIGNED_ZERO,
                                            SIGN_SHIFT, INV_MAX_BITS, FLOOR_BITS, QG_D)
                    if FUSED:
                        code = tl.where(all_zero, 0, code)
                    _store_data_row(q_row + gq * (16 if FP4 else 32), code, G - gq, FP4, QG_D)
                    if COMPACT_SCALES:
                        g = gq + tl.arange(0, QG_D)
                        tl.store(cs_row + g, s.to(tl.uint8), mask=g < G)
        if FUSED:
            if (t == T) & (T < M):
                for gq in range(gd, tl.minimum(gd + G_DTILE, G), QG_D):
                    _store_data_row(q_row + gq * (16 if FP4 else 32), tl.zeros([QG_D, 32], tl.int32), G - gq,
                                    FP4, QG_D)


@triton.jit
def _count_experts(ids_ptr, mask_ptr, lo, hi, E, E_BINS: tl.constexpr, PC: tl.constexpr,
                   HAS_MASK: tl.constexpr, USE_HIST: tl.constexpr):
    """Kept pairs per expert bin among pairs ``[lo, hi)``: one-hot sums for a small tile, else
    ``tl.histogram`` (one-hot cost grows with pairs x bins, the histogram's with pairs)."""
    bins = tl.arange(0, E_BINS)
    cnt = tl.zeros([E_BINS], tl.int32)
    for c in range(lo, hi, PC):
        e, keep = _expert_bins(ids_ptr, mask_ptr, c + tl.arange(0, PC), hi, E, E_BINS, HAS_MASK)
        if USE_HIST:
            cnt += tl.histogram(e, E_BINS)
        else:
            cnt += tl.sum((e[:, None] == bins[None, :]).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _count_same_expert(ids_ptr, mask_ptr, lo, hi, eq, E, E_BINS: tl.constexpr, PC: tl.constexpr,
                       HAS_MASK: tl.constexpr):
    """For each expert in ``eq``: kept pairs among ``[lo, hi)`` routed to it."""
    acc = tl.zeros(eq.shape, tl.int32)
    for c in range(lo, hi, PC):
        e, keep = _expert_bins(ids_ptr, mask_ptr, c + tl.arange(0, PC), hi, E, E_BINS, HAS_MASK)
        acc += tl.sum(((eq[:, None] == e[None, :]) & keep[None, :]).to(tl.int32), axis=1)
    return acc


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _decode_by_sort(ids_ptr, mask_ptr, P, q, eq, keep_q, E, BLOCK, E_BINS: tl.constexpr,
                    HAS_MASK: tl.constexpr, PP: tl.constexpr, PB: tl.constexpr, CH: tl.constexpr,
                    SELECT: tl.constexpr):
    """Sorted positions and segment padding of this token's pairs from a sort of all ``P <= PP``
    pairs by (expert, index): nothing is ``E`` wide. Returns ``(pos, fill, total)``: each pair's
    row in ``sorted_ids``, the padding rows after it (nonzero only for its expert's last pair)
    and the padded length ``num_valid_ids[0]``. Rows and padding reach this token's slots by a
    select over the sorted vectors (``SELECT``) or by counting the keys below each slot's key
    (``[K_PAD, CH]`` tiles of reloaded ids)."""
    i = tl.arange(0, PP)
    e, keep = _expert_bins(ids_ptr, mask_ptr, i, P, E, E_BINS, HAS_MASK)
    key = (e << PB) | i  # unique; dropped pairs (bin E_BINS - 1 >= E) sort last
    ks = tl.sort(key)
    es = ks >> PB
    start = (i == 0) | (tl.gather(es, tl.maximum(i - 1, 0), 0) != es)
    end = (i == PP - 1) | (tl.gather(es, tl.minimum(i + 1, PP - 1), 0) != es)
    run_start = tl.associative_scan(tl.where(start, i, 0), 0, _max_combine)
    # a segment's padding, (-count) mod BLOCK (a runtime power of two: 16..128, checked by
    # unsupported_reason), sits on its last sorted pair; segments start at
    # multiples of BLOCK, so a pair's row is its sorted index plus the padding of earlier segments
    pad = tl.where(end & (es < E), (run_start - i - 1) & (BLOCK - 1), 0)
    row = i + tl.cumsum(pad, 0) - pad
    total = tl.sum((es < E).to(tl.int32), 0) + tl.sum(pad, 0)
    if SELECT:
        # each sorted slot names its pair (the key's low bits): this token's slots pick their
        # (row, padding) out of the sorted vectors in one [K_PAD, PP] select-and-sum, no reload
        src = ks & (PP - 1)
        got = tl.sum(tl.where(src[None, :] == q[:, None], (row | (pad << 24))[None, :], 0), axis=1)
        pos = got & 0xFFFFFF
        fill = got >> 24
    else:
        # this token's pairs' sorted indices: keys below theirs, counted in [K_PAD, CH] tiles
        key_q = tl.where(keep_q, (eq << PB) | q, 0)
        sidx = tl.zeros(eq.shape, tl.int32)
        for c in range(0, PP, CH):
            kc = c + tl.arange(0, CH)
            ec, _ = _expert_bins(ids_ptr, mask_ptr, kc, P, E, E_BINS, HAS_MASK)
            sidx += tl.sum((((ec << PB) | kc)[None, :] < key_q[:, None]).to(tl.int32), axis=1)
        sidx = tl.minimum(sidx, PP - 1)
        pos = tl.gather(row, sidx, 0)
        fill = tl.gather(pad, sidx, 0)
    return pos, fill, total


@triton.jit
def _decode_by_compare(ids_ptr, mask_ptr, P, q, eq, keep_q, E, BLOCK,
                       E_BINS: tl.constexpr, HAS_MASK: tl.constexpr, PP: tl.constexpr,
                       CH: tl.constexpr, TRANSPOSED: tl.constexpr):
    """As :func:`_decode_by_sort`, by comparing every pair with every other: no sort, for a
    handful of tokens. ``[CH, PP]`` tiles (one when ``CH == PP``), two reductions per tile, each
    summing packed fields: per pair ``j`` its expert's count (low 16 bits) and the later pairs of
    its expert (high bits), which give its padding (nonzero on its expert's last pair only); then
    per own slot the rows before it (pairs and padding of smaller experts, earlier pairs of its
    own; low 24 bits) and its own padding (high bits)."""
    k = tl.arange(0, PP)
    e_all, keep_all = _expert_bins(ids_ptr, mask_ptr, k, P, E, E_BINS, HAS_MASK)
    acc = tl.zeros(eq.shape, tl.int32)
    total = 0
    for c in range(0, PP, CH):
        j = c + tl.arange(0, CH)
        ej, kj = _expert_bins(ids_ptr, mask_ptr, j, P, E, E_BINS, HAS_MASK)
        if TRANSPOSED:  # [PP, CH]: the per-pair sums come out in the layout the own-slot tile broadcasts
            same = (e_all[:, None] == ej[None, :]) & keep_all[:, None]
            s = tl.sum(tl.where(same, tl.where(k[:, None] > j[None, :], 65536, 1), 0), axis=0)
        else:
            same = (ej[:, None] == e_all[None, :]) & keep_all[None, :]
            s = tl.sum(tl.where(same, tl.where(k[None, :] > j[:, None], 65536, 1), 0), axis=1)
        pad = tl.where(kj & ((s >> 16) == 0), (0 - (s & 0xFFFF)) & (BLOCK - 1), 0)
        total += tl.sum(tl.where(kj, 1 + pad, 0), 0)
        before = tl.where(ej[None, :] < eq[:, None], 1 + pad[None, :],
                          ((ej[None, :] == eq[:, None]) & (j[None, :] < q[:, None])).to(tl.int32))
        acc += tl.sum(tl.where(kj[None, :], before, 0)
                      + tl.where(j[None, :] == q[:, None], pad[None, :] << 24, 0), axis=1)
    return acc & 0xFFFFFF, acc >> 24, total


@triton.jit(do_not_specialize=["M"])  # the token count: one variant for every batch size
def _sort_quant_kernel(
    ids_ptr, w_ptr, mask_ptr, nlt_ptr,
    sid_ptr, sw_ptr, seid_ptr, nv_ptr,
    x_ptr, x_stride, q_ptr, s_ptr,
    buf_ptr, init_ptr, init_stride,
    pre_ptr, tot_ptr, rank_ptr, cs_ptr,
    M, E, D, G,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK, PAD_STEP: tl.constexpr,
    E_BINS: tl.constexpr, COUNT_CHUNK: tl.constexpr, USE_HIST: tl.constexpr, RANK_CHUNK: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_NLT: tl.constexpr,
    QUANT: tl.constexpr, FP4: tl.constexpr, MB: tl.constexpr, EMIN: tl.constexpr,
    MAXC: tl.constexpr, NANC: tl.constexpr, SIGNED_ZERO: tl.constexpr, SIGN_SHIFT: tl.constexpr,
    INV_MAX_BITS: tl.constexpr, FLOOR_BITS: tl.constexpr,
    SNP: tl.constexpr, FUSED: tl.constexpr,
    BUF_MODE: tl.constexpr, D_BLOCK: tl.constexpr, D_SPLIT,
    PRESCANNED: tl.constexpr, CHUNK_T: tl.constexpr, G_TILE: tl.constexpr, QG: tl.constexpr,
    COMPACT_SCALES: tl.constexpr,
    DECODE: tl.constexpr, PAIRS_PAD: tl.constexpr, PAIRS_BITS: tl.constexpr, CMP_CHUNK: tl.constexpr,
    SORT_SELECT: tl.constexpr, COUNT_GATHER: tl.constexpr, DEFER_QUANT: tl.constexpr, COMPARE_T: tl.constexpr,
    ROUTE_PROGRAMS: tl.constexpr, G_DTILE: tl.constexpr, QG_D: tl.constexpr,
    TILE_STARTS: tl.constexpr, E_TILE: tl.constexpr, N_TILES: tl.constexpr,
):
    t = tl.program_id(0)
    cs = tl.program_id(1)  # column slice of the row work; slice 0 also writes the sort outputs
    g0 = cs * G_TILE
    T = _token_count(nlt_ptr, M, HAS_NLT)
    P = T * K
    my_first = t * K
    bins = tl.arange(0, E_BINS)
    row = t.to(tl.int64)
    q_row = q_ptr + row * (G * (16 if FP4 else 32))
    x_row = x_ptr + row * x_stride

    # split roles (ROUTE_PROGRAMS > 0): slices from ROUTE_PROGRAMS on are data programs (codes, compact
    # scales, moe_buf); the routing programs below write the sort outputs and the sorted-row scales only
    if ROUTE_PROGRAMS > 0:
        if cs >= ROUTE_PROGRAMS:
            _data_program(ids_ptr, w_ptr, mask_ptr, x_row, q_row, cs_ptr + row * G, buf_ptr, init_ptr, init_stride,
                          row, t, cs - ROUTE_PROGRAMS, T, M, E, D, G, D_SPLIT, K, K_PAD, E_BINS, HAS_MASK,
                          QUANT, FP4, MB, EMIN, MAXC, NANC, SIGNED_ZERO, SIGN_SHIFT, INV_MAX_BITS, FLOOR_BITS,
                          FUSED, BUF_MODE, D_BLOCK, G_DTILE, QG_D, COMPACT_SCALES)
            return
    ROUTE_QUANT: tl.constexpr = QUANT and not (ROUTE_PROGRAMS > 0 and COMPACT_SCALES)  # this program reads x
    ROUTE_DATA: tl.constexpr = ROUTE_PROGRAMS == 0  # ... and writes codes, compact scales, moe_buf

    # row work first: its loads overlap the routing math below (the math waits for it with
    # DEFER_QUANT; a share wider than one step is quantized after it, QG groups at a time, so that
    # a program's registers stay few and many programs fit an SM)
    if ROUTE_QUANT:
        if QG == G_TILE:
            x_tile = _load_groups(x_row + g0 * 32, tl.where(t < M, G - g0, 0), G_TILE)
            if not DEFER_QUANT:
                s, code = _mx_quant_groups(x_tile, MB, EMIN, MAXC, NANC, SIGNED_ZERO, SIGN_SHIFT, INV_MAX_BITS,
                                           FLOOR_BITS, G_TILE)
    if BUF_MODE != 0:
        if ROUTE_DATA:
            if t < T:
                _fill_moe_buf(buf_ptr, init_ptr, init_stride, row, cs, D, D_SPLIT, BUF_MODE, D_BLOCK)

    # this token's pairs
    slot = tl.arange(0, K_PAD)
    q = my_first + slot
    eq, keep_q = _expert_bins(ids_ptr, mask_ptr, q, tl.where(t < T, my_first + K, 0), E,
                              E_BINS, HAS_MASK)
    keep_q = keep_q & (slot < K)

    # position = segment start + earlier pairs of the same expert
    if PRESCANNED:
        # the launches before this one counted: here only table reads and one cumsum over expert tiles
        # (TILE_STARTS) or over experts
        chunk = t // CHUNK_T
        rank = (tl.load(pre_ptr + chunk * E_BINS + eq, mask=keep_q, other=0)
                + tl.load(rank_ptr + q, mask=keep_q, other=0))
        if TILE_STARTS:  # the scan launch's per-tile starts: a sum over N_TILES values, not E_BINS
            tiles = tl.arange(0, N_TILES)
            tile_q = eq // E_TILE
            tsum = tl.load(tot_ptr + 2 * E_BINS + tiles)
            base = (tl.load(tot_ptr + E_BINS + eq, mask=keep_q, other=0)
                    + tl.gather(tl.cumsum(tsum, 0) - tsum, tile_q, 0))
            cnt_q = tl.load(tot_ptr + eq, mask=keep_q, other=0)
            total = tl.sum(tsum, 0)
            if HAS_MASK:
                msum = tl.load(tot_ptr + 3 * E_BINS + N_TILES + tiles)
                lid = (tl.load(tot_ptr + 2 * E_BINS + N_TILES + eq, mask=keep_q, other=0)
                       + tl.gather(tl.cumsum(msum, 0) - msum, tile_q, 0))
            else:
                lid = eq
        else:
            cnt = tl.where(bins < E, tl.load(tot_ptr + bins), 0)
            padded = (cnt + BLOCK - 1) // BLOCK * BLOCK
            base = tl.gather(tl.cumsum(padded, 0) - padded, eq, 0)
            cnt_q = tl.gather(cnt, eq, 0)
            total = tl.sum(padded, 0)
            if HAS_MASK:
                mvals = tl.load(mask_ptr + bins, mask=bins < E, other=0)
                lid = tl.gather(tl.cumsum(mvals, 0) - mvals, eq, 0)
            else:
                lid = eq
        pos = base + rank
        fill = tl.where(rank == cnt_q - 1, (cnt_q + BLOCK - 1) // BLOCK * BLOCK - cnt_q, 0)
        if (t == 0) & (cs == 0):
            tl.store(nv_ptr, total)
            tl.store(nv_ptr + 1, _token_count_as_given(nlt_ptr, M, HAS_NLT))
    elif DECODE != 0:
        # decode: every program sorts the few pairs itself; only an expert mask is read E-wide
        if DECODE == 1:
            pos, fill, total = _decode_by_sort(ids_ptr, mask_ptr, P, q, eq, keep_q, E, BLOCK, E_BINS,
                                               HAS_MASK, PAIRS_PAD, PAIRS_BITS, CMP_CHUNK, SORT_SELECT)
        else:
            pos, fill, total = _decode_by_compare(ids_ptr, mask_ptr, P, q, eq, keep_q, E, BLOCK, E_BINS,
                                                  HAS_MASK, PAIRS_PAD, CMP_CHUNK, COMPARE_T)
        if HAS_MASK:
            mvals = tl.load(mask_ptr + bins, mask=bins < E, other=0)
            lid = tl.gather(tl.cumsum(mvals, 0) - mvals, tl.where(keep_q, eq, 0), 0)
        else:
            lid = eq
        if (t == 0) & (cs == 0):
            tl.store(nv_ptr, total)
            tl.store(nv_ptr + 1, _token_count_as_given(nlt_ptr, M, HAS_NLT))
    else:
        cnt = _count_experts(ids_ptr, mask_ptr, 0, P, E, E_BINS, COUNT_CHUNK, HAS_MASK, USE_HIST)
        before = _count_same_expert(ids_ptr, mask_ptr, 0, tl.minimum(my_first, P), eq, E, E_BINS,
                                    RANK_CHUNK, HAS_MASK)
        cnt = tl.where(bins < E, cnt, 0)
        padded = (cnt + BLOCK - 1) // BLOCK * BLOCK
        seg_start = tl.cumsum(padded, 0) - padded
        if HAS_MASK:
            mvals = tl.load(mask_ptr + bins, mask=bins < E, other=0)
            local_id = tl.cumsum(mvals, 0) - mvals
        else:
            local_id = bins
        if (t == 0) & (cs == 0):
            tl.store(nv_ptr, tl.sum(padded, 0))
            tl.store(nv_ptr + 1, _token_count_as_given(nlt_ptr, M, HAS_NLT))
        if COUNT_GATHER:  # eq < E_BINS always (dropped pairs: the empty bin E_BINS - 1)
            base = tl.gather(seg_start, eq, 0)
            lid = tl.gather(local_id, eq, 0)
            cnt_q = tl.gather(cnt, eq, 0)
        else:  # one-hot sums over [K_PAD, E_BINS]
            onehot = eq[:, None] == bins[None, :]
            base = tl.sum(tl.where(onehot, seg_start[None, :], 0), axis=1)
            lid = tl.sum(tl.where(onehot, local_id[None, :], 0), axis=1)
            cnt_q = tl.sum(tl.where(onehot, cnt[None, :], 0), axis=1)
        earlier = (eq[None, :] == eq[:, None]) & (slot[None, :] < slot[:, None]) & keep_q[None, :]
        rank = before + tl.sum(earlier.to(tl.int32), axis=1)
        pos = base + rank
        fill = tl.where(rank == cnt_q - 1, (cnt_q + BLOCK - 1) // BLOCK * BLOCK - cnt_q, 0)
    if ROUTE_QUANT:
        if QG == G_TILE:
            if DEFER_QUANT:  # the row's load was issued first; its math waits until the routing is done
                s, code = _mx_quant_groups(x_tile, MB, EMIN, MAXC, NANC, SIGNED_ZERO, SIGN_SHIFT, INV_MAX_BITS,
                                           FLOOR_BITS, G_TILE)
    wq = tl.load(w_ptr + q, mask=keep_q, other=0.0)
    mine = keep_q & ((slot * 0 + cs) == 0)
    tl.store(sid_ptr + pos, (slot << 24) | t, mask=mine)
    tl.store(sw_ptr + pos, wq, mask=mine)
    tl.store(seid_ptr + pos // BLOCK, lid, mask=mine)

    # the owner of an expert's last pair pads that expert's segment (fill is 0 for other pairs);
    # fill < BLOCK: BLOCK // PAD_STEP tiles of PAD_STEP columns, so the block size is not compiled in
    # (one MAX_BLOCK-wide tile spilled SGPRs at 896 experts with an expert mask on gfx950)
    pad_id = (K << 24) | (_token_count_as_given(nlt_ptr, M, HAS_NLT) & 0xFFFFFF)
    for j0 in range(0, BLOCK, PAD_STEP):
        jj = j0 + tl.arange(0, PAD_STEP)
        pad_live = keep_q[:, None] & (jj[None, :] < fill[:, None])
        pad_pos = pos[:, None] + 1 + jj[None, :]
        tl.store(sid_ptr + pad_pos, tl.full([K_PAD, PAD_STEP], 0, tl.int32) | pad_id, mask=pad_live & mine[:, None])
        tl.store(sw_ptr + pad_pos, tl.zeros([K_PAD, PAD_STEP], tl.float32), mask=pad_live & mine[:, None])
        if QUANT:
            if FUSED:
                if T < M:  # padding rows name real row T: AITER quantizes them as zero-weight rows
                    for g in range(g0, tl.minimum(g0 + G_TILE, G)):
                        tl.store(s_ptr + _swizzle(pad_pos, g, SNP), tl.zeros([K_PAD, PAD_STEP], tl.uint8),
                                 mask=pad_live)

    if ROUTE_QUANT:
        if t < T:
            zero_w = keep_q & (wq == 0.0)
            n_keep = tl.sum(keep_q.to(tl.int32), 0)
            all_zero = (n_keep > 0) & (tl.sum(zero_w.to(tl.int32), 0) == n_keep)
            if QG == G_TILE:
                _store_quant_tile(q_row, s_ptr, cs_ptr + row * G, s, code, g0, G, pos, keep_q, zero_w,
                                  all_zero, FUSED, FP4, SNP, K_PAD, G_TILE, COMPACT_SCALES, ROUTE_DATA)
            else:
                for gq in range(g0, tl.minimum(g0 + G_TILE, G), QG):
                    s, code = _mx_quant_row(x_row + gq * 32, G - gq, MB, EMIN, MAXC, NANC, SIGNED_ZERO,
                                            SIGN_SHIFT, INV_MAX_BITS, FLOOR_BITS, QG)
                    _store_quant_tile(q_row, s_ptr, cs_ptr + row * G, s, code, gq, G, pos, keep_q, zero_w,
                                      all_zero, FUSED, FP4, SNP, K_PAD, QG, COMPACT_SCALES, ROUTE_DATA)
    if QUANT and ROUTE_DATA:
        if FUSED:
            if (t == T) & (T < M):
                for gq in range(g0, tl.minimum(g0 + G_TILE, G), QG):
                    _store_data_row(q_row + gq * (16 if FP4 else 32), tl.zeros([QG, 32], tl.int32), G - gq,
                                    FP4, QG)


@triton.jit(do_not_specialize=["M"])
def _chunk_rank_kernel(ids_ptr, mask_ptr, nlt_ptr, hist_ptr, rank_ptr, M, E,
                       K: tl.constexpr, E_BINS: tl.constexpr, CHUNK_T: tl.constexpr,
                       PC: tl.constexpr, PC_BITS: tl.constexpr, HAS_MASK: tl.constexpr,
                       HAS_NLT: tl.constexpr):
    """Per chunk of ``CHUNK_T`` tokens: kept pairs per expert, and each pair's rank among the chunk's earlier
    pairs of its expert, both from a sort by (expert, index) of the chunk's ``PC`` slots: a pair's rank is its
    sorted position less the start of its run of equal experts, and a run's length is its expert's count,
    stored at that expert's bin over a row of zeros. Nothing but the zeros is ``E_BINS`` wide: a histogram, a
    cumsum and a gather over every bin took 3x longer at 1024 bins (47 -> 12 µs at (896, 16) 32768 tokens on
    an H100: docs/bench/moe_sort_quant_candidates_h200.md)."""
    c = tl.program_id(0)
    T = _token_count(nlt_ptr, M, HAS_NLT)
    lo = c * CHUNK_T * K
    hi = tl.minimum(lo + CHUNK_T * K, T * K)
    i = tl.arange(0, PC)
    e, _ = _expert_bins(ids_ptr, mask_ptr, lo + i, hi, E, E_BINS, HAS_MASK)  # dropped, dead: the last bin
    hist_row = hist_ptr + c * E_BINS
    tl.store(hist_row + tl.arange(0, E_BINS), tl.zeros([E_BINS], tl.int32))
    key = tl.sort((e << PC_BITS) | i)
    e_s = key >> PC_BITS
    start = (i == 0) | (tl.gather(e_s, tl.maximum(i - 1, 0), 0) != e_s)
    rank = i - tl.associative_scan(tl.where(start, i, 0), 0, _max_combine)
    end = (i == PC - 1) | (tl.gather(e_s, tl.minimum(i + 1, PC - 1), 0) != e_s)
    # orders the zeros (this program's earlier stores, other threads' among them) before the runs' lengths:
    # __syncthreads on NVIDIA; on AMD a workgroup release/acquire fence around s_barrier, which covers global
    # memory under LLVM's AMDGPU memory model (checked in the compiled LLVM IR: docs/bench/moe_sort_quant_amd_registers.md)
    tl.debug_barrier()
    tl.store(hist_row + e_s, rank + 1, mask=end)  # dropped and dead slots: the last bin's run, as counted before
    src = lo + (key & (PC - 1))
    tl.store(rank_ptr + src, rank, mask=src < hi)


@triton.jit(do_not_specialize=["M"])
def _scale_tiles_kernel(sid_ptr, nv_ptr, cs_ptr, s_ptr, G, M, SNP: tl.constexpr, GC: tl.constexpr):
    """Scale bytes of 32 sorted rows (``32 * SNP`` contiguous bytes of the swizzled layout), each
    from its token's compact row: full coalesced stores instead of one scattered byte per
    (pair, group), which leave every 32-byte sector to be merged from many programs. The 32 rows'
    compact bytes are loaded row-wise (each row's ``G`` bytes contiguous) and put in the swizzled
    order in registers (``_swizzle``: ``o = (g // 8) * 256 + (g % 4) * 64 + (r % 16) * 4 +
    ((g % 8) // 4) * 2 + r // 16``, so the tile is ``[r // 16, r % 16, g // 8, (g % 8) // 4, g % 4]``
    permuted): gathering each byte of the swizzled order from its row took twice as long (H100,
    docs/bench/moe_sort_quant_candidates_h200.md). ``GC`` groups at a time (``TILE_GROUPS``; every
    preset's row in one step), so that the permute's LDS stays at most 8 KB at any hidden size.

    ``num_valid_ids[1]`` is ``num_local_tokens`` as given, which can exceed the ``M`` compact rows
    (padding ids keep only its low 24 bits): a row is read only below ``min(T, M)``."""
    p = tl.program_id(0)
    nv = tl.load(nv_ptr)
    T = tl.load(nv_ptr + 1)
    r = p * 32 + tl.arange(0, 32)
    tok = tl.load(sid_ptr + r, mask=r < nv, other=0) & 0xFFFFFF
    real = (r < nv) & (tok < tl.minimum(T, M))
    for g0 in range(0, SNP, GC):  # the groups from g0 fill the bytes from g0 * 32 (g0 a multiple of 8)
        g = g0 + tl.arange(0, GC)
        val = tl.load(cs_ptr + tok.to(tl.int64)[:, None] * G + g[None, :], mask=real[:, None] & (g[None, :] < G),
                      other=0)
        val = tl.reshape(tl.permute(tl.reshape(val, [2, 16, GC // 8, 2, 4]), [2, 4, 1, 3, 0]), [GC * 32])
        o = g0 * 32 + tl.arange(0, GC * 32)
        tl.store(s_ptr + p.to(tl.int64) * (SNP * 32) + o, val, mask=o < SNP * 32)


@triton.jit(do_not_specialize=["n_chunks"])
def _chunk_scan_kernel(hist_ptr, pre_ptr, tot_ptr, mask_ptr, n_chunks, E, BLOCK,
                       E_BINS: tl.constexpr, E_TILE: tl.constexpr, C_TILE: tl.constexpr, N_TILES: tl.constexpr,
                       TILE_STARTS: tl.constexpr, HAS_MASK: tl.constexpr):
    """Exclusive prefix of the chunk histograms over chunks, per expert, and the totals (``tot[0:E_BINS]``).
    With ``TILE_STARTS``, per tile of ``E_TILE`` experts (this program's): each expert's segment start
    within the tile (``tot[E_BINS:2 E_BINS]``, counts padded to ``BLOCK``) and the tile's padded sum
    (``tot[2 E_BINS + tile]``), and with an expert mask the same for the local ids (after them), so that
    each program of the sort launch sums ``N_TILES`` values instead of ``E_BINS``."""
    p = tl.program_id(0)
    e = p * E_TILE + tl.arange(0, E_TILE)
    running = tl.zeros([E_TILE], tl.int32)
    for c0 in range(0, n_chunks, C_TILE):
        ci = c0 + tl.arange(0, C_TILE)
        offs = ci[:, None] * E_BINS + e[None, :]
        h = tl.load(hist_ptr + offs, mask=ci[:, None] < n_chunks, other=0)
        incl = tl.cumsum(h, 0)
        tl.store(pre_ptr + offs, running[None, :] + incl - h, mask=ci[:, None] < n_chunks)
        running += tl.sum(h, 0)
    tl.store(tot_ptr + e, running)
    if TILE_STARTS:
        padded = (tl.where(e < E, running, 0) + BLOCK - 1) // BLOCK * BLOCK  # the dropped pairs' bin: no segment
        tl.store(tot_ptr + E_BINS + e, tl.cumsum(padded, 0) - padded)
        tl.store(tot_ptr + 2 * E_BINS + p, tl.sum(padded, 0))
        if HAS_MASK:
            m = tl.load(mask_ptr + e, mask=e < E, other=0)
            tl.store(tot_ptr + 2 * E_BINS + N_TILES + e, tl.cumsum(m, 0) - m)
            tl.store(tot_ptr + 3 * E_BINS + N_TILES + p, tl.sum(m, 0))


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def expert_bin_count(num_experts: int) -> int:
    """``E_BINS``: the expert histogram's bins, one per expert and one for dropped pairs, to a power of two."""
    return _next_pow2(num_experts + 1)


def _prev_pow2(n: int) -> int:
    return 1 << max(n.bit_length() - 1, 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # host ints: triton.cdiv is a Python call per argument on the launch path


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def sort_sizes(num_tokens: int, topk: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """``(max_num_tokens_padded, max_num_m_blocks)`` as AITER allocates them."""
    return contract.sort_buffer_sizes(num_tokens * topk, topk, num_experts, block_size)


def unsupported_reason(topk_ids, topk_weights, num_experts, model_dim, block_size, expert_mask,
                       num_local_tokens, quant_input, quant_dtype, moe_buf, moe_buf_init) -> str | None:
    """None when :func:`moe_sort_mx_quant` handles the call, else why not. Reads metadata only."""
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        return "topk_ids not contiguous int32 [M, topk]"
    M, K = topk_ids.shape
    dev = topk_ids.device
    if (topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32
            or not topk_weights.is_contiguous() or topk_weights.device != dev):
        return "topk_weights not contiguous fp32 shaped like topk_ids"
    # reasons name the limit met, never the call's values (issue 35: they are counted per reason); those go
    # to DEBUG once per reason (reasons.with_values)
    if not 1 <= K <= MAX_TOPK:
        return with_values(f"topk outside 1..{MAX_TOPK}", topk=K)
    if not 1 <= num_experts <= MAX_EXPERTS:
        return with_values(f"num_experts outside 1..{MAX_EXPERTS}", num_experts=num_experts)
    if num_experts < K:
        return with_values("num_experts < topk", num_experts=num_experts, topk=K)
    if block_size not in (16, 32, 64, MAX_BLOCK):
        return with_values("block_size not in 16/32/64/128", block_size=block_size)
    if M >= 1 << contract.TOKEN_BITS:
        return with_values("tokens do not fit the 24-bit token field", tokens=M)
    n_sorted, _ = sort_sizes(M, K, num_experts, block_size)
    if n_sorted > INT32_LIMIT // 4:
        return with_values("tokens > int32 offset limit", tokens=M, topk=K, num_experts=num_experts)
    if model_dim < 1 or model_dim > INT32_LIMIT // max(M, 1):
        return with_values("model_dim x tokens > int32 offset limit", model_dim=model_dim, tokens=M)
    if expert_mask is not None and (expert_mask.dtype != torch.int32 or expert_mask.dim() != 1
                                    or expert_mask.numel() < num_experts
                                    or not expert_mask.is_contiguous() or expert_mask.device != dev):
        return "expert_mask not contiguous int32 [num_experts]"
    if num_local_tokens is not None and (num_local_tokens.dtype != torch.int32
                                         or num_local_tokens.numel() < 1
                                         or num_local_tokens.device != dev):
        return "num_local_tokens not an int32 device tensor"
    for name, buf in (("moe_buf", moe_buf), ("moe_buf_init", moe_buf_init)):
        if buf is None:
            continue
        if buf.device != dev or buf.dtype not in _MOE_BUF_DTYPES or buf.dim() != 2:
            return f"{name} not a 2-D bf16/fp16/fp32 tensor on the ids' device"
        if buf.shape[0] != M or buf.shape[1] != model_dim:
            return with_values(f"{name} shape != (tokens, model_dim)", shape=tuple(buf.shape), tokens=M,
                               model_dim=model_dim)
    if moe_buf is not None and not moe_buf.is_contiguous():
        return "moe_buf not contiguous"
    if moe_buf_init is not None and moe_buf_init.stride(1) != 1:
        return "moe_buf_init rows not contiguous"
    if moe_buf is not None and moe_buf_init is not None and moe_buf.dtype != moe_buf_init.dtype:
        return "moe_buf_init dtype != moe_buf dtype"
    if (quant_input is None) != (quant_dtype is None):
        return "quant_input and quant_dtype must be given together"
    if quant_input is not None:
        if quant_dtype not in _FP_FORMATS:
            return f"quant_dtype {quant_dtype} not fp4x2/e4m3fn/e4m3fnuz"
        if quant_input.dim() != 2 or quant_input.shape[0] != M or quant_input.device != dev:
            return "quant_input not [M, N] on the ids' device"
        if quant_input.dtype not in _INPUT_DTYPES:
            return f"quant_input dtype {quant_input.dtype} not bf16/fp16"
        if quant_input.stride(1) != 1:
            return "quant_input not contiguous"
        N = quant_input.shape[1]
        if N % 32 or not 32 <= N <= MAX_MODEL_DIM:
            return with_values(f"quant_input width not a multiple of 32 in 32..{MAX_MODEL_DIM}", width=N)
        if math.prod(contract.mx_scale_shape(n_sorted, N)) > INT32_LIMIT:
            return with_values("tokens > int32 offset limit (scale buffer)", tokens=M, width=N)
        if M * max(quant_input.stride(0), N) > INT32_LIMIT * 2:
            return with_values("tokens > int32 offset limit (quant input)", tokens=M, row_stride=quant_input.stride(0))
    return None


def moe_sort_mx_quant(topk_ids, topk_weights, num_experts, model_dim, moebuf_dtype, block_size, *,
                      expert_mask=None, num_local_tokens=None,
                      quant_input=None, quant_dtype=None,
                      moe_buf=None, moe_buf_init=None, zero_moe_buf=True,
                      quant_semantics: str = "auto", checked: bool = False, kept: list | None = None
                      ) -> SortQuantResult:
    """Sort ``topk_ids`` for the MoE GEMMs, fill ``moe_buf`` and MX-quantize ``quant_input``.

    Outputs have AITER's sizes and dtypes; the caller must have checked
    :func:`unsupported_reason` (``checked=True``: it just did, with these same arguments, and
    the check is not repeated). ``zero_moe_buf=False`` leaves ``moe_buf`` alone (a given one is
    returned as is, else a ``(0, 0)`` placeholder, as AITER returns when it does not zero).
    ``kept``: an empty list gets the plan this call used, when the plan cache keeps it (a caller
    whose own key holds everything the plan key reads, :func:`plan_key_reads`, may then launch its
    later calls with :func:`run_kept`).
    """
    reason = None if checked else unsupported_reason(
        topk_ids, topk_weights, num_experts, model_dim, block_size, expert_mask, num_local_tokens,
        quant_input, quant_dtype, moe_buf, moe_buf_init)
    if reason is not None:
        raise ValueError(reason)
    if moe_buf_init is not None and not zero_moe_buf:
        raise ValueError("moe_buf_init needs zero_moe_buf=True")
    M, K = topk_ids.shape
    dev = topk_ids.device
    zero_moe_buf = bool(zero_moe_buf)
    moe_buf, init, x = _buffers(M, dev, model_dim, moebuf_dtype, topk_weights, quant_input, moe_buf, moe_buf_init,
                                zero_moe_buf)
    quant = quant_input is not None
    key = (M, K, num_experts, model_dim, block_size, dev, expert_mask is not None, num_local_tokens is not None,
           quant, quant_dtype if quant else None, quant_input.shape[1] if quant else 0, x.stride(0),
           moe_buf_init is not None, init.stride(0) if init.dim() == 2 else 0, zero_moe_buf,
           quant_semantics) + plan_key_reads()
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(key)
        if len(_plans) < MAX_PLANS and not torch.compiler.is_compiling():  # Dynamo: a plan per trace
            _plans[key] = plan
        else:
            kept = None  # a plan the cache does not keep is not handed out to be kept either
    if kept is not None and not kept:
        kept.append(plan)
    return _launch(plan, M, K, dev, topk_ids, topk_weights, x, quant_dtype if quant else None, expert_mask,
                   num_local_tokens, moe_buf, init)


def _buffers(M, dev, model_dim, moebuf_dtype, topk_weights, quant_input, moe_buf, moe_buf_init, zero_moe_buf):
    """``(moe_buf, init, x)`` as the launch takes them: AITER's ``[M, model_dim]`` buffer when none is
    given (its ``(0, 0)`` placeholder when it does not zero), the init rows (``moe_buf`` itself when
    none), the quant's input (``topk_weights`` when none: a placeholder the kernel does not read)."""
    if moe_buf is None:
        moe_buf = (_empty(M, model_dim, dtype=moebuf_dtype, device=dev) if zero_moe_buf
                   else _empty(0, 0, dtype=moebuf_dtype, device=dev))
    return (moe_buf, moe_buf_init if moe_buf_init is not None else moe_buf,
            quant_input if quant_input is not None else topk_weights)


API = moe_sort_mx_quant  # this module's own API: a caller keeping its plans launches them only while it is in place


def plan_key_reads() -> tuple:
    """What the plan key reads besides the call's arguments (its tail): the four kernels by id and
    :func:`_tunables` (a caller keeping plans under its own key puts these in it, read at every call).
    By id, as a JITFunction hashes its source: a plan holds its kernels, so no id it was made under is
    reused while it is kept."""
    return (id(_sort_quant_kernel), id(_chunk_rank_kernel), id(_chunk_scan_kernel), id(_scale_tiles_kernel),
            _tunables())


def run_kept(plan: "_SortPlan", topk_ids, topk_weights, model_dim, moebuf_dtype, expert_mask, num_local_tokens,
             quant_input, quant_dtype, moe_buf, moe_buf_init, zero_moe_buf: bool, outputs: "SortOutputs | None" = None
             ) -> SortQuantResult:
    """:func:`moe_sort_mx_quant` (checked, ``quant_semantics="auto"``) with ``plan``, which a call of
    this same plan key handed back through ``kept``: the caller's key fixes every value the plan key
    reads (the arguments' sizes, strides, devices and flags, and :func:`plan_key_reads`), so the plan
    key is not built again (issue 15: one key per sort hit). ``outputs``: the sort's tables and the
    quant's buffers to write, made by :func:`new_outputs` for this plan and quant dtype, instead of
    new ones (a caller that reuses them must know that nothing reads them after its own consumers)."""
    M, K = topk_ids.shape
    dev = topk_ids.device
    moe_buf, init, x = _buffers(M, dev, model_dim, moebuf_dtype, topk_weights, quant_input, moe_buf, moe_buf_init,
                                zero_moe_buf)
    return _launch(plan, M, K, dev, topk_ids, topk_weights, x, quant_dtype, expert_mask, num_local_tokens,
                   moe_buf, init, outputs)


class SortOutputs(NamedTuple):
    """What one launch of a plan writes besides ``moe_buf``: the four sort tables and, with a quant, its
    data and scales (as the caller gets them, and as ``uint8`` views for the kernel)."""

    sorted_ids: torch.Tensor
    sorted_weights: torch.Tensor
    sorted_expert_ids: torch.Tensor
    num_valid_ids: torch.Tensor
    quant: tuple[torch.Tensor, torch.Tensor] | None
    q_u8: torch.Tensor
    s_u8: torch.Tensor


def new_outputs(plan: "_SortPlan", M: int, dev, quant_dtype) -> SortOutputs:
    """The output allocations of one launch of ``plan`` (``quant_dtype`` None: no quant), as AITER's
    sort and quant helper make them."""
    sorted_ids = _empty(plan.n_sorted, dtype=torch.int32, device=dev)
    sorted_weights = _empty(plan.n_sorted, dtype=torch.float32, device=dev)
    sorted_expert_ids = _empty(plan.n_blocks, dtype=torch.int32, device=dev)
    num_valid_ids = _empty(2, dtype=torch.int32, device=dev)
    if quant_dtype is None:
        return SortOutputs(sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, None, sorted_weights,
                           sorted_weights)
    q_out = _empty(M, plan.data_cols, dtype=quant_dtype, device=dev)
    s_out = _empty(plan.scale_rows, plan.snp, dtype=torch.float8_e8m0fnu, device=dev)
    return SortOutputs(sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, (q_out, s_out),
                       q_out.view(torch.uint8), s_out.view(torch.uint8))


def outputs_bytes(plan: "_SortPlan", M: int, quant_dtype) -> int:
    """Device bytes of :func:`new_outputs` for this plan (the fp4x2 / fp8 data and e8m0 scales: a byte each)."""
    n = 4 * (2 * plan.n_sorted + plan.n_blocks + 2)
    return n if quant_dtype is None else n + M * plan.data_cols + plan.scale_rows * plan.snp


def _launch(plan, M, K, dev, topk_ids, topk_weights, x, quant_dtype, expert_mask, num_local_tokens, moe_buf,
            init, outputs=None) -> SortQuantResult:
    """The allocations and launches of ``plan`` (``quant_dtype`` None: no quant; ``x``: the quant's
    input, else ``topk_weights``; ``outputs``: :func:`new_outputs`' set to write, else a new one)."""
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, out_quant, q_u8, s_u8 = (
        outputs if outputs is not None else new_outputs(plan, M, dev, quant_dtype))
    mask_arg = expert_mask if expert_mask is not None else topk_ids
    nlt_arg = num_local_tokens if num_local_tokens is not None else topk_ids
    pre = tot = ranks = compact = sorted_ids
    if plan.rank is not None:
        hist = _empty(plan.n_chunks, plan.e_bins, dtype=torch.int32, device=dev)
        pre = _empty(plan.n_chunks, plan.e_bins, dtype=torch.int32, device=dev)
        tot = _empty(plan.tot_size, dtype=torch.int32, device=dev)
        ranks = _empty(M * K, dtype=torch.int32, device=dev)
        _run(plan.rank, topk_ids, mask_arg, nlt_arg, hist, ranks)
        _run(plan.scan, hist, pre, tot, mask_arg)
    if plan.tiles is not None:  # large split-semantics batches: compact [M, G] scales, then the sorted rows
        compact = _empty(M, plan.G, dtype=torch.uint8, device=dev)
    _run(plan.sort, *plan.sort_pick((topk_ids, topk_weights, mask_arg, nlt_arg, sorted_ids, sorted_weights,
                                     sorted_expert_ids, num_valid_ids, x, q_u8, s_u8, moe_buf, init, pre, tot, ranks,
                                     compact)))
    if plan.tiles is not None:
        _run(plan.tiles, sorted_ids, num_valid_ids, compact, s_u8)
    return SortQuantResult(sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf, out_quant)


# ------------------------------------------------------------------ the per-shape plan

MAX_PLANS = 1024  # distinct call shapes kept; past it plans are made per call (same launches)
_plans: dict[tuple, "_SortPlan"] = {}


def _tunables() -> tuple:
    """The module constants a plan is derived from (benchmarks and tests change them)."""
    return (ONE_LAUNCH_MAX_PAIRS, ONE_LAUNCH_MAX_PAIR_BINS, FUSED_QUANT_MAX_PAIRS, CHUNK_PAIRS, SMALL_BATCH_CHUNK_PAIRS,
            SMALL_BATCH_MAX_TOKENS, SMALL_BATCH_MIN_CHUNK_TOKENS, DECODE_MAX_PAIRS, DECODE_PAIRS_PER_BIN,
            DECODE_PER_BIN_MIN_BINS,
            DECODE_COMPARE_MAX_PAIRS, DECODE_COMPARE_TILE, DECODE_SORT_SELECT, DECODE_NUM_WARPS, COUNT_NUM_WARPS, COUNT_GATHER, DECODE_MIN_PAIRS_PAD,
            DEFER_QUANT_MATH, QUANT_ONE_STEP_GROUPS, DECODE_COMPARE_T_MIN_PAIRS, DECODE_COMPARE_T_WARPS,
            DECODE_TILE, TILE, ROW_SPLIT_PROGRAMS, MIN_ROW_SPLIT, WIDE_ROW_ELEMS,
            ROLES_MAX_PAIRS, ROLES_PRESCANNED, ROUTE_SPLIT_DIV, DATA_MAX_GROUPS,
            QUANT_GROUPS, TILE_GROUPS, PRESCAN_TILE_STARTS, SCAN_MIN_TILE_BINS, SCAN_TILE_ELEMS, TOKEN_BUCKETS, PAD_STEP, _AMAX_FLOOR_BITS)


class _SortPlan(NamedTuple):
    """Everything :func:`moe_sort_mx_quant` derives from a call's shape: allocation sizes and the
    prepared launches (grid, scalars, constexprs). Python values only: never a tensor, so a plan
    first made during a CUDA-graph capture holds nothing of it."""

    n_sorted: int
    n_blocks: int
    data_cols: int
    scale_rows: int
    snp: int
    G: int
    n_chunks: int
    e_bins: int
    tot_size: int  # the scan launch's table: totals, per-tile starts and sums (and local ids with a mask)
    rank: Prepared | None
    scan: Prepared | None
    sort: Prepared
    tiles: Prepared | None
    kernels: tuple  # the four kernels the key names by id, kept alive so no id is reused while the plan is
    sort_pick: Any  # the sort launch's 17 tensors -> the distinct ones (see _sort_groups)


# the tensors of each launch, in the order _run passes them (positions in the kernel's argument list)
_SORT_TENSORS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 15, 16, 17, 18)


def _sort_groups(has_mask: bool, has_nlt: bool, quant: bool, has_init: bool, prescanned: bool,
                 compact_scales: bool) -> tuple[tuple, Any]:
    """The sort launch's tensors as :func:`moe_sort_mx_quant` builds them for a plan: which of its 17
    are the same tensor by construction (an absent mask or token count is ``topk_ids``; without a
    quant the input is ``topk_weights`` and the outputs ``sorted_weights``; without an init it is
    ``moe_buf``; the tables of launches that do not run are ``sorted_ids``), so that a call hands
    the prepared launch each distinct tensor once (``Prepared`` groups of positions), and
    ``itemgetter`` picking those from the 17."""
    alias = {}
    if not has_mask:
        alias[2] = 0
    if not has_nlt:
        alias[3] = 0
    if not quant:
        alias[8], alias[9], alias[10] = 1, 5, 5
    if not has_init:
        alias[12] = 11
    if not prescanned:
        alias[13] = alias[14] = alias[15] = 4
    if not compact_scales:
        alias[16] = 4
    heads = [i for i in range(len(_SORT_TENSORS)) if i not in alias]
    groups = tuple(tuple(_SORT_TENSORS[k] for k in range(len(_SORT_TENSORS)) if k == h or alias.get(k) == h)
                   for h in heads)
    return groups, operator.itemgetter(*heads)
_RANK_TENSORS = (0, 1, 2, 3, 4)
_SCAN_TENSORS = (0, 1, 2, 3)
_TILES_TENSORS = (0, 1, 2, 3)


def _run(prep: Prepared, *tensors) -> None:
    run_prepared(prep, launch, tensors)


def _make_plan(key: tuple) -> _SortPlan:
    (M, K, num_experts, model_dim, block_size, _dev, has_mask, has_nlt, quant, quant_dtype, N, x_stride,
     has_init, init_stride, zero_moe_buf, quant_semantics, *_) = key
    n_sorted, n_blocks = sort_sizes(M, K, num_experts, block_size)
    buf_mode = (2 if has_init else 1) if zero_moe_buf else 0

    fmt, G, snp, fused = _FP_FORMATS[torch.float4_e2m1fn_x2], 1, 8, False
    data_cols = scale_rows = 0
    if quant:
        G = N // contract.MX_GROUP
        scale_rows, snp = contract.mx_scale_shape(n_sorted, N)
        fmt = _FP_FORMATS[quant_dtype]
        if quant_semantics == "auto":
            fused = M * K <= FUSED_QUANT_MAX_PAIRS
        elif quant_semantics in ("fused", "split"):
            fused = quant_semantics == "fused"
        else:
            raise ValueError(f"quant_semantics {quant_semantics!r}")
        data_cols = N // 2 if fmt["FP4"] else N

    e_bins = expert_bin_count(num_experts)
    k_pad = _next_pow2(K)
    prescanned = _prescanned(M, K, e_bins)
    chunk_t, n_chunks = 1, 0
    rank = scan = tiles = None
    e_tile = min(e_bins, max(SCAN_MIN_TILE_BINS, e_bins // 64))
    n_tiles = e_bins // e_tile
    tile_starts = prescanned and PRESCAN_TILE_STARTS and not quant
    if prescanned:
        chunk_t = _chunk_tokens(M, K, e_bins)
        n_chunks = _cdiv(M, chunk_t)
        pc = _next_pow2(chunk_t * K)
        rank = Prepared(_chunk_rank_kernel, (n_chunks,), _RANK_TENSORS, (None,) * 5 + (M, num_experts), dict(
            K=K, E_BINS=e_bins, CHUNK_T=chunk_t, PC=pc, PC_BITS=pc.bit_length() - 1,
            HAS_MASK=has_mask, HAS_NLT=has_nlt, num_warps=4 if pc <= 1024 else 8))
        scan = Prepared(_chunk_scan_kernel, (n_tiles,), _SCAN_TENSORS, (None,) * 4 + (n_chunks, num_experts, block_size),
                        dict(E_BINS=e_bins, E_TILE=e_tile, C_TILE=max(SCAN_TILE_ELEMS // e_tile, 1), N_TILES=n_tiles, TILE_STARTS=tile_starts,
                             HAS_MASK=has_mask))

    compact_scales = prescanned and quant and not fused
    g_pad = _next_pow2(G)
    batch = _batch_params(M, K, e_bins, k_pad, g_pad, quant, model_dim)
    warps = sort_warps(batch)
    split, fill_split, _ = batch.pop("split"), batch.pop("fill_split"), batch.pop("warps")
    args = [None] * 23
    args[9], args[14] = x_stride, init_stride
    args[19:23] = (M, num_experts, model_dim, G)
    sort_at, sort_pick = _sort_groups(has_mask, has_nlt, quant, has_init, prescanned, compact_scales)
    sort = Prepared(_sort_quant_kernel, (max(M, 1), split), sort_at, args, dict(
        K=K, K_PAD=k_pad, BLOCK=block_size, PAD_STEP=PAD_STEP, E_BINS=e_bins, **batch,
        HAS_MASK=has_mask, HAS_NLT=has_nlt,
        QUANT=quant, **fmt, FLOOR_BITS=_AMAX_FLOOR_BITS,
        SNP=snp, FUSED=fused,
        BUF_MODE=buf_mode, D_BLOCK=min(_next_pow2(max(model_dim, 16)), 2048),
        D_SPLIT=_round_up(_cdiv(model_dim, fill_split), 16),
        PRESCANNED=prescanned, CHUNK_T=chunk_t, COMPACT_SCALES=compact_scales, DEFER_QUANT=DEFER_QUANT_MATH,
        TILE_STARTS=tile_starts, E_TILE=e_tile if prescanned else 1,
        N_TILES=n_tiles if prescanned else 1,
        num_warps=warps,
    ))
    if compact_scales:
        tiles = Prepared(_scale_tiles_kernel, (scale_rows // 32,), _TILES_TENSORS, (None,) * 4 + (G, M),
                         dict(SNP=snp, GC=min(_next_pow2(snp), TILE_GROUPS)))
    return _SortPlan(n_sorted, n_blocks, data_cols, scale_rows, snp, G, n_chunks, e_bins, 3 * e_bins + 2 * n_tiles,
                     rank, scan, sort, tiles,
                     (_sort_quant_kernel, _chunk_rank_kernel, _chunk_scan_kernel, _scale_tiles_kernel), sort_pick)


def _one_launch_max_pairs(e_bins: int) -> int:
    """The most routing pairs the one-launch path takes with ``e_bins`` expert bins:
    ``ONE_LAUNCH_MAX_PAIRS``, less where the per-program count would pass ``ONE_LAUNCH_MAX_PAIR_BINS``
    (never below the pairs the E-independent decode methods take)."""
    return min(ONE_LAUNCH_MAX_PAIRS, max(ONE_LAUNCH_MAX_PAIR_BINS // e_bins, _decode_max_pairs(e_bins)))


def _decode_max_pairs(e_bins: int) -> int:
    """The most pairs (a bucket's ceiling) the E-independent decode methods take with ``e_bins`` expert bins:
    ``DECODE_MAX_PAIRS``, or ``DECODE_PAIRS_PER_BIN`` per bin from ``DECODE_PER_BIN_MIN_BINS`` bins."""
    per_bin = DECODE_PAIRS_PER_BIN * e_bins if e_bins >= DECODE_PER_BIN_MIN_BINS else 0
    return max(DECODE_MAX_PAIRS, int(per_bin))


def _prescanned(M: int, K: int, e_bins: int) -> bool:
    """Whether a batch takes the launches that build the rank tables first (more routing pairs than
    :func:`_one_launch_max_pairs`) instead of the one-launch path."""
    return max(M * K, 1) > _one_launch_max_pairs(e_bins)


def _chunk_tokens(M: int, K: int, e_bins: int) -> int:
    """Tokens per chunk of the rank tables of a prescanned batch: ``CHUNK_PAIRS`` pairs; in token buckets up
    to ``SMALL_BATCH_MAX_TOKENS`` (chosen for the bucket, so one variant per bucket) at most
    ``SMALL_BATCH_CHUNK_PAIRS`` but no fewer than ``SMALL_BATCH_MIN_CHUNK_TOKENS`` tokens (a wide topk does not
    make a chunk, and a row of the rank tables, per token)."""
    full = max(1, _prev_pow2(CHUNK_PAIRS // K))
    if _bucket_tokens(M, K, e_bins) > SMALL_BATCH_MAX_TOKENS:
        return full
    return min(full, max(_prev_pow2(max(SMALL_BATCH_CHUNK_PAIRS // K, 1)), SMALL_BATCH_MIN_CHUNK_TOKENS))


def _bucket_tokens(M: int, K: int, e_bins: int) -> int:
    """The ceiling of ``M``'s bucket in ``TOKEN_BUCKETS``, within the launch path ``M`` takes (one-launch
    buckets end at ``ONE_LAUNCH_MAX_PAIRS // K`` tokens whatever the experts: where the pair-bins end the path
    sooner, a lower ceiling would change the variant, not only its tiles: at 256 experts, topk 8, 65-128
    tokens, a ceiling of 128 turned the split roles on, 9.8 -> 10.5 µs on the H200); never below ``M``."""
    m_b = next((b for b in TOKEN_BUCKETS if b >= M), max(M, 1))
    if not _prescanned(M, K, e_bins):
        m_b = max(min(m_b, ONE_LAUNCH_MAX_PAIRS // K), M, 1)
    return m_b


def _batch_params(M: int, K: int, e_bins: int, k_pad: int, g_pad: int, quant: bool, model_dim: int) -> dict:
    """Every launch parameter of ``_sort_quant_kernel`` chosen from the token count, and the grid split.

    Chosen for the ceiling ``m_b`` of ``M``'s bucket (:func:`_bucket_tokens`), so every batch size of
    a bucket compiles the same variant: the position method and its tiles (:func:`_sort_params`)
    for ``m_b * K`` pairs, which is at least the real pair count (so ``PAIRS_PAD`` holds every pair).
    Any value is correct; the bucket only trades a few masked lanes (tiles sized for the ceiling)
    and fewer row-split programs near the bucket's floor.
    """
    m_b = _bucket_tokens(M, K, e_bins)
    split = max(1, min(max(_prev_pow2(max(ROW_SPLIT_PROGRAMS // m_b, 1)), MIN_ROW_SPLIT),
                       max(g_pad // 16, 1) if quant else max(model_dim // 1024, 1)))
    g_tile = g_pad // split if quant else 1
    prescanned = _prescanned(M, K, e_bins)
    sort = _sort_params(m_b * K, e_bins, k_pad, prescanned)
    if quant and (ROLES_PRESCANNED if prescanned else m_b * K <= ROLES_MAX_PAIRS):
        # split roles: data programs (codes, compact scales, moe_buf) beside the routing programs
        d_split = min(max(split, g_pad // DATA_MAX_GROUPS, 1), g_pad)
        r_split = max(1, split // ROUTE_SPLIT_DIV)
        g_dtile, g_tile = g_pad // d_split, g_pad // r_split
        return dict(split=r_split + d_split, fill_split=d_split, ROUTE_PROGRAMS=r_split, G_TILE=g_tile,
                    QG=_quant_step(g_tile), G_DTILE=g_dtile, QG_D=_quant_step(g_dtile), **sort)
    return dict(split=split, fill_split=split, ROUTE_PROGRAMS=0, G_TILE=g_tile, QG=_quant_step(g_tile),
                G_DTILE=1, QG_D=1, **sort)


def sort_warps(batch: dict) -> int:
    """The sort launch's warps for :func:`_batch_params`' answer: the position method's, else 4 while a quant
    step holds at most ``WIDE_ROW_ELEMS`` elements, else 8 (the benchmark keys its timings by it)."""
    return batch["warps"] or (4 if max(batch["QG"], batch["QG_D"]) * 32 <= WIDE_ROW_ELEMS else 8)


def _quant_step(g_tile: int) -> int:
    """Groups a program quantizes at a time of its share of ``g_tile`` groups (all of them in one step
    up to ``QUANT_ONE_STEP_GROUPS``)."""
    return g_tile if g_tile <= QUANT_ONE_STEP_GROUPS else min(g_tile, QUANT_GROUPS)


def _sort_params(pairs: int, e_bins: int, k_pad: int, prescanned: bool) -> dict:
    """Constexprs that choose how the sort kernel finds positions for up to ``pairs`` pairs (a
    bucket's ceiling): the tables of the launches before it (``prescanned``), the E-independent
    decode sort or comparison (up to ``DECODE_MAX_PAIRS`` pairs), or the per-program expert count;
    parameters a path does not read stay fixed, so they never cause a recompile."""
    decode, pp = 0, 1
    if not prescanned and pairs <= _decode_max_pairs(e_bins):
        pp = max(_next_pow2(pairs), DECODE_MIN_PAIRS_PAD)
        decode = 2 if pp <= DECODE_COMPARE_MAX_PAIRS else 1
    select = decode == 1 and DECODE_SORT_SELECT
    if decode == 2:
        ch = max(1, min(pp, DECODE_COMPARE_TILE // pp))
    elif decode == 1 and not select:
        ch = max(1, min(pp, DECODE_TILE // k_pad))
    else:
        ch = 1
    transposed = decode == 2 and pp >= DECODE_COMPARE_T_MIN_PAIRS
    out = dict(DECODE=decode, PAIRS_PAD=pp, PAIRS_BITS=pp.bit_length() - 1, CMP_CHUNK=ch, SORT_SELECT=select,
               COMPARE_T=transposed,
               warps=DECODE_NUM_WARPS or (DECODE_COMPARE_T_WARPS if transposed else 0) if decode else 0)
    if prescanned or decode:
        return dict(out, COUNT_CHUNK=2, USE_HIST=False, RANK_CHUNK=2, COUNT_GATHER=False)
    return dict(out, **_count_params(pairs, e_bins), RANK_CHUNK=max(2, min(_next_pow2(pairs), TILE // k_pad)),
                COUNT_GATHER=COUNT_GATHER, warps=COUNT_NUM_WARPS)


def decode_path(num_tokens: int, topk: int, num_experts: int = 1) -> str:
    """Which one-launch position method a call of this size takes (chosen for its token bucket):
    "sort", "compare", "count" (per-program expert count over all bins) or "prescanned" (four
    launches)."""
    e_bins = expert_bin_count(num_experts)
    if _prescanned(num_tokens, topk, e_bins):
        return "prescanned"
    pairs_b = _bucket_tokens(num_tokens, topk, e_bins) * topk
    return ("count", "sort", "compare")[_sort_params(pairs_b, e_bins, 1, False)["DECODE"]]


def _count_params(pairs: int, e_bins: int) -> dict:
    """Tile size and method of the expert count over ``pairs`` pairs (see ``_count_experts``)."""
    chunk = _next_pow2(pairs)
    if chunk * e_bins <= TILE:
        return dict(COUNT_CHUNK=max(chunk, 2), USE_HIST=False)
    return dict(COUNT_CHUNK=min(chunk, 1024), USE_HIST=True)


def launch_count(num_tokens: int, topk: int, num_experts: int, quant: bool, fused: bool) -> int:
    """Kernels :func:`moe_sort_mx_quant` launches (``fused``: the quant's resolved semantics)."""
    return 3 + (quant and not fused) if _prescanned(num_tokens, topk, expert_bin_count(num_experts)) else 1
