"""Apply and revert, now or when AITER's modules are imported: the core's entry points.

``apply()`` takes each requested patch (and every patch it needs) in apply
order (``needs.py``): disabled by the environment, or settled (:func:`settle`)
into the state its needs and its modules allow: applied now (all or nothing,
``install.py``), pending until a module finishes executing, skipped, inactive.

A pending patch waits for its modules through ``import_hooks``: the next import
of a missing module, the end of an import in progress in another thread, a lazy
module's execution. Whichever comes first calls :func:`module_event`, which
settles every patch pending on that module, and every patch that needs one,
in the same pass. A patch already pending is settled again by every later
``apply()``: a module whose import went past every watch (another finder in
front of ours, an import in progress when the watch was set) is found ready, or
in progress and watched again, there (issue 35).

A module in ``sys.modules`` may still be running its code in another thread, or
be a lazy module that has not run it: both are waited for, never treated as
missing targets, and never executed here.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Iterable

from .. import runtime
from . import catalog, env, events, fork, import_hooks, install, needs, state, status  # noqa: F401 (fork: its handler)
from .declarations import APPLIED, CHECK_FAILED, DISABLED, INACTIVE, PENDING, SKIPPED, Patch, PatchSkipped
from .revert import revert_one

log = logging.getLogger("aiter_patches")


def apply(names: Iterable[str] | None = None, *, strict: bool | None = None) -> status.ApplyReport:
    """Apply patches (all by default, with every patch they need) now, or when AITER's modules get imported.

    Returns the status record of each requested patch. Unknown names, in
    ``names`` or in ``AITER_PATCHES_DISABLE``, raise ``ValueError``; nothing
    else raises outside strict mode.
    """
    all_patches = catalog.patches()
    known = [p.name for p in all_patches]
    requested = env.check_names(names, known, "apply()")
    disabled, why = env.disabled(known)
    off = env.not_switched_on(all_patches)
    if strict is not None:
        runtime.set_strict(strict)
    with state.lock:
        wanted = needs.closure(requested)
        for p in needs.apply_order():
            if p.name not in wanted:
                continue
            st = state.states[p.name]
            if st.state == CHECK_FAILED:  # stood down for this process's life (revert.stand_down)
                continue
            if p.name in disabled or p.name in off:
                if st.state in (APPLIED, PENDING):
                    revert_one(p.name)
                st.set(DISABLED, f"disabled by {why}" if p.name in disabled else off[p.name])
                continue
            settle(p)
        state.drop_unused_watches()
        report = status.ApplyReport((n, status.record(n)) for n in known if n in requested)
    events.emit(events.STATES_CHANGED, cause="apply")
    return report


def revert(names: Iterable[str] | None = None) -> list[str]:
    """Take patches off (all by default), dependents first, in reverse apply order; cancel pending hooks.

    Every binding the core changed that still holds its object gets the
    exact original back; a binding a third party changed since is left alone
    (logged), and the wrappers it may hold pass every call to the original.
    Returns the names that were reverted (with the dependents of the named ones). A patch that
    stood down (``check_failed``) becomes ``inactive``: the next ``apply()`` applies it afresh.
    """
    all_patches = catalog.patches()
    requested = env.check_names(names, [p.name for p in all_patches], "revert()")
    done: list[str] = []
    with state.lock:
        for p in reversed(needs.apply_order()):
            if p.name in requested and state.states[p.name].state in (APPLIED, PENDING, CHECK_FAILED):
                done += revert_one(p.name)
    events.emit(events.STATES_CHANGED, cause="revert")
    return done


def installed(package: str) -> bool:
    """Whether ``package`` can be imported here (a patch on a server's code is inactive where it is not)."""
    if package in sys.modules:
        return True
    try:
        spec = importlib.util.find_spec(package)
    except Exception as exc:  # a third party's finder may raise anything: apply() never does outside strict mode
        log.debug("aiter_patches: looking for %s raised %s: %s; taken as not installed", package,
                  type(exc).__name__, exc)
        return False
    # a bare directory of that name on sys.path is a namespace package (no origin): not the server's package
    return spec is not None and spec.origin is not None


def settle(p: Patch, just_executed: str | None = None) -> None:
    """Move ``p`` (requested, not disabled) to the state its package, needs and modules allow now. Under the lock.

    In order: a server's package not installed: ``inactive``; a need disabled,
    skipped or inactive: ``skipped``; applied and its needs applied: unchanged
    (nothing stacks); a module not executed yet: ``pending`` on it; a need
    pending (not ``pending_ok``): ``pending`` on that need; else applied now.
    ``just_executed``: the module whose import is calling us, ready though its
    import has not returned yet.
    """
    st = state.states[p.name]
    if st.state != APPLIED and p.requires is not None and not installed(p.requires):
        if st.state == PENDING:
            revert_one(p.name)
        st.set(INACTIVE, f"{p.requires} is not installed")
        return
    why = needs.blocker(p)
    if why is not None:
        if st.state in (APPLIED, PENDING):
            revert_one(p.name)
        if (st.state, st.reason) != (SKIPPED, why):
            log.info("aiter_patches: skipped patch '%s': %s", p.name, why)
        st.set(SKIPPED, why)
        return
    waited = needs.waited_for(p)
    if st.state == APPLIED:
        if not waited:
            return
        revert_one(p.name)  # a need went back to pending (a strict-mode import failed): wait with it
    waiting = {}
    for m in p.modules:
        r = import_hooks.READY if m == just_executed else import_hooks.readiness(m)
        if r != import_hooks.READY:
            waiting[m] = r
    if waiting:
        st.set(PENDING, f"waiting for import of {', '.join(waiting)}", waiting=tuple(waiting))
        for m, r in waiting.items():
            _watch(m, r)
        return
    if waited:
        st.set(PENDING, f"waiting for {', '.join(waited)}")
        return
    install.try_apply(p)


def _watch(module: str, readiness: str) -> None:
    """Be called back when ``module`` is ready: at its next import, and, if it is being imported or lazy now, then."""
    watches = [w for w in state.watches.get(module, []) if w.active]
    kinds = {w.kind for w in watches}
    try:
        if import_hooks.MISSING not in kinds:  # also the retry of an import that fails
            watches.append(import_hooks.when_imported(module, module_event))
        if readiness == import_hooks.INITIALIZING and readiness not in kinds:
            watches.append(import_hooks.when_initialized(module, module_event))
        elif readiness == import_hooks.LAZY and readiness not in kinds:
            watches.append(import_hooks.when_loaded_lazily(module, module_event))
    except Exception as exc:  # e.g. no thread can be started: the patch stays pending, apply() goes on
        log.warning("aiter_patches: cannot watch the import of %s: %s: %s", module, type(exc).__name__, exc)
    state.watches[module] = watches


def module_event(module: str, during_import: bool) -> None:
    """A watched module finished executing (``during_import``: we are inside its import), or its import ended.

    Settles every patch pending on ``module``, every patch pending on a need,
    and every applied patch that needs another (a need may have changed), in
    apply order: a dependent applies in the same pass as what it needs.

    In strict mode a patch that cannot apply raises ``PatchSkipped`` here,
    which fails that import: importlib then drops the module object, so the
    patches applied to it in this same pass are taken off again and wait for
    the caller's next import of it, and ``status()`` stays true to what is live.
    """
    errors: list[PatchSkipped] = []
    just = module if during_import else None
    with state.lock:
        for w in state.watches.pop(module, []):
            w.cancel()
        applied: list[str] = []
        for p in needs.apply_order():
            st = state.states[p.name]
            if st.state == PENDING:
                if module not in p.modules and st.waiting:
                    continue  # waits for other modules: their own events settle it
            elif st.state != APPLIED or not p.needs:
                continue
            was = st.state
            try:
                settle(p, just_executed=just)
            except PatchSkipped as exc:
                errors.append(exc)
                continue
            except Exception:  # never fail the user's import outside strict mode
                log.exception("aiter_patches: applying '%s' after the import of %s raised", p.name, module)
                continue
            if st.state == APPLIED and was != APPLIED:
                applied.append(p.name)
        if errors and during_import:
            taken: list[str] = []
            for name in reversed(applied):
                if state.states[name].state == APPLIED:
                    taken += revert_one(name)
            for p in needs.apply_order():  # pending again: the failed import left no module
                if p.name in taken:
                    try:
                        settle(p)
                    except PatchSkipped as exc:
                        errors.append(exc)
            _watch(module, import_hooks.MISSING)
        state.drop_unused_watches()
    events.emit(events.STATES_CHANGED, cause="import")
    if errors:
        raise errors[0]
