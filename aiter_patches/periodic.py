"""A daemon thread that calls one function every N seconds: the reporters' periodic work.

Why one module: two reporters need the same thread, and had it written twice: ``stats_log`` (the stats
lines every ``AITER_PATCHES_STATS_INTERVAL`` seconds) and ``prometheus_export`` (the multiprocess push
every ``AITER_PATCHES_PROMETHEUS_INTERVAL`` seconds). The thread is a daemon (it never keeps a process
alive), is stopped and joined on request (at exit, before the last line or push; tests), and in a
forked child is forgotten without a join (the parent's thread is not in the child; each reporter
starts its own there, on the core's fork events). What runs, when a reporter starts, and what it does
at exit and around a fork (prometheus_export's wait for a push in progress) stay with the reporter.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("aiter_patches")

JOIN_TIMEOUT_S = 5.0  # how long stop() waits for a call in progress


class Periodic:
    """``fn()`` every ``seconds`` from a daemon thread named ``name``, between :meth:`start` and :meth:`stop`.

    ``fn`` should not raise; if it does, the exception is logged at DEBUG and the next period comes as
    usual (reporting must never break a server, nor stop reporting)."""

    __slots__ = ("name", "fn", "_thread", "_stop")

    def __init__(self, name: str, fn: Callable[[], None]):
        self.name, self.fn = name, fn
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None

    def start(self, seconds: float) -> None:
        """Start the thread (a thread already started by this object is stopped first)."""
        self.stop()
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(stop, seconds), name=self.name, daemon=True)
        self._thread, self._stop = thread, stop
        thread.start()

    def _run(self, stop: threading.Event, seconds: float) -> None:
        while not stop.wait(seconds):
            try:
                self.fn()
            except Exception:  # noqa: BLE001 - the next period comes all the same
                log.debug("aiter_patches: %s raised", self.name, exc_info=True)

    def stop(self) -> None:
        """Stop the thread and wait up to :data:`JOIN_TIMEOUT_S` for a call in progress (not when called
        from the thread itself)."""
        thread, stop = self._thread, self._stop
        if stop is not None:
            stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=JOIN_TIMEOUT_S)
        self._thread, self._stop = None, None

    def forget(self) -> None:
        """In a forked child: the parent's thread is not there; drop it without a join. Never blocks."""
        self._thread, self._stop = None, None

    @property
    def running(self) -> bool:
        """Whether this object's thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()
