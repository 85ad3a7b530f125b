"""Patch: fold a shared-expert output into the MoE stage-2 reduction (``fused_moe(..., moe_addend=x)``).

AITER's atomic stage 2 adds every routed expert's weighted output into
``moe_buf``, which its sort zeroed. Starting ``moe_buf`` from the shared
expert's output instead makes ``out = fused_moe(...) + shared_out`` come out of
stage 2 with no extra launch: the one-launch sort writes the addend instead of
zeros; after AITER's own sort, one copy replaces the later add. Wherever stage 2
might overwrite instead of add, or the patch cannot prove the output is that
``moe_buf``, the addend is added after the call, once, and the fallback counted.
"""

from __future__ import annotations

import sys

from ... import foreign_layers, self_check
from ...core.declarations import Patch
from .. import pins, relied_on, sort_extension
from ..moe import pipeline as moe_pipeline
from ..moe.call import ADD_AFTER, FOLDED, PENDING

NAME = "moe_addend_fold"


def validate_addend(addend, hidden_states, topk_ids, w2, dtype, output=None) -> None:
    """Raise ``ValueError`` naming ``moe_addend`` and the rule it breaks."""
    import torch

    if not isinstance(addend, torch.Tensor):
        raise ValueError(f"moe_addend must be a torch.Tensor or None, not {type(addend).__name__}")
    M = topk_ids.shape[0]
    model_dim = w2.shape[1]
    out_dtype = dtype if dtype is not None else hidden_states.dtype
    if tuple(addend.shape) != (M, model_dim):
        raise ValueError(
            f"moe_addend must have shape [tokens, model_dim] = [{M}, {model_dim}] "
            f"(topk_ids rows, w2.shape[1]); got {list(addend.shape)}"
        )
    if addend.dtype != out_dtype:
        raise ValueError(f"moe_addend must have the output dtype {out_dtype}; got {addend.dtype}")
    if addend.device != topk_ids.device:
        raise ValueError(f"moe_addend must be on {topk_ids.device} like topk_ids; got {addend.device}")
    for name, other in (("hidden_states", hidden_states), ("output", output)):
        if other is not None and _overlaps(addend, other):
            raise ValueError(f"moe_addend must not share memory with {name} (it is read while the output is written)")


def _overlaps(a, b) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.data_ptr() != sb.data_ptr():
        return False
    a0, a1 = _byte_span(a)
    b0, b1 = _byte_span(b)
    return a0 < b1 and b0 < a1


def _byte_span(t) -> tuple[int, int]:
    start = t.data_ptr()
    extent = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def fold_blocker(bound: dict, call) -> str | None:
    """Why the sort's ``moe_buf`` cannot start from the addend, or None when stage 2 is known to add into it."""
    if not bound.get("accumulate", True):
        return "stage 2 overwrites its output (accumulate=False: reduce mode)"
    if bound.get("expert_mask") is not None:
        return "expert_mask (EP): AITER's EP stage 2 may switch to reduce mode"
    if bound.get("output_aux"):
        return "output_aux (a4w4 scatter-reduce overwrites)"
    if bound.get("return_local_topk_ids"):
        return "return_local_topk_ids"
    add = call.addend
    if bound.get("moebuf_dtype") != add.dtype:
        return f"moe_buf dtype {bound.get('moebuf_dtype')} differs from the addend's {add.dtype}"
    topk_ids = bound.get("topk_ids")
    if topk_ids is None or tuple(add.shape) != (topk_ids.shape[0], bound.get("model_dim")):
        return "moe_buf shape differs from the addend's"
    return None


def _is_same_tensor(a, b) -> bool:
    return b is not None and (a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()))


class AddendFold(moe_pipeline.Feature):
    """The pipeline steps of this patch (moe_pipeline.py's table: fused_moe 1 and 4, _moe_sorting_impl 2 and 6)."""

    name = NAME
    keywords = ("moe_addend",)
    reads = frozenset({"fused_moe.keywords", "fused_moe.output", "call.addend", "call.addend_state", "call.moe_buf",
                       "call.addend_check",
                       "sort.extensions", "sort.folding", "sort.outputs", "sort.addend_written"})
    writes = frozenset({"call.addend", "call.addend_state", "call.moe_buf", "call.addend_check", "sort.folding",
                        "sort.addend_offer"})

    def refuse(self, site, problem: str) -> None:
        raise TypeError(f"fused_moe(): {problem}")

    def forget(self) -> None:
        first_calls.forget()  # applied afresh: every plan is checked again

    def take_addend(self, site, call, step) -> None:
        bound, addend = step.arguments, step.keywords["moe_addend"]
        validate_addend(addend, bound.get("hidden_states"), bound.get("topk_ids"), bound.get("w2"),
                        bound.get("dtype"), bound.get("output"))
        call.addend, call.addend_state = addend, PENDING
        call.addend_check = first_calls.plan_for(NAME, step, addend)  # None: off, or this plan checked

    def add_or_count(self, site, call, step) -> None:
        """Folded into this very output: a hit. Otherwise the addend is added now, once, and the reason counted."""
        out = step.output
        if call.addend_state == FOLDED and _is_same_tensor(out, call.moe_buf):
            if isinstance(call.addend_check, first_calls.Begun):  # against AITER's fused_moe + the addend
                first_calls.finish(site, call, step)
                return
            site.counters.hit()
            return
        if call.addend_state == PENDING:
            site.counters.fallback(foreign_layers.unreached_sort_reason())
        elif call.addend_state == FOLDED:
            site.counters.fallback("fused_moe returned another tensor than the sort's moe_buf")
        out.add_(call.addend)

    def decide_fold(self, site, call, step) -> None:
        if call is None or call.addend is None or call.addend_state != PENDING:
            return
        bound, problems = step.bind()
        blocker = problems[0] if problems else fold_blocker(bound, call)
        if blocker is None and site.stood_down:
            blocker = self_check.STOOD_DOWN
        if blocker is None and call.addend_check is not None:
            if first_calls.defer(site, call, step):  # capture, tracing, an extension active (counted)
                call.addend_state = ADD_AFTER  # added after the call, as AITER's callers do
                return
        if blocker is not None:
            call.addend_state = ADD_AFTER
            site.counters.fallback(blocker)
            return
        step.folding = True
        # an extension's after-sort work may produce the addend: then it is copied in after that work
        if not sort_extension.work_after_sort(step.extensions):
            step.addend_offer = call.addend

    def start_from_addend(self, site, call, step) -> None:
        if not step.folding:
            return
        moe_buf = step.outputs[4]
        if not step.addend_written:
            moe_buf.copy_(call.addend)
        call.moe_buf, call.addend_state = moe_buf, FOLDED


