"""The stream a server hook's tensor is on now: what a fold's scope compares across its hooks.

A scope opened by one hook (the forward) is only valid for a later hook (the shared experts,
the routed call, a GEMM) that runs on the same stream: work on another stream is not ordered
after what the scope saw (a zero fill, the shared output). ``torch.cuda.Stream`` objects compare
by handle, so the two reads compare with ``==``. Off CUDA (CPU tests, the stand-in AITER) there
is one implicit order: every read is ``None`` and compares equal. Each integration binds this as
its own module-level ``_stream``, so a test can move one integration's calls to another stream.
"""

from __future__ import annotations

from typing import Any

import torch


def current(device) -> Any:
    """``torch.cuda.current_stream(device)`` for a CUDA device when CUDA is up; else ``None``."""
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_stream(device)
    return None
