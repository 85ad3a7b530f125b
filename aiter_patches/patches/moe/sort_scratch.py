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

- the call was opened by the ``fused_moe`` wrapper and has not returned (``MoeCall.scratch`` is a list
  while it runs, None before and after; a sort called on its own, or under ``moe_call.scope``, hands its
  outputs to its caller);
- the sort is that call's own (issue 35): the first sort of the call, reached from AITER's ``moe_sorting``
  called by AITER's own code in ``aiter.fused_moe`` (``MoeCall.own_sort``, set by the pipeline's sort
  wrapper). A ``moe_sorting`` or ``_moe_sorting_impl`` called directly from inside the call (by a stage
  hook, a tracing layer) hands its outputs to that caller, as do the sorts after the first;
- no foreign layer sits on the bindings AITER's callers look up (``aiter.fused_moe``'s
  ``_moe_sorting_impl``, ``fused_dynamic_mxfp4_quant_moe_sort``, ``fused_dynamic_mxfp8_quant_moe_sort``):
  each still holds our chain's outermost wrapper, and no chain there has a non-AITER function under ours
  (:func:`bindings_ours`). A layer over the sort would be handed the tables, one over a quant helper the
  stage-1 quant (and both the tables as arguments), and either may keep them;
- no sort extension is active (an extension's ``after_sort`` is handed the outputs and may keep them);
- AITER's own bench hook is off (``aiter.fused_moe.kernel_bench_callable``: when a caller sets it, AITER
  keeps every stage launch, with the sort tables and the quant it reads, to replay after the call);
- the current stream is not capturing a CUDA graph (a graph's buffers are its own; a leased set would
  be written by replays and eager calls alike), and no ``torch.compile`` CUDA-graph tree is on this
  device in this thread (its warm-up runs route the thread's allocations into the graphs' private pool,
  where a set the trees do not know of could be handed to a later recording);
