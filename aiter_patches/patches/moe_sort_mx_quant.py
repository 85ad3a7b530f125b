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

from .. import call_key, foreign_layers, runtime
from ..aiter_contract import SORT_FOUR_LAUNCHES_MIN_TOKENS
from ..core.declarations import Patch
from . import moe_call, moe_pipeline, relied_on, sort_scratch
from .moe_call import StageOneQuant, enum_value, tensor_key

NAME = "moe_sort_mx_quant"
KERNEL_MODULE = "aiter_patches.kernels.moe_sort_mx_quant"

_PER_1X32 = 3  # QuantType.per_1x32
_SWIGLU, _SITUV2 = 2, 3  # ActivationType


_KERNEL = []  # the kernel module, imported at the first call (an import statement per call costs ~1 µs)


def _kernel():
    if not _KERNEL:
        from ..kernels import moe_sort_mx_quant

        _KERNEL.append(moe_sort_mx_quant)
    return _KERNEL[0]


# AITER reads these once, at the import of aiter.fused_moe (fused_moe.py:76-77 at e4048607a5), and
# keeps them as module globals; they are read from there when present, else as AITER would have.
_BYPASS_QUANT_AT_IMPORT = os.environ.get("AITER_MOE_A8W4_BYPASS_QUANT", "0") == "1"
_SWIGLU_BF16_BOUND_AT_IMPORT = int(os.environ.get("GPTOSS_SWIGLU_MXFP4_BF16_BOUND", "256"))
_PER_128X128, _PER_1X128 = 5, 4


def predict_stage1_quant(bound: dict):
    """The MX dtype AITER's ``fused_moe_2stages`` will quantize the stage-1 activations to, or None.

    Follows AITER's own decisions for ``QuantType.per_1x32`` (fused_moe.py at e4048607a5):
    ``_fused_moe_impl``'s ``q_dtype_a`` rule (≈755-800: MXFP8 weights → fp8; Swiglu with
    separated gates → bf16 below ``GPTOSS_SWIGLU_MXFP4_BF16_BOUND`` tokens, fp4 from it;
    Swiglu/interleaved gates → fp8 on gfx950 from ``AITER_BF16_FP8_MOE_BOUND`` tokens, else
    bf16; SiTUv2 → bf16 unless ``AITER_SITUV2_A8W4``/``A4W4``), then the kernel config the
    same way AITER gets it (``get_2stage_cfgs``, an ``lru_cache`` AITER hits again right
    after: nothing on the device is read), then ``fused_moe_2stages``' stage-1 branch
    (≈3050-3110: no quant when the config does not pre-quantize, for bf16 Swiglu/SiTUv2/
    interleaved stage 1, and for preshuffled fp4 weights with ``ksplit > 1``; the fp8 quant
    skipped under ``AITER_MOE_A8W4_BYPASS_QUANT``). Activations that arrive quantized
    (an fp4x2/fp8 ``hidden_states``) are not quantized by stage 1's helper: None.
    A given ``a1_scale`` with bf16 activations does not stop AITER from quantizing.
    Paths where AITER never asks ``get_2stage_cfgs`` for these arguments are None before
    asking it (it is not free: a miss reads the tuned CSVs, logs, and under
    ``AITER_ONLINE_TUNE=1`` runs a tuning job): the shared-expert arguments (``fused_moe``
    hands the call to ``aiter.fhmoe``), and interleaved gates with FlyDSL available (its
    grouped a8w4 kernel may take the call before any sort).
    """
    g = bound.get
    if (g("shared_w1") is not None or g("shared_w2") is not None or g("shared_w1_scale") is not None
            or g("shared_w2_scale") is not None or g("shared_expert_id", -1) != -1):
        return None  # fused_moe diverts to aiter.fhmoe._fhmoe
    qt = enum_value(g("quant_type", 0))
    if qt == _PER_128X128:
        qt = _PER_1X128
    if qt != _PER_1X32:
        return None
    hidden, w1, w2, topk_ids = g("hidden_states"), g("w1"), g("w2"), g("topk_ids")
    if hidden is None or w1 is None or w2 is None or topk_ids is None:
        return None
    hidden_dtype = hidden.dtype
    out_dtype = g("dtype") or hidden_dtype
    if hidden_dtype not in _HALF or out_dtype not in _HALF:
        return None
    fm = moe_call.aiter_module("aiter.fused_moe")
    dtypes = moe_call.aiter_module().dtypes
    fp4, fp8, w1_dtype = dtypes.fp4x2, dtypes.fp8, w1.dtype
    q_dtype_a = _stage1_dtype(fm, dtypes, bound, w1_dtype, topk_ids.shape[0])
    if q_dtype_a != fp4 and q_dtype_a != fp8:
        return None
    metadata = _kernel_config(fm, bound, q_dtype_a, out_dtype)
    if metadata is None or getattr(metadata, "run_1stage", False) or not getattr(metadata, "prequant", True):
        return None
    if w1_dtype == fp4 and q_dtype_a == fp4 and metadata.ksplit > 1 and (_is_shuffled(w1) or _is_shuffled(w2)):
        return None  # CK-Tile split-K stage 1 on the bf16 activations
    if q_dtype_a == fp8:
        return None if getattr(fm, "_MOE_A8W4_BYPASS_QUANT", _BYPASS_QUANT_AT_IMPORT) else fp8
    return fp4


