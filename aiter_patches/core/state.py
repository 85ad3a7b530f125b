"""The core's tables and its one lock: what is declared, each patch's state, the chains live on AITER's functions.

Every other module of the core reads and changes these under ``lock`` (an
``RLock``: apply calls revert, revert rebuilds chains). Read it as
``state.lock`` at each use, never bind it to another name: the fork handler
(``fork.py``) replaces it in a child.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..runtime import PatchCounters
from .declarations import INACTIVE, PENDING, Patch, Site, Target

if TYPE_CHECKING:
    from .import_hooks import Watch


@dataclass
class PatchState:
    state: str = INACTIVE
    reason: str = ""
    targets: list[dict[str, Any]] = field(default_factory=list)
    waiting: tuple[str, ...] = ()  # the modules a patch pending on their import waits for (none: on a need)

    def set(self, state: str, reason: str = "", targets: list[dict[str, Any]] | None = None,
            waiting: tuple[str, ...] = ()) -> None:
        self.state, self.reason, self.targets, self.waiting = state, reason, targets or [], waiting


@dataclass
class Layer:
    """One patch's layer on one target's chain."""

    patch: Patch
    target: Target
    site: Site
    fn: Callable | None = None  # the wrapper last built for this layer
    over: Callable | None = None  # what ``fn`` wraps
    built: list[tuple[Any, Callable]] = field(default_factory=list)  # (weakref to a wrapper, what it wraps)


@dataclass
class Chain:
    """The layers on one AITER function, outermost first, over the original; where its head is bound."""

    module: str
    attr: str
    original: Callable
    layers: list[Layer] = field(default_factory=list)
    current: Callable | None = None
    locations: set[tuple[str, str]] = field(default_factory=set)


lock = threading.RLock()
declared: dict[str, Patch] = {}
states: dict[str, PatchState] = {}
counters: dict[str, PatchCounters] = {}
chains: dict[tuple[str, str], Chain] = {}
# owner patch -> (module, name, the foreign wrapper unwrap_foreign took off there, what it put there, AITER's object)
unwrapped: dict[str, list[tuple[str, str, Callable, Callable, Callable]]] = {}
watches: dict[str, list["Watch"]] = {}  # module name -> what waits for it, while a patch is pending on it


def ordered() -> list[Patch]:
    """The declared patches in declared order (``Patch.order``, then name): the order of ``status()``."""
    return sorted(declared.values(), key=lambda p: (p.order, p.name))


def drop_unused_watches() -> None:
    """Cancel the watches of modules no pending patch waits for any more."""
    needed = {m for st in states.values() if st.state == PENDING for m in st.waiting}
    for module in [m for m in watches if m not in needed]:
        for w in watches.pop(module):
            w.cancel()
