"""Integration: SGLang 0.5.23's DeepSeek MoE passes its shared-expert output to AITER's ``fused_moe`` as ``moe_addend``.

``DeepseekV2MoE.forward_normal`` (``srt/models/deepseek_v2.py`` ≈1300) computes the
shared experts first when the routed call is in place (``defer_shared`` is
``not experts.moe_runner_config.inplace``), on the current stream, then runs the
routed experts (``self.experts(...)``, whose AITER runner calls
``aiter.fused_moe.fused_moe``), then adds the two in
``maybe_fuse_routed_scale_and_shared_add`` (``routed += shared`` for AITER's quant
methods). Folding the add into stage 2 is exact in SGLang's terms only where
its routed output is final before that add: the routed scale is already in the
top-k weights (``_use_aiter and routed_scaling_factor_fused_in_topk``), so no
``routed *= routed_scaling_factor`` runs between the MoE call and the add.

Four hooks, one scope per ``forward_normal`` call (a context variable; the
gate reads attributes and Python values only):

- ``DeepseekV2MoE.forward_normal``: decides, from the same attributes and module
  flags SGLang's code reads, whether this call may fold; every "no" is counted
  with its reason and the call runs as shipped.
- ``DeepseekV2MoE._forward_shared_experts``: its output (on the scope's stream,
  for the scope's ``hidden_states``) becomes the scope's addend.
- ``aiter.fused_moe.fused_moe`` (outside ``moe_addend_fold``'s layer): the one
  call in that scope whose output shape and dtype are the addend's gets
  ``moe_addend=``; ``moe_addend_fold`` folds it or adds it after the call (its
  contract), so the returned tensor holds routed + shared either way.
- ``maybe_fuse_routed_scale_and_shared_add`` (deepseek_v2's binding): for exactly
  that tensor and that shared output, SGLang's own function runs with
  ``shared=None`` (its non-fused branch returns ``routed``): the add is skipped.

``forward_normal_dual_stream`` (the shared experts on ``alt_stream``, issued after
the routed call) is left alone and counted. So are deferred finalize, SBO,
TP-1 replicated shared experts (added after the all-reduce) and every path
that takes the pieces apart (``return_moe_output``, ``leave_output_sum``).
"""

from __future__ import annotations

import contextvars
import sys
from dataclasses import dataclass
from typing import Any

from ..patches import moe_call
from ..patches import pins as aiter_pins
from ..core.declarations import Patch, SourcePin, Target
from ..signatures import Pin
from . import addend_offer, compile_state, source_gate, streams

NAME = "sglang_shared_expert_fold"
FOLD = addend_offer.FOLD
MODULE = "sglang.srt.models.deepseek_v2"
CLASS = "DeepseekV2MoE"
FUSE_ADD = "maybe_fuse_routed_scale_and_shared_add"
_DS = "sglang 0.5.23 sglang/srt/models/deepseek_v2.py"
_MX = "sglang 0.5.23 sglang/srt/layers/quantization/mxfp4_flashinfer_trtllm_moe.py"

FORWARD_NORMAL_PINS = (Pin(
    "sglang-0.5.23",
    "(self, hidden_states, gemm_output_zero_allocator=None, input_ids=None, input_ids_global=None, "
    "skip_shared_experts=False, use_vision_topk=False, return_moe_output=False, leave_output_sum=False)",
    f"{_DS}:1300"),)
SHARED_EXPERTS_PINS = (Pin(
    "sglang-0.5.23", "(self, hidden_states, gemm_output_zero_allocator=None, pre_quant_input=None)", f"{_DS}:1739"),)
DUAL_STREAM_PINS = (Pin(
    "sglang-0.5.23",
    "(self, hidden_states, gemm_output_zero_allocator=None, input_ids=None, input_ids_global=None, "
    "use_vision_topk=False, return_moe_output=False, leave_output_sum=False)",
    f"{_DS}:1128"),)
FUSE_ADD_PINS = (Pin("sglang-0.5.23", "(experts, routed, shared, routed_scaling_factor)", f"{_MX}:533"),)

