"""The registry: the public face of the core (``aiter_patches/core``), the names users and tests import.

A patch is declared (``core/declarations.py``: its targets, the signatures it
accepts, a wrapper factory, the patches it needs); the core performs it: all
or nothing per patch, only when every target's signature matches a pin, at
once or the moment AITER's module is imported, on every module-level alias of
the original, chained with other patches on the same target in declared
order, after the patches it needs, idempotent, thread-safe, and exactly
revertible. This module only hands the core's names on.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from .core.aliases import unwrap_foreign
from .core.apply import apply, revert
from .core.catalog import patches, register, unregister
from .core.chains import chain_head, visit_chains
from .core.declarations import (
    APPLIED,
    CHECK_FAILED,
    DISABLED,
    INACTIVE,
    PENDING,
    SKIPPED,
    CheckResult,
    Patch,
    PatchSkipped,
    Site,
    SourcePin,
    Target,
)
from .core.status import ApplyReport, about_to_apply, counters, reset_stats, stats, status
from .core.status import patch_state as state



@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Run the block with every applied patch taken off; re-apply the same ones afterwards (what a
    ``verify`` check runs AITER's own path under)."""
    applied = [r["name"] for r in status()["patches"] if r["state"] == APPLIED]
    revert(applied)
    try:
        yield
    finally:
        if applied:
            apply(applied)


__all__ = [
    "APPLIED", "CHECK_FAILED", "DISABLED", "INACTIVE", "PENDING", "SKIPPED",
    "ApplyReport", "CheckResult", "Patch", "PatchSkipped", "Site", "SourcePin", "Target",
    "about_to_apply", "apply", "chain_head", "counters", "patches", "register", "reset_stats", "revert", "state",
    "stats", "status", "suspended", "unregister", "unwrap_foreign", "visit_chains",
]
