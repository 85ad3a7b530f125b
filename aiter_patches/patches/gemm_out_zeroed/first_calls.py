"""The self-check of ``gemm_out_zeroed``'s first calls per verdict (``aiter_patches/self_check.py``).

The contract: ``out_zeroed=True`` into an ``out`` of zeros gives what AITER's memset + GEMM gives.
AITER's split-K kernel adds its splits atomically, so its own result may differ run to run in
the last bits: the check runs AITER twice on the same inputs (once into the caller's ``out``,
once into a buffer of its own) and asks the no-memset launch (into zeros of its own) to equal
AITER's bit for bit where AITER's two runs agree, and otherwise to stay within the largest
difference between them. The caller gets AITER's first result.

Both GEMM entry points are covered here: ``gemm_dispatch_out_zeroed`` forwards the servers'
promise to this patch's wrapper. A call whose ``out`` is not all zeros broke the promise (its
splits add onto ``out``: the contract, not a fault); it is not compared and takes the fast path.
"""

from __future__ import annotations

from ... import self_check

FAST = object()  # run() says: take the fast path as usual
NOT_ZERO = "self-check skipped for this plan: out was not all zeros (its splits add onto it: the contract)"


def run(site, forget, check, inner, binder, args: tuple, kwargs: dict, plan, operands: tuple):
    """The call's result when served here (AITER's, checked or not), or :data:`FAST`. ``forget``: drops
    the patch's kept verdicts (a failed check stands the patch down: every later call decides afresh)."""
    counters = site.counters
    what = self_check.begin(check, counters)
    if what == self_check.FAST:
        return FAST
    if what == self_check.AITER:
        return inner(*args, **kwargs)
    import torch

    A, B, out, A_scale, B_scale = operands
    try:
        promised = not bool(out.any())
    except Exception:  # noqa: BLE001 - an out that cannot be read here: not compared
        promised = False
    if not promised:  # the splits add onto out (the contract): nothing to compare, for this plan's life
        self_check.finish_skipped(check, counters, NOT_ZERO)
        return FAST
    try:  # the plan may hold out's strides: a buffer of its own with the same ones
        ours = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device).zero_()
        plan.backend.launch(plan.plan, A, B, ours, A_scale, B_scale)
    except Exception as exc:
        self_check.finish_unchecked(check)
        counters.failed(exc, "GEMM launch without memset (self-check)")
        return inner(*args, **kwargs)
    try:
        result = inner(*args, **kwargs)
        bound, _ = binder.bind(args, kwargs)
        again = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device)
        inner(**dict(bound, out=again))
    except BaseException:
        self_check.finish_unchecked(check)
        raise  # AITER's own error, as the unpatched call raises it
    differs = self_check.compared(lambda: first_difference(ours, out, again))
    self_check.finish(check, site, differs, where=_where(A, B, out, plan),
                      inputs={"A": A, "B": B, "A_scale": A_scale, "B_scale": B_scale, "out_dtype": out.dtype,
                              "plan": plan.plan}, forget=forget)
    return result


def first_difference(ours, aiter_first, aiter_again) -> str | None:
    """None if ``ours`` equals AITER's bits (its runs agreeing) or stays within their spread; else why not."""
    import torch

    if ours.shape != aiter_first.shape or ours.dtype != aiter_first.dtype:
        return f"out is {ours.dtype} {tuple(ours.shape)}, AITER's {aiter_first.dtype} {tuple(aiter_first.shape)}"
    bits = torch.int16 if ours.element_size() == 2 else torch.int32
    if torch.equal(ours.view(bits), aiter_first.view(bits)):
        return None
    spread = (aiter_first.float() - aiter_again.float()).abs().nan_to_num(float("inf")).max().item()
    off = (ours.float() - aiter_first.float()).abs().nan_to_num(float("inf")).max().item()
    if spread > 0 and off <= spread:
        return None
    where = (ours.view(bits) != aiter_first.view(bits)).nonzero()[0].tolist()
    return (f"out differs from AITER's at {tuple(where)} (largest difference {off:g}; "
            f"AITER against itself: {spread:g})")


def _where(A, B, out, plan) -> str:
    return (f"GEMM without memset (M {A.shape[0]}, N {B.shape[0]}, K {A.shape[1]}, out {str(out.dtype).replace('torch.', '')})")
