"""Split-K block-scale fp8 GEMM (Triton) that needs no pre-zeroed output: the stand-in's asm GEMM.

It serves only the stand-in AITER: its ``gemm_a8w8_blockscale_bpreshuffle_asm`` runs it with the
memset (as AITER's launcher runs its ``.co``), and ``gemm_backend`` launches it without the memset for
the ``gemm_out_zeroed`` patch. On AMD's AITER the patch launches AITER's own ``.co`` instead.

AITER's asm block-scale GEMM splits K across workgroups that atomically add into
`out`, so its launcher zeroes `out` with a memset launch before every split call.
This kernel makes the memset optional and the result deterministic:

* each split of an output tile writes its fp32 partial to a workspace;
* the last split to arrive (an atomic per-tile counter, acq_rel at GPU scope) sums
  the partials in split order 0..S-1, adds `out`'s current value once, rounds to
  bf16 and stores; it then resets the counter to 0 for the next launch.

So the bits depend only on the inputs and the split count, never on scheduling,
and "memset + GEMM" equals "GEMM into an output the caller already zeroed" bit for
bit. The counters need zeroing once per (device, stream) (cached here); the
workspace is a per-call `torch.empty`, which is safe under CUDA-graph capture.

Operand layouts are AITER's: A fp8 [M, K] (row stride free, K contiguous); B fp8
[N, K], contiguous, either plain or pre-shuffled by AITER's `shuffle_weight(B, (16, 16))`;
A_scale fp32, the logical [M, K/128] tensor read through its strides (AITER's memory
is K-major, so its logical view has strides (1, M); AITER's own argument is a contiguous
[M, K/128] reinterpretation of that memory: see reference.blockscale_gemm.a_scale_as_read_by_asm);
B_scale fp32 [N/128, K/128] read through its strides;
out bf16 [M, N] with unit column stride. A split covers whole 128-wide K tiles and
the split count must pass AITER's own alignment check (`valid_split`).

Host time: a one-launch call's sizes, grid and launch arguments are kept per shape (`_plans`,
Python values only) and launched through `fast_launch.Prepared`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from aiter_patches.aiter_contract import SCALE_BLOCK, k_tiles_per_split, valid_split  # AITER's rule; tests read them here
from aiter_patches.kernels import device_stream
from aiter_patches.kernels.fast_launch import Prepared, launch, run_prepared
from aiter_patches.kernels.rounding import f32_to_bf16_rne  # the same bits on every backend (see rounding.py)

FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, name)
)
MAX_SPLITS = 16
# The fp32 split partials (splits * M * N * 4 bytes) never take more than this per launch: a
# larger call runs as several launches over row blocks (same bits), and the gemm_out_zeroed
# patch hands it back to AITER (counted) rather than allocate, e.g., 1.6 GB at
# M=4096, N=24576, 4 splits.
MAX_WORKSPACE_BYTES = 256 << 20


@triton.jit
def _blockscale_gemm_kernel(
    a_ptr, b_ptr, out_ptr, as_ptr, bs_ptr, ws_ptr, cnt_ptr,
    M, N, K_TILES, KT_PER_SPLIT, SPLIT_STRIDE,
    stride_am, stride_om, stride_asm, stride_ask, stride_bsn, stride_bsk,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    B_PRESHUFFLED: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    BLOCK_K: tl.constexpr = 128
    pid_ns = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = pid_ns // SPLITS
    split = pid_ns % SPLITS
    kb_start = split * KT_PER_SPLIT
    kb_end = tl.minimum(kb_start + KT_PER_SPLIT, K_TILES)
    K = K_TILES * BLOCK_K

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (kb_start * BLOCK_K + offs_k)[None, :]
    if B_PRESHUFFLED:
        # A group of 16 weight rows is one contiguous run of 16*K bytes; one 128-wide K tile
        # of that group is 16*128 consecutive bytes of it: load those runs as they lie
        # (wide, coalesced loads) and permute in registers. Computing each element's
        # shuffled address instead measured 2-10x slower on an H200.
        offs_g = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
        offs_run = kb_start * (BLOCK_K * 16) + tl.arange(0, BLOCK_K * 16)
        b_ptrs = b_ptr + offs_g[:, None].to(tl.int64) * (K * 16) + offs_run[None, :]
        b_step = BLOCK_K * 16
    else:
        b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * K + (kb_start * BLOCK_K + offs_k)[:, None]
        b_step = BLOCK_K
    as_ptrs = as_ptr + offs_m * stride_asm + kb_start * stride_ask
    bs_ptrs = bs_ptr + (pid_n * BLOCK_N // 128) * stride_bsn + kb_start * stride_bsk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(kb_start, kb_end):
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        b = tl.load(b_ptrs)
        if B_PRESHUFFLED:
            # (n0, k0, khalf, n_lo, k_lo) -> (k0, khalf, k_lo, n0, n_lo) = [K, N]
            b = b.reshape(BLOCK_N // 16, BLOCK_K // 32, 2, 16, 16).permute(1, 2, 4, 0, 3)
            b = b.reshape(BLOCK_K, BLOCK_N)
        sa = tl.load(as_ptrs, mask=m_mask, other=0.0)
        sb = tl.load(bs_ptrs)
        acc += tl.dot(a, b) * (sa * sb)[:, None]
        a_ptrs += BLOCK_K
        b_ptrs += b_step
        as_ptrs += stride_ask
        bs_ptrs += stride_bsk

    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLITS == 1:
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32)
        tl.store(out_ptrs, f32_to_bf16_rne(acc), mask=m_mask[:, None])
    else:
        ws_rows = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        split_stride = SPLIT_STRIDE.to(tl.int64)
        tl.store(ws_ptr + split * split_stride + ws_rows, acc, mask=m_mask[:, None])
        # Every thread's partial is written before one thread publishes the arrival.
        tl.debug_barrier()
        tile = pid_m * (N // BLOCK_N) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.load(ws_ptr + ws_rows, mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(ws_ptr + s * split_stride + ws_rows, mask=m_mask[:, None], other=0.0,
                                 cache_modifier=".cg")
            if ACCUMULATE:
                total += tl.load(out_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32)
            tl.store(out_ptrs, f32_to_bf16_rne(total), mask=m_mask[:, None])
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


def block_config(M: int) -> dict:
    """Tile shape, launch options and resident CTAs per SM (shared-memory bound), by M.

    The K tile is always 128 (the scale block). BLOCK_N=64 measured best at M <= 64 on an
    H200 (the benchmark's --tune, before it went with the kernel's move to the stand-in): more CTAs
    to keep weight loads in flight.
    """
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, ctas_per_sm=5)
    if M <= 32:
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=4, ctas_per_sm=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, ctas_per_sm=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, ctas_per_sm=2)


def choose_splits_triton(M: int, N: int, K: int, num_sms: int) -> int:
    """Default split count for this kernel: the most splits that still fit one wave of CTAs.

    Each split must keep >= 4 K tiles (>= 8 above M=16, where the fp32 partials it writes
    and the last CTA reads back grow with M) and pass AITER's alignment check.
    """
    cfg = block_config(M)
    tiles = math.ceil(M / cfg["BLOCK_M"]) * (N // cfg["BLOCK_N"])
    slots = num_sms * cfg["ctas_per_sm"]
    min_k_tiles = 4 if M <= 16 else 8
    best = 1
    for s in range(2, MAX_SPLITS + 1):
        if tiles * s > slots or k_tiles_per_split(K, s) < min_k_tiles:
            break
        if valid_split(K, s):
            best = s
    return best


def workspace_bytes(M: int, N: int, splits: int) -> int:
    """Bytes of fp32 split partials one launch over all ``M`` rows needs (none for one split)."""
    return splits * M * N * 4 if splits > 1 else 0


def workspace_reason(M: int, N: int, splits: int) -> str | None:
    """Why a call is above :data:`MAX_WORKSPACE_BYTES`, or None."""
    need = workspace_bytes(M, N, splits)
    if need > MAX_WORKSPACE_BYTES:
        return (f"split-K workspace {splits}*{M}*{N}*4 = {need} bytes exceeds MAX_WORKSPACE_BYTES "
                f"= {MAX_WORKSPACE_BYTES}")
    return None


def unsupported_reason(A, B, out, A_scale, B_scale, splits, b_preshuffled) -> str | None:
    """Why this kernel cannot take these arguments, or None. Reads metadata only (graph-safe)."""
    for name, t in (("A", A), ("B", B), ("out", out), ("A_scale", A_scale), ("B_scale", B_scale)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dim() != 2:
            return f"{name} must be 2-D, got {t.dim()}-D"
    dev = A.device
    if B.device != dev or out.device != dev or A_scale.device != dev or B_scale.device != dev:
        return "tensors are on different devices"
    if A.dtype not in FP8_DTYPES or B.dtype != A.dtype:
        return f"A and B must share an fp8 e4m3 dtype, got {A.dtype} and {B.dtype}"
    if out.dtype != torch.bfloat16:
        return f"out must be bfloat16, got {out.dtype}"
    if A_scale.dtype != torch.float32 or B_scale.dtype != torch.float32:
        return f"scales must be float32, got {A_scale.dtype} and {B_scale.dtype}"
    M, K = A.shape
    N = B.shape[0]
    if B.shape[1] != K:
        return f"B is {tuple(B.shape)}, A is {tuple(A.shape)}: K differs"
    if N % SCALE_BLOCK or K % SCALE_BLOCK:
        return f"N={N} and K={K} must be multiples of {SCALE_BLOCK}"
    if out.shape != (M, N):
        return f"out is {tuple(out.shape)}, expected {(M, N)}"
    if A_scale.shape != (M, K // SCALE_BLOCK):
        return f"A_scale is {tuple(A_scale.shape)}, expected {(M, K // SCALE_BLOCK)}"
    if B_scale.shape != (N // SCALE_BLOCK, K // SCALE_BLOCK):
        return f"B_scale is {tuple(B_scale.shape)}, expected {(N // SCALE_BLOCK, K // SCALE_BLOCK)}"
    if M > 0 and A.stride(1) != 1:
        return "A must have unit stride along K"
    if not B.is_contiguous():
        return "B must be contiguous"
    if M > 0 and out.stride(1) != 1:
        return "out must have unit stride along N"
    if not isinstance(splits, int) or isinstance(splits, bool) or not 1 <= splits <= MAX_SPLITS:
        return f"splits must be an int in 1..{MAX_SPLITS}, got {splits!r}"
    if not valid_split(K, splits):
        return f"splits={splits} does not cut K={K} into {splits} runs of whole {SCALE_BLOCK}-wide tiles"
    if b_preshuffled not in (True, False):
        return f"b_preshuffled must be a bool, got {b_preshuffled!r}"
    return None


_counters: dict[tuple[int, int], list[torch.Tensor]] = {}


_stream_key = device_stream.stream_key


def _tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per output tile, kept zero by the kernel itself.

    One buffer per (device, stream) so concurrent streams never share a counter. A
    larger request allocates a new buffer; the old ones stay alive because captured
    CUDA graphs may still point at them. A buffer first needed inside a CUDA-graph
    capture is not cached: its zero fill is a node of that graph alone (and its
    memory the graph's), so each capturing call gets its own, zeroed at every replay.
    """
    bufs = _counters.get(_stream_key(device), [])
    if bufs and bufs[-1].numel() >= n:
        return bufs[-1]
    if device_stream.capturing(device):
        return torch.zeros(n, dtype=torch.int32, device=device)
    buf = torch.zeros(max(n, 4096, 2 * bufs[-1].numel() if bufs else 0), dtype=torch.int32, device=device)
    _counters.setdefault(_stream_key(device), []).append(buf)
    return buf


