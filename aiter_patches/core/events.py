"""The core's events: how the reporting modules hear of the core without the core naming them.

The core emits; the modules above it (``process_report``, ``stats_log``,
``foreign_layers``) subscribe when they are imported, and ``aiter_patches/__init__``
imports them; so do the modules that own a lock (``call_key``'s verdict tables, the
kernels' ``fast_launch`` and ``hip_blockscale_asm``, the sort-output pool) for
``FORK_RENEW``, when they are imported. The core imports none of them, so it runs (and
is tested) alone.

Events, emitted to every subscriber in subscription order (a subscriber that
raises is logged at DEBUG; nothing reaches the core's caller):

- ``STATES_CHANGED(cause)``: patch states may have changed: after ``apply()``
  (cause ``"apply"``), after ``revert()`` (``"revert"``), after a watched module's
  import applied or re-examined pending patches (``"import"``). Emitted outside
  the core's lock.
- ``FORK_RENEW()``: in a forked child, first, once the core renewed its own
  locks: replace every lock you own (a thread of the parent may have held it,
  and that thread is gone). Start nothing, wait on nothing.
- ``FORK_RESTART(inherited)``: then, every lock of the package fresh: restart
  your threads, write the child's own lines. ``inherited``: each patch's counts
  at the fork (``{name: snapshot}``), which are not this process's.

Hooks, asked by the core, each subscriber answering with a dict of fields:

- ``STATUS_FIELDS(name, state)``: fields appended to that patch's ``status()`` record;
- ``STATS_FIELDS(name, state)``: fields added to its ``stats()`` entry.

Subscribing is done at import time, so this module needs no lock: a subscriber
is keyed by where it was defined, so a module imported again replaces its own.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("aiter_patches")

STATES_CHANGED = "states changed"
FORK_RENEW = "fork: renew locks"
FORK_RESTART = "fork: restart"
STATUS_FIELDS = "status fields"
STATS_FIELDS = "stats fields"

_subscribers: dict[str, dict[tuple[str, str], Callable[..., Any]]] = {}


def subscribe(event: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Call ``fn`` on ``event`` (one of the names above); returns ``fn`` (usable as a decorator's body)."""
    key = (getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", repr(fn)))
    _subscribers.setdefault(event, {})[key] = fn
    return fn


def unsubscribe(event: str, fn: Callable[..., Any]) -> None:
    subs = _subscribers.get(event, {})
    for key, held in list(subs.items()):
        if held is fn:
            del subs[key]


def emit(event: str, **payload: Any) -> None:
    """Tell every subscriber of ``event``; never raises."""
    for fn in tuple(_subscribers.get(event, {}).values()):
        try:
            fn(**payload)
        except Exception:  # a reporter must never break apply(), an import or a fork
            log.debug("aiter_patches: a subscriber of %r raised", event, exc_info=True)


def fields(hook: str, *args: Any) -> dict[str, Any]:
    """The fields every subscriber of ``hook`` adds, merged in subscription order; never raises."""
    out: dict[str, Any] = {}
    for fn in tuple(_subscribers.get(hook, {}).values()):
        try:
            out.update(fn(*args) or {})
        except Exception:
            log.debug("aiter_patches: a subscriber of %r raised", hook, exc_info=True)
    return out
