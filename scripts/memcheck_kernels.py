"""Run every Triton kernel once on adversarial inputs, for `compute-sanitizer --tool memcheck`.

Bad expert ids (negative, >= the expert count), num_local_tokens beyond capacity,
zero tokens, odd widths, every split count: none may touch memory outside its
buffers. Every case runs twice: the second call of a shape takes its per-shape plan and
the prepared direct launch (kernels/fast_launch.py). Run on a GPU:

    compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/memcheck_kernels.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiter_patches_standin import blockscale_gemm_splitk as gemm  # noqa: E402
from aiter_patches.kernels.moe_sort_mx_quant import moe_sort_mx_quant  # noqa: E402
from aiter_patches.reference.blockscale_gemm import shuffle_weight_16x16  # noqa: E402


def sort_cases(dev):
    for M, E, topk, dim, block in [(0, 8, 2, 256, 32), (1, 256, 8, 7168, 32), (37, 513, 11, 2048, 16),
                                   (300, 896, 16, 3584, 128), (2100, 256, 8, 7168, 64),
                                   (64, 256, 8, 7168, 32), (200, 128, 4, 6144, 32)]:  # 128-, 256-group data programs
        ids = torch.randint(0, E, (M, topk), device=dev, dtype=torch.int32)
        if M:
            ids[0, 0] = -1
            ids[M // 2, topk - 1] = E + 5
            ids[-1, 0] = 2**30
        w = torch.rand(M, topk, device=dev)
        x = torch.randn(M, dim, device=dev).to(torch.bfloat16)
        nlt = torch.tensor([M + 7], dtype=torch.int32, device=dev)  # beyond capacity: clamped on the device
        mask = (torch.rand(E, device=dev) > 0.5).to(torch.int32)
        for kwargs in ({}, {"num_local_tokens": nlt}, {"expert_mask": mask}):
            for qd in (None, torch.float4_e2m1fn_x2, torch.float8_e4m3fn):
                moe_sort_mx_quant(ids, w, E, dim, torch.bfloat16, block, quant_input=None if qd is None else x,
                                  quant_dtype=qd, moe_buf_init=torch.randn(M, dim, device=dev).to(torch.bfloat16),
                                  **kwargs)
        torch.cuda.synchronize()
        print(f"sort M={M} E={E} topk={topk} ok", flush=True)


def gemm_cases(dev):
    for M, N, K in [(1, 256, 1024), (7, 7168, 2048), (100, 1536, 7168)]:
        A = torch.randn(M, K, device=dev).to(torch.float8_e4m3fn)
        B = shuffle_weight_16x16(torch.randn(N, K, device=dev).to(torch.float8_e4m3fn))
        a_s = torch.rand(K // 128, M, device=dev).t()
        b_s = torch.rand(N // 128, K // 128, device=dev)
        out = torch.zeros(M, N, device=dev, dtype=torch.bfloat16)
        for split in (1, 2, 3, 4, 8, 16):
            if gemm.unsupported_reason(A, B, out, a_s, b_s, split, True) is None:
                gemm.blockscale_gemm_splitk(A, B, out, a_s, b_s, splits=split, zero_out=split % 2 == 0)
        torch.cuda.synchronize()
        print(f"gemm M={M} N={N} K={K} ok", flush=True)


if __name__ == "__main__":
    dev = torch.device("cuda")
    for _ in ("first calls", "plan hits"):
        sort_cases(dev)
        gemm_cases(dev)
    print("memcheck cases done")
