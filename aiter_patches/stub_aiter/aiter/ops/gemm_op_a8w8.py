"""Stand-in for ``aiter/ops/gemm_op_a8w8.py`` (v0.1.20): the asm block-scale fp8 GEMM entry points.

``gemm_a8w8_blockscale_bpreshuffle_asm`` (AITER line 404) is plain Python over the
op ``_gemm_a8w8_blockscale_bpreshuffle_asm`` (line 377). Under that op, AITER's C++
launcher (``csrc/py_itfs_cu/asm_a8w8_blockscale_bpreshuffle.cu``) checks the
shapes, picks the tile and split count, memsets ``out`` when the split count is
above one, and launches the ``.co`` kernel whose splits add atomically. The
stand-in does the same with the Triton split-K kernel of ``aiter_patches``.
"""

import functools

import torch
from torch import Tensor

__all__ = [
    "gemm_a8w8_blockscale_bpreshuffle_asm",
    "_gemm_a8w8_blockscale_bpreshuffle_asm",
    "get_zero_bias_buf",
]


@functools.lru_cache(maxsize=1024)
def _zero_bias_buf_keyed(device: torch.device, out_shape: int) -> Tensor:
    return torch.zeros(1, out_shape, dtype=torch.float32, device=device)


def get_zero_bias_buf(B: Tensor) -> Tensor:
    """AITER keys this cache by stream as well; the stand-in only needs a zero fp32 row."""
    return _zero_bias_buf_keyed(B.device, B.shape[0])


def launcher_split(K: int, splitK: int) -> int:
    """The split count AITER's launcher runs: ``splitK`` < 0 (not given) is 1; an explicit count must
    cut K into that many runs of whole 128-wide tiles, else it raises as AITER's TORCH_CHECK does."""
    from aiter_patches.kernels.hip_blockscale_asm import TILE_K, aligned_split

    if splitK is None or splitK < 0:
        return 1
    split = splitK or 1
    actual = aligned_split(K, split)
    per = -(-(-(-K // split)) // TILE_K) * TILE_K
    if actual != split or not (K % per == 0 or K // per == split - 1):
        raise RuntimeError(f"Kdim alignment check failed for splitK! Kdim={K}, splitK={split}, actual_ksplit={actual}")
    return split


def _gemm_a8w8_blockscale_bpreshuffle_asm(
    A: Tensor,
    B: Tensor,
    out: Tensor,
    A_scale: Tensor,
    B_scale: Tensor,
    bias: Tensor | None = None,
    splitK: int = -1,
    kernelName: str | None = None,
    bpreshuffle: int = 1,
    zero_bias_buf: Tensor | None = None,
) -> None:
    """AITER line 377 (the op) and its C++ launcher: check, choose the split, memset when split, launch."""
    from aiter_patches.kernels import blockscale_gemm_splitk as kernel
    from aiter_patches.reference.blockscale_gemm import a_scale_as_read_by_asm

    if bias is not None:
        raise NotImplementedError("the aiter_patches stand-in has no bias epilogue")
    A_scale = a_scale_as_read_by_asm(A_scale)  # AITER's asm reads ptr[kb * M + m] whatever the strides
    splits = launcher_split(A.shape[1], splitK)
    reason = kernel.unsupported_reason(A, B, out, A_scale, B_scale, splits, bool(bpreshuffle))
    if reason is not None:
        raise RuntimeError(f"gemm_a8w8_blockscale_bpreshuffle_asm: {reason}")
    # zero_out=True: a memset of `out` first when splits > 1, then the splits add into it
    kernel.blockscale_gemm_splitk(A, B, out, A_scale, B_scale, splits=splits, b_preshuffled=bool(bpreshuffle),
                                  zero_out=True)


def gemm_a8w8_blockscale_bpreshuffle_asm(
    A: Tensor,
    B: Tensor,
    out: Tensor,
    A_scale: Tensor,
    B_scale: Tensor,
    bias: Tensor | None = None,
    splitK: int | None = None,
    kernelName: str | None = None,
    bpreshuffle: bool | None = True,
    zero_bias_buf: Tensor | None = None,
) -> Tensor:
    """AITER line 404."""
    if bias is None and zero_bias_buf is None:
        zero_bias_buf = get_zero_bias_buf(B)
    _gemm_a8w8_blockscale_bpreshuffle_asm(
        A,
        B,
        out,
        A_scale,
        B_scale,
        bias,
        splitK if splitK is not None else -1,
        kernelName,
        int(bpreshuffle) if bpreshuffle is not None else 1,
        zero_bias_buf,
    )
    return out
