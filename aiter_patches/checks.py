"""What the MoE features' equivalence checks share: inputs and comparisons.

Each MoE patch keeps its ``check`` beside it (``patches/moe_sort_mx_quant.py``,
``moe_addend_fold.py``, ``sort_extension.py``); they share the routing, the
stand-in's ``fused_moe`` weights, the sort's defined region and the masked MX
bytes, which live here once. The two checks of a skipped split-K memset
(``patches/gemm_dispatch_out_zeroed.py``, ``integrations/sglang_zero_pool.py``)
share their inputs, the stand-in's tuned entry and their verdict: ``split_k_gemm_inputs``,
``stand_in_split_k``, ``split_k_verdict``.

A check calls AITER's public entry points (``moe_sorting``, the MX quant-sort
helpers, ``fused_moe`` on the stand-in) with the patch
applied and, inside ``verify.suspended()``, without it, on the same inputs, then
compares over every position AITER defines. Each also asserts that the fast
path was taken (a check that only exercised fallbacks would prove nothing).
"""

from __future__ import annotations

import contextlib
import sys

import torch

from . import registry
from .core.declarations import CheckResult
from .patches import moe_call
from .verify import suspended


def aiter_modules():
    return sys.modules["aiter"], sys.modules["aiter.fused_moe"]


def is_stand_in() -> bool:
    return bool(getattr(sys.modules.get("aiter"), "IS_AITER_PATCHES_STAND_IN", False))


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
    from .reference.mx_quant import mx_quant_moe_sort_reference, stage1_uses_fused_quant

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


def stand_in_moe_inputs(device, M=5, E=8, topk=2, dim=256, inter=128, quant="fp4", seed=3):
    """Inputs for the stand-in's fused_moe: MXFP4 (or bf16) weights with unshuffled e8m0 scales."""
    aiter, fm = aiter_modules()
    g = torch.Generator().manual_seed(seed)
    ids, w = routing(M, E, topk, device, seed)
    x = torch.randn(M, dim, generator=g).to(torch.bfloat16).to(device)
    if quant == "bf16":
        w1 = (torch.randn(E, 2 * inter, dim, generator=g) / dim**0.5).to(torch.bfloat16).to(device)
        w2 = (torch.randn(E, dim, inter, generator=g) / inter**0.5).to(torch.bfloat16).to(device)
        return dict(hidden_states=x, w1=w1, w2=w2, topk_weight=w, topk_ids=ids)
    w1 = torch.randint(0, 256, (E, 2 * inter, dim // 2), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, dim, inter // 2), generator=g, dtype=torch.uint8)
    s1 = torch.randint(120, 124, (E, 2 * inter, dim // 32), generator=g, dtype=torch.uint8)
    s2 = torch.randint(120, 124, (E, dim, inter // 32), generator=g, dtype=torch.uint8)
    return dict(
        hidden_states=x,
        w1=w1.to(device).view(aiter.dtypes.fp4x2),
        w2=w2.to(device).view(aiter.dtypes.fp4x2),
        topk_weight=w,
        topk_ids=ids,
        quant_type=aiter.QuantType.per_1x32,
        w1_scale=s1.to(device).view(aiter.dtypes.fp8_e8m0),
        w2_scale=s2.to(device).view(aiter.dtypes.fp8_e8m0),
    )


def whole_fused_moe_bitwise(device) -> list[str]:
    _, fm = aiter_modules()
    args = stand_in_moe_inputs(device)
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
    from .reference.blockscale_gemm import shuffle_weight_16x16

    fp8 = sys.modules["aiter"].dtypes.fp8
    g = torch.Generator().manual_seed(seed)
    M, N, K = SPLIT_K_SHAPE
    A = (torch.randn(M, K, generator=g) * 2).to(fp8).to(device)
    Bs = shuffle_weight_16x16((torch.randn(N, K, generator=g) * 2).to(fp8)).to(device)
    a_scale = (torch.rand(K // 128, M, generator=g) + 0.5).to(device).t()
    b_scale = (torch.rand(N // 128, K // 128, generator=g) + 0.5).to(device)
    return A, Bs, a_scale, b_scale


@contextlib.contextmanager
def stand_in_split_k(mod):
    """Yields whether ``aiter`` is the stand-in; if so, its tuned table ``mod.TUNED`` sends ``SPLIT_K_SHAPE`` to asm
    with two splits for the duration (restored after). On real AITER the installed tuned config decides."""
    stand_in = getattr(sys.modules["aiter"], "IS_AITER_PATCHES_STAND_IN", False)
    saved = dict(getattr(mod, "TUNED", {}))
    if stand_in:
        mod.TUNED[SPLIT_K_SHAPE] = {"libtype": "asm", "splitK": 2, "kernelName": ""}
    try:
        yield stand_in
    finally:
        if stand_in:
            mod.TUNED.clear()
            mod.TUNED.update(saved)


SPLIT_K_BOUND = 1e-2  # relative 2-norm error of AITER's atomically added asm splits vs. its memset + GEMM


def split_k_verdict(patched, original, *, stand_in: bool, taken: bool, missing: str, taken_detail: str,
                    untaken_detail: str, bound_detail: str) -> CheckResult:
    """The verdict of a check whose patched GEMM may skip AITER's memset before its split-K asm kernel.

    On the stand-in the fast path must be taken (else ``missing``) and its splits add in a fixed
    order: bitwise. On real AITER, bitwise where the tuned config did not take it; where it did,
    AITER's splits add atomically (in any order), so within ``SPLIT_K_BOUND`` (2-norm, relative).
    """
    if stand_in and not taken:
        return CheckResult("bitwise", False, missing)
    if stand_in or not taken:
        ok = torch.equal(patched.view(torch.int16), original.view(torch.int16))
        detail = taken_detail if taken else untaken_detail
        return CheckResult("bitwise", ok, detail if ok else "outputs differ")
    err = ((patched.float() - original.float()).norm() / original.float().norm()).item()
    return CheckResult("bound: 2-norm rel. error <= 1e-2 (AITER's atomic splits)", err <= SPLIT_K_BOUND,
                       f"{bound_detail}; relative error {err:.2e}")
