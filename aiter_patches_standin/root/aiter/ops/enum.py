"""Stand-in for ``aiter/ops/enum.py``: AITER builds these enums in C++ (module_aiter_core); the values match."""

from enum import IntEnum

__all__ = ["ActivationType", "QuantType", "MlaVersion"]


class ActivationType(IntEnum):
    No = -1
    Silu = 0
    Gelu = 1
    Swiglu = 2
    Situv2 = 3


class QuantType(IntEnum):
    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5
    per_256x128 = 6
    per_1024x128 = 7


class MlaVersion(IntEnum):
    V32 = 0
    V40 = 1
