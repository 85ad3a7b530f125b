"""Declared needs between patches: the order they apply in, who waits, who is skipped, who goes first on revert.

A patch names the patches it works with in ``Patch.needs`` (and, among them, in
``Patch.pending_ok`` those it may be applied ahead of). The rule, all of it
derived from the declarations, none of it found out at call time:

- ``register()``: every name in ``needs`` is registered already, ``pending_ok``
  is part of ``needs``, and no chain of needs comes back to the patch; else
  ``ValueError`` (discovery registers needs first).
- ``apply(names)`` applies the named patches and every patch they need,
  transitively: needs before their dependents (:func:`apply_order`: a
  topological order, ties broken by declared order).
- A dependent is applied only while each of its needs is applied:

  - a need ``disabled``, ``skipped`` or ``inactive``: the dependent is
    ``skipped``, reason ``needs X, which is <state>: <X's reason>`` (not a
    ``PatchSkipped`` in strict mode: X's own state says why);
  - a need ``pending`` (waiting for its module's import): the dependent is
    ``pending`` too (``waiting for X``, or ``waiting for import of M`` while its
    own modules are missing as well) and applies in the same pass as X,
    whichever thread's import brings it; unless X is in ``pending_ok``: then it
    applies as soon as its own modules are ready, and its wrappers ask their
    site (``Site.needs_unmet()``) at call time;
  - a need that turns ``skipped`` or ``pending`` again later (its import came
    and its pins did not match; a strict-mode import failed): a dependent
    applied ahead of it is reverted, then skipped or pending as above.

- ``revert(X)``, and X disabled by a later ``apply()``: X's dependents are
  reverted first (the last applied first); each is then ``inactive``, reason
  ``reverted with X, which it needs``. The next ``apply()`` applies it again,
  or skips it as above. ``revert()`` of everything goes in reverse apply order.
- ``unregister(X)`` while a registered patch needs X raises ``ValueError``.
"""

from __future__ import annotations

import heapq
from typing import Iterable

from . import state
from .declarations import APPLIED, DISABLED, INACTIVE, PENDING, SKIPPED, Patch

BLOCKING = (DISABLED, SKIPPED, INACTIVE)  # not CHECK_FAILED: its wrappers stay, handing every call to AITER


def validate(p: Patch) -> None:
    """At ``register()``: known needs, ``pending_ok`` within them, no cycle through ``p``."""
    unknown = [n for n in p.needs if n not in state.declared and n != p.name]
    if unknown:
        raise ValueError(f"patch '{p.name}' needs unknown patch(es) {', '.join(unknown)}; register them first "
                         f"(known patches: {', '.join(sorted(state.declared))})")
    stray = [n for n in p.pending_ok if n not in p.needs]
    if stray:
        raise ValueError(f"patch '{p.name}': pending_ok names {', '.join(stray)}, which it does not need")
    path = _path_back(p)
    if path:
        raise ValueError(f"patch '{p.name}': its needs form a cycle: {' -> '.join(path)}")


def _path_back(p: Patch) -> list[str]:
    """A chain of needs from ``p`` back to ``p`` (with ``p`` as declared now), or []."""
    graph = {name: q.needs for name, q in state.declared.items()}
    graph[p.name] = p.needs
    stack = [(p.name, [p.name])]
    seen: set[str] = set()
    while stack:
        name, path = stack.pop()
        for n in graph.get(name, ()):
            if n == p.name:
                return path + [n]
            if n not in seen:
                seen.add(n)
                stack.append((n, path + [n]))
    return []


def apply_order() -> list[Patch]:
    """Every declared patch, each after the patches it needs; otherwise in declared order."""
    waiting = {name: set(p.needs) & set(state.declared) for name, p in state.declared.items()}
    ready = [(p.order, p.name) for name, p in state.declared.items() if not waiting[name]]
    heapq.heapify(ready)
    out: list[Patch] = []
    while ready:
        _, name = heapq.heappop(ready)
        out.append(state.declared[name])
        for other, left in waiting.items():
            if name in left:
                left.discard(name)
                if not left:
                    q = state.declared[other]
                    heapq.heappush(ready, (q.order, q.name))
    return out


def closure(names: Iterable[str]) -> set[str]:
    """``names`` and every patch they need, transitively."""
    out: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in out or name not in state.declared:
            continue
        out.add(name)
        todo.extend(state.declared[name].needs)
    return out


def dependents(name: str) -> list[str]:
    """Every patch that needs ``name``, transitively, in the order to revert them (the last applied first)."""
    found: set[str] = set()
    todo = [name]
    while todo:
        n = todo.pop()
        for p in state.declared.values():
            if n in p.needs and p.name not in found:
                found.add(p.name)
                todo.append(p.name)
    return [p.name for p in reversed(apply_order()) if p.name in found]


def blocker(p: Patch) -> str | None:
    """The skip reason while a need of ``p`` is disabled, skipped or inactive, else None."""
    for n in p.needs:
        st = state.states.get(n)
        if st is not None and st.state in BLOCKING:
            return f"needs {n}, which is {st.state}" + (f": {st.reason}" if st.reason else "")
    return None


def waited_for(p: Patch) -> list[str]:
    """The needs of ``p`` that are pending and that it may not be applied ahead of."""
    return [n for n in p.needs if n not in p.pending_ok and state.states[n].state == PENDING]


def unmet(name: str) -> str | None:
    """``"<need> is <state>"`` for the first need of patch ``name`` not applied now, else None (a call path's question)."""
    p = state.declared.get(name)
    for n in p.needs if p is not None else ():
        st = state.states.get(n)
        if st is None or st.state != APPLIED:
            return f"{n} is {st.state if st is not None else 'unregistered'}"
    return None
