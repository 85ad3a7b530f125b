"""The patches as the registry declares them: names, target modules, locations.

Tests take every patch name and target module from here, never from a list
written by hand, so a patch added or renamed is tested without editing them.
A patch whose modules the stand-in AITER does not have (a server's module, say)
stays ``pending`` on it, or ``inactive`` where it requires a package that is not
installed: ``expected_on_stand_in()`` says so.
"""

from __future__ import annotations

from aiter_patches import registry
from aiter_patches.core import env
from aiter_patches.core.apply import installed
from helpers.standin import stand_in_has


def names() -> list[str]:
    """Every registered patch, in declared order (the order of ``status()`` and of the summary line)."""
    return [p.name for p in registry.patches()]


def patch(name: str):
    return next(p for p in registry.patches() if p.name == name)


def with_needs(name: str) -> list[str]:
    """``name`` and every patch it needs, transitively (``apply([name])`` applies them all), in declared order."""
    todo, found = [name], set()
    while todo:
        n = todo.pop()
        if n not in found:
            found.add(n)
            todo.extend(patch(n).needs)
    return [n for n in names() if n in found]


def modules(name: str) -> list[str]:
    return list(patch(name).modules)


def locations(name: str) -> list[str]:
    return [t.location for t in patch(name).targets]


def on_stand_in(module: str) -> bool:
    """Whether the stand-in AITER has this module (read from its files: nothing is imported)."""
    return stand_in_has(module)


def stand_in_names() -> list[str]:
    """The patches every module of which the stand-in has: they apply on it."""
    return [n for n in names() if all(on_stand_in(m) for m in modules(n)) and not opt_in_off(n)]


def expected_on_stand_in() -> dict[str, str]:
    """Each patch's state once every stand-in module is imported and ``apply()`` ran."""
    ok = set(stand_in_names())
    return {n: "disabled" if opt_in_off(n) else "applied" if n in ok else "inactive" if _requires_missing(n)
            else "pending" for n in names()}


def expected_before_import() -> dict[str, str]:
    """Each patch's state after ``apply()`` with nothing of AITER imported yet."""
    return {n: "disabled" if opt_in_off(n) else "inactive" if _requires_missing(n) else "pending" for n in names()}


def opt_in_off(name: str) -> bool:
    """A server integration the switch (AITER_PATCHES_INTEGRATIONS) leaves off: disabled whatever is installed."""
    return name in env.not_switched_on(registry.patches())


def _requires_missing(name: str) -> bool:
    req = patch(name).requires
    return req is not None and not installed(req)


def outermost_at(location: str) -> str:
    """The patch whose wrapper is the head of the chain at ``location`` (lowest order)."""
    live = set(stand_in_names())
    on_it = [p for p in registry.patches() if location in (t.location for t in p.targets) and p.name in live]
    return min(on_it, key=lambda p: (p.order, p.name)).name


def on_location(location: str) -> list[str]:
    """The patches that wrap ``location``, in declared order."""
    return [n for n in names() if location in locations(n)]


def shared_location() -> str:
    """The target location the most patches wrap (where chains, and their bugs, are)."""
    counts: dict[str, int] = {}
    for n in names():
        for loc in locations(n):
            counts[loc] = counts.get(loc, 0) + 1
    return max(counts, key=lambda loc: (counts[loc], loc))
