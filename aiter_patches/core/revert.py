"""Revert: a patch's layers off every chain, its bindings back to what they held, its dependents first.

Every binding the core changed that still holds its object gets the exact
original (or the rebuilt chain without this patch) back; a binding a third
party changed since is left alone (logged), and the wrappers it may hold are
disarmed (``disarm.py``). A patch that others need takes them off first
(``needs.py``): each is then ``inactive``, reason ``reverted with X, which it needs``.
"""

from __future__ import annotations

import logging

from . import aliases, chains, disarm, needs, state
from .declarations import APPLIED, CHECK_FAILED, INACTIVE, PENDING, SKIPPED

log = logging.getLogger("aiter_patches")


def revert_one(name: str, reason: str = "reverted") -> list[str]:
    """Take patch ``name`` off (applied or pending), its dependents first; returns every name taken off, in order.

    Under the core's lock.
    """
    done = []
    for other in needs.dependents(name):
        if state.states[other].state in (APPLIED, PENDING):
            done += _take_off(other, f"reverted with {name}, which it needs")
    return done + _take_off(name, reason)


def stand_down(name: str, reason: str) -> bool:
    """Applied patch ``name`` stood down for this process's life: its state becomes ``check_failed`` with
    ``reason`` (its first calls differed from AITER's, ``self_check.py``). Its wrappers stay where they are
    and hand every call to AITER (their sites say so: ``Site.stood_down``), so a caller passing the patch's
    keyword (``out_zeroed=True``, ``moe_addend=``) still gets AITER's result, and the patches that need it
    go on. ``apply()`` leaves it so; ``revert()`` takes it off (``inactive``), and the next ``apply()``
    applies it afresh. False if it was not applied. Takes the core's lock: never call it holding another."""
    with state.lock:
        st = state.states[name]
        if st.state != APPLIED:
            return False
        st.set(CHECK_FAILED, reason, st.targets)
        for chain in state.chains.values():  # every layer of it: the wrappers read their site when deciding
            for layer in chain.layers:
                if layer.patch.name == name:
                    layer.site.stood_down = reason
    return True


def _take_off(name: str, reason: str) -> list[str]:
    st = state.states[name]
    was = st.state
    st.set(INACTIVE, reason)
    state.drop_unused_watches()
    if was not in (APPLIED, CHECK_FAILED):  # a patch that stood down keeps its layers until reverted
        return [name]
    aliases.rewrap_foreign(name)
    casualties: list[str] = []
    for chain in list(state.chains.values()):
        mine = [l for l in chain.layers if l.patch.name == name]
        if not mine:
            continue
        rest = [l for l in chain.layers if l.patch.name != name]
        old_head = chain.current
        try:
            head, builds = chains.compose(chain.original, rest)
        except Exception as exc:  # a factory that worked before raised now: take its patches off this target too
            log.warning("aiter_patches: rebuilding %s.%s without '%s' raised %s: %s; the patches left on it are "
                        "taken off", chain.module, chain.attr, name, type(exc).__name__, exc)
            casualties += [l.patch.name for l in rest]
            mine, rest, head, builds = chain.layers, [], chain.original, []
        chains.commit(chain, rest, head, builds)
        aliases.bind(chain, old_head, head)
        for layer in mine:
            for problem in disarm.disarm(layer):
                log.warning("aiter_patches: reverted '%s' but could not disarm %s; a reference to it that revert "
                            "cannot see still runs the patch", layer.patch.name, problem)
    log.info("aiter_patches: reverted '%s'", name)
    done = [name]
    for other in dict.fromkeys(casualties):
        if state.states[other].state == APPLIED:
            done += revert_one(other)
            state.states[other].set(SKIPPED, f"taken off while reverting '{name}': its wrapper could not be rebuilt")
    return done