_HALF = (torch.bfloat16, torch.float16)


def _is_shuffled(w) -> bool:
    return bool(getattr(w, "is_shuffled", False))


def _stage1_dtype(fm, dtypes, bound, w1_dtype, tokens):
    """``_fused_moe_impl``'s ``q_dtype_a`` for ``per_1x32`` (None: a path this patch does not model)."""
    if w1_dtype == dtypes.fp8:
        return dtypes.fp8
    if w1_dtype != dtypes.fp4x2:
        return None  # int4 weights (a16wi4: bf16 stage 1), or a dtype AITER's rule does not name
    gfx = fm.get_gfx() if hasattr(fm, "get_gfx") else None
    if gfx == "gfx1250":
        return None  # its own grouped kernels
    act = enum_value(bound.get("activation", 0))
    gate = bound.get("gate_mode", "separated")
    interleaved = getattr(gate, "value", gate) == "interleave"
    if act == _SITUV2:
        if interleaved and _flydsl(fm):
            return None  # AITER may take its grouped a8w4 kernel before any sort
        if os.environ.get("AITER_SITUV2_A8W4", "0") == "1":
            return dtypes.fp8
        if os.environ.get("AITER_SITUV2_A4W4", "0") == "1":
            return dtypes.fp4x2
        return dtypes.bf16
    if act == _SWIGLU and not interleaved:
        bound_m = getattr(fm, "_SWIGLU_MXFP4_BF16_BOUND", _SWIGLU_BF16_BOUND_AT_IMPORT)
        return dtypes.bf16 if tokens < bound_m else dtypes.fp4x2
    if act == _SWIGLU or interleaved:
        if interleaved and _flydsl(fm):
            return None  # AITER may take its grouped a8w4 kernel before any sort
        fp8_bound = int(os.environ.get("AITER_BF16_FP8_MOE_BOUND", "256"))
        return dtypes.bf16 if gfx != "gfx950" or tokens < fp8_bound else dtypes.fp8
    return dtypes.fp4x2


def _flydsl(fm) -> bool:
    try:
        return bool(fm.is_flydsl_available())
    except Exception:  # noqa: BLE001 - an unknown answer is "maybe": predict nothing
        return True


