"""Integration: SGLang 0.5.23's DeepSeek decode GEMMs write into a per-forward zero pool, so split-K asm skips its memset.

SGLang's fp8 block linear (``aiter_w8a8_block_fp8_linear``, ``srt/layers/quantization/
fp8_utils.py`` ≈1648) calls AITER's tuned dispatcher ``gemm_a8w8_blockscale_bpreshuffle``
without ``out=`` on gfx950 with ROCm >= 7.2, for every (N, K) outside its Triton list
(``use_aiter_triton_gemm_w8a8_tuned_gfx950``). Where AITER's tuned CSV then picks the
asm kernel with a split above one, AITER's launcher memsets the output first: one
launch per GEMM. For DeepSeek-V3/R1 that is, at decode M on gfx950 (256 CUs), the
attention-TP-1 ``o_proj`` (N 7168, K 16384: DP attention) and the TP-4 dense MLP
(README "SGLang": the table, read from AITER's CSVs by ``tests/integrations``).

Two hooks, one scope per forward (a context variable):

- ``DeepseekV2Model.forward``: at or below ``MAX_M`` tokens, allocates the scope's
  pool with ``torch.zeros`` (the one fill, on the forward's stream, inside the
  forward, so a CUDA graph captures it with the GEMMs and each replay re-zeroes it)
  and runs SGLang's forward. The pool's size is what the same model asked for at the
  same token count before (the first such forward sizes it: its GEMMs keep their
  memset, counted), capped at ``AITER_PATCHES_SGLANG_ZERO_POOL_MIB`` (default 256).
- ``gemm_a8w8_blockscale_bpreshuffle`` (AITER's dispatcher, outside
  ``gemm_dispatch_out_zeroed``'s layer): a call without ``out=`` inside the scope, on
  its stream and device, with M <= ``MAX_M`` and a shape AITER's tuned config sends to
  asm with a split above one, gets the next unused slice of the pool as ``out`` and
  ``out_zeroed=True``. Every slice is handed out once per pool; a pool lives for one
  forward; nothing else writes it. Everything else runs as shipped, counted.

The patch needs ``gemm_dispatch_out_zeroed`` (``Patch.needs``: without it the asm
kernel keeps its memset, and a slice would save nothing), hands it the promise
only where that patch's layer lies directly under its own (``site.below``), and
learns per call whether the promise reached the asm kernel (``dispatch.forwarding``).

Lifetime. A GEMM output is an activation: it may live past its layer, and past the
forward (returned hidden states, PP proxy tensors, spec-decoding captures). A fresh
pool per forward makes each slice behave as SGLang's own ``torch.empty`` output would:
an unshared tensor allocated on the forward's stream, whose memory the caching
allocator does not reuse while any slice of it is alive (a kept slice keeps its
whole pool: at most the cap per kept forward). No buffer outlives a
forward into the next one's zero fill: there is none to outlive.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from ...core.declarations import Patch, SourcePin, Target
from ...drift import live_source_reason
from ...patches import gemm_dispatch_out_zeroed as dispatch
from ...patches.moe import call as moe_call
from ...reasons import with_values
from ...signatures import Pin
from .. import compile_state, source_gate, streams

NAME = "sglang_gemm_zero_pool"
DISPATCH = dispatch.NAME
MODULE = "sglang.srt.models.deepseek_v2"
FP8_UTILS = "sglang.srt.layers.quantization.fp8_utils"
LINEAR = "aiter_w8a8_block_fp8_linear"
_DS = "sglang 0.5.23 sglang/srt/models/deepseek_v2.py"
_FP8 = "sglang 0.5.23 sglang/srt/layers/quantization/fp8_utils.py"

MAX_M = 256  # tokens per forward, and rows per GEMM: decode batches
# The pool's cap: DeepSeek-V3 at attention TP 1 pools its 61 o_proj outputs, 61 x M x 7168 x 2 B
# (0.83 MiB a token: 40 MiB at M 48, 213.5 MiB at M 256), so 256 MiB covers every M <= MAX_M.
CAP_ENV = "AITER_PATCHES_SGLANG_ZERO_POOL_MIB"
_log = logging.getLogger("aiter_patches")
DEFAULT_CAP_MIB = 256
ALIGN = 128  # elements per slice start (256 bytes)

FORWARD_PINS = (Pin("sglang-0.5.23", "(self, input_ids, positions, forward_batch, input_embeds=None, "
                                     "pp_proxy_tensors=None)", f"{_DS}:3094"),)

RELIED_ON = (
    SourcePin(MODULE, "DeepseekV2Model.forward",
              "b29bfaf597fcfb70cd36ae226cfb4a4db3c6741938a1260b3c1f523552e482f5",
              "one call runs every decoder layer of a forward on the caller's stream (SGLang allocates its own "
              "per-forward zeroed BumpAllocators at its start the same way)",
              f"{_DS}:3094"),
    SourcePin(FP8_UTILS, LINEAR,
              "cd5c188cbfcb7b3bdd79ee40b75947db25af9aae7919ce7bade906418b46d5ba",
              "calls gemm_a8w8_blockscale_bpreshuffle without out= and returns its output (plus bias, .to, .view) "
              "as the layer's activation: a fresh zeroed slice serves as well as the dispatcher's torch.empty",
              f"{_FP8}:1648"),
)

NOT_SIZED = "the pool was not sized for this token count yet (sized from this forward for the next)"
EXHAUSTED = "the pool is exhausted (its cap, or more GEMMs than this token count had before)"
NOT_TAKEN = ("a pooled slice went to the dispatcher but its layer did not pass the promise on (another kernel "
             "or split 1 was picked, or gemm_out_zeroed stood down): the GEMM wrote the zeroed slice as usual")
NOT_SPLIT = "AITER's tuned config picks no asm split above one here: no memset to save"


@dataclass
class _Scope:
    pool: Any  # torch.Tensor (bf16, zeroed at entry) or None
    device: Any
    stream: Any
    thread: int = 0
    cursor: int = 0
    demand: int = 0


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("aiter_patches_sglang_zero_pool", default=None)
_demand: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()  # model -> {(device, M): elements}
_split_cache: dict = {}  # (M, N, K) -> True / the reason it is not an asm split above one; SPLIT_CACHE_CAP at most
# M <= MAX_M, (N, K) a model's GEMM weights: a few thousand at most; past the cap AITER is asked each time (host only)
SPLIT_CACHE_CAP = 4096


_stream = streams.current  # this module's seam: a test moves its calls to another stream


def asm_split_reason(M: int, N: int, K: int) -> str | None:
    """None when AITER's tuned config (its own lookup, host-only, cached) sends (M, N, K) to asm with splitK > 1."""
    key = (M, N, K)
    found = _split_cache.get(key)
    if found is None:
        mod = sys.modules.get(dispatch.MODULE)
        try:
            configs = getattr(mod, "AITER_CONFIGS", None)
            tuned = configs.AITER_CONFIG_GEMM_A8W8_BLOCKSCALE_BPRESHUFFLE_FILE if configs is not None else None
            config = mod.get_CKGEMM_config(M, N, K, tuned)
            if config is not None and config["libtype"] == "asm" and int(config["splitK"]) > 1:
                found = True
            else:
                found = NOT_SPLIT
        except Exception as exc:  # another AITER: no prediction, no pool slice (never wrong, at worst the memset)
            # the exception's kind, a category (issue 35); its message may hold the shape: at DEBUG
            found = with_values(f"cannot read AITER's tuned config: {type(exc).__name__}", error=exc, M=M, N=N, K=K)
        if len(_split_cache) < SPLIT_CACHE_CAP:
            _split_cache[key] = found
    return None if found is True else found


