"""Benchmark: patched (one launch; four above ONE_LAUNCH_MAX_PAIRS pairs) MoE sort + moe_buf zero + MXFP4 quant vs a multi-launch torch path.

GPU time per call from CUDA-graph replay of many back-to-back calls (how a decode step runs),
median of several replays, inputs rotated over several sets, never all-zero. Every row also
shows, measured in the same run, the launch floor (an empty Triton kernel's replay time) and
the byte floor (bytes that must move over the measured device copy bandwidth).

    python bench/bench_moe_sort_quant.py --out docs/bench/moe_sort_quant_h200.md
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiter_patches.kernels import moe_sort_mx_quant as kernel  # noqa: E402
from aiter_patches.kernels.moe_sort_mx_quant import moe_sort_mx_quant, sort_sizes  # noqa: E402
from aiter_patches.reference.mx_quant import (  # noqa: E402
    e8m0_scale_bytes,
    mx_element_codes,
    mx_format,
    mx_scale_swizzle_index,
    scale_shape,
)
from bench.harness import copy_bandwidth, graph_us, launch_floor_us  # noqa: E402

DECODE = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
PREFILL = [2048, 8192, 32768]
MODELS = [(256, 8, 7168), (128, 4, 6144), (896, 16, 3584), (128, 8, 2048)]
BLOCK = 32
SETS = 3
FP4 = torch.float4_e2m1fn_x2


def graph_time_us(fn, calls: int, replays: int) -> float:
    """Median per-call time of ``calls`` back-to-back ``fn(i)`` captured in one CUDA graph."""
    return graph_us([functools.partial(fn, i) for i in range(calls)], calls, replays)


def torch_multi_launch(ids, w, x, num_experts, block, model_dim):
    """Sort with torch ops, zero moe_buf, MX-quantize, scatter the scales to sorted rows."""
    M, K = ids.shape
    dev = ids.device
    n_sorted, n_blocks = sort_sizes(M, K, num_experts, block)
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    e_sorted = flat[order]
    pos = seg_start[e_sorted] + torch.arange(M * K, device=dev) - cnt_start[e_sorted]
    sorted_ids = torch.full((n_sorted,), (K << 24) | M, dtype=torch.int32, device=dev)
    sorted_ids[pos] = (((order % K) << 24) | (order // K)).int()
    sorted_w = torch.zeros(n_sorted, dtype=torch.float32, device=dev)
    sorted_w[pos] = w.reshape(-1)[order]
    blocks = torch.arange(n_blocks, device=dev) * block
    sorted_e = torch.searchsorted(seg_end, blocks, right=True).int()
    num_valid = torch.stack([seg_end[-1], torch.full_like(seg_end[-1], M)]).int()
    moe_buf = torch.zeros(M, model_dim, dtype=torch.bfloat16, device=dev)

    fmt = mx_format(FP4)
    N = x.shape[1]
    groups = x.float().reshape(M, N // 32, 32)
    scale = e8m0_scale_bytes(groups, fmt)
    codes = mx_element_codes(groups, scale, fmt).reshape(M, N)
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    rows, snp = scale_shape(n_sorted, N)
    out_scale = torch.empty(rows * snp, dtype=torch.uint8, device=dev)
    g = torch.arange(N // 32, device=dev)
    addr = mx_scale_swizzle_index(pos[:, None], g[None, :], snp)
    out_scale[addr.reshape(-1)] = scale[order // K].reshape(-1).to(torch.uint8)
    return sorted_ids, sorted_w, sorted_e, num_valid, moe_buf, data, out_scale


def make_inputs(M, K, E, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.argsort(torch.rand(M, E, device="cuda", generator=g), dim=1)[:, :K].int().contiguous()
    w = torch.rand(M, K, device="cuda", generator=g) + 0.01
    x = (torch.randn(M, N, device="cuda", generator=g) + 0.1).bfloat16()
    return ids, w, x


def bench_one(M, E, K, N, bandwidth):
    sets = [make_inputs(M, K, E, N, s) for s in range(SETS)]
    calls, replays = (40, 7) if M <= 1024 else (6, 3)

    def fused(i):
        ids, w, x = sets[i % SETS]
        moe_sort_mx_quant(ids, w, E, N, torch.bfloat16, BLOCK, quant_input=x, quant_dtype=FP4)

    def multi(i):
        ids, w, x = sets[i % SETS]
        torch_multi_launch(ids, w, x, E, BLOCK, N)

    t_fused = graph_time_us(fused, calls, replays)
    t_multi = graph_time_us(multi, max(calls // 4, 2), replays)
    pairs = M * K
    moved = (pairs * 8  # ids + weights in
             + M * N * 2  # activations in
             + pairs * 8  # sorted ids + weights out (padding not counted)
             + M * N * 2  # moe_buf zeroed (bf16, model_dim = N)
             + M * N // 2  # fp4 data out
             + pairs * N // 32)  # scale bytes out
    byte_floor = moved / bandwidth * 1e6
    return t_fused, t_multi, byte_floor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="decode sizes of the first model only")
    args = ap.parse_args()

    floor_us = launch_floor_us()
    bandwidth = copy_bandwidth()
    models = MODELS[:1] if args.quick else MODELS
    tokens = DECODE if args.quick else DECODE + PREFILL
    lines = [
        f"# MoE sort + zero + MXFP4 quant on {torch.cuda.get_device_name()}",
        "",
        f"CUDA-graph replay, median per call; block_size {BLOCK}; launch floor (empty Triton kernel) "
        f"{floor_us:.2f} us; copy bandwidth {bandwidth / 1e9:.0f} GB/s. "
        "`multi` is the torch-op path (sort + zero fill + quant + scale sort), not AITER's HIP kernels.",
        "",
        "| experts | topk | hidden | tokens | launches | patched us | multi us | speedup | byte floor us "
        "| patched / max(floors) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for E, K, N in models:
        for M in tokens:
            t_fused, t_multi, byte_floor = bench_one(M, E, K, N, bandwidth)
            ratio = t_fused / max(floor_us, byte_floor)
            launches = 1 if M * K <= kernel.ONE_LAUNCH_MAX_PAIRS else 4
            lines.append(f"| {E} | {K} | {N} | {M} | {launches} | {t_fused:.2f} | {t_multi:.2f} | "
                         f"{t_multi / t_fused:.1f}x | {byte_floor:.2f} | {ratio:.2f} |")
            print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
