"""Where the declared patches come from: the packages of the discovery list, and an entry-point group.

Why found, not listed: a new patch is its own module (or folder) in one of
``PACKAGES`` and nothing else; the core, ``status()``, ``verify``, the drift
check, SIGNATURES.md and the tests take it from the registry. Each module (or
sub-package) of those packages that defines ``PATCH`` (a ``Patch``) is one.
Third parties add theirs through the entry-point group ``aiter_patches.patches``:
an entry point may name a ``Patch``, a module that defines ``PATCH``, or an
iterable of ``Patch``es; one that fails to load is logged and left out.

The packages are imported with importlib at the first need (the first
``patches()``, ``apply()`` or ``status()``), under the core's lock so that a
fork waits for it; importing them imports no AITER module (patch modules
declare targets by module path and import their kernels on first use). The
core imports no patch by name: this list is its only knowledge of where they are.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import pkgutil
from typing import Any, Iterable

from .declarations import Patch

log = logging.getLogger("aiter_patches")

PACKAGES = ("aiter_patches.patches", "aiter_patches.integrations")
ENTRY_POINT_GROUP = "aiter_patches.patches"


def find() -> list[Patch]:
    """Every patch of ``PACKAGES`` and of the entry-point group, each name once (the packages' first)."""
    found: dict[str, Patch] = {}
    for patch in [*_from_packages(), *_from_entry_points()]:
        if patch.name in found:
            if found[patch.name] is not patch:
                log.warning("aiter_patches: a second patch named '%s' was found and left out", patch.name)
            continue
        found[patch.name] = patch
    return list(found.values())


def _from_packages() -> list[Patch]:
    out = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            out.extend(_patches_of(importlib.import_module(f"{name}.{info.name}"), strict=False))
    return out


def _from_entry_points() -> list[Patch]:
    out = []
    try:
        points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as exc:  # unreadable metadata of some installed distribution: no third-party patches
        log.warning("aiter_patches: cannot read the entry points %s: %s: %s", ENTRY_POINT_GROUP,
                    type(exc).__name__, exc)
        return out
    for ep in sorted(points, key=lambda e: e.name):
        try:
            out.extend(_patches_of(ep.load(), strict=True))
        except Exception as exc:  # a third party's patch never fails apply()
            log.warning("aiter_patches: entry point %s = %s left out: %s: %s", ep.name, ep.value,
                        type(exc).__name__, exc)
    return out


def _patches_of(obj: Any, *, strict: bool) -> list[Patch]:
    """A ``Patch``; a module's ``PATCH``; an iterable of ``Patch``es. ``strict``: anything else raises ``TypeError``."""
    if isinstance(obj, Patch):
        return [obj]
    patch = getattr(obj, "PATCH", None)
    if isinstance(patch, Patch):
        return [patch]
    if strict and not isinstance(obj, (str, bytes)) and isinstance(obj, Iterable):
        items = list(obj)
        if all(isinstance(p, Patch) for p in items):
            return items
    if strict:
        raise TypeError(f"not a Patch, a module defining PATCH, or an iterable of Patches: {type(obj).__name__}")
    return []
