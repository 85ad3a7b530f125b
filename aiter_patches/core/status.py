"""What the core tells: each patch's state and record, its counters, which AITER is loaded.

The records hold what the core knows (state, reason, targets, pins); modules
above it add their own fields through the ``STATUS_FIELDS`` and ``STATS_FIELDS``
hooks (``events.py``): ``foreign_layers`` adds the foreign layers seen.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from typing import Any

from .. import runtime
from ..runtime import PatchCounters
from . import catalog, events, import_hooks, state
from .declarations import APPLIED, DISABLED, PENDING, SKIPPED


class ApplyReport(dict):
    """``{patch name: status record}`` for the patches an ``apply()`` call was about.

    Printed (``repr``/``str``) one line per patch: ``name: state (reason)``.
    """

    def _names(self, state: str) -> list[str]:
        return [n for n, r in self.items() if r["state"] == state]

    @property
    def applied(self) -> list[str]:
        return self._names(APPLIED)

    @property
    def skipped(self) -> list[str]:
        return self._names(SKIPPED)

    @property
    def pending(self) -> list[str]:
        return self._names(PENDING)

    @property
    def disabled(self) -> list[str]:
        return self._names(DISABLED)

    def __repr__(self) -> str:
        lines = [f"{n}: {r['state']}" + (f" ({r['reason']})" if r.get("reason") else "") for n, r in self.items()]
        return "\n".join(lines) if lines else "(no patch)"

    __str__ = __repr__


def aiter_info() -> dict[str, Any]:
    mod = sys.modules.get("aiter")
    info: dict[str, Any] = {"imported": mod is not None, "version": None, "location": None}
    if mod is not None:
        info["version"] = getattr(mod, "__version__", None)
        info["location"] = os.path.dirname(getattr(mod, "__file__", "") or "") or None
        info["stand_in"] = bool(getattr(mod, "IS_AITER_PATCHES_STAND_IN", False))
    if info["version"] is None:
        try:
            info["version"] = importlib.metadata.version("amd-aiter")
        except (importlib.metadata.PackageNotFoundError, ValueError):
            pass
    return info


def record(name: str) -> dict[str, Any]:
    """One patch's status record (under the lock)."""
    p, st = state.declared[name], state.states[name]
    rec = {
        "name": name,
        "summary": p.summary,
        "state": st.state,
        "reason": st.reason,
        "kernel_module": p.kernel_module,
        "order": p.order,
        "targets": [dict(t) for t in st.targets]
        or [{"location": t.location, "signature": None, "pin": None, "aliases": []} for t in p.targets],
        "pins": {t.location: [pin.label for pin in t.pins] for t in p.targets},
    }
    rec.update(events.fields(events.STATUS_FIELDS, name, st.state))
    return rec


def status() -> dict[str, Any]:
    """Machine-readable state of every registered patch, and which AITER is loaded."""
    all_patches = catalog.patches()
    with state.lock:
        return {
            "aiter": aiter_info(),
            "strict": runtime.strict(),
            "patches": [record(p.name) for p in all_patches],
        }


def patch_state(name: str) -> str:
    """One patch's state (applied, skipped, pending, disabled, inactive)."""
    catalog.patches()
    return state.states[name].state


def stats() -> dict[str, dict[str, Any]]:
    """Per patch: fast-path hits, fallbacks by reason, fast-path errors. Host counters only."""
    catalog.patches()
    with state.lock:
        out = {name: c.snapshot() for name, c in state.counters.items()}
        for name, snap in out.items():
            snap.update(events.fields(events.STATS_FIELDS, name, state.states[name].state))
        return out


def reset_stats() -> None:
    with state.lock:
        for c in state.counters.values():
            c.reset()


def counters(name: str) -> PatchCounters:
    catalog.patches()
    return state.counters[name]


def about_to_apply() -> bool:
    """Whether a patch pending on an import is about to apply: each module it waits for is imported or being
    imported (its hook runs in a moment). A lazy module may never run: a patch waiting for one is not."""
    about = (import_hooks.READY, import_hooks.INITIALIZING)
    with state.lock:
        waits = [st.waiting for st in state.states.values() if st.state == PENDING and st.waiting]
    return any(all(import_hooks.readiness(m) in about for m in modules) for modules in waits)
