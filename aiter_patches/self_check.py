"""The self-check: the first calls of each plan run AITER's path too; a difference stands the patch down.

Why: nothing here had run on AMD hardware when it was written. A miscompile on gfx950, an AITER
build whose quant rounds otherwise, a ``.co`` that launches otherwise: any of them would serve
wrong numbers until someone noticed. AITER's own path is always at hand on the same machine, so
a patch runs both on the first eager calls of each plan (the key it already keeps its verdict
under), compares them under its own contract, and returns AITER's outputs on those calls:

- equal: the call counts as a passed check; after ``AITER_PATCHES_SELF_CHECK_CALLS`` of them
  (default 1) the plan takes the fast path alone. The only cost left on it is one attribute read;
- different: the patch stands down for the process's life (state ``check_failed``, its reason
  naming the call, the shape and the first differing output; ``core/revert.stand_down``), with
  one ERROR line and the inputs saved under ``AITER_PATCHES_CHECK_DIR`` (default: the temp dir).
  Its wrappers stay and hand every call to AITER, counted (a caller's ``out_zeroed=True`` is
  still taken); the other patches go on;
- a call inside CUDA-graph capture (or torch.compile tracing) whose plan is not checked yet goes
  to AITER, counted: nothing unchecked is captured. Servers run each batch size eagerly before
  they capture it, so every captured plan has been checked (docs/self_check.md);
- two threads meeting the same new plan: one checks it, the other goes to AITER, counted.

On by default where it matters: with a ROCm torch (``torch.version.hip``), where the real AITER
runs. ``AITER_PATCHES_SELF_CHECK=0`` turns it off, ``=1`` forces it (the tests, the stand-in).
A patch asks :func:`new_plan` when it keeps a new verdict, then :func:`begin` / :func:`finish`
on a call whose plan has checks left.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from . import env_flags

log = logging.getLogger("aiter_patches")

ENV = "AITER_PATCHES_SELF_CHECK"
CALLS_ENV = "AITER_PATCHES_SELF_CHECK_CALLS"
DIR_ENV = "AITER_PATCHES_CHECK_DIR"

CAPTURE_REASON = "inside CUDA-graph capture with a plan not yet checked against AITER (AITER's path captured)"
TRACING_REASON = "inside torch.compile tracing with a plan not yet checked against AITER"
BUSY_REASON = "plan being checked against AITER in another thread"
STOOD_DOWN = "stood down: its self-check against AITER failed (status gives the call and the difference)"

CHECK, FAST, AITER = "check", "fast", "aiter"  # what begin() says the call does

_lock = threading.Lock()
_busy: set = set()  # the plans a check runs on now (a forked child frees them: their thread is not there)
_warned: set[str] = set()


def enabled() -> bool:
    """Whether new plans are checked: ``AITER_PATCHES_SELF_CHECK`` yes/no, else a ROCm torch (real AITER)."""
    raw = os.environ.get(ENV, "").strip()
    if env_flags.is_true(raw):
        return True
    if env_flags.is_false(raw):
        return False
    on = getattr(getattr(sys.modules.get("torch"), "version", None), "hip", None) is not None
    if raw and raw not in _warned:
        _warned.add(raw)
        log.warning("%s=%r ignored: the rule is 1/true/yes/on or 0/false/no/off; using the default (%s)",
                    ENV, raw, "on: a ROCm torch" if on else "off: not a ROCm torch")
    return on


def calls_per_plan() -> int:
    """``AITER_PATCHES_SELF_CHECK_CALLS``: eager calls checked per plan (a whole number, more than 0)."""
    return env_flags.positive_number(CALLS_ENV, 1, whole=True)


class Plan:
    """The self-check's state of one plan: calls still to check (``left``), whether one runs now."""

    __slots__ = ("left", "busy")

    def __init__(self, left: int):
        self.left, self.busy = left, False


MAX_PLANS = 4096  # plans checked per patch and process; later ones take the fast path unchecked (logged once)
_plans_made: dict[str, int] = {}


def new_plan(name: str) -> Plan | None:
    """For a verdict patch ``name`` keeps now: its check state, or None (the fast path alone): the check is
    off, or :data:`MAX_PLANS` plans of this patch were checked already. The cap bounds what the check costs
    a server that meets ever new shapes (prefill lengths; verdicts past their caches' caps, made per call)."""
    if not enabled():
        return None
    with _lock:
        made = _plans_made.get(name, 0)
        if made >= MAX_PLANS:
            return None
        _plans_made[name] = made + 1
    if made + 1 == MAX_PLANS:
        log.info("aiter_patches: %s: %d plans checked against AITER; later new plans are not checked", name,
                 MAX_PLANS)
    return Plan(calls_per_plan())


