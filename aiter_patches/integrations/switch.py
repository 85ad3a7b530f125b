"""The opt-in switch of the server integrations: ``AITER_PATCHES_INTEGRATIONS``.

A patch of a server's own code (SGLang's or vLLM's model code, not AITER's)
changes where that server adds its shared-expert output; users ask for it by
name, so it is off until switched on. The value is a comma list of server groups
(``sglang``, ``vllm``) and/or patch names; ``all`` turns on every integration.
An unknown word is an error naming the known ones (like ``AITER_PATCHES_DISABLE``).
This module reads the environment only; the registry calls it at ``apply()``.
"""

from __future__ import annotations

import os
from typing import Iterable

ENV = "AITER_PATCHES_INTEGRATIONS"
GROUPS = ("sglang", "vllm")


def requested(groups: dict[str, str]) -> set[str]:
    """The integration patch names switched on; ``groups`` maps each such patch name to its server group."""
    raw = os.environ.get(ENV, "")
    words = {w.strip() for w in raw.split(",") if w.strip()}
    if not words:
        return set()
    known = set(groups) | set(groups.values()) | set(GROUPS) | {"all"}
    unknown = sorted(words - known)
    if unknown:
        raise ValueError(f"{ENV} names unknown integration(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    if "all" in words:
        return set(groups)
    return {name for name, group in groups.items() if name in words or group in words}


def not_switched_on(patches: Iterable) -> dict[str, str]:
    """``{patch name: reason}`` for every opt-in patch the switch leaves off."""
    groups = {p.name: p.opt_in for p in patches if getattr(p, "opt_in", None)}
    on = requested(groups)
    return {name: f"opt-in: {ENV}={group} turns it on"  # short: one status line holds every patch
            for name, group in groups.items() if name not in on}
