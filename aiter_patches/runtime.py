"""What a patched call needs at run time: counters, the strict switch, fail-safe fallback.

Wrappers run on every MoE call of a server, in many threads, possibly inside
CUDA-graph capture. Counting here is host-only bookkeeping (no device sync), a
fallback's reason is logged once at DEBUG, and a fast path that raises is logged
once at WARNING and handed back to AITER unless strict mode asks to re-raise.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from . import env_flags

log = logging.getLogger("aiter_patches")

_strict_override: bool | None = None


def strict() -> bool:
    """Strict mode: skips and fast-path errors raise instead of falling back."""
    if _strict_override is not None:
        return _strict_override
    return env_flags.env_true("AITER_PATCHES_STRICT")


def set_strict(value: bool | None) -> None:
    global _strict_override
    _strict_override = value


MAX_REASONS = 64  # distinct fallback reasons (and error kinds) kept per patch
OTHER_REASONS = "other reasons (past the 64 distinct kept per patch; each logged at DEBUG)"
OTHER_ERRORS = "other errors (past the 64 distinct kinds kept per patch; each logged at DEBUG)"


class PatchCounters:
    """Per-patch counts of fast-path hits, fallbacks by reason, and fast-path errors.

    Bounded over a server's life (issue 35): at most :data:`MAX_REASONS` distinct reasons, and as many error
    kinds, per patch; a call whose reason is new past that is counted under :data:`OTHER_REASONS`
    (:data:`OTHER_ERRORS`), its reason logged at DEBUG. Reasons name categories: a per-call value (a token
    count) goes to a DEBUG line of the patch that met it, not into the reason."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._fast = 0
        self._fallback: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._checks = [0, 0]  # the self-check's calls compared with AITER's: [passed, failed] (self_check.py)

    def checked(self, ok: bool) -> None:
        """One self-checked call: its outputs equalled AITER's (``ok``) or not."""
        with self._lock:
            self._checks[0 if ok else 1] += 1

    def hit(self) -> None:
        with self._lock:
            self._fast += 1

    def fallback(self, reason: str) -> None:
        with self._lock:
            seen = self._fallback.get(reason)
            first = seen is None
            if first and len(self._fallback) >= MAX_REASONS and reason != OTHER_REASONS:
                self._fallback[OTHER_REASONS] = self._fallback.get(OTHER_REASONS, 0) + 1
            else:
                self._fallback[reason] = (seen or 0) + 1
        if first:
            log.debug("aiter_patches: %s fell back to AITER: %s", self.name, reason)

    def failed(self, exc: BaseException, where: str) -> None:
        """Record a fast path that raised; re-raise in strict mode, else the caller falls back."""
        key = f"{where}: {type(exc).__name__}"
        with self._lock:
            seen = self._errors.get(key)
            first = seen is None
            if first and len(self._errors) >= MAX_REASONS and key != OTHER_ERRORS:
                self._errors[OTHER_ERRORS] = self._errors.get(OTHER_ERRORS, 0) + 1
            else:
                self._errors[key] = (seen or 0) + 1
        if strict():
            raise exc
        if first:
            log.warning(
                "aiter_patches: %s fast path raised in %s and fell back to AITER "
                "(logged once; see stats()): %s: %s",
                self.name, where, type(exc).__name__, exc,
            )

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "fast": self._fast,
                "fallback": dict(self._fallback),
                "errors": dict(self._errors),
                "checks_passed": self._checks[0],
                "checks_failed": self._checks[1],
            }

    def after_fork_in_child(self) -> None:
        """A fresh lock in a forked child: the parent's may have been held by a thread that is gone."""
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self._fast = 0
            self._fallback.clear()
            self._errors.clear()
            self._checks = [0, 0]


def triton_backend_reason(device) -> str | None:
    """Why Triton cannot run a kernel on ``device`` here, or None (graph-safe: reads no tensor)."""
    kind = getattr(device, "type", str(device))
    if kind == "cuda":  # NVIDIA and ROCm GPUs alike
        return None
    if kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    # the device's type, not its index: a reason is a category (issue 35)
    return f"tensors on {kind}: no Triton backend there (TRITON_INTERPRET=1 runs the kernels on CPU)"
