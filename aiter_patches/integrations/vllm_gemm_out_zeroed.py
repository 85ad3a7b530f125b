"""Integration: why vLLM 0.33.0's block-scale GEMMs never reach ``out_zeroed``, counted at run time (changes nothing).

``gemm_dispatch_out_zeroed`` lets a caller that owns a zeroed buffer pass
``out=buf, out_zeroed=True`` to AITER's tuned dispatcher. vLLM 0.33.0 owns none:

- its FP8 block-scale linear (``model_executor/kernels/linear/scaled_mm/aiter.py`` ≈479-506,
  ``AiterFp8BlockScaledMMKernel.apply_block_scaled_mm``: the DeepSeek-V2/V3 path) never calls this
  dispatcher: it picks AITER's Triton ``gemm_a8w8_blockscale`` (tuned shapes), the Triton
  preshuffled one (gfx1250 only), or ``rocm_aiter_ops.gemm_a8w8_blockscale`` → AITER's CK
  ``gemm_a8w8_blockscale`` (≈1047-1056), which allocates its own output and has no ``out``;
- the dispatcher's only caller is the custom op ``torch.ops.vllm.rocm_aiter_gemm_a8w8_blockscale_bpreshuffle``
  (``_aiter_ops.py`` ≈1072-1082, ``_rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_impl``), reached from the
  DeepSeek-V4/V4.1 AMD model code (``models/deepseek_v4/amd/model.py`` ≈183, ``.../rocm.py`` ≈1246,
  ``models/deepseek_v41/amd/rocm.py`` ≈655); it calls the dispatcher with ``(A, B, As, Bs,
  dtype=output_dtype)``, no ``out``;
- the op's schema has no ``out`` and its fake (≈1085) returns a fresh ``torch.empty``: the op is
  functional, so Inductor and the piecewise CUDA graphs' memory pool own its output. A buffer
  zeroed once per forward and returned as that output would be reused in place by later ops
  (Inductor's buffer reuse): not provably zero at the next GEMM;
- the op is registered with its implementation's function object (``direct_register_custom_op``,
  ≈3165), so no module attribute reaches the call to give it an ``out``; and a zero fill inside
  the op would be the memset it saves.

So this patch only counts: each dispatcher call without ``out`` in a vLLM process is one
``fallback`` with :data:`NO_OUT`, in ``stats()["vllm_gemm_out_zeroed"]``. It also binds vLLM's
impl (a pass-through the op never calls) so that it applies only where that impl's signature and
source hash are the pinned ones; with the linear's and the fake's hashes, ``aiter-patches drift
--server`` reports a vLLM that starts routing the linear to the dispatcher or passing ``out=``.
"""

from __future__ import annotations

from ..core.declarations import Patch, SourcePin, Target
from ..patches import moe_call
from ..patches.gemm_dispatch_out_zeroed import DISPATCHER, DISPATCHER_PINS, MODULE
from ..signatures import Pin
from . import source_gate

NAME = "vllm_gemm_out_zeroed"
OPS = "vllm._aiter_ops"
IMPL = "_rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_impl"
_OPS = "vllm 0.33.0 vllm/_aiter_ops.py"
IMPL_PINS = (Pin("vllm-0.33.0", "(A, B, As, Bs, output_dtype=torch.float16)", f"{_OPS}:1072"),)
NO_OUT = ("vLLM's rocm_aiter_gemm_a8w8_blockscale_bpreshuffle op has no out= (a functional op: its output is fresh "
          "and owned by Inductor / the CUDA-graph pool), so no provably zero buffer reaches the dispatcher")

RELIED_ON = (
    SourcePin("vllm.model_executor.kernels.linear.scaled_mm.aiter", "AiterFp8BlockScaledMMKernel.apply_block_scaled_mm",
              "f0cbbb6cbd7984adcfe2e2e512db19b6b2191373e9fe150ed87c2a4cb220e64d",
              "the FP8 block-scale linear calls AITER's Triton or CK gemm_a8w8_blockscale, never the bpreshuffle "
              "dispatcher", "vllm 0.33.0 vllm/model_executor/kernels/linear/scaled_mm/aiter.py:479"),
    SourcePin(OPS, IMPL,
              "c7f6290cd2bfb681e4e2282a0a810a06e2e0e44874f135599f440d1ea926091b",
              "calls AITER's dispatcher (A, B, As, Bs, dtype=output_dtype) without out=", f"{_OPS}:1072"),
    SourcePin(OPS, "_rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_fake",
              "60e099ed6ae49bd6a4ffbd261ae1436faf57b9927d9ec1bfe93361b446d72406",
              "the op's output is a fresh torch.empty(m, n): the op owns no caller buffer", f"{_OPS}:1085"),
)


def _dispatcher_wrapper(inner, site):
    counters = site.counters

    def gemm_a8w8_blockscale_bpreshuffle(*args, **kwargs):
        out = args[5] if len(args) > 5 else kwargs.get("out")  # out is the dispatcher's sixth parameter
        if out is None:
            counters.fallback(NO_OUT)
        return inner(*args, **kwargs)

    return moe_call.like(gemm_a8w8_blockscale_bpreshuffle, inner)


def _impl_wrapper(inner, site):
    # The op holds the function object it was registered with: this binding is never called by the op. It is here so
    # that the patch applies only where vLLM's impl is the pinned one (its signature and source hash, at apply time).
    def _rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_impl(*args, **kwargs):
        return inner(*args, **kwargs)

    return moe_call.like(_rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_impl, inner)


def _source_reason(target: Target, original) -> str | None:
    return source_gate.reason(target, original, RELIED_ON)


PATCH = Patch(
    name=NAME,
    summary="vLLM: counts each block-scale GEMM dispatcher call without out= (vLLM's op has none); changes nothing",
    targets=(
        Target(MODULE, DISPATCHER, DISPATCHER_PINS, _dispatcher_wrapper,
               "Outside gemm_dispatch_out_zeroed: counts calls without out=, then calls through unchanged."),
        Target(OPS, IMPL, IMPL_PINS, _impl_wrapper,
               "Pins vLLM's op body (signature and source hash, checked at apply time); calls through."),
    ),
    order=39,
    relies_on=RELIED_ON,
    requires="vllm",
    precheck=_source_reason,
    opt_in="vllm",
)
