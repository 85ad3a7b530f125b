"""Stand-in for ``aiter/utility/dtypes.py``: AITER's dtype aliases.

``fp8`` follows the emulated chip: gfx950 (e4m3fn) unless ``AITER_STUB_GFX=gfx942`` (e4m3fnuz).
"""

import os

import torch

_GFX = os.environ.get("AITER_STUB_GFX", "gfx950")

i4x2 = getattr(torch, "int4", torch.uint8)
fp4x2 = torch.float4_e2m1fn_x2
fp8 = torch.float8_e4m3fnuz if _GFX == "gfx942" else torch.float8_e4m3fn
fp8_e8m0 = torch.float8_e8m0fnu
fp16 = torch.float16
bf16 = torch.bfloat16
fp32 = torch.float32
u32 = torch.uint32
i32 = torch.int32
i16 = torch.int16
i8 = torch.int8
u8 = torch.uint8
i64 = torch.int64
