"""A sort computed earlier (by a fused router kernel, say), handed to the sort AITER runs inside fused_moe.

The extension takes over only the sort call whose ``topk_ids`` is the very
tensor object the layout was made from, with the same storage address, shape
and strides, once; any other call (a copy, another view of the same memory) is
declined and AITER (or the one-launch sort) runs as usual. It holds that tensor
while it waits, so its memory cannot be recycled for another layer's ids.
"""

from __future__ import annotations

import logging

from ..patches.moe_call import tensor_key
from .api import SortCall, SortExtension

log = logging.getLogger("aiter_patches")


class PrecomputedSort(SortExtension):
    def __init__(self, topk_ids, outputs: tuple, quant: tuple | None = None):
        """``outputs``: AITER's five sort outputs for ``topk_ids``; ``quant``: optional stage-1 ``(data, scale)``."""
        if len(outputs) != 5:
            raise ValueError(f"outputs must be AITER's five sort outputs, got {len(outputs)} items")
        self._topk_ids = topk_ids  # held, so its address cannot be recycled for another tensor while we wait
        self._key = tensor_key(topk_ids)
        self._outputs = tuple(outputs)
        self._quant = quant
        self.used = 0

    def sort(self, call: SortCall):
        ids = call.arguments["topk_ids"]
        if self._outputs is None or ids is not self._topk_ids or tensor_key(ids) != self._key:
            return None
        out = self._outputs if self._quant is None else (*self._outputs, self._quant)
        self._outputs = self._quant = self._topk_ids = None  # once: a second layer must not reuse this layout
        self.used += 1
        return out

    def close(self) -> None:
        if self._outputs is not None:
            log.debug("aiter_patches: PrecomputedSort discarded an unused sort layout at scope exit")
        self._outputs = self._quant = self._topk_ids = None