# What the hooks rely on, checked at apply time (a changed function is not patched) and by `aiter-patches drift`.
RELIED_ON = (
    SourcePin(MODULE, f"{CLASS}.forward_normal_dual_stream",
              "baa1fdf6b9a67f8dae359a7cf3f0ac5e5ab4991b12feab0ad3d1c280ffce562e",
              "the shared experts run on alt_stream after the routed call is issued (counted, never folded)",
              f"{_DS}:1128"),
    SourcePin(MODULE, f"{CLASS}.forward_normal",
              "ea6055624889bd0cf4cd04ea2d995fdd668e02c55b2180f2843a7ca2aee65cf3",
              "shared experts before the routed call on the current stream when not defer_shared; the routed "
              "output goes from self.experts(...) to maybe_fuse_routed_scale_and_shared_add with only the "
              "routed_scaling_factor multiply (under the condition the gate mirrors) in between",
              f"{_DS}:1300"),
    SourcePin(MODULE, f"{CLASS}._forward_shared_experts",
              "71854fa1c7d26a0337f977720f15918503411d08185843156a5095097ff197cb",
              "returns the shared experts' output for hidden_states (sliced when pre-quantized rows were padded)",
              f"{_DS}:1739"),
    SourcePin("sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe", FUSE_ADD,
              "0e46d90fdf180fc369febba85a016634749636b0233e35ef3944c1ee6384a4bf",
              "for quant methods outside its fused set: routed += shared, and routed returned as is when shared "
              "is None",
              f"{_MX}:533"),
)

# Quant methods for which maybe_fuse_routed_scale_and_shared_add applies the routed scale itself (its fused set)
FUSED_SCALE_METHODS = frozenset({"Mxfp4FlashinferTrtllmMoEMethod", "Mxfp4FlashinferCutlassMoEMethod",
                                 "Mxfp4MarlinMoEMethod", "ExpertPackMoEMethod"})


NO_SHARED = "no shared-expert output on the scope's stream before the routed call"
NOT_REACHED = "the routed call did not reach AITER's fused_moe (SGLang's small-M kernel or another runner)"


@dataclass
class _Scope:
    hidden_states: Any
    stream: Any
    shared: Any = None
    offered: bool = False
    out: Any = None


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("aiter_patches_sglang_fold", default=None)


_stream = streams.current  # this module's seam: a test moves its calls to another stream


def blocker(layer, g: dict, skip_shared_experts: bool, return_moe_output: bool, leave_output_sum: bool,
            hidden_states) -> str | None:
    """Why this forward_normal call may not fold (None: it may). ``g``: deepseek_v2's globals, as SGLang reads them."""
    if layer.shared_experts is None or layer.num_fused_shared_experts != 0:
        return "no separate shared experts (fused into the routed experts, or none)"
    if skip_shared_experts:
        return "skip_shared_experts: the decoder layer adds them elsewhere"
    if hidden_states.shape[0] == 0:
        return "no tokens"
    if return_moe_output or leave_output_sum:
        return "the caller takes routed and shared apart (return_moe_output / leave_output_sum)"
    if not layer.experts.moe_runner_config.inplace:
        return "defer_shared: the shared experts run after the routed call"
    if layer._fuse_shared_experts_inside_sbo:
        return "SBO: the shared experts run on alt_stream inside the combine hook"
    if layer._shared_expert_tp1:
        return "TP-1 replicated shared experts: added after the all-reduce"
    quant_method = layer.experts.quant_method
    post_scale = (not g["_is_cuda"] and not g["_is_musa"] and not g["_is_xpu"]
                  and not (g["_use_aiter"] and layer.routed_scaling_factor_fused_in_topk)
                  or isinstance(quant_method, g["KTEPWrapperMethod"]))
    if post_scale:
        return "routed_scaling_factor is applied to the routed output after the MoE call: folding would scale " \
               "the shared output too"
    # SGLang tests isinstance: a subclass of one of these classes takes the fused branch too
    fused = next((c.__name__ for c in type(quant_method).__mro__ if c.__name__ in FUSED_SCALE_METHODS), None)
    if fused is not None:
        return f"{fused}: the shared add carries the routed scale (shared.add_(routed, alpha))"
    forward = getattr(type(layer.experts), "forward", None)
    piecewise = getattr(forward, "__globals__", {}).get("is_in_tc_piecewise_cuda_graph")
    if callable(piecewise) and piecewise():
        return "piecewise CUDA graph: the routed experts run inside an opaque op"
    return None


