"""Sort outputs reused from one ``fused_moe`` call to the next, where nothing can read them after the call.

Why (issue 15): at decode sizes the one-launch sort + stage-1 quant spends most of its host time on
allocations (six ``torch.empty`` and two dtype views, about 4 µs and 2-3 µs each on the H200 host),
where AITER's own sort and quant make the same seven. Inside AITER's ``fused_moe`` those six outputs
(the four sort tables, the quant's data and scales) are locals of ``_fused_moe_impl``: its stages read
them and it returns ``moe_buf`` alone. So a call opened by the pipeline's ``fused_moe`` wrapper leases
one set per sort launch from here and gives it back when AITER's ``fused_moe`` has returned, by which
time every kernel reading it has been queued; the next call's sort is queued after them on the same
stream, so it overwrites nothing still to be read, the order the caching allocator relies on for a
freed block. ``moe_buf``, which ``fused_moe`` returns, is always new.

A set is leased only where that holds (:func:`lease` says None otherwise, and the sort allocates):

- the call was opened by the ``fused_moe`` wrapper (``MoeCall.scratch`` is a list; a sort called on its
  own, or under ``moe_call.scope``, hands its outputs to its caller);
- no sort extension is active (an extension's ``after_sort`` is handed the outputs and may keep them);
- the current stream is not capturing a CUDA graph (a graph's buffers are its own; a leased set would
  be written by replays and eager calls alike);
- not under ``torch.compile`` tracing (the caller's verdict key already says so: only kept plans lease);
- sets are per (plan, device, stream): a set is only ever reused in the stream order it was written in,
  and a set is in one call at a time (two threads on one stream each get their own);
- at most :data:`MAX_BYTES` of device memory in all (past it, new plans allocate per call; a decode
  set is 0.1-2 MB); ``AITER_PATCHES_SORT_SCRATCH=0`` turns leasing off; the pool is dropped whenever
  the patches' wrappers are built (apply, revert).

The bits are the kernel's either way: it writes every element its consumers read (the tests poison new
outputs), so a reused set's old contents are never read.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..kernels import device_stream

MAX_BYTES = 128 << 20
_pool: dict[tuple, tuple[Any, list]] = {}  # (id(plan), quant dtype, device index, stream) -> (plan, free sets)
_held = [0]  # device bytes of every set made for the pool (leased or free)
_lock = threading.Lock()
_stats = {"leased": 0, "made": 0, "refused": 0}


def enabled() -> bool:
    return os.environ.get("AITER_PATCHES_SORT_SCRATCH", "1") != "0"


def lease(call, plan, topk_ids, quant_dtype):
    """A set of ``new_outputs`` for ``plan`` (the sort kernel's) that ``call`` holds until it ends, or None
    (the sort allocates). ``call.scratch`` must be the list the ``fused_moe`` wrapper opened the call with;
    the set goes on it."""
    dev = topk_ids.device
    if call is None or call.scratch is None or device_stream.capturing(dev) or not enabled():
        return None
    key = (id(plan), quant_dtype, *device_stream.stream_key(dev))
    entry = _pool.get(key)
    free = entry[1] if entry is not None and entry[0] is plan else None
    try:
        got = free.pop() if free else None
    except IndexError:  # another thread took the last one
        got = None
    if got is None:
        got = _make(key, plan, topk_ids.shape[0], dev, quant_dtype)
        if got is None:
            return None
    call.scratch.append((key, plan, got))
    _stats["leased"] += 1
    return got


def _make(key, plan, M, dev, quant_dtype):
    from ..kernels import moe_sort_mx_quant as kernel

    size = kernel.outputs_bytes(plan, M, quant_dtype)
    with _lock:
        if _held[0] + size > MAX_BYTES:
            _stats["refused"] += 1
            return None
        _held[0] += size
        if _pool.get(key, (None,))[0] is not plan:
            _pool[key] = (plan, [])  # the plan is held, so its id names no other plan while the key lives
    _stats["made"] += 1
    return kernel.new_outputs(plan, M, dev, quant_dtype)


def release(call) -> None:
    """Give back every set ``call`` leased (the ``fused_moe`` wrapper, once AITER's call has returned)."""
    for key, plan, got in call.scratch:
        entry = _pool.get(key)
        if entry is not None and entry[0] is plan:
            entry[1].append(got)
        # else: the pool was dropped meanwhile (apply, revert); the set is freed with its last reference
    call.scratch.clear()


def clear() -> None:
    """Drop every free set (leased ones are dropped as their calls end) and the byte count."""
    with _lock:
        _pool.clear()
        _held[0] = 0


def stats() -> dict:
    """Leases, sets made, sets refused past :data:`MAX_BYTES`, sets and bytes held (diagnostics)."""
    return {**_stats, "plans": len(_pool), "bytes": _held[0]}
