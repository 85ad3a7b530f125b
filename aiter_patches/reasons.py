"""Fallback reasons name categories; a call's own values go to a DEBUG line, once per category.

A patch counts its fallbacks by reason (``runtime.PatchCounters``), at most 64 distinct reasons
kept per patch, and each stats line carries them (issue 35). A reason that held a per-call
value (a token count, a shape, a size) would be a new reason for every batch size a server
runs: the 64 would fill with one category's numbers and every later category would be lost in
"other reasons". So a reason names the category and the limit it met ("topk outside 1..64"),
never the call's value; :func:`with_values` returns it unchanged and logs the values of the
first call that met it at DEBUG, for whoever needs to see which call that was.

Values bounded by configuration rather than by calls (a dtype, a kernel file's name) may stay
in a reason. Imports nothing heavy: kernels and patches call it on a verdict miss only.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("aiter_patches")

MAX_LOGGED = 256  # categories whose first values were logged; past it, none more (bounded as the counters are)
_logged: set[str] = set()


def with_values(reason: str, **values: Any) -> str:
    """``reason``; the first time this process meets it with DEBUG on, its call's ``values`` are logged."""
    if reason not in _logged and len(_logged) < MAX_LOGGED and log.isEnabledFor(logging.DEBUG):
        _logged.add(reason)  # a race logs a category twice at worst
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        log.debug("aiter_patches: %s (first call: %s)", reason, shown)
    return reason
