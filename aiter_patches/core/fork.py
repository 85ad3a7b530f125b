"""Fork safety: the package's one fork handler.

Servers fork. A lock held by another thread at the fork is held for good in
the child (that thread is gone), so the child gets fresh ones, and fork() waits
(briefly) for a thread inside the core so that the child inherits consistent
tables. The order matters and lives here only: the handler renews every lock
first (the core's, the import hooks', each patch's counters', then every
subscriber's through ``FORK_RENEW``: the foreign-layer memo's, the stats log's,
the verdict tables', the fast launcher's, the sort-output pool's, the asm
launcher's),
and only then restarts what runs code that takes them (the import waiters, then
``FORK_RESTART``: the stats thread, the child's summary). Handlers registered
separately would run in import order, and a waiter restarted before the core's
lock was renewed would block on the old one forever.

Why every import of the package is at module level: an import running in one
thread when another forks leaves that module's import lock held in the child.
"""

from __future__ import annotations

import logging
import os
import threading

from . import events, import_hooks, state

log = logging.getLogger("aiter_patches")

FORK_WAIT_S = 1.0  # how long fork() waits for another thread to leave the core
_fork = threading.local()


def _before_fork() -> None:
    """Hold the lock across fork() so the child inherits consistent tables; never block fork() for long."""
    lock = state.lock
    _fork.lock = lock if lock.acquire(timeout=FORK_WAIT_S) else None


def _after_fork_in_parent() -> None:
    lock, _fork.lock = getattr(_fork, "lock", None), None
    if lock is not None:
        lock.release()


def _after_fork_in_child() -> None:
    """Fresh locks first, then what takes them."""
    held, _fork.lock = getattr(_fork, "lock", None) is not None, None
    state.lock = threading.RLock()
    import_hooks.renew_lock_after_fork()
    for c in list(state.counters.values()):
        c.after_fork_in_child()
    events.emit(events.FORK_RENEW)
    if not held:
        log.warning("aiter_patches: process %d was forked while another thread had been inside the patch registry "
                    "for over %.0f s; this child's patch states may be incomplete", os.getpid(), FORK_WAIT_S)
    inherited = {name: c.snapshot() for name, c in list(state.counters.items())}
    try:
        import_hooks.restart_waiters_after_fork()
    except Exception:  # e.g. no thread can be started: the patch stays pending
        log.warning("aiter_patches: could not restart the import waiters in process %d", os.getpid(), exc_info=True)
    events.emit(events.FORK_RESTART, inherited=inherited)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
