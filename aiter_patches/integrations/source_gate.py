"""The apply-time gate of a server integration: the live functions it relies on still hash to their pins.

A server integration relies on the code around its hooks (where SGLang computes
the shared output, what runs between the routed call and the add), which no
signature shows. Each relied-on function is pinned by ``drift.source_hash`` of
its lines; a live function whose source differs is not patched (the patch is
skipped with the reason), and ``aiter-patches drift --server`` reports the same
from files, without importing the server.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..drift import live_source_reason


def reason(target: Any, original: Any, pins: Sequence[Any]) -> str | None:
    """The apply-time gate: the live function's source hashes to its pin (functions without a pin pass)."""
    qualname = getattr(original, "__qualname__", None)
    pin = next((p for p in pins if p.qualname == qualname), None)
    if pin is None:
        return None
    return live_source_reason(original, pin)
