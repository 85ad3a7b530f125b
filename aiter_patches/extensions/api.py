"""What a sort extension is: the base class it subclasses, the call it is offered, the error it can cause.

Why a module of its own: the extensions shipped here (``DeferredWork``,
``PrecomputedSort``) and the patch that offers them each MoE sort call
(``patches/sort_extension``, whose ``verify`` check runs a ``PrecomputedSort``)
both need these types. Kept in the patch, the patch and the extensions imported
each other; here they depend on nothing else of the package, and both import them.
``aiter_patches.SortExtension`` and ``aiter_patches.SortExtensionError`` are these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


class SortExtensionError(ValueError):
    """An extension returned outputs that do not have the shape, dtype or device AITER would allocate."""


@dataclass(frozen=True)
class SortCall:
    """One ``_moe_sorting_impl`` call as an extension sees it: every parameter by name, read-only."""

    arguments: Mapping[str, Any]


class SortExtension:
    """Base class of a sort extension. Override :meth:`sort`; optionally :meth:`after_sort` and :meth:`close`.

    ``sort(call)`` returns None to decline, or AITER's five sort outputs
    ``(sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf)``,
    optionally with a sixth item ``(data, scale)``: the stage-1 MX quant of the
    activations, which ``fused_moe``'s stage-1 quant helper then returns as is.
    """

    @property
    def name(self) -> str:
        return type(self).__name__

    def sort(self, call: SortCall):
        return None

    def after_sort(self, call: SortCall, outputs: tuple) -> None:
        """Called after each sort this scope saw, whoever produced it (on the current stream)."""

    def close(self) -> None:
        """Called when the scope exits, also on exceptions: flush work that no call took."""
