"""Other code that wraps the functions our patches wrap: find it, name it, say which calls it takes.

A server may install its own wrappers on the same AITER functions (SGLang 0.5.23
wraps ``aiter.fused_moe.fused_moe``, ``_moe_sorting_impl`` and
``fused_dynamic_mxfp8_quant_moe_sort`` from ``AiterRunnerCore.__init__``). Over
ours, such a layer may take calls before they reach our wrapper; under ours, it
is what our wrapper hands calls back to. Either way our counters alone would
tell an operator something untrue, so ``status()``, the summary line,
``stats()`` and the fallback reasons name the layer.

Detection runs at apply, status, stats and log time, never per call (the one
call-path use, :func:`outer_layer_name`, is an identity test on a fallback
branch with the description memoized). The core does not call this module: it
subscribes to the core's hooks (``core/events.py``) and adds ``foreign_layers``
to each applied patch's status record and stats entry, and renews its lock in a
forked child. A layer is found by identity only: a
location whose object is not our chain's outermost wrapper but reaches it
through ``__wrapped__`` (functools.wraps, wrapt proxies) or a closure cell is an
outer layer; a chain original that is a Python function defined outside AITER's
package is an inner layer. Names come from where the code was defined (the
function's globals and code object), not from ``__module__``/``__qualname__``,
which ``functools.wraps`` copies from the function it wraps.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from .core import chains, events
from .core.declarations import APPLIED

OUTER, INNER, REPLACED = "outer", "inner", "replaced"
_DEPTH = 6  # wrappers followed from one location before giving up

# (defining module, code qualname) -> which calls that layer takes; filled by the patches that know a layer.
_KNOWN: dict[tuple[str, str], str] = {}
_memo: dict[int, tuple[Any, str]] = {}  # id(obj) -> (obj, description) for the call-path helper
_memo_lock = threading.Lock()


def renew_lock_after_fork() -> None:
    """A fresh memo lock in a forked child (a parent thread may have been inside the memo): ``FORK_RENEW``."""
    global _memo_lock
    _memo_lock = threading.Lock()


@dataclass(frozen=True)
class Layer:
    position: str  # outer | inner | replaced
    location: str  # module.attr where it was seen
    module: str | None  # where its code was defined
    qualname: str | None
    takes: str | None  # which calls it takes, when the layer is known

    def describe(self) -> str:
        who = self.module or "unknown code"
        if self.qualname:
            who += f" ({self.qualname})"
        if self.position == REPLACED:
            text = f"{self.location} rebound to {who}, which does not reach aiter_patches' wrapper"
        else:
            text = f"{self.position} layer {who} on {self.location}"
        return text + (f": {self.takes}" if self.takes else "")


def register_known(module: str, qualname: str, takes: str) -> None:
    """Describe a layer we have read, so reports can say which calls it takes."""
    _KNOWN[(module, qualname)] = takes


def defined_by(obj: Any) -> tuple[str | None, str | None]:
    """(module, qualname) of the code behind ``obj``, read where ``functools.wraps`` cannot overwrite it."""
    kind = type(obj)
    if _is_proxy(obj):  # a proxy forwards __code__: name the function doing the wrapping
        wrapper = _attr(obj, "_self_wrapper")
        return defined_by(wrapper) if wrapper is not None else (kind.__module__, kind.__qualname__)
    code = getattr(obj, "__code__", None)
    glb = getattr(obj, "__globals__", None)
    if code is not None and isinstance(glb, dict):
        return glb.get("__name__"), getattr(code, "co_qualname", code.co_name)
    return kind.__module__, kind.__qualname__


def _is_proxy(obj: Any) -> bool:
    """A wrapt proxy (any version: the C base class is ``_wrappers.ObjectProxy``, the Python one ``wrapt.*``)."""
    return any(c.__name__ == "ObjectProxy" and (c.__module__ == "_wrappers" or c.__module__.startswith("wrapt"))
               for c in type(obj).__mro__)


def _attr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name, None)
    except Exception:  # a proxy whose getattr raises
        return None


def _inner_objects(obj: Any) -> Iterator[Any]:
    wrapped = _attr(obj, "__wrapped__")
    if wrapped is not None:
        yield wrapped
    for cell in _attr(obj, "__closure__") or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(value) and value is not wrapped:
            yield value


def path_to(obj: Any, target: Any, depth: int = _DEPTH) -> list[Any] | None:
    """The wrappers from ``obj`` down to ``target`` (``obj`` first, ``target`` excluded), or None."""
    if obj is target:
        return []
    if depth == 0:
        return None
    for inner in _inner_objects(obj):
        rest = path_to(inner, target, depth - 1)
        if rest is not None:
            return [obj] + rest
    return None


def _is_foreign(obj: Any, root: str) -> bool:
    """A Python function (or wrapt proxy) whose code was defined outside package ``root``."""
    if not _is_proxy(obj) and getattr(obj, "__code__", None) is None:
        return False  # builtins, torch ops, lru caches: no reliable origin
    module, _ = defined_by(obj)
    return module is not None and module != root and not module.startswith(root + ".")


def _layer(position: str, location: str, obj: Any) -> Layer:
    module, qualname = defined_by(obj)
    return Layer(position, location, module, qualname, _KNOWN.get((module, qualname)))


def scan_chain(chain: Any) -> list[Layer]:
    """Foreign layers over and under one registry chain (its home binding and every alias it rebound)."""
    found: list[Layer] = []
    locations = sorted(chain.locations | {(chain.module, chain.attr)})
    for mod_name, attr in locations:
        mod = sys.modules.get(mod_name)
        if mod is None or chain.current is None:
            continue
        obj = getattr(mod, attr, None)
        if obj is chain.current or obj is None:
            continue
        where = f"{mod_name}.{attr}"
        path = path_to(obj, chain.current)
        if path is None:
            found.append(_layer(REPLACED, where, obj))
        else:
            found.extend(_layer(OUTER, where, o) for o in path)
    root = chain.module.partition(".")[0]
    obj, where = chain.original, f"{chain.module}.{chain.attr}"
    for _ in range(_DEPTH):
        if not _is_foreign(obj, root):
            break
        found.append(_layer(INNER, where, obj))
        nxt = next(_inner_objects(obj), None)
        if nxt is None:
            break
        obj = nxt
    return _unique(found)


def _unique(layers: list[Layer]) -> list[Layer]:
    seen, out = set(), []
    for layer in layers:
        if layer not in seen:
            seen.add(layer)
            out.append(layer)
    return out


def for_patch(name: str) -> list[Layer]:
    """Foreign layers on the targets of one applied patch."""
    return _unique(chains.visit_chains(name, scan_chain))


def records(name: str) -> list[dict[str, Any]]:
    """``for_patch`` as plain dicts with their one-line description (for status records and JSON)."""
    return [dict(asdict(layer), text=layer.describe()) for layer in for_patch(name)]


def outer_layer_name(module: str, attr: str) -> str | None:
    """Which foreign layer holds ``module.attr`` over our wrapper, or None. For fallback reasons.

    Cheap enough for a fallback branch: one lookup and one identity test while
    the binding is ours; the chain walk is done once per foreign object.
    """
    head = chains.chain_head(module, attr)
    mod = sys.modules.get(module)
    if head is None or mod is None:
        return None
    obj = getattr(mod, attr, None)
    if obj is head or obj is None:
        return None
    with _memo_lock:
        hit = _memo.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
    path = path_to(obj, head) or [obj]
    names = []
    for o in path:
        m, q = defined_by(o)
        names.append(m or "unknown code")
    text = ", ".join(dict.fromkeys(names))
    with _memo_lock:
        if len(_memo) > 64:
            _memo.clear()
        _memo[id(obj)] = (obj, text)
    return text


def short(layers: list[Layer] | list[dict[str, Any]]) -> list[str]:
    """One short phrase per layer for the summary line: ``outer sglang.x.y on aiter.fused_moe.fused_moe``."""
    out = []
    for layer in layers:
        d = layer if isinstance(layer, dict) else asdict(layer)
        out.append(f"{d['position']} {d['module'] or 'unknown code'} on {d['location']}")
    return list(dict.fromkeys(out))


def _status_fields(name: str, state: str) -> dict[str, Any]:
    return {"foreign_layers": records(name) if state == APPLIED else []}


def _stats_fields(name: str, state: str) -> dict[str, Any]:
    """The key appears only when a foreign layer is seen."""
    layers = records(name) if state == APPLIED else []
    return {"foreign_layers": [layer["text"] for layer in layers]} if layers else {}


events.subscribe(events.STATUS_FIELDS, _status_fields)
events.subscribe(events.STATS_FIELDS, _stats_fields)
events.subscribe(events.FORK_RENEW, renew_lock_after_fork)


UNREACHED_SORT = "the sort did not run through _moe_sorting_impl (flat or FlyDSL sort)"


def unreached_sort_reason() -> str:
    """Why a ``fused_moe`` call's sort never reached our ``_moe_sorting_impl`` wrapper, naming a layer that took it."""
    layer = outer_layer_name("aiter.fused_moe", "_moe_sorting_impl")
    if layer is None:
        return UNREACHED_SORT
    return f"the sort was taken by outer layer {layer} on aiter.fused_moe._moe_sorting_impl"
