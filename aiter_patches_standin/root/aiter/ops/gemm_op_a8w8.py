"""Stand-in for ``aiter/ops/gemm_op_a8w8.py`` (v0.1.20): the asm block-scale fp8 GEMM entry points.

``gemm_a8w8_blockscale_bpreshuffle_asm`` (AITER line 404) is plain Python over the
op ``_gemm_a8w8_blockscale_bpreshuffle_asm`` (line 377). Under that op, AITER's C++
launcher (``csrc/py_itfs_cu/asm_a8w8_blockscale_bpreshuffle.cu``) checks the
shapes, picks the tile and split count, memsets ``out`` when the split count is
above one, and launches the ``.co`` kernel whose splits add atomically. The
stand-in does the same with its Triton split-K kernel (``aiter_patches_standin.blockscale_gemm_splitk``,
whose splits add in a fixed order).

``gemm_a8w8_blockscale_bpreshuffle`` (AITER line 909) is the dispatcher servers call:
it takes ``out`` (or allocates ``Y``), looks the shape up in its tuned config and calls
the chosen kernel with ``Y`` positionally; for ``libtype == "asm"`` that is
``gemm_a8w8_blockscale_bpreshuffle_asm(XQ, WQ, Y, x_scale, w_scale, splitK=..., kernelName=...)``,
looked up in this module's globals at call time. The stand-in's tuned config is
``TUNED`` (``{(M, N, K): {"libtype": ..., "splitK": ...}}``, empty: every shape takes
the CK default, a one-split kernel that writes every element).
"""

import functools

import torch
from torch import Tensor

__all__ = [
    "gemm_a8w8_blockscale_bpreshuffle",
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
    cut K into that many runs of whole 128-wide tiles, else it raises as AITER's TORCH_CHECK does.
    The rule is written here again on purpose: the stand-in plays AITER, so a slip in
    ``aiter_patches.aiter_contract`` shows up as a difference against it."""
    tile_k = 128
    if splitK is None or splitK < 0:
        return 1
    split = splitK or 1
    per = -(-(-(-K // split)) // tile_k) * tile_k  # each split rounded up to whole K tiles
    actual = -(-K // per)
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
    from aiter_patches_standin import blockscale_gemm_splitk as kernel
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


# (M, N, K) -> AITER's tuned-config row for the dispatcher (libtype, splitK, kernelName); tests fill it
TUNED: dict = {}


class _Configs:
    """AITER's ``AITER_CONFIGS`` (``aiter/jit/core.py``): the tuned-CSV path the dispatcher passes to the lookup."""

    AITER_CONFIG_GEMM_A8W8_BLOCKSCALE_BPRESHUFFLE_FILE = "<stand-in: TUNED>"


AITER_CONFIGS = _Configs()


def get_CKGEMM_config(M: int, N: int, K: int, tuned_file: str | None = None):
    """AITER's lookup of the tuned CSV row for one shape (None: untuned); the stand-in has one table."""
    return TUNED.get((M, N, K))


def gemm_a8w8_blockscale_bpreshuffle_ck(XQ: Tensor, WQ: Tensor, x_scale: Tensor, w_scale: Tensor, Y: Tensor,
                                        kernelName: str = "") -> Tensor:
    """The stand-in's CK kernel: one split (no memset, every element written)."""
    _gemm_a8w8_blockscale_bpreshuffle_asm(XQ, WQ, Y, x_scale, w_scale, None, -1, None, 1, None)
    return Y


def gemm_a8w8_blockscale_bpreshuffle(
    XQ: Tensor,
    WQ: Tensor,
    x_scale: Tensor,
    w_scale: Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: Tensor | None = None,
) -> Tensor:
    """AITER line 909 (the tuned dispatcher), for the libtypes the stand-in has: asm, and CK otherwise."""
    assert dtype in (torch.bfloat16, torch.float16), f"Output {dtype=} is currently not supported in gemm_a8w8"
    m, n, k = XQ.shape[0], WQ.shape[0], XQ.shape[1]
    if out is not None:
        assert out.shape == (m, n) and out.dtype == dtype and out.device == XQ.device, (
            f"gemm_a8w8_blockscale_bpreshuffle: out buffer {tuple(out.shape)}/{out.dtype} != expected ({m},{n})/{dtype}"
        )
        Y = out
    else:
        Y = torch.empty(m, n, dtype=dtype, device=XQ.device)
    config = get_CKGEMM_config(m, n, k, AITER_CONFIGS.AITER_CONFIG_GEMM_A8W8_BLOCKSCALE_BPRESHUFFLE_FILE)
    if config is not None and config["libtype"] == "asm":
        return gemm_a8w8_blockscale_bpreshuffle_asm(XQ, WQ, Y, x_scale, w_scale, splitK=config["splitK"],
                                                    kernelName=str(config.get("kernelName", "")))
    return gemm_a8w8_blockscale_bpreshuffle_ck(XQ, WQ, x_scale, w_scale, Y)
