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

from ... import self_check

BOUND = 1e-2  # the fold's contract (README, verify's check): 2-norm relative error against fused_moe + addend
_PLANS: dict[tuple, self_check.Plan] = {}
MAX_PLANS = 1024  # past it a new plan is made per call (and counted by self_check.MAX_PLANS)


def plan_for(name: str, call) -> self_check.Plan | None:
    """The check state of this call's plan (None: the check is off or spent)."""
    a, x = call.addend, call.hidden_states
    key = (tuple(a.shape), a.dtype, a.device, tuple(getattr(x, "shape", ())), getattr(x, "dtype", None),
           call.quant_dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = self_check.new_plan(name)
        if plan is not None and len(_PLANS) < MAX_PLANS:
            _PLANS[key] = plan
    return plan


def finish(site, call, step) -> None:
    """The folded output in ``step.output`` against AITER's ``fused_moe`` + the addend; the caller gets AITER's."""
    import torch

    out = step.output
    try:
        theirs = step.call_aiter() + call.addend
    except BaseException:
        self_check.finish_unchecked(call.addend_check)
        raise
    num = (out.float() - theirs.float()).norm().item()
    den = theirs.float().norm().item()
    err = num / den if den > 0 else (0.0 if num == 0 else float("inf"))
    differs = None if err <= BOUND else (f"the folded output is {err:.3g} (2-norm, relative) from AITER's fused_moe "
                                         f"+ the addend (bound {BOUND:g}): AITER's stage 2 may not add into moe_buf")
    M, dim = call.addend.shape
    self_check.finish(call.addend_check, site, differs,
                      where=f"fused_moe with moe_addend (tokens {M}, model_dim {dim}, {str(out.dtype).replace('torch.', '')})",
                      inputs={**{k: v for k, v in step.arguments.items() if isinstance(v, torch.Tensor)},
                              "moe_addend": call.addend}, forget=_PLANS.clear)
    out.copy_(theirs)
