"""Applying one patch whose modules are ready: all or nothing.

Every target must be present, callable and match one of its pins (and pass the
patch's ``precheck``); then every wrapper is built; only then is each bound.
Any failure on the way leaves nothing changed and skips the patch with the
reason (``PatchSkipped`` in strict mode).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

from .. import runtime
from ..signatures import Binder, Pin, SignatureUnavailable, from_callable, match
from . import aliases, chains, needs, state
from .declarations import APPLIED, SKIPPED, Patch, PatchSkipped, Site, Target
from .state import Chain, Layer

log = logging.getLogger("aiter_patches")


def check_targets(p: Patch, records: list[dict[str, Any]]) -> tuple[str | None, list[tuple[Target, Callable, Pin]]]:
    """Every target present, callable and matching a pin: (None, found), else (the reason, [])."""
    found: list[tuple[Target, Callable, Pin]] = []
    for t in p.targets:
        mod = sys.modules.get(t.module)
        obj = aliases.get_dotted(mod, t.attr) if mod is not None else aliases.MISSING
        chain = state.chains.get((t.module, t.attr))
        original = chain.original if chain is not None else obj
        rec: dict[str, Any] = {"location": t.location, "signature": None, "pin": None, "aliases": []}
        records.append(rec)
        if original is aliases.MISSING:
            return f"{t.location} is missing", []
        if not callable(original):
            return f"{t.location} is not callable ({type(original).__name__})", []
        try:
            sig = from_callable(original, op_names=(t.attr.rpartition(".")[2],))
        except SignatureUnavailable as exc:
            return f"{t.location}: cannot read its signature: {exc}", []
        rec["signature"] = str(sig)
        pin, differences = match(sig, t.pins)
        if pin is None:
            accepted = ", ".join(x.label for x in t.pins)
            return f"{t.location} signature drifted ({'; '.join(differences)}); accepted pins: {accepted}", []
        rec["pin"] = pin.label
        if p.precheck is not None:
            try:
                problem = p.precheck(t, original)
            except Exception as exc:  # a gate that cannot decide does not apply the patch
                problem = f"its precheck raised {type(exc).__name__}: {exc}"
            if problem is not None:
                return f"{t.location}: {problem}", []
        found.append((t, original, pin))
    return None, found


def try_apply(p: Patch) -> None:
    """All or nothing: check every target, build every wrapper, then bind them; any failure changes nothing."""
    st = state.states[p.name]
    records: list[dict[str, Any]] = []
    try:
        problem, found = check_targets(p, records)
        if problem is None:
            problem = _install(p, found, records)
    except Exception as exc:  # an AITER object that raises on inspection: skip this patch, never fail apply()
        log.debug("aiter_patches: applying '%s' raised", p.name, exc_info=True)
        problem = f"applying raised {type(exc).__name__}: {exc}"
    if problem is not None:
        st.set(SKIPPED, problem, records)
        log.warning("aiter_patches: skipped patch '%s': %s", p.name, problem)
        if runtime.strict():
            raise PatchSkipped(f"patch '{p.name}' skipped: {problem}")
        return
    st.set(APPLIED, "", records)
    pins = ", ".join(f"{r['location']} @ {r['pin']}" for r in records)
    log.info("aiter_patches: applied '%s' (%s) to %s", p.name, p.summary, pins)
    if p.after_apply is not None:
        sites = [(l.site, c.original) for t, _, _ in found for c in [state.chains[(t.module, t.attr)]]
                 for l in c.layers if l.patch.name == p.name]
        try:
            p.after_apply(sites)
        except Exception:  # the patch is applied; its follow-up step failed and says so
            log.warning("aiter_patches: the step after applying '%s' raised", p.name, exc_info=True)


def _install(p: Patch, found: list[tuple[Target, Callable, Pin]], records: list[dict[str, Any]]) -> str | None:
    """Add the patch's layer to each target's chain; on any exception undo the targets done so far."""
    counters = state.counters[p.name]
    unmet = functools.partial(needs.unmet, p.name)
    plans = []
    for t, original, pin in found:  # build first: a wrapper factory that raises leaves no trace
        chain = state.chains.get((t.module, t.attr)) or Chain(t.module, t.attr, original)
        layer = Layer(p, t, Site(p, t, pin, Binder(pin.signature), counters, needs_unmet=unmet))
        layers = chains.ordered([*chain.layers, layer])
        try:
            head, builds = chains.compose(chain.original, layers)
        except Exception as exc:
            return f"{t.location}: the wrapper factory raised {type(exc).__name__}: {exc}"
        plans.append((chain, layers, head, builds))
    done: list[tuple[Chain, list[Layer], Callable | None]] = []
    for (chain, layers, head, builds), rec in zip(plans, records):
        before = (chain, list(chain.layers), chain.current)
        try:
            chains.commit(chain, layers, head, builds)
            done.append(before)
            aliases.bind(chain, before[2], head, strict_home=True)
        except Exception as exc:
            for old_chain, old_layers, old_head in reversed(done):
                _restore(old_chain, old_layers, old_head)
            return f"{chain.module}.{chain.attr}: binding the wrapper raised {type(exc).__name__}: {exc}"
        rec["aliases"] = sorted(f"{m}.{a}" for m, a in chain.locations if (m, a) != (chain.module, chain.attr))
    return None


def _restore(chain: Chain, layers: list[Layer], head: Callable | None) -> None:
    """Undo a commit + bind of this apply(): the chain's layers and its bindings as they were."""
    new_head = chain.current
    chain.layers = layers
    chain.current = head
    if layers:
        state.chains[(chain.module, chain.attr)] = chain
    else:
        state.chains.pop((chain.module, chain.attr), None)
    if new_head is not None:
        aliases.bind(chain, new_head, head if head is not None else chain.original)
