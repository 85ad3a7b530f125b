"""Knowing when a module has finished executing, without executing anything ourselves.

The core applies a pending patch the moment its AITER module is ready.
A module in ``sys.modules`` is not always ready: another thread may be in the
middle of importing it (its attributes do not exist yet), or it may be a
``importlib.util.LazyLoader`` module whose code has not run (touching any
attribute would run it). This module tells those states apart by reading only
the module's own ``__dict__`` and its spec, and calls back when the state
changes:

- ``when_imported``: our own small meta-path finder wraps the loader of the
  module's next import and calls back once its code ran (inside that import,
  so a callback's exception fails the import: strict mode relies on that).
  Cancelling removes the callback; nothing of another library is touched.
- ``when_initialized``: a module another thread is importing right now has
  already passed every finder; a daemon thread polls ``__spec__._initializing``
  (the flag importlib itself checks) and calls back once it is cleared, or
  once the failed import took the module out of ``sys.modules``.
- ``when_loaded_lazily``: the spec's loader of a lazy module is wrapped so that
  its deferred execution calls back.

The state is guarded by one plain lock, never held while calling out, and
replaced in a forked child (a thread of the parent may have held it) by the
core's single fork handler (``fork.py``), which restarts the waiter threads only after
every lock of the package is fresh.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
import time
import types
from typing import Any, Callable

log = logging.getLogger("aiter_patches")

MISSING, INITIALIZING, LAZY, READY = "missing", "initializing", "lazy", "ready"

Callback = Callable[[str, bool], None]  # (module name, called from inside that module's import)

_lock = threading.Lock()
_on_import: dict[str, list["Watch"]] = {}
_waiters: list["Watch"] = []
_finder: "_Finder | None" = None
_finding = threading.local()
_LazyModule = getattr(importlib.util, "_LazyModule", None)


# ---------------------------------------------------------------- reading a module without running it

def module_dict(module: Any) -> dict | None:
    """A module's ``__dict__`` read past any ``__getattribute__`` (a lazy module's runs its code); None if not a module."""
    if not issubclass(type(module), types.ModuleType):  # no isinstance(): it would read __class__
        return None
    try:
        d = object.__getattribute__(module, "__dict__")
    except Exception:
        return None
    return d if type(d) is dict else None


def is_lazy(module: Any) -> bool:
    """A LazyLoader module whose code has not run yet (its class changes back to ModuleType when it runs)."""
    cls = type(module)
    if cls is types.ModuleType:
        return False
    if _LazyModule is not None and issubclass(cls, _LazyModule):
        return True
    return cls.__name__ == "_LazyModule"


def readiness(name: str) -> str:
    """``missing``, ``initializing`` (its import is still running), ``lazy`` (not executed yet) or ``ready``."""
    module = sys.modules.get(name)
    if module is None:
        return MISSING
    if is_lazy(module):
        return LAZY
    d = module_dict(module)
    spec = d.get("__spec__") if d is not None else None
    if getattr(spec, "_initializing", False) is True:
        return INITIALIZING
    return READY


# ---------------------------------------------------------------- watches

class Watch:
    """One pending call-back; ``cancel()`` makes it inert and forgets it."""

    def __init__(self, name: str, callback: Callback, kind: str, module: Any = None):
        self.name, self.callback, self.kind, self.module = name, callback, kind, module
        self.active = True

    def cancel(self) -> None:
        self.active = False
        with _lock:
            lst = _on_import.get(self.name)
            if lst and self in lst:
                lst.remove(self)
                if not lst:
                    del _on_import[self.name]
            if self in _waiters:
                _waiters.remove(self)

    def _fire(self, during_import: bool) -> None:
        if self.active:
            self.active = False
            self.callback(self.name, during_import)


def when_imported(name: str, callback: Callback) -> Watch:
    """Call ``callback(name, True)`` at the end of the next execution of module ``name`` (inside its import)."""
    _install_finder()
    w = Watch(name, callback, MISSING)
    with _lock:
        _on_import.setdefault(name, []).append(w)
    return w


def when_initialized(name: str, callback: Callback) -> Watch:
    """Call ``callback(name, False)`` from a helper thread once the import of ``name`` in progress has ended."""
    w = Watch(name, callback, INITIALIZING, sys.modules.get(name))
    with _lock:
        _waiters.append(w)
    _start_waiter(w)
    return w


def when_loaded_lazily(name: str, callback: Callback) -> Watch:
    """Call ``callback(name, True)`` once the lazy module ``name`` executes (its first attribute access)."""
    module = sys.modules.get(name)
    w = Watch(name, callback, LAZY, module)
    spec = (module_dict(module) or {}).get("__spec__")
    loader = getattr(spec, "loader", None)
    if loader is None or not hasattr(loader, "exec_module"):
        return when_initialized(name, callback)  # cannot hook its execution: watch it from a thread
    spec.loader = _NotifyingLoader(loader, [w])
    return w


def _notify(name: str, watches: list[Watch]) -> None:
    """Run every call-back, then raise the first exception one raised (it fails the import, as strict mode asks)."""
    first: BaseException | None = None
    for w in watches:
        try:
            w._fire(True)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            first = first or exc
    if first is not None:
        raise first


# ---------------------------------------------------------------- the finder

class _NotifyingLoader:
    """Delegates to the real loader; after the module's code ran, calls the watches of its name."""

    def __init__(self, loader: Any, watches: list[Watch] | None = None):
        self._aiter_patches_loader = loader
        self._aiter_patches_watches = watches  # None: whatever is registered for the name at that time

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_aiter_patches_"):  # not set yet (a copy being built): no recursion
            raise AttributeError(attr)
        return getattr(self._aiter_patches_loader, attr)

    def create_module(self, spec):
        create = getattr(self._aiter_patches_loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        inner = self._aiter_patches_loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:  # introspection (importlib.resources, inspect) sees the real one
            spec.loader = inner
        if getattr(module, "__loader__", None) is self:
            try:
                module.__loader__ = inner
            except AttributeError:
                pass
        inner.exec_module(module)
        name = spec.name if spec is not None else module.__name__
        watches = self._aiter_patches_watches
        if watches is None:
            with _lock:
                watches = _on_import.pop(name, [])
        _notify(name, watches)


class _Finder:
    """A meta-path finder that only answers for watched names: it asks the finders after it, then wraps the loader."""

    def find_spec(self, fullname, path=None, target=None):
        with _lock:
            if fullname not in _on_import:
                return None
        busy = getattr(_finding, "names", None)
        if busy is None:
            busy = _finding.names = set()
        if fullname in busy:  # a finder after us asked the import system again
            return None
        busy.add(fullname)
        try:
            try:
                rest = sys.meta_path[sys.meta_path.index(self) + 1:]
            except ValueError:
                return None
            for finder in rest:
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            busy.discard(fullname)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _NotifyingLoader(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        pass


def _install_finder() -> None:
    global _finder
    with _lock:
        if _finder is None or _finder not in sys.meta_path:
            _finder = _Finder()
            sys.meta_path.insert(0, _finder)


# ---------------------------------------------------------------- waiting for an import in progress

def _start_waiter(w: Watch) -> None:
    threading.Thread(target=_wait, args=(w,), name=f"aiter_patches: wait for {w.name}", daemon=True).start()


def _wait(w: Watch) -> None:
    delay = 0.001
    while w.active:
        if sys.modules.get(w.name) is not w.module or readiness(w.name) != INITIALIZING:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    with _lock:
        if w in _waiters:
            _waiters.remove(w)
    try:
        w._fire(False)
    except Exception:  # the core logs its own problems; nothing may escape a helper thread
        log.debug("aiter_patches: a call-back after the import of %s raised", w.name, exc_info=True)


def renew_lock_after_fork() -> None:
    """A fresh lock in a forked child (a parent thread may have held this one). Called by the core's fork handler."""
    global _lock
    _lock = threading.Lock()


def restart_waiters_after_fork() -> None:
    """The helper threads did not survive the fork: restart them. Called by the core's fork handler once every
    lock of the package is fresh (a waiter that finds its module ready calls into the core at once)."""
    for w in list(_waiters):
        if w.active:
            _start_waiter(w)
