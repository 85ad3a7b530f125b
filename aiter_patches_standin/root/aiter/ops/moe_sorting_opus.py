"""Stand-in for ``aiter/ops/moe_sorting_opus.py``: the opus sort op (default since v0.1.14)."""

from ._leaf_kernels import moe_sorting_opus_fwd, moe_sorting_opus_get_workspace_size

__all__ = ["moe_sorting_opus_fwd", "moe_sorting_opus_get_workspace_size"]
