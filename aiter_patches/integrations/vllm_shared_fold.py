"""Integration: vLLM 0.33.0's MoE runner passes its shared-expert output to ``fused_moe`` as ``moe_addend`` (eager).

vLLM's DeepSeek-V2/V3 MoE (``model_executor/models/deepseek_v2.py`` ``DeepseekV2MoE``)
hands its shared MLP to the MoE runner (``fused_moe/runner/moe_runner.py``
``MoERunner``). ``MoERunner.forward`` (≈689) calls the opaque custom op
``torch.ops.vllm.moe_forward_shared`` (``_moe_forward_shared`` ≈154, whose Python
body is ``layer._forward_impl``), which returns ``(shared, routed)``; the add
``shared_output + fused_output`` (≈790) runs in ``forward``, after
``_maybe_apply_routed_scale_to_output`` (≈403). With AITER's MoE the routed scale is
in the router's top-k weights and the runner's factor is 1.0
(``apply_routed_scale_to_output=not rocm_aiter_ops.is_fused_moe_enabled()``,
deepseek_v2.py ≈1336; ``fused_moe/layer.py`` ≈435), so the routed output is final
at the add. Inside the op, ``_apply_quant_method`` (≈598) runs the shared experts
first on the current stream when ``SharedExperts._determine_shared_experts_order``
says ``NO_OVERLAP`` (more than ``VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD`` tokens,
or ``VLLM_DISABLE_SHARED_EXPERTS_STREAM=1``), then the routed experts, whose AITER
path (``AiterExperts.apply`` → ``rocm_aiter_fused_experts`` →
``torch.ops.vllm.rocm_aiter_fused_moe`` → ``_rocm_aiter_fused_moe_impl``, ``_aiter_ops.py``
≈319) imports ``aiter.fused_moe.fused_moe`` at call time.

Where the fold is exact: ``forward`` running as Python (eager mode: ``--enforce-eager``
or compilation mode NONE), ``NO_OVERLAP``, and the static conditions the gate reads.
Five hooks, one scope per ``forward`` call (a context variable):

- ``MoERunner.forward``: under ``torch.compiler.is_compiling()`` it is vLLM's own, untouched
  (Dynamo traces vLLM's add; see below), as are the other four hooks. Otherwise the gate reads the layer's attributes;
  every "no" is counted with its reason and the call runs as shipped.
- ``MoERunner._forward_impl`` (inside the op, never traced): counts why nothing folds when no
  scope is open (the compiled graph calls the op without running ``forward``), or when the
  shared experts are not ordered ``NO_OVERLAP`` (aux stream, modular-kernel overlap).
- ``SharedExperts.forward``: its ``NO_OVERLAP`` output, on the scope's stream, becomes the addend.
- ``aiter.fused_moe.fused_moe`` (outside ``moe_addend_fold``'s layer): the scope's first call whose
  output shape and dtype are the addend's gets ``moe_addend=``; ``moe_addend_fold`` folds it or adds
  it after the call (its contract): the routed output holds routed + shared either way.
- ``MoERunner._maybe_apply_routed_scale_to_output``: for the scope's runner, once a fold was
  passed, vLLM's own method runs with ``shared_output=None`` (at factor 1.0 it returns its inputs),
  so ``forward`` takes its ``result = fused_output`` branch: the add is skipped.

Why not under torch.compile: the add is in the graph Dynamo traces and Inductor compiles, the
fold's decision is taken inside the opaque op at run time (token count, stream order), and
vLLM runs its compiled graph without guards and caches it on disk (``VLLM_USE_AOT_COMPILE``,
on by default with torch ≥ 2.10; the artifact's key holds neither ``AITER_PATCHES_INTEGRATIONS``
nor this patch's state, ``compilation/decorators.py`` ≈556-600). A graph traced without the add
would be loaded by a later process with the integration off and silently lose the shared output.
So under tracing every hook is vLLM's code path and the graph keeps its add.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

from ..core.declarations import Patch, SourcePin, Target
from ..patches import moe_call
from ..patches import pins as aiter_pins
from ..signatures import Pin
from . import addend_offer, compile_state, source_gate, streams

NAME = "vllm_shared_expert_fold"
FOLD = addend_offer.FOLD
RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
SHARED = "vllm.model_executor.layers.fused_moe.runner.shared_experts"
_MR = "vllm 0.33.0 vllm/model_executor/layers/fused_moe/runner/moe_runner.py"
_SE = "vllm 0.33.0 vllm/model_executor/layers/fused_moe/runner/shared_experts.py"

FORWARD_PINS = (Pin("vllm-0.33.0", "(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None)",
                    f"{_MR}:689"),)
FORWARD_IMPL_PINS = (Pin("vllm-0.33.0", "(self, hidden_states, router_logits, shared_experts_input, input_ids=None)",
                         f"{_MR}:869"),)
SCALE_PINS = (Pin("vllm-0.33.0", "(self, shared_output, fused_output)", f"{_MR}:403"),)
SHARED_FORWARD_PINS = (Pin("vllm-0.33.0", "(self, shared_experts_input, order)", f"{_SE}:179"),)

RELIED_ON = (
    SourcePin(RUNNER, "MoERunner.forward", "876f47275e134c8f83a725bac3747d75ca0ae3747434dda74f27522a14a04faa",
              "one op call returns (shared, routed); between it and `shared_output + fused_output` only the "
              "reductions, transforms and _maybe_apply_routed_scale_to_output the gate rules out; a None shared "
              "output takes `result = fused_output`", f"{_MR}:689"),
    SourcePin(RUNNER, "MoERunner._forward_impl", "7ee2b3cdb54df8b95bf199a940003791b6f76af773f591a107b1081b839fa95e",
              "the aux-stream launch, then _apply_quant_method, then _maybe_combine", f"{_MR}:869"),
    SourcePin(RUNNER, "MoERunner._apply_quant_method",
              "becb8e88c4c402c8a0d9e0fe4ad58089b605c9ee3759c0154b38ab017fd8fa6d",
              "NO_OVERLAP shared experts run before the router and the routed experts, on the current stream; "
              "their output is returned untouched beside the routed output", f"{_MR}:598"),
    SourcePin(RUNNER, "MoERunner._maybe_apply_routed_scale_to_output",
              "b35ce9d406d8cd052348ffcca0819a5fa31f404ba00272e6ed63088d1ad10986",
              "at routed_scaling_factor 1.0 returns its inputs (a None shared output included)", f"{_MR}:403"),
    SourcePin(RUNNER, "MoERunner._maybe_combine", "e7c2489065a43cb4699980dd4e82d45c39a990d84533a02f1333e990ec6ddfee",
              "without naive dispatch/combine and PCP the routed output is returned as computed", f"{_MR}:833"),
    SourcePin(SHARED, "SharedExperts.forward", "4b3521003787efc1c9f1b42c52baa5ceea238654986b7c6d268428b25ae87e6b",
              "for its order, stores the shared layer's output in _output[_output_idx] on the current stream",
              f"{_SE}:179"),
    SourcePin(SHARED, "SharedExperts._determine_shared_experts_order",
              "86c81bd27e5931bbf76497249efaa2b886e86c3ad988ecb1bded6f1d5392bb44",
              "NO_OVERLAP unless the modular kernel overlaps or the aux stream takes <= threshold tokens",
              f"{_SE}:120"),
)

NO_SCOPE = ("MoERunner.forward did not run as Python around the op (torch.compile's graph holds the add; "
            "or a caller of the op other than forward)")
AUX_STREAM = ("aux stream: <= VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD tokens run the shared experts concurrently "
              "with the routed call (VLLM_DISABLE_SHARED_EXPERTS_STREAM=1 orders them first)")
MK_OVERLAP = "the modular kernel runs the shared experts inside its dispatch/combine"
NO_SHARED = "no shared-expert output on the scope's stream before the routed call"
UNSKIPPED = "folded, but forward did not reach _maybe_apply_routed_scale_to_output: the shared output was added twice"
NOT_REACHED = "the routed call did not reach AITER's fused_moe (another experts class)"


@dataclass
class _Scope:
    runner: Any
    stream: Any
    shared: Any = None
    offered: bool = False
    folded: bool = False


_DECLINED = object()  # forward ran as Python and counted why not: the op's hook counts nothing more
_scope: contextvars.ContextVar[Any] = contextvars.ContextVar("aiter_patches_vllm_fold", default=None)


_stream = streams.current  # this module's seam: a test moves its calls to another stream


def blocker(runner, runner_cls, shared_experts_input) -> str | None:
    """Why this eager ``forward`` call may not fold (None: it may); reads attributes and Python values only."""
    if type(runner) is not runner_cls:
        return f"{type(runner).__name__}: a subclass of MoERunner (its steps may differ)"
    if runner._shared_experts is None:
        return ("no separate shared experts (none, or fused into the routed experts: "
                "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS)")
    if (shared_experts_input is not None or runner.routed_input_transform is not None
            or runner.routed_output_transform is not None):
        return "latent MoE: the routed input/output is transformed around the experts"
    if runner.routed_scaling_factor != 1.0:
        return ("routed_scaling_factor is applied to the routed output after the op (apply_routed_scale_to_output): "
                "folding would scale the shared output too")
    if runner.enable_dbo:
        return "DBO: two micro-batches share the runner's shared-expert outputs"
    cfg = runner.moe_config
    if (cfg.is_sequence_parallel or cfg.pcp_size > 1 or runner.do_naive_dispatch_combine
            or cfg.moe_parallel_config.use_all2all_kernels):
        return "expert/data/context/sequence parallel: the routed output is combined across ranks after fused_moe"
    if runner._fused_output_is_reduced:
        return "the combine kernel reduces the routed output: vLLM all-reduces the shared output on its own"
    return None


def _forward_wrapper(inner, site):
    binder = site.binder
    counters = site.counters
    runner_cls = inner.__globals__.get("MoERunner")

    def forward(*args, **kwargs):
        if compile_state.tracing():  # Dynamo traces vLLM's forward, add included (module docstring)
            return inner(*args, **kwargs)
        if _scope.get() is not None:
            return inner(*args, **kwargs)
        bound, problems = binder.bind(args, kwargs)
        if problems:
            reason = problems[0]
        elif compile_state.in_compiled_region():  # eager here, but Dynamo could trace the scale hook below
            reason = compile_state.IN_COMPILED_REGION
        else:
            reason = blocker(bound["self"], runner_cls, bound.get("shared_experts_input"))
        if reason is not None:
            counters.fallback(reason)
            token = _scope.set(_DECLINED)
            try:
                return inner(*args, **kwargs)
            finally:
                _scope.reset(token)
        scope = _Scope(bound["self"], _stream(bound["hidden_states"].device))
        token = _scope.set(scope)
        try:
            result = inner(*args, **kwargs)
        finally:
            _scope.reset(token)
        if scope.folded:
            if scope.runner is None:
                counters.hit()
            else:  # cannot happen on the pinned forward: its add then ran on routed + shared
                counters.fallback(UNSKIPPED)
        elif scope.shared is not None and not scope.offered:
            counters.fallback(NOT_REACHED)
        return result

    return moe_call.like(forward, inner)


def _forward_impl_wrapper(inner, site):
    counters = site.counters
    order_enum = None

    def _forward_impl(self, hidden_states, *args, **kwargs):
        nonlocal order_enum
        if compile_state.tracing():  # traced only where vLLM calls the op's body directly (CPU, TPU): no scope there
            return inner(self, hidden_states, *args, **kwargs)
        scope = _scope.get()
        if scope is _DECLINED or self._shared_experts is None:
            return inner(self, hidden_states, *args, **kwargs)
        if scope is None or scope.runner is not self:
            counters.fallback(NO_SCOPE)
            return inner(self, hidden_states, *args, **kwargs)
        if order_enum is None:
            import sys

            order_enum = sys.modules[SHARED].SharedExpertsOrder
        shared_input = args[1] if len(args) > 1 else kwargs.get("shared_experts_input")
        order = self._shared_experts._determine_shared_experts_order(
            hidden_states if shared_input is None else shared_input)
        if order != order_enum.NO_OVERLAP:
            counters.fallback(AUX_STREAM if order == order_enum.MULTI_STREAM_OVERLAPPED else MK_OVERLAP)
            scope.offered = True  # nothing to offer: the routed call runs as shipped
            return inner(self, hidden_states, *args, **kwargs)
        result = inner(self, hidden_states, *args, **kwargs)
        if scope.shared is None:
            counters.fallback(NO_SHARED)
        return result

    return moe_call.like(_forward_impl, inner)


def _shared_forward_wrapper(inner, site):
    def forward(self, shared_experts_input, order, *args, **kwargs):
        if compile_state.tracing():
            return inner(self, shared_experts_input, order, *args, **kwargs)
        scope = _scope.get()
        if (not isinstance(scope, _Scope) or scope.shared is not None or scope.offered or scope.runner is None
                or scope.runner._shared_experts is not self):
            return inner(self, shared_experts_input, order, *args, **kwargs)
        before = self._output[self._output_idx]
        out = inner(self, shared_experts_input, order, *args, **kwargs)
        after = self._output[self._output_idx]
        if (before is None and after is not None and order == type(order).NO_OVERLAP
                and _stream(shared_experts_input.device) == scope.stream):  # Stream objects compare by handle
            scope.shared = after
        return out

    return moe_call.like(forward, inner)


def _fused_moe_wrapper(inner, site):
    def current():
        scope = _scope.get()
        return scope if isinstance(scope, _Scope) else None  # not the declined marker

    def record(scope, out):
        scope.folded = True  # moe_addend_fold's contract: out holds routed + shared

    return addend_offer.fused_moe_wrapper(inner, site, current, lambda device: _stream(device), record)


def _scale_wrapper(inner, site):
    def _maybe_apply_routed_scale_to_output(self, shared_output, fused_output):
        if compile_state.tracing():
            return inner(self, shared_output, fused_output)
        scope = _scope.get()
        if not isinstance(scope, _Scope) or not scope.folded or scope.runner is not self or shared_output is None:
            return inner(self, shared_output, fused_output)
        scope.runner = None  # once per scope
        return inner(self, None, fused_output)  # vLLM's forward then takes `result = fused_output`

    return moe_call.like(_maybe_apply_routed_scale_to_output, inner)


def _source_reason(target: Target, original) -> str | None:
    return source_gate.reason(target, original, RELIED_ON)


PATCH = Patch(
    name=NAME,
    summary="vLLM MoERunner (eager): the NO_OVERLAP shared-expert output goes to AITER's fused_moe as moe_addend "
            "(vLLM's add is skipped); every other path counted",
    targets=(
        Target(RUNNER, "MoERunner.forward", FORWARD_PINS, _forward_wrapper,
               "Eager: opens the fold scope when the layer's attributes allow it, counts why not otherwise; "
               "under torch.compile tracing it is vLLM's own."),
        Target(RUNNER, "MoERunner._forward_impl", FORWARD_IMPL_PINS, _forward_impl_wrapper,
               "Inside the opaque op: counts the compiled graph and the aux-stream / modular-kernel orders."),
        Target(SHARED, "SharedExperts.forward", SHARED_FORWARD_PINS, _shared_forward_wrapper,
               "Its NO_OVERLAP output, on the scope's stream, becomes the addend."),
        Target(RUNNER, "MoERunner._maybe_apply_routed_scale_to_output", SCALE_PINS, _scale_wrapper,
               "After a fold: vLLM's method with shared_output=None, so forward skips its add."),
        Target("aiter.fused_moe", "fused_moe", aiter_pins.FUSED_MOE, _fused_moe_wrapper,
               "Outside moe_addend_fold: the scope's routed call gets moe_addend=shared."),
    ),
    order=6,
    relies_on=RELIED_ON,
    requires="vllm",
    precheck=_source_reason,
    opt_in="vllm",
    needs=(FOLD,),
)
