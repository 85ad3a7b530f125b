"""What the equivalence checks share: inputs, comparisons, and what the AITER under test provides.

Each patch keeps its ``check`` beside it (``patches/moe_sort_mx_quant.py``,
``moe_addend_fold.py``, ``sort_extension.py``, ...); they share the routing, ``fused_moe``
inputs, the sort's defined region and the masked MX bytes, which live here once. The two
checks of a skipped split-K memset (``patches/gemm_dispatch_out_zeroed.py``,
``integrations/sglang_zero_pool.py``) share their inputs, the routing of their shape to split-K
asm and their verdict: ``split_k_gemm_inputs``, ``split_k_routed``, ``split_k_verdict``.

A check calls AITER's public entry points (``moe_sorting``, the MX quant-sort helpers,
``fused_moe``) with the patch applied and, inside ``registry.suspended()``, without it, on the
same inputs, then compares over every position AITER defines. Each also asserts that the fast
path was taken (a check that only exercised fallbacks would prove nothing).

What a check may ask beyond AITER's functions depends on the AITER build, not on the check:
:class:`Provided` (whole ``fused_moe`` inputs it runs here, a way to route a GEMM shape to
split-K asm, whether its split-K adds in a fixed order, whether every fast path must serve the
checks' calls). AMD's AITER provides none of these (the defaults); a build that does (the
stand-in) registers them at its import with :func:`provide`. No check asks which build it is.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Callable, NamedTuple

import torch

from .. import registry
from ..core.declarations import CheckResult
from .moe import call as moe_call
from ..registry import suspended


class Provided(NamedTuple):
    """What an AITER build provides the checks beyond its functions (the defaults: AMD's AITER).

    - ``fused_moe_inputs(device, quant)``: keyword arguments of a whole ``fused_moe`` call this
      build runs here (``quant``: ``"fp4"``, MXFP4 weights; ``"bf16"``); None: the checks compare
      no whole call.
    - ``route_split_k(module, shape, split)``: a context manager under which the block-scale
      dispatcher of ``module`` runs ``shape`` (M, N, K) as split-K asm with ``split`` splits; None:
      the installed tuned config decides.
    - ``split_k_in_order``: its split-K asm adds the splits in a fixed order (bitwise at any split);
      False: atomically, in any order (AITER's ``.co``).
    - ``fast_paths_required``: every patch's fast path serves the checks' calls on this build, so
      one not taken is a failure; False: the machine and the tuned config decide.
    """

    fused_moe_inputs: Callable[[Any, str], dict] | None = None
    route_split_k: Callable[..., Any] | None = None
    split_k_in_order: bool = False
    fast_paths_required: bool = False


AITER = Provided()
_PROVIDED: "weakref.WeakKeyDictionary[Any, Provided]" = weakref.WeakKeyDictionary()


def provide(aiter, provided: Provided | None) -> None:
    """What ``aiter`` (an imported AITER package) provides the checks; None: the defaults again."""
    if provided is None:
        _PROVIDED.pop(aiter, None)
    else:
        _PROVIDED[aiter] = provided


def provided() -> Provided:
    """What the imported ``aiter`` provides the checks (the defaults where it registered nothing)."""
    mod = sys.modules.get("aiter")
    return _PROVIDED.get(mod, AITER) if mod is not None else AITER


def aiter_modules():
    return sys.modules["aiter"], sys.modules["aiter.fused_moe"]


def routing(M: int, E: int, topk: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :topk].to(torch.int32)
    w = torch.rand(M, topk, generator=g).softmax(dim=1).to(torch.float32)
    w[0, 0] = 0.0 if M > 1 and topk > 1 else w[0, 0]  # a zero routing weight (AITER's zero-row rule)
    return ids.to(device), w.to(device)


def fast_hits(name: str) -> int:
    return registry.stats()[name]["fast"]


def sort_and_quant(fm, ids, w, E, x, block, quant_dtype, *, addend=None):
    """moe_sorting (+ the stage-1 quant helper) as fused_moe_2stages calls them, inside one MoeCall."""
    call = moe_call.MoeCall(hidden_states=x, quant_dtype=quant_dtype)
    if addend is not None:
        call.addend = addend
    with moe_call.scope(call):
        sorted_ids, sorted_w, sorted_e, nv, buf = fm.moe_sorting(ids, w, E, x.shape[1], x.dtype, block)
        helper = fm.fused_dynamic_mxfp4_quant_moe_sort if quant_dtype == torch.float4_e2m1fn_x2 \
            else fm.fused_dynamic_mxfp8_quant_moe_sort
        data, scale = helper(x, sorted_ids=sorted_ids, num_valid_ids=nv, token_num=x.shape[0], topk=ids.shape[1],
                             block_size=block, sorted_weights=sorted_w)
    return sorted_ids, sorted_w, sorted_e, nv, buf, data, scale


def compare_sort_quant(a, b, block: int) -> list[str]:
    """Sort outputs over the defined region, and moe_buf rows below the token count."""
    bad = []
    names = ["sorted_ids", "sorted_weights", "sorted_expert_ids", "num_valid_ids", "moe_buf", "data", "scale"]
    if not torch.equal(a[3].cpu(), b[3].cpu()):
        return ["num_valid_ids"]
    nv, T = (int(v) for v in a[3].cpu())
    for i, n in ((0, nv), (1, nv), (2, nv // block)):
        if not torch.equal(a[i][:n].cpu().view(torch.int32), b[i][:n].cpu().view(torch.int32)):
            bad.append(names[i])
    if not torch.equal(a[4][:T].cpu(), b[4][:T].cpu()):
        bad.append("moe_buf")
    return bad


def masked_quant_equal(x, res_a, res_b, quant_dtype, topk: int) -> list[str]:
    """Compare data rows and scale bytes over the positions AITER defines (reference masks)."""
    from ..reference.mx_quant import mx_quant_moe_sort_reference, stage1_uses_fused_quant

    sorted_ids, sorted_w, _, nv = (t.cpu() for t in res_a[:4])
    M = x.shape[0]
    ref = mx_quant_moe_sort_reference(x.cpu(), sorted_ids, nv, sorted_w, M, quant_dtype,
                                      fused=stage1_uses_fused_quant(M, topk))
    bad = []
    rows = ref.data_defined
    da, db = res_a[5].cpu().view(torch.uint8), res_b[5].cpu().view(torch.uint8)
    if not torch.equal(da[rows], db[rows]):
        bad.append("MX data rows")
    sa, sb = res_a[6].cpu().view(torch.uint8), res_b[6].cpu().view(torch.uint8)
    if not torch.equal(sa[ref.scale_defined], sb[ref.scale_defined]):
        bad.append("MX scale bytes")
    return bad


def bf16_moe_inputs(device, M=5, E=8, topk=2, dim=256, inter=128, seed=3) -> dict:
    """``fused_moe`` keyword arguments with bf16 weights (no quantization): the routing, ``x``, ``w1``, ``w2``."""
    g = torch.Generator().manual_seed(seed)
    ids, w = routing(M, E, topk, device, seed)
    x = torch.randn(M, dim, generator=g).to(torch.bfloat16).to(device)
    w1 = (torch.randn(E, 2 * inter, dim, generator=g) / dim**0.5).to(torch.bfloat16).to(device)
    w2 = (torch.randn(E, dim, inter, generator=g) / inter**0.5).to(torch.bfloat16).to(device)
    return dict(hidden_states=x, w1=w1, w2=w2, topk_weight=w, topk_ids=ids)


def mxfp4_moe_inputs(aiter, device, M=5, E=8, topk=2, dim=256, inter=128, seed=3) -> dict:
    """``fused_moe`` keyword arguments with MXFP4 weights (per_1x32: the stage-1 MX quant runs): random fp4
    bytes, e8m0 scales near 1."""
    g = torch.Generator().manual_seed(seed)
    ids, w = routing(M, E, topk, device, seed)
    x = torch.randn(M, dim, generator=g).to(torch.bfloat16).to(device)
    fp4, e8m0 = aiter.dtypes.fp4x2, aiter.dtypes.fp8_e8m0
    w1 = torch.randint(0, 256, (E, 2 * inter, dim // 2), generator=g, dtype=torch.uint8).view(fp4)
    w2 = torch.randint(0, 256, (E, dim, inter // 2), generator=g, dtype=torch.uint8).view(fp4)
    s1 = torch.randint(118, 122, (E, 2 * inter, dim // 32), generator=g, dtype=torch.uint8).view(e8m0)
    s2 = torch.randint(118, 122, (E, dim, inter // 32), generator=g, dtype=torch.uint8).view(e8m0)
    return dict(hidden_states=x, topk_weight=w, topk_ids=ids, w1=w1.to(device), w2=w2.to(device),
                quant_type=aiter.QuantType.per_1x32, w1_scale=s1.to(device), w2_scale=s2.to(device))


def whole_fused_moe_bitwise(args: dict) -> list[str]:
    """``fused_moe(**args)`` patched vs. unpatched, bit for bit; the sort + quant's fast path must be taken."""
    _, fm = aiter_modules()
    before = fast_hits("moe_sort_mx_quant")
    patched = fm.fused_moe(**args)
    if fast_hits("moe_sort_mx_quant") < before + 2:
        return ["fused_moe: fast path not taken"]
    with suspended():
        original = fm.fused_moe(**args)
    return [] if torch.equal(patched.view(torch.int16), original.view(torch.int16)) else ["fused_moe output differs"]


SPLIT_K_SHAPE = (16, 256, 512)  # (M, N, K) of the skipped-memset checks


def split_k_gemm_inputs(device, seed: int):
    """fp8 ``A`` [M, K], a 16x16-shuffled fp8 ``B`` [N, K], ``A``'s 1x128 scales (K-major, transposed) and ``B``'s
    128x128 scales, as AITER's block-scale dispatcher takes them, for ``SPLIT_K_SHAPE``."""
    from ..reference.blockscale_gemm import shuffle_weight_16x16

    fp8 = sys.modules["aiter"].dtypes.fp8
    g = torch.Generator().manual_seed(seed)
    M, N, K = SPLIT_K_SHAPE
    A = (torch.randn(M, K, generator=g) * 2).to(fp8).to(device)
    Bs = shuffle_weight_16x16((torch.randn(N, K, generator=g) * 2).to(fp8)).to(device)
    a_scale = (torch.rand(K // 128, M, generator=g) + 0.5).to(device).t()
    b_scale = (torch.rand(N // 128, K // 128, generator=g) + 0.5).to(device)
    return A, Bs, a_scale, b_scale


def split_k_routed(mod):
    """A context manager under which the dispatcher of ``mod`` runs ``SPLIT_K_SHAPE`` as split-K asm with two
    splits, where the AITER under test provides a way (:attr:`Provided.route_split_k`); otherwise
    (AMD's AITER) it changes nothing: the installed tuned config decides."""
    route = provided().route_split_k
    return route(mod, SPLIT_K_SHAPE, 2) if route is not None else contextlib.nullcontext()


SPLIT_K_BOUND = 1e-2  # relative 2-norm error of AITER's atomically added asm splits vs. its memset + GEMM


def split_k_verdict(patched, original, *, taken: bool, missing: str, taken_detail: str, untaken_detail: str,
                    bound_detail: str, aiter: Provided | None = None) -> CheckResult:
    """The verdict of a check whose patched GEMM may skip AITER's memset before its split-K asm kernel.

    ``aiter``: what the AITER under test provides (default: :func:`provided`). Where its fast paths
    are required, this one must be taken (else ``missing``). Bitwise where the fast path was not
    taken, or where its split-K adds in a fixed order; where it was taken and AITER's splits add
    atomically (in any order), within ``SPLIT_K_BOUND`` (2-norm, relative).
    """
    aiter = provided() if aiter is None else aiter
    if aiter.fast_paths_required and not taken:
        return CheckResult("bitwise", False, missing)
    if aiter.split_k_in_order or not taken:
        ok = torch.equal(patched.view(torch.int16), original.view(torch.int16))
        detail = taken_detail if taken else untaken_detail
        return CheckResult("bitwise", ok, detail if ok else "outputs differ")
    err = ((patched.float() - original.float()).norm() / original.float().norm()).item()
    return CheckResult("bound: 2-norm rel. error <= 1e-2 (AITER's atomic splits)", err <= SPLIT_K_BOUND,
                       f"{bound_detail}; relative error {err:.2e}")
