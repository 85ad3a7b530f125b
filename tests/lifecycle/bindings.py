"""Every binding the registry declares, checked by identity against what ``status()`` says is live.

For each target location of each registered patch: the patches ``status()``
calls applied there are exactly the layers found at the location (walking our
wrappers' ``__wrapped__``), in declared order; every alias ``status()``
records holds the same object; and a location no applied patch covers holds
the exact original object, as do all the aliases seen for it before.
"""

from __future__ import annotations

import sys

import aiter_patches
from aiter_patches import registry

MISSING = object()


def names() -> list[str]:
    return [p.name for p in registry.patches()]


def locations(name: str) -> list[str]:
    return [t.location for p in registry.patches() if p.name == name for t in p.targets]


def resolve(location: str):
    module, attr = location.rsplit(".", 1)
    mod = sys.modules.get(module)
    return MISSING if mod is None else mod.__dict__.get(attr, MISSING)


def layers(obj) -> list[str]:
    """The patch names of the aiter_patches wrappers at the top of ``obj``, outermost first."""
    out, seen = [], set()
    while id(obj) not in seen and getattr(obj, "__aiter_patches__", None):
        seen.add(id(obj))
        out.append(obj.__aiter_patches__)
        obj = obj.__wrapped__
    return out


def original_of(obj):
    for _ in layers(obj):
        obj = obj.__wrapped__
    return obj


class Bindings:
    """Remembers originals and aliases across checks within one import of the stand-in."""

    def __init__(self) -> None:
        self.originals: dict[str, object] = {}
        self.aliases: dict[str, set[str]] = {}

    def snapshot(self) -> None:
        """Record the object at every target location now (call before any patch applies)."""
        for name in names():
            for loc in locations(name):
                obj = resolve(loc)
                if obj is not MISSING:
                    assert not layers(obj), f"{loc} already wrapped: {layers(obj)}"
                    self.originals.setdefault(loc, obj)

    def check(self, expected: dict[str, str] | None = None) -> dict[str, str]:
        st = aiter_patches.status()
        states = {p["name"]: p["state"] for p in st["patches"]}
        if expected is not None:
            assert states == expected, f"states {states} != expected {expected}"
        order = {p.name: (p.order, p.name) for p in registry.patches()}
        applied_at: dict[str, set[str]] = {}
        recorded: dict[str, set[str]] = {}
        for rec in st["patches"]:
            for t in rec["targets"]:
                applied_at.setdefault(t["location"], set())
                if rec["state"] == "applied":
                    applied_at[t["location"]].add(rec["name"])
                    recorded.setdefault(t["location"], set()).update(t["aliases"])
        for name in names():
            for loc in locations(name):
                obj = resolve(loc)
                if obj is MISSING:
                    assert states[name] != "applied", f"{name} applied but {loc} is missing"
                    continue
                found = layers(obj)
                assert found == sorted(found, key=order.__getitem__), f"{loc}: chain out of order: {found}"
                assert set(found) == applied_at[loc], f"{loc}: live layers {found}, status says {applied_at[loc]}"
                if found:
                    orig = original_of(obj)
                    assert self.originals.setdefault(loc, orig) is orig, f"{loc}: wraps another original"
                    for alias in recorded.get(loc, ()):
                        assert resolve(alias) is obj, f"alias {alias} of {loc} does not hold the chain head"
                    self.aliases.setdefault(loc, set()).update(recorded.get(loc, ()))
                elif loc in self.originals:
                    assert obj is self.originals[loc], f"{loc}: not the exact original while nothing is applied"
                    for alias in self.aliases.get(loc, ()):
                        assert resolve(alias) is self.originals[loc], f"alias {alias} not restored"
        return states
