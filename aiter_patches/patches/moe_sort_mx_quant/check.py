"""``aiter-patches verify``'s check of ``moe_sort_mx_quant``: the sort + MX quant patched against AITER's own."""

from __future__ import annotations

def check(device):
    """`aiter-patches verify`: sort + MX quant (MXFP4 and MXFP8) patched vs AITER, bitwise over every position AITER
    defines; also a whole MXFP4 ``fused_moe`` where the AITER under test provides inputs it runs here."""
    import torch

    from ... import registry
    from .. import checks as kit
    from ...core.declarations import CheckResult
    from ...registry import suspended

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
