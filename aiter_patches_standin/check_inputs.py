"""What the stand-in provides verify's checks beyond AITER's functions (``aiter_patches.checks.Provided``).

On the stand-in every patch's fast path serves the checks' calls (its kernels run wherever Triton
does), so a fast path not taken is a failure; its split-K GEMM adds the splits in a fixed order, so
a skipped memset is compared bit for bit; its ``fused_moe`` runs whole on the checks' small inputs
(MXFP4 weights with unshuffled e8m0 scales, as its leaf kernels read them, or bf16); and its tuned
table (``TUNED``) can send the checks' GEMM shape to split-K asm for the duration of a check. The
stand-in's ``aiter`` package registers this at its import (:func:`register`).
"""

from __future__ import annotations

import contextlib
import sys

from aiter_patches import checks


def fused_moe_inputs(device, quant: str, M=5, E=8, topk=2, dim=256, inter=128, seed=3) -> dict:
    """Inputs of the stand-in's ``fused_moe``: MXFP4 (``quant="fp4"``) weights with unshuffled e8m0 scales, or bf16."""
    import torch

    if quant == "bf16":
        return checks.bf16_moe_inputs(device, M=M, E=E, topk=topk, dim=dim, inter=inter, seed=seed)
    aiter = sys.modules["aiter"]
    g = torch.Generator().manual_seed(seed)
    ids, w = checks.routing(M, E, topk, device, seed)
    x = torch.randn(M, dim, generator=g).to(torch.bfloat16).to(device)
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


@contextlib.contextmanager
def route_split_k(mod, shape: tuple[int, int, int], split: int):
    """The stand-in dispatcher's tuned table ``mod.TUNED`` sends ``shape`` to asm with ``split`` splits
    for the duration (restored after)."""
    saved = dict(getattr(mod, "TUNED", {}))
    mod.TUNED[shape] = {"libtype": "asm", "splitK": split, "kernelName": ""}
    try:
        yield
    finally:
        mod.TUNED.clear()
        mod.TUNED.update(saved)


PROVIDED = checks.Provided(fused_moe_inputs=fused_moe_inputs, route_split_k=route_split_k,
                           split_k_in_order=True, fast_paths_required=True)


def register(aiter) -> None:
    """Called by the stand-in's ``aiter`` package at its import: :data:`PROVIDED` is what it provides."""
    checks.provide(aiter, PROVIDED)