def blockscale_gemm_splitk(A, B, out, A_scale, B_scale, *, splits: int, b_preshuffled: bool = True,
                           zero_out: bool = True, checked: bool = False) -> torch.Tensor:
    """out (bf16 [M, N]) <- block-scaled A @ B^T, K cut into `splits` runs.

    zero_out=True: AITER's behaviour, the result overwrites `out` (a memset launch
    first when splits > 1, as AITER's launcher does). zero_out=False: no memset; the
    result is added onto `out` as given, so a caller that already zeroed `out` gets
    the same bits as zero_out=True. checked=True: the caller just had `unsupported_reason` return
    None for these same arguments (not repeated).
    """
    reason = None if checked else unsupported_reason(A, B, out, A_scale, B_scale, splits, b_preshuffled)
    if reason is not None:
        raise ValueError(f"blockscale_gemm_splitk: {reason}")
    M, K = A.shape
    N = B.shape[0]
    if M == 0:
        return out
    plan = one_launch_plan(M, N, K, splits, b_preshuffled, zero_out, A.stride(0), out.stride(0),
                           A_scale.stride(0), A_scale.stride(1), B_scale.stride(0), B_scale.stride(1))
    if plan is not None:
        return run_plan(plan, A, B, out, A_scale, B_scale)
    cfg = block_config(M)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    rows = max(MAX_WORKSPACE_BYTES // workspace_bytes(1, N, splits) // block_m, 1) * block_m
    if splits > 1:  # always here: one split needs no workspace
        if zero_out:
            out.zero_()
        ws = torch.empty(splits * rows * N, dtype=torch.float32, device=A.device)
        cnt = _tile_counters(A.device, -(-rows // block_m) * (N // block_n))
    for m0 in range(0, M, rows):
        m = min(rows, M - m0)
        a, o, a_s = (A, out, A_scale) if m == M else (A[m0:m0 + m], out[m0:m0 + m], A_scale[m0:m0 + m])
        if splits == 1:
            ws = cnt = o  # unused by the kernel when SPLITS == 1
        launch(_blockscale_gemm_kernel, ((N // block_n) * splits, -(-m // block_m)),
            a, B, o, a_s, B_scale, ws, cnt,
            m, N, K // SCALE_BLOCK, k_tiles_per_split(K, splits), m * N,
            a.stride(0), o.stride(0), a_s.stride(0), a_s.stride(1), B_scale.stride(0), B_scale.stride(1),
            SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
            B_PRESHUFFLED=bool(b_preshuffled), ACCUMULATE=bool(splits > 1 or not zero_out),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return out


# ------------------------------------------------------------------ the per-shape plan (one-launch calls)

MAX_PLANS = 1024  # distinct call shapes kept; past it plans are made per call (same launch)
_plans: dict[tuple, "_GemmPlan"] = {}


class _GemmPlan(NamedTuple):
    """What a one-launch call derives from its shape: workspace and counter sizes and the prepared
    launch. Python values only (never a tensor)."""

    ws_numel: int
    counters: int
    splits: int
    zero_out: bool
    launch: Prepared
    kernel: object  # the kernel the key names by id, kept alive so the id is not reused
    config: object  # likewise the block_config function the key names


def one_launch_plan(M: int, N: int, K: int, splits: int, b_preshuffled: bool, zero_out: bool, s_am: int, s_om: int,
                    s_asm: int, s_ask: int, s_bsn: int, s_bsk: int) -> "_GemmPlan | None":
    """The kept plan of a checked call of this shape and these strides (``s_asm``/``s_ask``: the
    logical A_scale's), or None when its split partials need more than one launch (M > 0)."""
    if workspace_bytes(M, N, splits) > MAX_WORKSPACE_BYTES:
        return None
    key = (M, N, K, splits, bool(b_preshuffled), bool(zero_out), s_am, s_om, s_asm, s_ask, s_bsn, s_bsk,
           id(_blockscale_gemm_kernel), id(block_config))  # the tile choice is replaceable (a test may swap it)
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(key)
        if len(_plans) < MAX_PLANS and not torch.compiler.is_compiling():  # Dynamo: a plan per trace
            _plans[key] = plan
    return plan


def run_plan(plan: "_GemmPlan", A, B, out, A_scale, B_scale) -> torch.Tensor:
    """Launch ``plan`` (from :func:`one_launch_plan` for these operands' shapes and strides) into ``out``.

    Only the tensors' data pointers and dtypes are read here (the strides are the plan's): ``A_scale``
    may be any tensor whose data starts where the logical scale tensor's does (AITER's argument itself,
    not its strided view)."""
    if plan.splits > 1:
        if plan.zero_out:
            out.zero_()
        dev = A.device
        ws = torch.empty(plan.ws_numel, dtype=torch.float32, device=dev)
        cnt = _tile_counters(dev, plan.counters)
    else:
        ws = cnt = out  # unused by the kernel when SPLITS == 1
    run_prepared(plan.launch, launch, (A, B, out, A_scale, B_scale, ws, cnt))
    return out


def _make_plan(key: tuple) -> _GemmPlan:
    M, N, K, splits, b_preshuffled, zero_out, s_am, s_om, s_asm, s_ask, s_bsn, s_bsk, _, _ = key
    cfg = block_config(M)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    args = (None,) * 7 + (M, N, K // SCALE_BLOCK, k_tiles_per_split(K, splits), M * N,
                          s_am, s_om, s_asm, s_ask, s_bsn, s_bsk)
    prep = Prepared(_blockscale_gemm_kernel, ((N // block_n) * splits, -(-M // block_m)), tuple(range(7)), args, dict(
        SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
        B_PRESHUFFLED=b_preshuffled, ACCUMULATE=bool(splits > 1 or not zero_out),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return _GemmPlan(splits * M * N, -(-M // block_m) * (N // block_n), splits, zero_out, prep, _blockscale_gemm_kernel, block_config)
