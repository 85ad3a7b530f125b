"""Switch the patches on in a process that did not ask for them: the start-up path of run, auto and the vLLM plugin.

``start()`` runs very early (from ``sitecustomize``, a ``.pth`` line or a
plugin loader), often before logging is configured and always inside someone
else's process: it applies the patches (or registers the hooks that apply them
when AITER is imported), makes the INFO summary visible, and never raises.

This folder is put on ``PYTHONPATH`` by ``aiter-patches run``, so it holds
nothing but ``sitecustomize.py`` and this file: any other module here would
shadow a same-named module in every process the command starts.
"""

from __future__ import annotations

import logging
import os
import sys

BOOTSTRAP_DIR = os.path.dirname(os.path.abspath(__file__))

log = logging.getLogger("aiter_patches")

class _StderrUntilConfigured(logging.Handler):
    """Writes to stderr only while the root logger has no handler, so lines appear before and never twice after."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def _make_logs_visible() -> None:
    """INFO on the ``aiter_patches`` logger (or ``AITER_PATCHES_LOG_LEVEL``), shown on stderr until the host configures logging."""
    if log.level == logging.NOTSET:
        level = os.environ.get("AITER_PATCHES_LOG_LEVEL", "INFO").strip().upper()
        log.setLevel(level if isinstance(logging.getLevelName(level), int) else logging.INFO)
    if not log.handlers:  # a handler already there was put by the host, or by an earlier start()
        log.addHandler(_StderrUntilConfigured())


def start(via: str) -> None:
    """Apply every patch in this process now or when AITER is imported; log the summary; never raise."""
    try:
        _make_logs_visible()
        from .. import process_report, registry

        process_report.note_start(via)
        registry.apply()
        process_report.summary_after_fork = True  # the registry's fork handler writes it, after renewing every lock
    except Exception as exc:
        log.error("aiter_patches: could not apply the patches in process %d (via %s); it runs unpatched: %s: %s",
                  os.getpid(), via, type(exc).__name__, exc)
