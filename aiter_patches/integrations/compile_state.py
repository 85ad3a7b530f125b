"""Whether a server integration's hooks may keep per-call state: not while torch.compile is in play.

A fold spans several hooks (the shared experts, the routed call, the add) that must all see one
call's scope. Dynamo traces a hook into a graph that is replayed later without running it, and
it may trace some hooks of one forward and run others eagerly (a graph break, a frame over its
recompile limit): the routed call could then take the addend while a traced add still adds it.
So each hook passes straight through while Dynamo traces it (``is_compiling()``; no counter, no
context variable: neither traces), and the hook that opens a scope opens none inside a compiled
region at all (Dynamo's frame callback is set there, also in the eager parts between graphs).
"""

from __future__ import annotations

import torch

try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _frame_callback
except ImportError:  # a torch without it: only the tracing check below applies
    _frame_callback = None

IN_COMPILED_REGION = "torch.compile is active around this call (its traced and eager parts could disagree): as shipped"


def tracing() -> bool:
    return torch.compiler.is_compiling()


def in_compiled_region() -> bool:
    """Called eagerly only (after ``tracing()`` said no): a torch.compile'd function is on the stack."""
    return _frame_callback is not None and _frame_callback() is not None
