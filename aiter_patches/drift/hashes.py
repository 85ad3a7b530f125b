"""The source-hash pin of a function a patch relies on without wrapping it, read live or from files.

A signature pin says nothing of what a function does; a patch that mirrors
logic it does not wrap (how ``moe_sorting`` routes, what SGLang computes around
its hooks) pins that logic by a hash of its source. The same hash is computed in
two places: at apply time from the live function (``inspect``; a mismatch skips
the patch) and by ``aiter-patches drift`` from a release's files (a mismatch is a
warning). One definition here, so the two can never hash differently.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Sequence


def source_hash(lines: Sequence[str]) -> str:
    """sha256 of a function's source: its lines (decorators included), each right-stripped, joined by "\\n"."""
    text = "\n".join(line.rstrip() for line in lines)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def live_source_reason(fn: Any, pin: Any) -> str | None:
    """The apply-time gate of a relied-on function: None when the live ``fn``'s source hashes to
    ``pin`` (a :class:`SourcePin`: its ``sha256`` or one of ``also``), else why not."""
    try:
        lines, _ = inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        return f"cannot read its source to check the relied-on hash: {exc}"
    found = source_hash(lines)
    if found != pin.sha256 and found not in pin.also:
        return f"source changed (hash {found[:12]} != pinned {pin.sha256[:12]}, {pin.source}): re-read it"
    return None
