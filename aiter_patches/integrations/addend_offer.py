"""Whether a server's shared-expert output may go to this ``fused_moe`` call as ``moe_addend``.

The SGLang and vLLM folds take the same decision at the routed call: the addend must be
exactly the tensor ``fused_moe`` would return (shape, dtype, device), on the stream the shared
experts ran on, with ``moe_addend_fold``'s layer below to take it (``site.below``: the folds
need that patch, and the core says whose layer lies under theirs) and no caller-owned output.
One function, so the two servers cannot drift apart on it; ``offer`` is the routed call's hook
body that both folds run once their scope holds a shared output, ``fused_moe_wrapper`` the hook.
"""

from __future__ import annotations

from typing import Any, Callable

from ..patches.moe import call as moe_call
from ..reasons import with_values
from . import compile_state

FOLD = "moe_addend_fold"


def reason(bound: dict, problems: list[str], add: Any, takes_addend: bool,
           stream_of: Callable[[Any], Any], shared_stream: Any) -> str | None:
    """None when ``add`` may be passed; else why not (counted by the caller)."""
    if problems:
        return problems[0]
    if not takes_addend:
        return f"{FOLD}'s layer is not under this one"
    hs, ids, w2 = bound["hidden_states"], bound["topk_ids"], bound["w2"]
    dtype = bound.get("dtype") or hs.dtype
    if bound.get("output") is not None:
        return "fused_moe(output=...): a caller-owned buffer"
    if tuple(add.shape) != (ids.shape[0], w2.shape[1]) or add.dtype != dtype or add.device != ids.device:
        # a category (issue 35: reasons are counted per text), the shapes, which hold the token count, at DEBUG
        return with_values("shared output is not fused_moe's output [tokens, w2.shape[1]] in its dtype on its device "
                           "(padded hidden size, other dtype)", shared=(list(add.shape), add.dtype, add.device),
                           output=([ids.shape[0], w2.shape[1]], dtype, ids.device))
    if stream_of(ids.device) != shared_stream:
        return "the routed call runs on another stream than the shared experts"
    return None


def offer(inner, args: tuple, kwargs: dict, scope: Any, binder: Any, counters: Any, takes_addend: bool,
          stream_of: Callable[[Any], Any]) -> tuple[Any, bool]:
    """``inner(*args, **kwargs)`` with ``moe_addend=scope.shared`` where ``reason`` allows it, else as given (counted).

    Marks the scope ``offered`` first: one routed call per scope (a second one is not the one the server
    adds the shared output to). Returns the output and whether the addend was passed.
    """
    scope.offered = True
    bound, problems = binder.bind(args, kwargs)
    add = scope.shared
    why = reason(bound, problems, add, takes_addend, stream_of, scope.stream)
    if why is not None:
        counters.fallback(why)
        return inner(*args, **kwargs), False
    return inner(*args, moe_addend=add, **kwargs), True


def fused_moe_wrapper(inner, site, current_scope: Callable[[], Any], stream_of: Callable[[Any], Any],
                      record: Callable[[Any, Any], None]):
    """The routed ``fused_moe`` hook of a fold: as given while Dynamo traces, without a scope holding an
    unoffered shared output (``current_scope()``: the fold's scope or None), or with ``moe_addend``
    already given; else :func:`offer`, and ``record(scope, out)`` where the addend was passed."""
    binder, counters = site.binder, site.counters
    takes_addend = site.below == FOLD

    def fused_moe(*args, **kwargs):
        if compile_state.tracing():
            return inner(*args, **kwargs)
        scope = current_scope()
        if scope is None or scope.shared is None or scope.offered or "moe_addend" in kwargs:
            return inner(*args, **kwargs)
        out, folded = offer(inner, args, kwargs, scope, binder, counters, takes_addend, stream_of)
        if folded:
            record(scope, out)
        return out

    return moe_call.like(fused_moe, inner)