def _forward_normal_wrapper(inner, site):
    binder = site.binder
    counters = site.counters
    g = inner.__globals__

    def forward_normal(*args, **kwargs):
        if compile_state.tracing() or _scope.get() is not None:
            return inner(*args, **kwargs)
        bound, problems = binder.bind(args, kwargs)
        if problems:
            counters.fallback(problems[0])
            return inner(*args, **kwargs)
        hs = bound["hidden_states"]
        if compile_state.in_compiled_region():
            reason = compile_state.IN_COMPILED_REGION
        else:
            reason = blocker(bound["self"], g, bound.get("skip_shared_experts", False),
                             bound.get("return_moe_output", False), bound.get("leave_output_sum", False), hs)
        if reason is not None:
            counters.fallback(reason)
            return inner(*args, **kwargs)
        scope = _Scope(hs, _stream(hs.device))
        token = _scope.set(scope)
        try:
            result = inner(*args, **kwargs)
        finally:
            _scope.reset(token)
        if scope.shared is None:
            counters.fallback(NO_SHARED)
        elif not scope.offered:
            counters.fallback(NOT_REACHED)
        return result

    return moe_call.like(forward_normal, inner)


def _shared_experts_wrapper(inner, site):
    def _forward_shared_experts(self, hidden_states, *args, **kwargs):
        out = inner(self, hidden_states, *args, **kwargs)
        if compile_state.tracing():
            return out
        scope = _scope.get()
        if (scope is not None and scope.shared is None and not scope.offered and hidden_states is scope.hidden_states
                and out is not None and _stream(hidden_states.device) == scope.stream):  # Stream objects compare by handle
            scope.shared = out
        return out

    return moe_call.like(_forward_shared_experts, inner)


def _dual_stream_wrapper(inner, site):
    counters = site.counters

    def forward_normal_dual_stream(*args, **kwargs):
        if compile_state.tracing():
            return inner(*args, **kwargs)
        counters.fallback("dual stream: the shared experts run on alt_stream, issued after the routed call")
        return inner(*args, **kwargs)

    return moe_call.like(forward_normal_dual_stream, inner)


def _fused_moe_wrapper(inner, site):
    def record(scope, out):
        scope.out = out

    return addend_offer.fused_moe_wrapper(inner, site, _scope.get, lambda device: _stream(device), record)


def _fuse_add_wrapper(inner, site):
    counters = site.counters

    def maybe_fuse_routed_scale_and_shared_add(experts, routed, shared, routed_scaling_factor):
        if compile_state.tracing():
            return inner(experts, routed, shared, routed_scaling_factor)
        scope = _scope.get()
        if scope is None or scope.out is None or shared is None or shared is not scope.shared:
            return inner(experts, routed, shared, routed_scaling_factor)
        if routed is not scope.out:
            # routed + shared came out of fused_moe, then through a copy: the add must not run again
            counters.fallback("the routed output reached the add as a copy of the folded output: add skipped")
        else:
            counters.hit()
        scope.out = None
        return inner(experts, routed, None, routed_scaling_factor)

    return moe_call.like(maybe_fuse_routed_scale_and_shared_add, inner)