FEATURE = moe_pipeline.feature(AddendFold())

from . import first_calls  # noqa: E402


def fused_moe_with_addend(addend, *args, **kwargs):
    """``fused_moe(*args, **kwargs) + addend``, folded into stage 2 when this patch is applied.

    For callers that must not depend on the patch being active: the same result
    either way (bitwise equal to the unpatched add where AITER's stage 2 adds in
    a fixed order; within bf16 rounding of it otherwise). Whether it is active is
    asked of the function bound now: does its call reach this patch's step
    (``moe_pipeline.takes_keyword``)?
    """
    fm = sys.modules["aiter.fused_moe"].fused_moe
    if moe_pipeline.takes_keyword(fm, "moe_addend"):
        return fm(*args, moe_addend=addend, **kwargs)
    from ...signatures import Binder

    binder = Binder(pins.FUSED_MOE[-1].signature)
    bound, _ = binder.bind(args, kwargs)
    validate_addend(addend, bound.get("hidden_states"), bound.get("topk_ids"), bound.get("w2"), bound.get("dtype"),
                    bound.get("output"))
    out = fm(*args, **kwargs)
    return out.add_(addend)




def check(device):
    """`aiter-patches verify`: ``moe_buf`` starts from the addend; and, where the AITER under test provides whole
    ``fused_moe`` inputs it runs here, ``fused_moe(moe_addend=)`` is within the fold's bound of ``fused_moe + addend``."""
    import torch

    from ... import registry
    from .. import checks as kit
    from ...core.declarations import CheckResult
    from ...registry import suspended
    from ..moe import call as moe_call

    _, fm = kit.aiter_modules()
    problems = []
    M, E, topk, dim, block = 6, 16, 4, 256, 32
    ids, w = kit.routing(M, E, topk, device)
    addend = torch.randn(M, dim, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device)
    call = moe_call.MoeCall(hidden_states=None)
    call.addend = addend
    before = kit.fast_hits("moe_addend_fold")
    with moe_call.scope(call):
        out = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, block)
    T = int(out[3][1])
    if call.addend_state != moe_call.FOLDED or not torch.equal(out[4][:T], addend[:T]):
        problems.append(f"moe_buf does not start from the addend (state {call.addend_state})")
    whole = kit.provided().fused_moe_inputs  # a whole fused_moe, where the AITER under test runs one here
    if whole is not None:
        args = whole(device, "bf16")
        add = torch.randn(args["topk_ids"].shape[0], args["w2"].shape[1],
                          generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(device)
        folded = fm.fused_moe(**args, moe_addend=add)
        if kit.fast_hits("moe_addend_fold") <= before:
            problems.append(f"fold not taken ({registry.stats()['moe_addend_fold']['fallback']})")
        with suspended():
            plain = fm.fused_moe(**args) + add
        err = ((folded.float() - plain.float()).norm() / plain.float().norm().clamp_min(1e-6)).item()
        if err > 1e-2:
            problems.append(f"relative error (2-norm) {err:.3g} > 1e-2")
    ok = not problems
    return CheckResult("bound: 2-norm rel. error <= 1e-2 vs fused_moe + addend", ok,
                       "moe_buf starts from the addend; result within bound" if ok else "; ".join(problems))


PATCH = Patch(
    name=NAME,
    summary="fused_moe(..., moe_addend=x): the shared-expert output folded into stage 2's accumulation",
    targets=(
        moe_pipeline.target(moe_pipeline.FUSED_MOE, NAME,
                            "Takes the extra keyword moe_addend; adds it after the call wherever it was not folded."),
        moe_pipeline.target(moe_pipeline.SORT, NAME,
                            "Starts moe_buf from the addend (in the one-launch sort, or one copy after AITER's sort)."),
    ),
    kernel_module="aiter_patches.kernels.moe_sort_mx_quant",
    relies_on=relied_on.MOE_ADDEND_FOLD,
    order=10,
    check=check,
)
