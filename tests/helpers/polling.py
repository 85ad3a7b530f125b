"""Waiting for something another thread or an import watcher does, with a deadline (a hang fails, never blocks)."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float = 30.0, step: float = 0.005) -> bool:
    """True as soon as ``predicate()`` is; after ``timeout`` seconds, its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