def check(device):
    """``aiter-patches verify``: SGLang's own ``forward_normal`` on a minimal layer, folded vs. as shipped.

    The layer is a stand-in object with the attributes SGLang's code reads (shared experts a bf16 matmul,
    routed experts one ``aiter.fused_moe.fused_moe`` call as SGLang's AITER runner makes it); the result
    must be within the fold's bound of SGLang's own sum, and the fold must have been taken.
    """
    import types

    import torch

    from .. import registry
    from ..checks import bf16_moe_inputs
    from ..core.declarations import CheckResult
    from ..verify import suspended

    kind = "bound: 2-norm rel. error <= 1e-2 vs SGLang's forward_normal"
    ds = sys.modules[MODULE]
    args = bf16_moe_inputs(device, M=6, E=8, topk=2, dim=256, inter=128, seed=7)
    w = (torch.randn(256, 256, generator=torch.Generator().manual_seed(9)) / 16).to(torch.bfloat16).to(device)

    class _Experts:
        moe_runner_config = types.SimpleNamespace(inplace=True)
        quant_method = object()

        def __call__(self, hidden_states, topk_output):
            return sys.modules["aiter.fused_moe"].fused_moe(hidden_states, args["w1"], args["w2"],
                                                             args["topk_weight"], args["topk_ids"])

    class _Shared:
        gate_up_proj = None

        def __call__(self, x, gemm_output_zero_allocator=None):
            return x @ w

    layer = ds.DeepseekV2MoE.__new__(ds.DeepseekV2MoE)
    torch.nn.Module.__init__(layer)
    for k, v in dict(experts=_Experts(), shared_experts=_Shared(), num_fused_shared_experts=0,
                     _fuse_shared_experts_inside_sbo=False, _shared_expert_tp1=False, routed_scaling_factor=2.5,
                     routed_scaling_factor_fused_in_topk=True, reduce_results=False, is_hash=False,
                     _maybe_quant_moe_input_once=lambda x: None,
                     gate=lambda x, *a: x[:, :8].float(),
                     topk=lambda x, logits, **kw: (args["topk_weight"], args["topk_ids"])).items():
        object.__setattr__(layer, k, v)
    x = args["hidden_states"]
    before = registry.stats()[NAME]["fast"]
    try:
        folded = layer.forward_normal(x)
    except Exception as exc:  # SGLang's helpers this layer does not stand in for (a newer SGLang, another platform)
        return CheckResult(kind, False, f"SGLang's forward_normal raised on the check's layer: {type(exc).__name__}: {exc}")
    taken = registry.stats()[NAME]["fast"] > before
    with suspended():
        ref = layer.forward_normal(x)
    err = ((folded.float() - ref.float()).norm() / ref.float().norm()).item()
    ok = taken and err <= 1e-2
    detail = f"fold taken; relative error {err:.2e}" if taken else \
        f"fold not taken ({registry.stats()[NAME]['fallback']})"
    return CheckResult(kind, ok, detail)


def _source_reason(target: Target, original) -> str | None:
    return source_gate.reason(target, original, RELIED_ON)


PATCH = Patch(
    name=NAME,
    summary="SGLang DeepseekV2MoE.forward_normal: the shared-expert output goes to AITER's fused_moe as moe_addend "
            "(the separate add is skipped)",
    targets=(
        Target(MODULE, f"{CLASS}.forward_normal", FORWARD_NORMAL_PINS, _forward_normal_wrapper,
               "Opens the fold scope when SGLang's own flags say the shared output is ready before the routed call "
               "and the routed output is final before the add; counts why not otherwise."),
        Target(MODULE, f"{CLASS}._forward_shared_experts", SHARED_EXPERTS_PINS, _shared_experts_wrapper,
               "Its output, on the scope's stream, becomes the addend."),
        Target(MODULE, f"{CLASS}.forward_normal_dual_stream", DUAL_STREAM_PINS, _dual_stream_wrapper,
               "Runs as shipped; counted (shared experts on alt_stream after the routed call)."),
        Target(MODULE, FUSE_ADD, FUSE_ADD_PINS, _fuse_add_wrapper,
               "For the folded output and its shared output: SGLang's function with shared=None (no add)."),
        Target("aiter.fused_moe", "fused_moe", aiter_pins.FUSED_MOE, _fused_moe_wrapper,
               "Outside moe_addend_fold: the scope's routed call gets moe_addend=shared."),
    ),
    order=5,
    relies_on=RELIED_ON,
    requires="sglang",
    precheck=_source_reason,
    opt_in="sglang",
    needs=(FOLD,),
    check="aiter_patches.integrations.sglang_shared_fold:check",
)
