"""f32 -> bf16 rounding in integer arithmetic, so every backend writes the same bits.

Why: ``x.to(tl.bfloat16)`` is a hardware conversion on NVIDIA (``cvt.rn.bf16.f32``) and on
gfx950 (``v_cvt_pk_bf16_f32``), and Triton's own integer expansion on gfx942, which has no
such instruction (read in the generated code: tests/amd/test_rounding.py). All round to
nearest-even, but the NaN each writes is its own business (NVIDIA and Triton's gfx942
expansion the canonical 0x7FFF, gfx950 whatever its hardware quiets the input to), and
Triton's interpreter (triton 3.9) truncates instead of rounding (the same test shows it). Here the rounding is
spelled out on the fp32 bit pattern: round to nearest, ties to even, overflow to infinity,
subnormals kept (torch's ``Tensor.to(torch.bfloat16)`` bit for bit on every non-NaN), and every
NaN to 0x7FFF (NVIDIA's, and torch's on CUDA; torch's CPU build writes 0xFFFF or 0x7FC0
depending on the code path).
"""

import triton
import triton.language as tl

BF16_NAN = tl.constexpr(0x7FFF)  # a constexpr: a jit function may read only constexpr globals


@triton.jit
def f32_to_bf16_rne(x):
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, BF16_NAN, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