- not under ``torch.compile`` tracing (the caller's verdict key already says so: only kept plans lease);
- sets are per (plan, device, stream): a set is only ever reused in the stream order it was written in,
  and a set is in one call at a time (two threads on one stream each get their own);
- at most :data:`MAX_BYTES` of device memory in all, and sets of at most :data:`MAX_KEYS` (plan, dtype,
  device, stream) keys: past either the free sets used longest ago are dropped first, and a set that still
  does not fit is not made (the sort allocates; a decode set is 0.1-2 MB);
  ``AITER_PATCHES_SORT_SCRATCH=0`` turns leasing off (read at the first lease after the patches' wrappers
  are built); the pool is dropped whenever they are built (apply, revert), and a set leased before that is
  freed when its call ends.
"""

from __future__ import annotations

import sys
import threading

from ... import env_flags
from ...core import chains, events
from ...kernels import device_stream

MAX_BYTES = 128 << 20
MAX_KEYS = 1024  # as the kernel's MAX_PLANS: a pool key holds a kept plan (issue 35: bounded in count too)
# (id(plan), quant dtype, device index, stream) -> [plan, free sets, bytes a set, last lease, pool generation]:
# the plan is held, so its id names no other plan while its key is here; its sets were counted in its generation
_pool: dict[tuple, list] = {}
_held = [0]  # device bytes of the sets made for the pool since it was last dropped (leased or free)
_generation = [0]  # bumped by clear(): a set leased before is not filed back
_switch: list = [None]  # AITER_PATCHES_SORT_SCRATCH read at the first lease after clear(); None: not read yet
_tick = [0]
_lock = threading.Lock()
_MODULE = "aiter.fused_moe"
_BINDINGS = ("_moe_sorting_impl", "fused_dynamic_mxfp4_quant_moe_sort", "fused_dynamic_mxfp8_quant_moe_sort")
# (aiter.fused_moe's globals, our three chain heads, whether no foreign layer is under them), read when a
# binding was not the head last read (first lease after clear(), after apply/revert or a foreign layer)
_heads: list = [None]
_stats = {"leased": 0, "made": 0, "refused": 0, "evicted": 0}


def enabled() -> bool:
    """``AITER_PATCHES_SORT_SCRATCH`` is not off, as read at the first lease since the pool was last dropped."""
    on = _switch[0]
    if on is None:
        on = _switch[0] = not env_flags.env_false("AITER_PATCHES_SORT_SCRATCH")
    return on


def _kept_after_the_call(dev) -> bool:
    """Whether something may read or reallocate a set after its call: AITER's bench hook keeps the stage
    launches, or a CUDA-graph tree of ``torch.compile`` routes allocations into its pool (one is on this
    device in this thread, or a tree is warming up or recording in any thread: torch holds its process-wide
    ``graph_capture_lock`` then)."""
    if getattr(sys.modules.get("aiter.fused_moe"), "kernel_bench_callable", None) is not None:
        return True
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or dev.type != "cuda":
        return False
    try:
        lock = getattr(trees, "graph_capture_lock", None)
        if lock is not None and lock.locked():
            return True
        index = dev.index if dev.index is not None else device_stream.current_index()
        container = trees.get_obj(trees.local, "tree_manager_containers").get(index)
        return container is not None and container.tree_manager is not None
    except Exception:  # noqa: BLE001 - a torch whose trees this cannot read: assume one is there
        return True


def bindings_ours() -> bool:
    """Whether ``aiter.fused_moe``'s sort and MX quant-helper bindings each hold our chain's outermost wrapper,
    with no foreign function under it. Three dict reads and identity tests while they do (the heads and the
    verdict on the layers under them are kept until a binding differs); while a foreign layer sits over one,
    three more reads a call."""
    got = _heads[0]
    if got is not None:
        where, heads, clean = got
        if (where.get(_BINDINGS[0]) is heads[0] and where.get(_BINDINGS[1]) is heads[1]
                and where.get(_BINDINGS[2]) is heads[2]):
            return clean
    mod = sys.modules.get(_MODULE)
    if mod is None:
        return False
    where = vars(mod)
    heads = tuple(chains.chain_head(_MODULE, attr) for attr in _BINDINGS)
    if any(h is None or where.get(attr) is not h for attr, h in zip(_BINDINGS, heads)):
        return False  # a layer over ours (or a patch not applied there): asked again next call
    clean = not _inner_layers()
    _heads[0] = (where, heads, clean)
    return clean


def _inner_layers() -> bool:
    """Whether a foreign function sits under one of our three chains (it is handed the sort tables as
    arguments whenever our wrapper hands a call back)."""
    from ... import foreign_layers

    try:
        layers = chains.visit_chains("moe_sort_mx_quant", foreign_layers.scan_chain)
    except Exception:  # noqa: BLE001 - cannot tell: assume one is there
        return True
    wanted = {f"{_MODULE}.{attr}" for attr in _BINDINGS}
    return any(layer.location in wanted for layer in layers)


def lease(call, plan, topk_ids, quant_dtype):
    """A set of ``new_outputs`` for ``plan`` (the sort kernel's) that ``call`` holds until it ends, or None
    (the sort allocates). ``call.scratch`` must be the list the ``fused_moe`` wrapper opened the call with;
    the set goes on it."""
    scratch = call.scratch if call is not None else None
    if scratch is None or not call.own_sort or not bindings_ours():
        return None
    dev = topk_ids.device
    if not enabled() or _kept_after_the_call(dev) or device_stream.capturing(dev):
        return None
    key = (id(plan), quant_dtype, *device_stream.stream_key(dev))
    entry = _pool.get(key)  # its plan is ``plan``: the key holds id(plan), and the entry the plan
    got = None
    if entry is not None:
        _tick[0] = entry[3] = _tick[0] + 1
        size, gen = entry[2], entry[4]
        if entry[1]:
            try:
                got = entry[1].pop()
            except IndexError:  # another thread took the last one
                pass
    if got is None:
        made = _make(key, plan, topk_ids.shape[0], dev, quant_dtype)
        if made is None:
            return None
        got, gen, size = made
    scratch.append((key, plan, got, gen, size))
    _stats["leased"] += 1
    return got


def _make(key, plan, M, dev, quant_dtype):
    """``(set, pool generation it was counted in, its bytes)``: a new set counted in the pool's bytes; None
    past the limit."""
    from ...kernels import moe_sort_mx_quant as kernel

    size = kernel.outputs_bytes(plan, M, quant_dtype)
    with _lock:
        gen = _generation[0]
        room = key not in _pool and len(_pool) >= MAX_KEYS
        if _held[0] + size > MAX_BYTES or room:
            free = sum(len(e[1]) * e[2] for k, e in _pool.items() if k != key)
            if _held[0] - free + size > MAX_BYTES:  # does not fit even with every other free set dropped
                _stats["refused"] += 1
                return None
            _evict(size, key, room)
        _held[0] += size
        if key not in _pool:
            _tick[0] += 1
            _pool[key] = [plan, [], size, _tick[0], gen]
    try:
        got = kernel.new_outputs(plan, M, dev, quant_dtype)
    except BaseException:
        with _lock:
            if _generation[0] == gen:
                _held[0] -= size
        raise
    _stats["made"] += 1
    return got, gen, size


def _evict(size: int, keep: tuple, room: bool = False) -> None:
    """Drop free sets, those of the plans leased longest ago first, until ``size`` more bytes fit and, with
    ``room``, a new key does too (the key leased longest ago dropped with all its free sets) (under _lock)."""
    for key, entry in sorted(_pool.items(), key=lambda kv: kv[1][3]):
        if key == keep:
            continue
        free = entry[1]
        whole = room and len(_pool) >= MAX_KEYS
        while free and (whole or _held[0] + size > MAX_BYTES):
            try:
                free.pop()
            except IndexError:
                break
            _held[0] -= entry[2]
            _stats["evicted"] += 1
        if not free:
            del _pool[key]  # a set of it still leased is uncounted when it comes back (release)
        if _held[0] + size <= MAX_BYTES and not (room and len(_pool) >= MAX_KEYS):
            return


def release(call) -> None:
    """Give back every set ``call`` leased and close it to leases (the ``fused_moe`` wrapper, once AITER's
    call has returned)."""
    scratch, call.scratch = call.scratch, None
    if not scratch:
        return
    with _lock:
        for key, plan, got, gen, size in scratch:
            if gen != _generation[0]:
                continue  # the pool was dropped meanwhile (apply, revert): freed with its last reference
            entry = _pool.get(key)
            if entry is not None:
                entry[1].append(got)
            else:
                _held[0] -= size  # its plan's entry was evicted while it was leased


def clear() -> None:
    """Drop every free set (a leased one is freed as its call ends), the byte count and the switch's reading."""
    with _lock:
        _pool.clear()
        _held[0] = 0
        _generation[0] += 1
        _switch[0] = None
        _heads[0] = None


def _renew_lock_after_fork() -> None:
    """``FORK_RENEW``: a fresh lock in a forked child (issue 31): a thread of the parent may have held it while
    making or filing back a set, and that thread is gone. Never blocks."""
    global _lock
    _lock = threading.Lock()


events.subscribe(events.FORK_RENEW, _renew_lock_after_fork)


def stats() -> dict:
    """Leases, sets made, sets refused past :data:`MAX_BYTES`, free sets evicted to make room, plans and bytes
    held (diagnostics)."""
    return {**_stats, "plans": len(_pool), "bytes": _held[0]}