def _kernel_config(fm, bound, q_dtype_a, out_dtype):
    """AITER's ``get_2stage_cfgs`` result for this call, asked exactly as ``_fused_moe_impl`` asks
    (same positional/keyword layout, so AITER's own ``lru_cache`` answers its next call).

    Kept per :data:`_CONFIGS` key: the plain values it is asked with (ints, strings, shapes, dtypes;
    the enums by value) and the AITER functions and enums it goes through, by identity. AITER keeps
    the answer in that ``lru_cache`` for the same arguments; asking it again costs microseconds a
    call (its key hashes four Python enums and keywords). A call that raised is asked again."""
    try:
        g = bound.get
        w1, w2, topk_ids = bound["w1"], bound["w2"], bound["topk_ids"]
        gate = g("gate_mode")
        act, gate = enum_value(g("activation", 0)), getattr(gate, "value", gate) or "separated"
        doweight, hidden_pad, inter_pad = bool(g("doweight_stage1", False)), g("hidden_pad", 0), g("intermediate_pad", 0)
        s1, s2 = _is_shuffled(w1), _is_shuffled(w2)
        ids_shape, w1_shape, w2_shape = topk_ids.shape, w1.shape, w2.shape
        ask = fm.get_2stage_cfgs
        key = (ask, fm.get_inter_dim, fm.get_padded_M, fm.QuantType, fm.ActivationType, fm.GateMode,
               ids_shape, w1_shape, w2_shape, w1.dtype, out_dtype, q_dtype_a, act, gate, doweight,
               hidden_pad, inter_pad, s1, s2, g("expert_mask") is None, g("bias2") is None)
        if type(gate) is not str or type(hidden_pad) is not int or type(inter_pad) is not int:
            key = None  # asked as given, every call (a tensor's value is not in a key)
        else:
            got = _CONFIGS.get(key)
            if got is not None:
                return got
        M, topk = ids_shape
        E, model_dim, inter_dim = fm.get_inter_dim(w1_shape, w2_shape)
        config = ask(
            fm.get_padded_M(M), model_dim, inter_dim, E, topk, out_dtype, q_dtype_a, w1.dtype,
            _member(fm.QuantType, _PER_1X32), inter_dim != w1_shape[1],
            _member(fm.ActivationType, act), doweight, hidden_pad, inter_pad, s1 or s2,
            _member(fm.GateMode, gate),
            is_ep=g("expert_mask") is not None,
            has_stage2_bias=g("bias2") is not None,
            opus_weights_shuffled=s1 and s2,
            config_file=None,
        )
    except Exception:  # noqa: BLE001 - AITER's own call will raise the same; predict nothing
        return None
    if key is not None and config is not None and len(_CONFIGS) < MAX_CONFIGS and not torch.compiler.is_compiling():
        _CONFIGS[key] = config
    return config


MAX_CONFIGS = 1024
_CONFIGS: dict[tuple, object] = {}  # _kernel_config's key -> AITER's answer (never a tensor: AITER's config object)


_MEMBERS: dict[tuple, object] = {}  # (enum class, value) -> member: an Enum lookup by value costs ~1 µs


def _member(enum_cls, value):
    """``enum_cls(value)``, remembered (a value the enum refuses raises, every time, as before)."""
    key = (enum_cls, type(value), value)
    member = _MEMBERS.get(key)
    if member is None:
        member = enum_cls(value)
        if len(_MEMBERS) < 256:
            _MEMBERS[key] = member
    return member


class SortMxQuant(moe_pipeline.Feature):
    """The pipeline steps of this patch (moe_pipeline.py's table: fused_moe 2 and 3, _moe_sorting_impl 4)."""

    name = NAME
    reads = frozenset({"call.hidden_states", "call.quant_dtype", "call.stage1_quant", "call.sort_reached",
                       "call.scratch", "sort.addend_offer", "sort.outputs", "sort.extensions"})
    writes = frozenset({"call.quant_dtype", "call.stage1_quant", "sort.outputs", "sort.addend_written"})

    def forget(self) -> None:
        VERDICTS.clear()
        _NOTHING_SAVED.clear()
        _SHORTCUT_LAYOUTS.clear()
        _CONFIGS.clear()
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
            verdict = _decide(step, call)
            if key is not None and verdict.keep:
                VERDICTS.put(key, tensors, verdict)
        for reason in verdict.reasons:
            counters.fallback(reason)
        if not verdict.launch:
            return
        ids, weights, experts, dim, buf_dtype, block, mask, nlt, moe_buf = step.pick(verdict.picker)
        quant_input, quant_dtype = (call.hidden_states, call.quant_dtype) if verdict.quant else (None, None)
        init = step.addend_offer if verdict.init else None
        kernel, kept = _KERNEL[0], verdict.plan
        api = kernel.moe_sort_mx_quant
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
                kernel.MAX_MODEL_DIM, kernel.ONE_LAUNCH_MAX_PAIRS, kernel.INT32_LIMIT, kernel.run_kept,
                kernel.plan_key_reads()), tensors  # the kept kernel plan's own key reads (tunables, kernels)
    except call_key.Unkeyable:
        return None, ()


