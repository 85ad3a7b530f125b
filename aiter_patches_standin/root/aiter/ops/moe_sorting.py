"""Stand-in for ``aiter/ops/moe_sorting.py``: the CK sort op (``AITER_USE_CK_MOE_SORTING=1``)."""

from ._leaf_kernels import moe_sorting_fwd

__all__ = ["moe_sorting_fwd"]