def pool_cap_bytes() -> int:
    """The pool's cap from ``AITER_PATCHES_SGLANG_ZERO_POOL_MIB`` (MiB; 0: no pool), read at apply time;
    not a whole number: one warning, then the default."""
    from ... import env_flags

    mib = env_flags.positive_number(CAP_ENV, DEFAULT_CAP_MIB, whole=True, zero_ok=True, unit="MiB")
    return mib << 20


@contextlib.contextmanager
def pool_scope(model, device, tokens: int, cap: int):
    """One forward's scope: a pool of what ``model`` asked for at ``tokens`` before (at most ``cap`` elements),
    zeroed now on the current stream; on a normal exit, what this forward asked for is remembered."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # compared with tensors' devices, which name their index
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), tokens)
    try:
        learned = _demand.setdefault(model, {})
    except TypeError:  # not weak-referenceable: no memory of its demand
        learned = {}
    need = min(learned.get(key, 0), cap)
    pool = torch.zeros(need, dtype=torch.bfloat16, device=device) if need else None  # the one fill
    scope = _Scope(pool, device, _stream(device), threading.get_ident())
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)
    if scope.demand > learned.get(key, 0):
        learned[key] = scope.demand


def _forward_wrapper(inner, site):
    binder = site.binder
    counters = site.counters
    cap = pool_cap_bytes() // 2  # elements of 2 bytes

    def forward(*args, **kwargs):
        if compile_state.tracing():
            return inner(*args, **kwargs)
        bound, problems = binder.bind(args, kwargs)
        if problems:
            counters.fallback(problems[0])
            return inner(*args, **kwargs)
        positions = bound["positions"]
        shape = getattr(positions, "shape", None)
        tokens = shape[0] if shape else 0  # no tensor, or a 0-d one: not a decode batch
        if compile_state.in_compiled_region():
            counters.fallback(compile_state.IN_COMPILED_REGION)
            return inner(*args, **kwargs)
        if cap == 0:
            counters.fallback(f"{CAP_ENV}=0: no pool")
            return inner(*args, **kwargs)
        if not 0 < tokens <= MAX_M:  # the reason a category (bounded: issue 35), the count at DEBUG
            counters.fallback(f"tokens outside the pool's bound 1..{MAX_M} (prefill or idle)")
            _log.debug("aiter_patches: %s: %s tokens outside the pool's bound 1..%s", NAME, tokens, MAX_M)
            return inner(*args, **kwargs)
        with pool_scope(bound["self"], positions.device, tokens, cap):
            return inner(*args, **kwargs)

    return moe_call.like(forward, inner)


def _dispatcher_wrapper(inner, site):
    import torch

    binder = site.binder
    counters = site.counters
    takes_promise = site.below == DISPATCH

    def gemm_a8w8_blockscale_bpreshuffle(*args, **kwargs):
        if compile_state.tracing():
            return inner(*args, **kwargs)
        scope = _scope.get()
        if scope is None or "out_zeroed" in kwargs:
            return inner(*args, **kwargs)
        bound, problems = binder.bind(args, kwargs)
        if problems or bound.get("out") is not None:  # AITER's own error, or a caller-owned buffer
            return inner(*args, **kwargs)
        XQ, WQ = bound["XQ"], bound["WQ"]
        dtype = bound.get("dtype", torch.bfloat16)
        reason = None
        if not takes_promise:
            reason = f"{DISPATCH} is not applied under this layer: the asm kernel would keep its memset"
        elif getattr(XQ, "dim", lambda: 0)() != 2 or getattr(WQ, "dim", lambda: 0)() < 2:
            reason = "XQ is not [M, K]"
        elif dtype != torch.bfloat16:
            reason = f"output dtype {dtype}: AITER's asm kernel writes bf16 only (the memset stays with the kernel picked)"
        elif not 0 < XQ.shape[0] <= MAX_M:
            reason = f"M outside the pool's bound 1..{MAX_M}"
            _log.debug("aiter_patches: %s: M %s outside the pool's bound 1..%s", NAME, XQ.shape[0], MAX_M)
        elif XQ.device != scope.device:
            reason = "another device than the forward's"
        elif _stream(XQ.device) != scope.stream:
            reason = "another stream than the forward's (its zero fill is not ordered before this GEMM)"
        elif threading.get_ident() != scope.thread:
            reason = "another thread than the forward's (the scope's cursor is not shared across threads)"
        else:
            reason = asm_split_reason(XQ.shape[0], WQ.shape[0], XQ.shape[1])
        if reason is not None:
            counters.fallback(reason)
            return inner(*args, **kwargs)
        M, N = XQ.shape[0], WQ.shape[0]
        size = -(-M * N // ALIGN) * ALIGN
        start = scope.cursor
        scope.demand += size
        if scope.pool is None or start + size > scope.pool.numel():
            counters.fallback(NOT_SIZED if scope.pool is None else EXHAUSTED)
            return inner(*args, **kwargs)
        scope.cursor = start + size  # never handed out again from this pool
        out = scope.pool[start:start + M * N].view(M, N)
        rest = {k: v for k, v in kwargs.items() if k != "out"}
        result, forwarded = dispatch.forwarding(inner, *args[:5], out=out, out_zeroed=True, **rest)
        if forwarded:
            counters.hit()  # the dispatcher's layer passed the promise on: asm at split > 1 skipped its memset
        else:
            counters.fallback(NOT_TAKEN)
        return result

    return moe_call.like(gemm_a8w8_blockscale_bpreshuffle, inner)


def _precheck(target: Target, original) -> str | None:
    problem = source_gate.reason(target, original, RELIED_ON)
    if problem is not None or target.module != MODULE:
        return problem
    fp8 = sys.modules.get(FP8_UTILS)  # deepseek_v2 imports it at its top
    linear = getattr(fp8, LINEAR, None) if fp8 is not None else None
    if linear is None:
        return f"{FP8_UTILS}.{LINEAR} is missing"
    problem = live_source_reason(linear, RELIED_ON[1])
    return None if problem is None else f"{FP8_UTILS}.{LINEAR}: {problem}"


def check(device):
    """``aiter-patches verify``: AITER's dispatcher inside a pool scope (as SGLang's forward opens it) vs. unpatched.

    The scope is opened twice for the same placeholder model and token count (the first sizes the pool, the
    second hands out a slice). Where the AITER under test provides a way, the check's shape is routed to
    asm with two splits: the slice must then be taken where it requires its fast paths, and the result is
    bitwise where its splits add in a fixed order. Otherwise the installed tuned config decides: bitwise
    where no slice was taken; where asm took one, AITER's splits add atomically, so within 1e-2 relative
    (2-norm) (``checks.split_k_verdict``).
    """
    import torch

    from ... import registry
    from ...patches.checks import SPLIT_K_SHAPE, split_k_gemm_inputs, split_k_routed, split_k_verdict
    from ...registry import suspended

    mod = sys.modules[dispatch.MODULE]
    A, Bs, a_scale, b_scale = split_k_gemm_inputs(device, seed=12)

    class _Model:
        pass

    model = _Model()
    with split_k_routed(mod):
        _split_cache.pop(SPLIT_K_SHAPE, None)
        try:
            for _ in range(2):
                before = registry.stats()[NAME]["fast"]
                with pool_scope(model, A.device, A.shape[0], DEFAULT_CAP_MIB << 19):
                    out_p = getattr(mod, dispatch.DISPATCHER)(A, Bs, a_scale, b_scale, torch.bfloat16)
            pooled = registry.stats()[NAME]["fast"] > before
            with suspended():
                out_o = getattr(mod, dispatch.DISPATCHER)(A, Bs, a_scale, b_scale, torch.bfloat16)
        finally:
            _split_cache.pop(SPLIT_K_SHAPE, None)
    return split_k_verdict(
        out_p, out_o, taken=pooled,
        missing=f"no pool slice was taken ({registry.stats()[NAME]['fallback']})",
        taken_detail="a pool slice with out_zeroed=True equals the dispatcher's own output",
        untaken_detail="AITER's tuned config runs no split-K asm here: no slice taken, AITER's result",
        bound_detail="asm took a pool slice")


PATCH = Patch(
    name=NAME,
    summary="SGLang DeepseekV2Model.forward: decode GEMMs that AITER runs as split-K asm write into a per-forward "
            "zero pool (one fill per forward) with out_zeroed=True (their memset is skipped)",
    targets=(
        Target(MODULE, "DeepseekV2Model.forward", FORWARD_PINS, _forward_wrapper,
               "At or below MAX_M tokens: one torch.zeros pool per forward, sized from the model's earlier demand "
               "at that token count; counts why not otherwise."),
        Target(dispatch.MODULE, dispatch.DISPATCHER, dispatch.DISPATCHER_PINS, _dispatcher_wrapper,
               "Outside gemm_dispatch_out_zeroed: inside the scope, a split-K asm shape without out= gets an unused "
               "pool slice as out and out_zeroed=True."),
    ),
    order=6,
    relies_on=RELIED_ON,
    requires="sglang",
    precheck=_precheck,
    opt_in="sglang",
    needs=(DISPATCH,),
    check="aiter_patches.integrations.sglang_zero_pool:check",
)