def _decide(step, call) -> SortVerdict:
    """The sort gate in full (the counted reasons in the order it meets them)."""
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
                       _zeroes(bound), step.picker(_LAUNCH_ARGS), plan=[])


FEATURE = moe_pipeline.feature(SortMxQuant())


_OPUS_WORKSPACE: dict[tuple, int] = {}


def aiter_sort_launches(tokens: int, num_experts: int, topk: int, dispatch_policy: int) -> int:
    """Kernels AITER's opus sort launches (``moe_sorting_opus`` in csrc/include/moe_sorting_opus.h
    at e4048607a5): one when its workspace size is 0 (the one-shot kernel, which zero-fills
    ``moe_buf`` itself; dispatch policy 1 forces it), else the multi-phase kernels: two below
    2048 tokens (P0 + P23), four from 2048 (workspace clear, P0, P1, P23). The workspace size
    is AITER's own answer (the host function ``_moe_sorting_impl`` calls anyway), cached per shape."""
    fn = moe_call.aiter_module().moe_sorting_opus_get_workspace_size
    key = (fn, int(tokens), int(num_experts), int(topk), int(dispatch_policy))
    ws = _OPUS_WORKSPACE.get(key)
    if ws is None:
        ws = int(fn(*key[1:]))
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
    ours = kernel.launch_count(M, topk, quant=False, fused=False)
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
    Python value, AITER's sort more than one launch, torch.compile tracing). The other values the full
    gate reads (``model_dim``, ``block_size``, ``accumulate``) are not read here: given as tensors, such a
    call is counted "nothing saved" where the full gate counts "is a tensor", AITER's either way.
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




def check(device):
    """`aiter-patches verify`: sort + MX quant (MXFP4 and MXFP8) patched vs AITER, bitwise over every position AITER
    defines; also a whole MXFP4 ``fused_moe`` where the AITER under test provides inputs it runs here."""
    import torch

    from .. import checks as kit, registry
    from ..verify import CheckResult, suspended

    aiter, fm = kit.aiter_modules()
    M, E, topk, dim, block = 7, 16, 4, 256, 32
    ids, w = kit.routing(M, E, topk, device)
    x = (torch.randn(M, dim, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16).to(device)
    problems, checked, unavailable = [], [], []
    for qd in (aiter.dtypes.fp4x2, aiter.dtypes.fp8):
        with suspended():
            try:
                original = kit.sort_and_quant(fm, ids, w, E, x, block, qd)
            except Exception as exc:  # this GPU's AITER has no such quant (MXFP8/MXFP4 on gfx942, say)
                unavailable.append(f"{qd} n/a here ({type(exc).__name__})")
                continue
        before = kit.fast_hits("moe_sort_mx_quant")
        patched = kit.sort_and_quant(fm, ids, w, E, x, block, qd)
        if kit.fast_hits("moe_sort_mx_quant") < before + 2:
            problems.append(f"{qd}: fast path not taken ({registry.stats()['moe_sort_mx_quant']['fallback']})")
        problems += [f"{qd}: {p}" for p in kit.compare_sort_quant(patched, original, block)]
        problems += [f"{qd}: {p}" for p in kit.masked_quant_equal(x, patched, original, qd, topk)]
        checked.append(str(qd).replace("torch.", ""))
    if not checked:
        problems.append("AITER quantizes to neither MXFP4 nor MXFP8 here: nothing to compare")
    whole = kit.provided().fused_moe_inputs
    if whole is not None:
        problems += kit.whole_fused_moe_bitwise(whole(device, "fp4"))
    ok = not problems
    detail = f"sort, moe_buf, MX data and scales equal ({', '.join(checked)})" if ok else "; ".join(problems)
    return CheckResult("bitwise", ok, "; ".join([detail, *unavailable]))


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
    check=check,
)
