"""Example SortExtensions shipped with aiter_patches (each knows nothing of any model)."""

from .deferred_work import DeferredWork
from .precomputed_sort import PrecomputedSort

__all__ = ["DeferredWork", "PrecomputedSort"]