def _unsafe_now() -> str | None:
    """Why a check cannot run now (graph capture, torch.compile tracing), or None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.compiler.is_compiling():
            return TRACING_REASON
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return CAPTURE_REASON
    except Exception:  # noqa: BLE001 - a torch without these: nothing is captured
        return None
    return None


def begin(plan: Plan, counters) -> str:
    """What this call does: :data:`CHECK` (run both, then :func:`finish`), :data:`FAST` (the plan was
    checked meanwhile), or :data:`AITER` (hand the call to AITER: capture, tracing, another thread's
    check; counted as a fallback here)."""
    why = _unsafe_now()
    if why is not None:
        counters.fallback(why)
        return AITER
    with _lock:
        if plan.left <= 0:
            return FAST
        if plan.busy:
            counters.fallback(BUSY_REASON)
            return AITER
        plan.busy = True
        _busy.add(plan)
    return CHECK


def finish_unchecked(plan: Plan) -> None:
    """End a check begun by :func:`begin` that compared nothing (a side raised): the plan stays unchecked."""
    with _lock:
        plan.busy = False
        _busy.discard(plan)


def finish_skipped(plan: Plan, counters, reason: str) -> None:
    """End a check begun by :func:`begin` whose call cannot be compared under the contract (a GEMM's ``out`` not
    zero): the plan is not checked again (each try would cost a device sync); counted once as ``reason``."""
    with _lock:
        plan.busy, plan.left = False, 0
        _busy.discard(plan)
    counters.fallback(reason)


def compared(compare: Callable[[], str | None]) -> str | None:
    """``compare()``'s answer; an exception while comparing (outputs of another shape, say) is a difference."""
    try:
        return compare()
    except Exception as exc:  # noqa: BLE001 - the patch's outputs could not even be compared: not AITER's
        return f"comparing the outputs raised {type(exc).__name__}: {exc}"


def finish(plan: Plan, site, differs: str | None, *, where: str, inputs: dict[str, Any],
           forget: Callable[[], None]) -> None:
    """End a check begun by :func:`begin`: ``differs`` None (equal) or the first differing output.

    ``site``: the patch's layer that checked (its counters; where it stands down). ``where``: the call
    and its shape, for the reason. ``inputs``: what to save for a bug report. ``forget``: drops the
    patch's kept verdicts, so that every later call decides afresh and hands back."""
    with _lock:
        plan.busy = False
        _busy.discard(plan)
        if differs is None:
            plan.left -= 1
    site.counters.checked(differs is None)
    if differs is not None:
        stand_down(site, f"self-check failed at {where}: {differs}", inputs, forget)


def stand_down(site, reason: str, inputs: dict[str, Any], forget: Callable[[], None]) -> None:
    """The patch of ``site`` stands down for this process: every later call of its layer goes to AITER
    (:data:`STOOD_DOWN`, counted), its state is ``check_failed``, one ERROR line, the inputs saved."""
    from .core import events
    from .core.revert import stand_down as core_stand_down

    name = site.patch.name
    path = save_inputs(name, reason, inputs)
    full = f"{reason} (AITER serves every call from now on; inputs: {path})"
    site.stood_down = full  # before forgetting: the next decision reads it (the core marks the other layers)
    forget()
    if not core_stand_down(name, full):
        return  # another thread stood it down first, or it was reverted meanwhile
    log.error("aiter_patches: %s stood down (check_failed): %s", name, full)
    events.emit(events.STATES_CHANGED, cause="check_failed")


def _renew_after_fork() -> None:
    """In a forked child: a fresh lock, and the plans a parent's thread was checking free again."""
    global _lock
    _lock = threading.Lock()
    for plan in list(_busy):
        plan.busy = False
    _busy.clear()


def _subscribe() -> None:
    from .core import events

    events.subscribe(events.FORK_RENEW, _renew_after_fork)


_subscribe()

MAX_SAVED_BYTES = 64 << 20  # a tensor larger than this (expert weights) is saved as its metadata only


def save_inputs(name: str, reason: str, inputs: dict[str, Any]) -> str:
    """Write the failing call's inputs (tensors copied to the CPU) for a bug report; the path, or why not."""
    try:
        import torch

        folder = os.environ.get(DIR_ENV, "").strip() or tempfile.gettempdir()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"aiter_patches_check_failed_{name}_{os.getpid()}_{time.time_ns()}.pt")
        kept = {k: (v.detach().cpu() if v.numel() * v.element_size() <= MAX_SAVED_BYTES
                    else f"not saved: {tuple(v.shape)} {v.dtype} stride {tuple(v.stride())} on {v.device}")
                if isinstance(v, torch.Tensor) else repr(v) for k, v in inputs.items()}
        torch.save({"patch": name, "reason": reason, "inputs": kept}, path)
        return path
    except Exception as exc:  # noqa: BLE001 - the stand-down must happen whatever the disk says
        return f"not written ({type(exc).__name__}: {exc})"
