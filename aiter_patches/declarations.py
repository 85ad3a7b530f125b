"""What a patch is, as data: ``Patch``, ``Target``, ``SourcePin``, the ``Site`` its wrapper factory gets.

Why a module of its own: a patch module declares what it patches and nothing
more, so it imports this file, which holds no state, starts nothing and imports
neither torch nor AITER. The registry (``registry.py``) is the only code that
acts on these declarations; it re-exports them, so ``from aiter_patches.registry
import Patch`` keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

from .signatures import Binder, Pin

if TYPE_CHECKING:  # for annotations only: runtime holds the counters' lock
    from .runtime import PatchCounters

# A patch's state, as status() reports it.
APPLIED, SKIPPED, PENDING, DISABLED, INACTIVE = "applied", "skipped", "pending", "disabled", "inactive"


class PatchSkipped(RuntimeError):
    """Raised in strict mode when a patch cannot be applied; the message says why."""


@dataclass(frozen=True)
class SourcePin:
    """A function a patch relies on without wrapping it: its source hash is watched by the drift check."""

    module: str
    qualname: str
    sha256: str  # of the function's source text with trailing whitespace stripped per line
    why: str
    source: str = ""
    also: tuple[str, ...] = ()  # hashes of other releases whose change was read and found irrelevant


@dataclass(frozen=True)
class Target:
    module: str
    attr: str
    pins: tuple[Pin, ...]
    wrap: Callable[[Callable, "Site"], Callable]
    why: str = ""

    @property
    def location(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass
class CheckResult:
    """What a patch's equivalence check returns to ``aiter-patches verify``."""

    kind: str  # "bitwise" or "bound: <what>"
    ok: bool
    detail: str = ""


# A check: ``check(device) -> CheckResult``, or its "module:function" (imported only when verify runs it).
Check = Union[str, Callable[[Any], CheckResult]]


@dataclass(frozen=True)
class Patch:
    name: str
    summary: str
    targets: tuple[Target, ...]
    kernel_module: str | None = None
    order: int = 50  # among patches on one target: lower is outer (asked first)
    relies_on: tuple[SourcePin, ...] = ()
    check: Check | None = None  # the equivalence check `aiter-patches verify` runs, declared beside the patch
    # a patch of a server's code: stays inactive (not pending) where that top-level package is not installed
    requires: str | None = None
    # a further gate after a target's pin matched (e.g. a source hash): a reason skips the patch
    precheck: Callable[[Target, Callable], str | None] | None = None
    # after every binding of the patch is committed (under the registry lock): (site, original) per target.
    # What it changes must be undoable by revert (e.g. through ``unwrap_foreign(..., owner=name)``); it may not raise.
    after_apply: Callable[[list[tuple["Site", Callable]]], None] | None = None
    # a server integration (its group, "sglang"/"vllm"): disabled unless AITER_PATCHES_INTEGRATIONS names it
    opt_in: str | None = None

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules of its targets, each once, in declared order."""
        return tuple(dict.fromkeys(t.module for t in self.targets))


@dataclass
class Site:
    """What a wrapper factory gets: which pin matched, a binder for it, and the patch's counters."""

    patch: Patch
    target: Target
    pin: Pin
    binder: Binder
    counters: "PatchCounters"
