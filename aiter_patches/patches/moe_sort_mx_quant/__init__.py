"""Patch: AITER's MoE sort, the ``moe_buf`` zero-fill and the stage-1 MX quant in one launch.

At decode sizes AITER spends more time launching than working: the opus sort
(1-4 kernels), then the stage-1 MXFP4/MXFP8 quant + scale sort (1-2 kernels).
``fused_moe``'s wrapper predicts from its arguments whether stage 1 will quantize
the activations per 1x32; the sort wrapper then runs one Triton kernel that
sorts, zero-fills and quantizes, and the quant helper hands the result back for
exactly the stage-1 call it was made for. A wrong prediction costs time, never
bits: an unused quant is dropped and AITER quantizes as usual.

Host time (issue 15): the sort gate's verdict (the reasons it counts, whether it launches, with
or without the quant and the addend fill) is kept per key of everything it reads (``call_key``:
the sort's arguments as given, the open call's predicted quant and activations, the addend
offered, the functions and kernel limits it consults), so a repeated call skips the checks.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

import torch

from ... import call_key, foreign_layers, runtime, self_check
from ...aiter_contract import SORT_FOUR_LAUNCHES_MIN_TOKENS
from ...core.declarations import Patch
from .. import relied_on
from ..moe import call as moe_call
from ..moe import pipeline as moe_pipeline
from ..moe import sort_scratch
from ..moe.call import StageOneQuant, tensor_key

NAME = "moe_sort_mx_quant"
KERNEL_MODULE = "aiter_patches.kernels.moe_sort_mx_quant"



_KERNEL = []  # the kernel module, imported at the first call (an import statement per call costs ~1 µs)


def _kernel():
    if not _KERNEL:
        from ...kernels import moe_sort_mx_quant

        _KERNEL.append(moe_sort_mx_quant)
    return _KERNEL[0]


from . import first_calls, predict  # noqa: E402
from .predict import predict_stage1_quant  # noqa: E402 (the fused_moe step and the tests use it)


class SortMxQuant(moe_pipeline.Feature):
    """The pipeline steps of this patch (moe_pipeline.py's table: fused_moe 2 and 3, _moe_sorting_impl 4)."""

    name = NAME
    reads = frozenset({"call.hidden_states", "call.quant_dtype", "call.stage1_quant", "call.sort_reached",
                       "call.scratch", "call.own_sort", "sort.addend_offer", "sort.outputs", "sort.extensions"})
    writes = frozenset({"call.quant_dtype", "call.stage1_quant", "sort.outputs", "sort.addend_written"})

    def forget(self) -> None:
        VERDICTS.clear()
        _NOTHING_SAVED.clear()
        _SHORTCUT_LAYOUTS.clear()
        predict.CONFIGS.clear()
        _OPUS_WORKSPACE.clear()
        sort_scratch.clear()

    def predict_quant(self, site, call, step) -> None:
        if call.quant_dtype is None:
            call.quant_dtype = predict_stage1_quant(step.arguments)

    def count_unreached(self, site, call, step) -> None:
        if not call.sort_reached:
            site.counters.fallback(foreign_layers.unreached_sort_reason())

    def one_launch_sort(self, site, call, step) -> None:
        """The one-launch sort (+ quant, + the addend as moe_buf's fill); leaves ``step.outputs`` None to give the call to AITER.

        The gate's verdict (the reasons it counts, whether it launches, and without which of the
        quant and the addend) is kept per :func:`_verdict_key`; a hit replays the counted reasons."""
        if step.outputs is not None:
            return
        counters = site.counters
        if step.addend_offer is None and (call is None or call.quant_dtype is None or call.stage1_quant is not None):
            reason = nothing_to_save(step)
            if reason is not None:
                counters.fallback(reason)
                return
        key, tensors = _verdict_key(step, call)
        verdict = VERDICTS.get(key, tensors) if key is not None else None
        if verdict is None:
            verdict = _decide(step, call, site)
            if key is not None and verdict.keep:
                VERDICTS.put(key, tensors, verdict)
                if site.stood_down:  # stood down while this call decided: nothing kept outlives it
                    VERDICTS.clear()
        for reason in verdict.reasons:
            counters.fallback(reason)
        if not verdict.launch:
            return
        ids, weights, experts, dim, buf_dtype, block, mask, nlt, moe_buf = step.pick(verdict.picker)
        quant_input, quant_dtype = (call.hidden_states, call.quant_dtype) if verdict.quant else (None, None)
        init = step.addend_offer if verdict.init else None
        kernel, kept = _KERNEL[0], verdict.plan
        api = kernel.moe_sort_mx_quant
        if verdict.check is not None and verdict.check.left and first_calls.run(VERDICTS.clear, site, step, verdict, api, dict(
                topk_ids=ids, topk_weights=weights, num_experts=experts, model_dim=dim, moebuf_dtype=buf_dtype,
                block_size=block, zero_moe_buf=verdict.zeroes, expert_mask=mask, num_local_tokens=nlt,
                quant_input=quant_input, quant_dtype=quant_dtype, moe_buf=moe_buf, moe_buf_init=init)):
            return  # a self-checked call (self_check.py): AITER's outputs, or AITER's sort runs
        if api is not kernel.API:  # the API replaced (a wrapper, an injected failure): it takes every call
            kept = None
        try:
            if kept:  # the kernel plan this verdict's first launch used: its key holds all the plan key reads
                outs = (sort_scratch.lease(call, kept[0], ids, quant_dtype)
                        if call is not None and call.scratch is not None and not step.extensions else None)
                res = kernel.run_kept(kept[0], ids, weights, dim, buf_dtype, mask, nlt, quant_input, quant_dtype,
                                      moe_buf, init, verdict.zeroes, outs)
            else:
                res = api(
                    ids, weights, experts, dim, buf_dtype, block, zero_moe_buf=verdict.zeroes, checked=True,
                    expert_mask=mask, num_local_tokens=nlt, quant_input=quant_input, quant_dtype=quant_dtype,
                    moe_buf=moe_buf, moe_buf_init=init, kept=kept,
                )
        except Exception as exc:  # a compile or launch failure: AITER does the work
            counters.failed(exc, "moe_sort_mx_quant kernel")
            return
        counters.hit()
        if call is not None and res.quant is not None:
            call.stage1_quant = StageOneQuant(
                sorted_ids=res.sorted_ids, num_valid_ids=res.num_valid_ids, sorted_weights=res.sorted_weights,
                quant_dtype=quant_dtype, data=res.quant[0], scale=res.quant[1],
                input_key=tensor_key(quant_input), block_size=block,
                counters=counters,
            )
        step.addend_written = init is not None
        step.outputs = (res.sorted_ids, res.sorted_weights, res.sorted_expert_ids, res.num_valid_ids, res.moe_buf)


class SortVerdict(NamedTuple):
    """What the sort gate decided for one key: the fallback reasons it counts (in order), whether
    the one-launch sort runs, whether with the stage-1 quant and with the addend fill, whether it
    zero-fills ``moe_buf``, and where the launch's arguments are among the call's (``SortStep.picker``)."""

    reasons: tuple
    launch: bool
    quant: bool = False
    init: bool = False
    zeroes: bool = True
    picker: Any = None
    keep: bool = True  # False: decided per call (AITER could not answer this time)
    plan: list | None = None  # a launching verdict's kernel plan, once its first launch made it (kernel's ``kept``)
    check: self_check.Plan | None = None  # a launching verdict's first calls still to check against AITER's


# the sort's arguments the launch takes, in moe_sort_mx_quant's order (then expert_mask, num_local_tokens, output)
_LAUNCH_ARGS = ("topk_ids", "topk_weights", "num_experts", "model_dim", "moebuf_dtype", "block_size",
                "expert_mask", "num_local_tokens", "output")


# Verdicts by _verdict_key (never a tensor: metadata, Python values, the functions and limits read, and
# torch's guard of the tensors' metadata).
VERDICTS = call_key.GuardedVerdicts(NAME)


def _verdict_key(step, call):
    """``(key, tensors)``: everything :func:`_decide` reads, the tensors' strides, dtypes, devices and
    ``requires_grad`` left to a guard over ``tensors`` (``call_key.split_key``); ``(None, ())``: an
    unkeyable argument, or torch.compile tracing.

    It also holds everything the kernel API's plan key reads (the arguments', the activations' and
    the addend's metadata are in the key and the guard; the verdict fixes the quant, the init and the
    zero-fill; the rest is ``plan_key_reads()``), so a launching verdict keeps the kernel plan its
    first launch used and a hit launches it without a second key (issue 15)."""
    kernel = _KERNEL[0] if _KERNEL else _kernel()
    try:
        args, tensors = step.arguments_key()
        offer = step.addend_offer
        state = None
        if call is not None:
            # the activations are read only where a quant is predicted (_request): keyed only then
            seen = None
            if call.hidden_states is not None and call.quant_dtype is not None:
                seen, more = call_key.value_split(call.hidden_states)
                tensors += more
            state = (call.quant_dtype, call.stage1_quant is None, seen)
        if offer is not None:
            offer, more = call_key.value_split(offer)
            tensors += more
        return (args, state, offer,
                runtime.triton_backend_reason, os.environ.get("TRITON_INTERPRET"),
                python_level_reason, sort_only_reason, aiter_sort_launches,
                getattr(sys.modules.get("aiter"), "moe_sorting_opus_get_workspace_size", None),
                kernel.unsupported_reason, kernel.launch_count, kernel.MAX_TOPK, kernel.MAX_EXPERTS,
                kernel.MAX_MODEL_DIM, kernel.INT32_LIMIT, kernel.run_kept,
                kernel.plan_key_reads()), tensors  # the kept kernel plan's own key reads (tunables, kernels)
    except call_key.Unkeyable:
        return None, ()


def _decide(step, call, site) -> SortVerdict:
    """The sort gate in full (the counted reasons in the order it meets them)."""
    if site.stood_down:
        return SortVerdict((self_check.STOOD_DOWN,), False)
    reasons = []
    bound, problems = step.bind()
    if problems:
        return SortVerdict((problems[0],), False)
    reason = python_level_reason(bound) or runtime.triton_backend_reason(bound["topk_ids"].device)
    if reason is not None:
        return SortVerdict((reason,), False)
    kernel = _kernel()
    request = _request(bound, call, step.addend_offer)
    if request["quant_input"] is not None and request["quant_input"].shape[0] == 0:
        # AITER's quant launcher divides by token_num: its outcome, not an empty result
        reasons.append("stage-1 quant not fused: 0 tokens (AITER's quant decides the outcome)")
        request.update(quant_input=None, quant_dtype=None)
    reason = kernel.unsupported_reason(**request)
    if reason is not None and request["quant_input"] is not None:
        reasons.append(f"stage-1 quant not fused: {reason}")
        request.update(quant_input=None, quant_dtype=None)
        reason = kernel.unsupported_reason(**request)
    if reason is not None and request["moe_buf_init"] is not None:
        reasons.append(f"addend not written in the sort launch (copied after it): {reason}")
        request.update(moe_buf_init=None)
        reason = kernel.unsupported_reason(**request)
    if reason is not None:
        return SortVerdict((*reasons, reason), False)
    if request["quant_input"] is None and request["moe_buf_init"] is None:
        reason = sort_only_reason(bound, kernel)
        if reason is not None:
            return SortVerdict((*reasons, reason), False, keep=reason != WORKSPACE_UNKNOWN)
    return SortVerdict(tuple(reasons), True, request["quant_input"] is not None, request["moe_buf_init"] is not None,
                       _zeroes(bound), step.picker(_LAUNCH_ARGS), plan=[], check=self_check.new_plan(NAME))


FEATURE = moe_pipeline.feature(SortMxQuant())


_OPUS_WORKSPACE: dict[tuple, int] = {}  # (AITER's function, shape) -> its workspace size, WORKSPACE_CAP at most
WORKSPACE_CAP = 1024  # as the other caches of this patch: past it AITER is asked each time (a host call)


def aiter_sort_launches(tokens: int, num_experts: int, topk: int, dispatch_policy: int) -> int:
    """Kernels AITER's opus sort launches (``moe_sorting_opus`` in csrc/include/moe_sorting_opus.h
    at e4048607a5): one when its workspace size is 0 (the one-shot kernel, which zero-fills
    ``moe_buf`` itself; dispatch policy 1 forces it), else the multi-phase kernels: two below
    2048 tokens (P0 + P23), four from 2048 (workspace clear, P0, P1, P23). The workspace size
    is AITER's own answer (the host function ``_moe_sorting_impl`` calls anyway), cached per shape
    (at most :data:`WORKSPACE_CAP` shapes)."""
    fn = moe_call.aiter_module().moe_sorting_opus_get_workspace_size
    key = (fn, int(tokens), int(num_experts), int(topk), int(dispatch_policy))
    ws = _OPUS_WORKSPACE.get(key)
    if ws is None:
        ws = int(fn(*key[1:]))
        if len(_OPUS_WORKSPACE) < WORKSPACE_CAP:
            _OPUS_WORKSPACE[key] = ws
    if ws == 0:
        return 1
    return 2 if tokens < SORT_FOUR_LAUNCHES_MIN_TOKENS else 4


WORKSPACE_UNKNOWN = "sort only: AITER's opus sort launch count unknown (moe_sorting_opus_get_workspace_size failed)"


def sort_only_reason(bound: dict, kernel) -> str | None:
    """Why the one-launch sort alone (no quant handed back, no addend written) would save nothing, or None.

    It replaces AITER's sort launches (which already zero-fill ``moe_buf``) with its own:
    worth it only where it launches fewer kernels.
    """
    M, topk = bound["topk_ids"].shape
    ours = kernel.launch_count(M, topk, bound["num_experts"], quant=False, fused=False)
    try:
        theirs = aiter_sort_launches(M, bound["num_experts"], topk, bound.get("dispatch_policy", 0) or 0)
    except Exception:  # noqa: BLE001 - AITER cannot say: do not replace its sort for nothing (asked again next call)
        return WORKSPACE_UNKNOWN
    if ours >= theirs:
        return (f"sort only, nothing saved: AITER's opus sort takes {theirs} launch(es), "
                f"the one-launch sort {ours}")
    return None


_SHORTCUT_NAMES = ("topk_ids", "num_experts", "dispatch_policy", "use_opus", "output_aux", "return_local_topk_ids")
_SHORTCUT_LAYOUTS: dict[tuple, Any] = {}  # (binder, positional count, keyword names) -> picker, or False
_NOTHING_SAVED: dict[tuple, str | None] = {}  # what nothing_to_save reads -> its answer
_FLAG_TYPES = (type(None), bool, int)


def nothing_to_save(step) -> str | None:
    """The hand-back of a sort-only call (no quant to make, no addend to write) where the one-launch
    sort saves no launch (AITER's opus sort is one launch already: decode sizes), decided by the full
    gate's own rule, :func:`sort_only_reason`, without the verdict key (issue 15): the plain
    ``fused_moe`` call of bf16 and fp8 weights at decode sizes, and the sort alone there, cost the host
    no more than this.

    Exact in its outcome: the full gate hands such a call to AITER too (the same rule); the
    reason counted is that one, met first (the full gate may have met another first: a kernel limit,
    a device without Triton; either way the call is AITER's). AITER's workspace query failing is
    counted as the full gate counts it (not remembered: asked again next call). None: the full gate
    decides (arguments the pin does not explain, a flag that is set, or any of the values read here,
    ``num_experts``, ``dispatch_policy``, ``use_opus``, ``output_aux``, ``return_local_topk_ids``, not a
    Python value, AITER's sort in more launches than ours, torch.compile tracing). The other values the full
    gate reads (``model_dim``, ``block_size``, ``accumulate``) are not read here: given as tensors, such a
    call is counted "nothing saved" where the full gate counts "is a tensor", AITER's either way. The kernel's
    module constants, which ``launch_count`` reads, are not in the remembered answer's key: only benchmarks and
    tests change them (``forget`` clears the answers), a stale answer only sends a call to AITER or to the full
    gate where the new constants would not (AITER's bits or the gate's own choice, never other numbers), and
    reading them (``plan_key_reads()``) would cost about 0.9 µs a call on this path.
    """
    layout = step.layout()
    pick = _SHORTCUT_LAYOUTS.get(layout)
    if pick is None:
        pick = False if step.bind()[1] else step.picker(_SHORTCUT_NAMES)
        if len(_SHORTCUT_LAYOUTS) < 64:
            _SHORTCUT_LAYOUTS[layout] = pick
    if pick is False:
        return None
    ids, experts, policy, use_opus, aux, local = step.pick(pick)
    if (type(ids) is not torch.Tensor or type(experts) is not int or type(policy) not in _FLAG_TYPES
            or type(use_opus) not in _FLAG_TYPES or type(aux) not in _FLAG_TYPES or type(local) not in _FLAG_TYPES
            or aux or local or not use_opus or ids.dim() != 2 or call_key._compiling()):
        return None
    kernel = _KERNEL[0] if _KERNEL else _kernel()
    key = (aiter_sort_launches, kernel.launch_count, ids.shape, experts, policy or 0,
           getattr(sys.modules.get("aiter"), "moe_sorting_opus_get_workspace_size", None))
    try:
        return _NOTHING_SAVED[key]
    except KeyError:
        pass
    reason = sort_only_reason({"topk_ids": ids, "num_experts": experts, "dispatch_policy": policy}, kernel)
    if reason != WORKSPACE_UNKNOWN and len(_NOTHING_SAVED) < 1024:  # a failed query: asked again next call
        _NOTHING_SAVED[key] = reason
    return reason


# Read by value (truthiness, sizes, policy): a tensor there would be read on the device (a sync) and
# keyed by its metadata only, so a kept verdict would outlive a changed value.
VALUE_PARAMS = ("accumulate", "output_aux", "return_local_topk_ids", "use_opus", "num_experts", "block_size",
                "dispatch_policy", "model_dim")


def python_level_reason(bound: dict) -> str | None:
    """Arguments the one-launch sort does not cover (AITER's own path handles them)."""
    for name in VALUE_PARAMS:
        if isinstance(bound.get(name), torch.Tensor):
            return f"{name} is a tensor: the gate reads it as a Python value (AITER's own path takes it)"
    if bound.get("output_aux"):
        return "output_aux (the a4w4 adaptive sort)"
    if bound.get("return_local_topk_ids"):
        return "return_local_topk_ids"
    if not bound.get("use_opus", True):
        return "use_opus=False (the CK sort, AITER_USE_CK_MOE_SORTING=1)"
    return None


def _zeroes(bound: dict) -> bool:
    return bool(bound.get("accumulate", True)) or bound.get("expert_mask") is not None


def _request(bound: dict, call, addend_offer) -> dict:
    quant_input = None
    quant_dtype = None
    if call is not None and call.quant_dtype is not None and call.stage1_quant is None:
        hs = call.hidden_states
        if hs is not None and hs.dim() == 2 and hs.shape[0] == bound["topk_ids"].shape[0]:
            quant_input, quant_dtype = hs, call.quant_dtype
    init = addend_offer if (addend_offer is not None and _zeroes(bound)) else None
    return {
        "topk_ids": bound["topk_ids"],
        "topk_weights": bound["topk_weights"],
        "num_experts": bound["num_experts"],
        "model_dim": bound["model_dim"],
        "block_size": bound["block_size"],
        "expert_mask": bound.get("expert_mask"),
        "num_local_tokens": bound.get("num_local_tokens"),
        "quant_input": quant_input,
        "quant_dtype": quant_dtype,
        "moe_buf": bound.get("output"),
        "moe_buf_init": init,
    }




PATCH = Patch(
    name=NAME,
    summary="MoE sort + moe_buf zero-fill + stage-1 MX (fp4/fp8) activation quant in one Triton launch",
    targets=(
        moe_pipeline.target(moe_pipeline.FUSED_MOE, NAME,
                            "Predicts the stage-1 MX quant from the arguments and opens the per-call hand-off."),
        moe_pipeline.target(moe_pipeline.SORT, NAME, "Looked up in aiter.fused_moe's globals by moe_sorting at "
                                                     "call time: the one-launch sort (+ quant)."),
        *moe_pipeline.stage1_quant_targets(NAME, "the sort"),
    ),
    kernel_module=KERNEL_MODULE,
    order=30,
    relies_on=relied_on.MOE_SORT_MX_QUANT,
    check="aiter_patches.patches.moe_sort_mx_quant.check:check",
)
