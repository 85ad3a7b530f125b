"""The declared patches: register, unregister, and the list every other entry point starts from.

``patches()`` registers what discovery finds the first time it is asked (needs
before their dependents, so that ``register()`` can check every name); a patch
registered by hand under a discovered name keeps its place.
"""

from __future__ import annotations

import logging

from ..runtime import PatchCounters
from . import discovery, needs, revert, state
from .declarations import APPLIED, CHECK_FAILED, PENDING, Patch

log = logging.getLogger("aiter_patches")

_discovered = False


def register(patch: Patch) -> Patch:
    """Declare a patch. Re-registering the same name replaces an inactive declaration.

    Raises ``ValueError`` for a patch that is applied or pending, and for needs
    that name an unregistered patch or come back to this one (``needs.py``).
    """
    with state.lock:
        old = state.states.get(patch.name)
        if old is not None and old.state in (APPLIED, PENDING, CHECK_FAILED):
            raise ValueError(f"patch '{patch.name}' is {old.state}; revert it before re-registering")
        needs.validate(patch)
        state.declared[patch.name] = patch
        state.states[patch.name] = state.PatchState()
        state.counters.setdefault(patch.name, PatchCounters(patch.name))
    return patch


def unregister(name: str) -> None:
    """Forget a patch (reverted first). Raises ``ValueError`` while a registered patch needs it."""
    with state.lock:
        users = [p.name for p in state.declared.values() if name in p.needs and p.name != name]
        if users:
            raise ValueError(f"patch '{name}' is needed by {', '.join(sorted(users))}; unregister those first")
        if name in state.states and state.states[name].state in (APPLIED, PENDING, CHECK_FAILED):
            revert.revert_one(name)
        state.declared.pop(name, None)
        state.states.pop(name, None)
        state.counters.pop(name, None)


def _ensure_discovered() -> None:
    global _discovered
    if _discovered:
        return
    with state.lock:  # the imports under the lock: fork() waits for them (see fork.py)
        if _discovered:
            return
        todo = [p for p in discovery.find() if p.name not in state.declared]
        while todo:
            ready = [p for p in todo if all(n in state.declared for n in p.needs)]
            for p in ready or todo:  # none ready: register() says why each is refused
                try:
                    register(p)
                except ValueError as exc:
                    log.warning("aiter_patches: patch '%s' left out: %s", p.name, exc)
            todo = [p for p in todo if p not in ready] if ready else []
        _discovered = True


def patches() -> list[Patch]:
    """Every registered patch, in declared order (``Patch.order``, then name)."""
    _ensure_discovered()
    with state.lock:
        return state.ordered()
