"""The self-check of ``moe_addend_fold``'s first calls per plan (``aiter_patches/self_check.py``).

The fold relies on AITER's stage 2 adding into ``moe_buf`` (which then starts from the addend).
An AITER build whose stage 2 overwrites instead would lose the addend. So the first folded call
of each plan (the activations' and the addend's shapes, dtypes and device, and the predicted
stage-1 quant) also runs AITER's ``fused_moe`` without the addend and adds the addend after it,
as an unpatched server does. The folded result must be within the fold's documented bound of that
(2-norm relative error ``BOUND``; not bitwise: the sum is rounded in another order). The caller
gets AITER's result on that call, written into the folded output.
"""

from __future__ import annotations

from ... import call_key, self_check

BOUND = 1e-2  # the fold's contract (README, verify's check): 2-norm relative error against fused_moe + addend
_PLANS: dict[tuple, self_check.Plan] = {}
MAX_PLANS = 1024  # past it a new plan is made per call (and counted by self_check.MAX_PLANS)
EXTENSION_ACTIVE = "self-check deferred: a sort extension is active (the addend is added after the call)"
_BY_CALL: dict[tuple, tuple] = {}  # the call's meta key -> (its plan,): see plan_for
MAX_CALL_KEYS = 1024  # past it a call met for the first time finds its plan by plan_key, every call


class Begun:
    """This call's fold is being checked (:func:`defer` began it): ``plan`` is its check state."""

    __slots__ = ("plan",)

    def __init__(self, plan):
        self.plan = plan


def forget() -> None:
    """Drop every plan: applied afresh, or stood down (every later call decides afresh)."""
    _PLANS.clear()
    _BY_CALL.clear()


def plan_for(name: str, step, addend) -> self_check.Plan | None:
    """The check state of this ``fused_moe`` call's plan while it has checks left, else None.

    Why not :func:`plan_key` alone: this runs on every ``fused_moe(moe_addend=)`` call, and the fast path
    after the check must cost what it cost before it (docs/self_check.md). A call is looked up by the
    key of its arguments as given (``step.meta_key()``: generated code per layout, each tensor's shape,
    dtype and device, values by type and value) and the addend's metadata: one dict lookup, then one
    attribute read. That key tells apart everything :func:`plan_key` does, so a call met for the first
    time (or unkeyable) finds its plan by :func:`plan_key`, and calls one plan key covers share its
    check. With the check off and no plan made, nothing is keyed; a plan not made while the check is
    off is made when it is on again. Past the check's cap (``self_check.MAX_PLANS``) the call keeps None."""
    if not _PLANS and not self_check.enabled():
        return None
    try:
        key = (step.meta_key(), type(addend), addend.shape, addend.dtype, addend.device)
        got = _BY_CALL.get(key)
    except (call_key.Unkeyable, TypeError):  # TypeError: an argument that does not hash (an Enum with __eq__ only)
        key = None
    else:
        if got is not None:
            plan = got[0]
            return plan if plan is not None and plan.left else None
    full = plan_key(step.arguments, addend)
    plan = _PLANS.get(full)
    if plan is None:
        if not self_check.enabled():
            return None
        plan = self_check.new_plan(name)  # None: past the cap, for the process's life
        if plan is not None:
            if len(_PLANS) >= MAX_PLANS:
                return plan  # made per call, kept nowhere (self_check.MAX_PLANS bounds them)
            plan = _PLANS.setdefault(full, plan)  # two threads meeting one new plan key: one plan
    if key is not None and len(_BY_CALL) < MAX_CALL_KEYS:
        _BY_CALL[key] = (plan,)
    return plan if plan is not None and plan.left else None


def plan_key(bound: dict, addend) -> tuple:
    """The plan: everything in the call that picks AITER's stages: every argument's metadata (tensors) or value."""
    key = []
    for k, v in bound.items():
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            key.append((k, tuple(v.shape), v.dtype, getattr(v, "device", None)))
        elif v is None or isinstance(v, (bool, int, float, str)):
            key.append((k, v))
        else:
            key.append((k, type(v).__name__, str(v)[:64]))
    key.append(("moe_addend", tuple(addend.shape), addend.dtype, addend.device))
    return tuple(key)


def defer(site, call, step) -> bool:
    """At the sort, for a call whose plan has checks left: True hands the fold back (the addend is added after
    the call: capture, tracing, another thread checking, an extension active; counted); False folds, and
    ``call.addend_check`` says whether this call is the check. The plan is not held busy across the call
    (an exception inside ``fused_moe`` would hold it for good): two threads may check one plan at once."""
    plan = call.addend_check
    if step.extensions:  # the check runs fused_moe again: not inside an extension's scope
        site.counters.fallback(EXTENSION_ACTIVE)
        return True
    what = self_check.begin(plan, site.counters)
    if what == self_check.AITER:
        return True
    if what == self_check.CHECK:
        self_check.finish_unchecked(plan)  # free at once; finish() below counts the check
        call.addend_check = Begun(plan)
    else:
        call.addend_check = None
    return False


def finish(site, call, step) -> None:
    """The folded output in ``step.output`` against AITER's ``fused_moe`` + the addend; the caller gets AITER's."""
    import torch

    out, plan = step.output, call.addend_check.plan
    call.addend_check = None
    theirs = step.call_aiter() + call.addend
    differs = self_check.compared(lambda: _difference(out, theirs, step.arguments))
    M, dim = call.addend.shape
    bound = step.arguments
    kept = {k: bound.get(k) for k in ("hidden_states", "topk_ids", "topk_weight", "topk_weights")
            if isinstance(bound.get(k), torch.Tensor)}
    self_check.finish(plan, site, differs,
                      where=f"fused_moe with moe_addend (tokens {M}, model_dim {dim}, {str(out.dtype).replace('torch.', '')})",
                      inputs={**kept, "moe_addend": call.addend,
                              "the other arguments": {k: (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor)
                                                      else repr(v)[:200] for k, v in bound.items() if k not in kept}},
                      forget=forget)
    out.copy_(theirs)


def _difference(out, theirs, bound: dict) -> str | None:
    """Within the bound over the rows AITER defines (below ``num_local_tokens``), NaN where AITER has NaN."""
    rows = bound.get("num_local_tokens")
    if rows is not None:
        rows = max(0, min(int(rows), out.shape[0]))
        out, theirs = out[:rows], theirs[:rows]
    a, b = out.float(), theirs.float()
    finite = b.isfinite()
    if not (a.isfinite() == finite).all():
        return "the folded output is not finite where AITER's fused_moe + the addend is, or the other way round"
    a, b = a[finite], b[finite]
    num, den = (a - b).norm().item(), b.norm().item()
    err = num / den if den > 0 else (0.0 if num == 0 else float("inf"))
    if err <= BOUND:
        return None
    return (f"the folded output is {err:.3g} (2-norm, relative) from AITER's fused_moe + the addend (bound {BOUND:g}): "
            "AITER's stage 2 may not add into moe_buf")
