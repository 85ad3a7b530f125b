"""Torch reference of AITER's block-scale fp8 GEMM contract (a8w8, 1x128 / 128x128 scales).

Written from the contract, not from any kernel, so that the Triton replacement and
AITER's own `.co` kernel can both be judged against it:

    out[m, n] = sum_kb  A_scale[m, kb] * B_scale[n // 128, kb]
                        * sum_{k in block kb} A[m, k] * B[n, k]

with fp32 accumulation and one rounding to the output dtype by the caller.

Layouts, as AITER passes them to `gemm_a8w8_blockscale_bpreshuffle_asm`:

* B is pre-shuffled by `shuffle_weight(B, layout=(16, 16))`; for 1-byte elements that
  is `view(N/16, 16, K/32, 2, 16).permute(0, 2, 3, 1, 4)` (`shuffle_weight_16x16`).
* A_scale memory is K-major: element (m, kb) lives at `ptr[kb * M + m]`. AITER's tests
  build it as `x_scale.transpose(0, 1).contiguous().view(M, K/128)`, a *contiguous*
  `[M, K/128]` tensor whose logical indexing is NOT the scale of (m, kb): the asm kernel
  ignores strides and reads raw memory. `a_scale_as_read_by_asm` turns such an argument
  into the logical `[M, K/128]` view (strides `(1, M)`) that this reference and the
  Triton kernel index through strides.
"""

from __future__ import annotations

import torch

from ..aiter_contract import SCALE_BLOCK  # noqa: F401  (re-exported)


def shuffle_weight_16x16(b: torch.Tensor) -> torch.Tensor:
    """[N, K] 1-byte weight -> AITER's (16, 16) pre-shuffled layout, same shape and dtype."""
    n, k = b.shape
    if b.element_size() != 1 or n % 16 or k % 32:
        raise ValueError(f"need 1-byte elements, N % 16 == 0, K % 32 == 0; got {b.dtype} {tuple(b.shape)}")
    raw = b.contiguous().view(torch.uint8)
    out = raw.view(n // 16, 16, k // 32, 2, 16).permute(0, 2, 3, 1, 4).contiguous()
    return out.view(n, k).view(b.dtype)


def unshuffle_weight_16x16(bs: torch.Tensor) -> torch.Tensor:
    """Inverse of `shuffle_weight_16x16`."""
    n, k = bs.shape
    if bs.element_size() != 1 or n % 16 or k % 32:
        raise ValueError(f"need 1-byte elements, N % 16 == 0, K % 32 == 0; got {bs.dtype} {tuple(bs.shape)}")
    raw = bs.contiguous().view(torch.uint8)
    out = raw.view(n // 16, k // 32, 2, 16, 16).permute(0, 3, 1, 2, 4).contiguous()
    return out.view(n, k).view(bs.dtype)


def a_scale_aiter_layout(x_scale: torch.Tensor) -> torch.Tensor:
    """Logical [M, K/128] scales -> the argument AITER's tests pass (K-major memory, shape [M, K/128])."""
    m, kt = x_scale.shape
    return x_scale.transpose(0, 1).contiguous().view(m, kt)


def a_scale_as_read_by_asm(a_scale_arg: torch.Tensor) -> torch.Tensor:
    """The logical [M, K/128] view of an A_scale argument as AITER's asm kernel reads it.

    The kernel reads `ptr[kb * M + m]` whatever the tensor's strides say, so the
    logical scale tensor is the same storage with strides (1, M). Zero-copy.
    """
    m, kt = a_scale_arg.shape
    if not a_scale_arg.is_contiguous() and a_scale_arg.stride() != (1, m):
        raise ValueError("A_scale must occupy M*K/128 consecutive elements (contiguous or strides (1, M))")
    return a_scale_arg.as_strided((m, kt), (1, m))


def blockscale_gemm_reference(
    A: torch.Tensor, B: torch.Tensor, A_scale: torch.Tensor, B_scale: torch.Tensor
) -> torch.Tensor:
    """fp32 [M, N] = block-scaled A @ B^T; B plain [N, K]; A_scale logical [M, K/128], any strides.

    Each 128-wide K block's product is accumulated in fp32, scaled, and summed over
    blocks in fp32. Round once (`.to(torch.bfloat16)`) to get the GEMM's output.
    """
    m, k = A.shape
    n, k2 = B.shape
    if k != k2 or k % SCALE_BLOCK or n % SCALE_BLOCK:
        raise ValueError(f"shapes A {tuple(A.shape)} B {tuple(B.shape)}: need equal K, K and N multiples of 128")
    kt = k // SCALE_BLOCK
    if tuple(A_scale.shape) != (m, kt) or tuple(B_scale.shape) != (n // SCALE_BLOCK, kt):
        raise ValueError(f"scale shapes {tuple(A_scale.shape)}, {tuple(B_scale.shape)} do not fit M={m} N={n} K={k}")
    a = A.to(torch.float32)
    b = B.to(torch.float32)
    sa = A_scale.to(torch.float32)
    sb = B_scale.to(torch.float32).repeat_interleave(SCALE_BLOCK, dim=0)  # [N, kt]
    out = torch.zeros(m, n, dtype=torch.float32, device=A.device)
    for kb in range(kt):
        cols = slice(kb * SCALE_BLOCK, (kb + 1) * SCALE_BLOCK)
        out += (a[:, cols] @ b[:, cols].T) * sa[:, kb, None] * sb[None, :, kb]
    return out
