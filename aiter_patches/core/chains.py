"""Chains: several patches on one AITER function, composed in declared order over the original.

Each target's chain holds one layer per applied patch, outermost (lowest
``Patch.order``) first. Composing builds the wrappers innermost first; a layer
whose inner object is unchanged keeps its wrapper, so adding or removing one
patch rebuilds only the layers above it. Each wrapper built gets a fresh
``Site`` whose ``below`` names the patch whose layer it wraps (None over AITER's
object or a foreign one), and is marked (``__aiter_patches__``, ``__wrapped__``)
so that status, revert by identity and the foreign-layer reports can walk it.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

from . import state
from .state import Chain, Layer

# (layer, its new wrapper, what that wraps, the site the wrapper was built with)
Build = tuple[Layer, Callable, Callable, Any]


def ordered(layers: list[Layer]) -> list[Layer]:
    return sorted(layers, key=lambda l: (l.patch.order, l.patch.name))


def compose(original: Callable, layers: list[Layer]) -> tuple[Callable, list[Build]]:
    """The chain head over ``original``, outer layers first; layers whose inner is unchanged are reused."""
    fn = original
    below: str | None = None
    builds: list[Build] = []
    for layer in reversed(layers):
        if layer.fn is not None and layer.over is fn:
            if layer.fn is not fn:
                below = layer.patch.name
            fn = layer.fn
            continue
        site = dataclasses.replace(layer.site, below=below)
        wrapped = layer.target.wrap(fn, site)
        if wrapped is not fn:  # a factory that hands back its inner adds no layer: nothing to mark or disarm
            mark(wrapped, layer.patch.name, fn)
            below = layer.patch.name
        builds.append((layer, wrapped, fn, site))
        fn = wrapped
    return fn, builds


def commit(chain: Chain, layers: list[Layer], head: Callable, builds: list[Build]) -> None:
    for layer, fn, over, site in builds:
        layer.fn, layer.over, layer.site = fn, over, site
        layer.built = [(r, o) for r, o in layer.built if r() is not None]
        if fn is over:
            continue
        try:
            layer.built.append((weakref.ref(fn), over))
        except TypeError:  # not weak-referenceable: cannot be disarmed at revert either
            pass
    chain.layers = layers
    chain.current = head if layers else None
    if layers:
        state.chains[(chain.module, chain.attr)] = chain
    else:
        state.chains.pop((chain.module, chain.attr), None)


def mark(wrapper: Callable, patch_name: str, inner: Callable) -> None:
    try:
        wrapper.__aiter_patches__ = patch_name  # type: ignore[attr-defined]
        if not hasattr(wrapper, "__wrapped__"):
            wrapper.__wrapped__ = inner  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass


def visit_chains(name: str, visit: Callable[[Any], list]) -> list:
    """``visit(chain)`` for each binding chain that holds a layer of patch ``name``, concatenated; run
    under the core's lock, the one place another module may walk the chains (foreign_layers reads
    the bindings over and under our layers there)."""
    out: list = []
    with state.lock:
        for chain in [c for c in state.chains.values() if any(layer.patch.name == name for layer in c.layers)]:
            out.extend(visit(chain))
    return out


def chain_head(module: str, attr: str) -> Callable | None:
    """The outermost wrapper the core bound at ``module.attr``, or None where no patch is applied there.

    One dictionary read, no lock: cheap enough for a fallback branch on a call path."""
    chain = state.chains.get((module, attr))
    return None if chain is None else chain.current
