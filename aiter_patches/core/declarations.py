"""What a patch is, as data: ``Patch``, ``Target``, ``SourcePin``, the ``Site`` its wrapper factory gets.

Why a module of its own: a patch module declares what it patches and nothing
more, so it imports this file, which holds no state, starts nothing and imports
neither torch nor AITER. The core (``aiter_patches/core``) is the only code that
acts on these declarations; ``aiter_patches.registry`` re-exports them, so
``from aiter_patches.registry import Patch`` keeps working.

How patches depend on each other is declared here too, never found out at call
time by reading another patch's state or marker:

- ``Patch.needs``: the patches this one works with. It is applied only while
  each of them is applied (see ``core/needs.py`` for the whole rule: apply and
  revert order, ``pending``, the ``skipped`` reason);
- ``Patch.pending_ok``: those of its needs it may be applied ahead of while they
  still wait for their module's import; its wrappers then ask their own site
  (``Site.needs_unmet()``) at call time;
- ``Site.below``: which patch's layer lies directly under this one on a target,
  told to the wrapper factory by the core when it composes the chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

from ..signatures import Binder, Pin

if TYPE_CHECKING:  # for annotations only: runtime holds the counters' lock
    from ..runtime import PatchCounters

# A patch's state, as status() reports it. CHECK_FAILED: it stood down for the process's life, its first
# calls having differed from AITER's (``aiter_patches/self_check.py``); apply() leaves it down.
APPLIED, SKIPPED, PENDING, DISABLED, INACTIVE = "applied", "skipped", "pending", "disabled", "inactive"
CHECK_FAILED = "check_failed"


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
    # after every binding of the patch is committed (under the core's lock): (site, original) per target.
    # What it changes must be undoable by revert (e.g. through ``unwrap_foreign(..., owner=name)``); it may not raise.
    after_apply: Callable[[list[tuple["Site", Callable]]], None] | None = None
    # a server integration (its group, "sglang"/"vllm"): disabled unless AITER_PATCHES_INTEGRATIONS names it
    opt_in: str | None = None
    # the patches this one works with (by name): applied before it, applied only while each is applied (else this
    # one is pending "waiting for X", or skipped "needs X, which is <state>: <X's reason>"), reverted after it
    needs: tuple[str, ...] = ()
    # names in ``needs`` this patch may be applied ahead of while they are pending (waiting for their import):
    # its wrappers ask ``site.needs_unmet()`` at call time
    pending_ok: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules of its targets, each once, in declared order."""
        return tuple(dict.fromkeys(t.module for t in self.targets))


def _all_met() -> str | None:
    return None


@dataclass
class Site:
    """What a wrapper factory gets: which pin matched, a binder for it, the patch's counters, its neighbours.

    ``below``: the patch whose layer lies directly under this one on this target
    (the wrapper given as ``inner``), or None when ``inner`` is AITER's object or
    a foreign one; set by the core each time it builds the wrapper, so a factory
    reads it when called. ``needs_unmet()``: None while every patch this one
    needs is applied, else ``"<need> is <state>"`` for the first that is not
    (cheap: for a call path; only a patch with ``pending_ok`` can see one).
    """

    patch: Patch
    target: Target
    pin: Pin
    binder: Binder
    counters: "PatchCounters"
    below: str | None = None
    stood_down: str | None = None  # why this layer hands every call to AITER: its self-check failed (self_check.py)
    needs_unmet: Callable[[], str | None] = _all_met
