"""Bindings: where a chain's head is bound, in its home module and in every module-level alias.

A name is read where the caller looks it up, so a patch binds its chain head at
the target's own name and at every module-level name that held the same
object (``aiter.foo`` and ``aiter.ops.X.foo``, a server's ``from aiter.fused_moe
import fused_moe``). Only bindings that hold one of our own objects, by
identity, ever change; revert gives each the exact original back. Modules are
read through their raw ``__dict__``: a lazily loaded module is never executed.

Foreign wrappers that a patch takes off its chain (``unwrap_foreign``, for a
server's own patch over ours) are recorded and put back when that patch is reverted.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any, Callable

from . import import_hooks, state
from .state import Chain

log = logging.getLogger("aiter_patches")

MISSING = object()


def dotted_owner(mod: Any, attr: str) -> tuple[Any, str]:
    """The object holding a target's last name: the module, or a class in it for ``"Class.method"`` targets."""
    *owners, name = attr.split(".")
    for part in owners:
        mod = getattr(mod, part, None) if mod is not None else None
    return mod, name


def get_dotted(mod: Any, attr: str) -> Any:
    owner, name = dotted_owner(mod, attr)
    return MISSING if owner is None else getattr(owner, name, MISSING)


def bind(chain: Chain, old_head: Callable | None, new: Callable, *, strict_home: bool = False) -> None:
    """Point every module-level binding of ``old_head`` (and of the original, unless reverting to it) at ``new``.

    Only bindings that hold one of our own objects, by identity, change. A
    location we bound earlier that now holds something else was rebound by a
    third party (its own wrapper, usually around ours): it is left in place,
    with a WARNING naming it.
    """
    reverting = new is chain.original
    old_ids = {id(old_head)} if old_head is not None else set()
    if not reverting:
        old_ids.add(id(chain.original))
    home, name = dotted_owner(sys.modules.get(chain.module), chain.attr)
    if home is not None:
        held = getattr(home, name, MISSING)
        if id(held) in old_ids:
            try:
                setattr(home, name, new)
            except Exception:
                if strict_home:
                    raise
                log.warning("aiter_patches: could not rebind %s.%s", chain.module, chain.attr, exc_info=True)
            else:
                chain.locations.add((chain.module, chain.attr))
    chain.locations |= rebind(old_ids, new)
    for mod_name, attr in sorted(chain.locations):
        d = import_hooks.module_dict(sys.modules.get(mod_name))
        held = d.get(attr, MISSING) if d is not None else MISSING
        if held is new or held is MISSING or held is chain.original:
            continue
        what = f"a {type(held).__name__} {getattr(held, '__qualname__', '')}".rstrip()
        log.warning("aiter_patches: %s.%s holds %s, bound there by someone else after aiter_patches; left in place: "
                    "calls through it reach only the patches applied when it was bound, and none once reverted",
                    mod_name, attr, what)
    if reverting:
        chain.locations = set()


def rebind(old_ids: set[int], new: Callable) -> set[tuple[str, str]]:
    """Point every module-level binding of an old object at ``new``; returns the locations changed.

    Modules are read through their raw ``__dict__``: a lazily loaded module is
    never executed by this scan, and a module that cannot be read is skipped.
    """
    changed: set[tuple[str, str]] = set()
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("aiter_patches."):  # our own modules hold no alias (the stand-in is aiter_patches_standin)
            continue
        d = import_hooks.module_dict(mod)
        if d is None:
            continue
        try:
            items = [(k, v) for k, v in list(d.items()) if id(v) in old_ids]
        except Exception:  # dict changed size under a concurrent import, or a hostile key
            continue
        for k, v in items:
            if d.get(k) is v:
                d[k] = new
                changed.add((mod_name, k))
    return changed


def unwrap_foreign(module: str, attr: str, is_layer: Callable[[Any], bool], *, owner: str | None = None) -> list[str]:
    """Take foreign wrappers that sit directly over our chain off its bindings, by identity only.

    A binding is restored to our outermost wrapper only when it holds a Python
    function ``is_layer`` accepts whose ``__wrapped__`` is exactly that wrapper.
    Returns the locations restored. With ``owner`` (an applied patch), reverting
    that patch puts each foreign wrapper back where it was taken off, if that
    location still holds what was put there (or AITER's object, its chain reverted).
    """
    with state.lock:
        chain = state.chains.get((module, attr))
        if chain is None or chain.current is None:
            return []
        restored = []
        for mod_name, mod in list(sys.modules.items()):
            d = import_hooks.module_dict(mod)
            if d is None:
                continue
            try:
                names = [attr] if mod_name == module else list(d)
            except RuntimeError:  # changed size under a concurrent import
                continue
            for k in names:
                v = d.get(k)
                if type(v) is not types.FunctionType or v is chain.current or not is_layer(v):
                    continue
                if getattr(v, "__wrapped__", None) is chain.current:
                    d[k] = chain.current
                    chain.locations.add((mod_name, k))
                    restored.append(f"{mod_name}.{k}")
                    if owner is not None:
                        state.unwrapped.setdefault(owner, []).append((mod_name, k, v, chain.current, chain.original))
        return sorted(restored)


def rewrap_foreign(owner: str) -> None:
    """Revert of ``owner``: the foreign wrappers it took off go back where they were, if nothing else moved in."""
    for mod_name, k, foreign, put, original in reversed(state.unwrapped.pop(owner, [])):
        d = import_hooks.module_dict(sys.modules.get(mod_name))
        if d is None:
            continue
        held = d.get(k, MISSING)
        if held is put or held is original:
            d[k] = foreign
        else:
            log.warning("aiter_patches: reverting '%s': %s.%s changed since its foreign wrapper was taken off; "
                        "left as it is", owner, mod_name, k)
