"""The launcher calls a server makes for one model, as the patches make them.

Why: a variant count or a compile check is only as good as the calls it is made from. These
are the calls ``patches/moe_sort_mx_quant.py`` makes into ``kernels.moe_sort_mx_quant`` for
each configuration a server fixes at start-up (routing shape, stage-1 quant dtype, expert
mask and ``num_local_tokens``, how ``moe_buf`` is prepared) over what varies call by call
(the token count, and AITER's block size), with CPU tensors of the real shapes and dtypes;
and, with ``include_stand_in``, the stand-in's split-K GEMM calls (on AMD the GEMM patch
launches AITER's own code object, so that kernel never runs there).

A call the kernel's gate refuses (``unsupported_reason``) is skipped: the patch would hand
it to AITER. The gate is asked on meta tensors first, so a refused call allocates nothing (a
huge token count is refused, not a CPU allocation of terabytes); the caller may collect the
gate's reasons (``refused``) to say why a shape launches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from .presets import ModelShape, token_counts

# AITER's dtypes.fp8 on each arch (aiter/utility/dtypes.py at e4048607a5)
AITER_FP8 = {"gfx942": "float8_e4m3fnuz", "gfx950": "float8_e4m3fn"}
STAND_IN = "stand-in GEMM"  # in the configuration label of the stand-in's GEMM calls
GEMM_TOKENS = (1, 8, 16, 17, 32, 48, 64, 100, 128, 256, 1000)


@dataclass(frozen=True)
class Call:
    config: str  # the configuration a server fixes; variants are counted per config
    tokens: int
    run: Callable[[], object]


def _fp8(arch: str):
    import torch

    return getattr(torch, AITER_FP8.get(arch, "float8_e4m3fn"))


def config_label(model: str, experts: int, topk: int, quant: str, ep: str, buf: str) -> str:
    return f"{model} E{experts}/k{topk} quant={quant} ep={ep} buf={buf}"


def sort_quant_calls(shape: ModelShape, arch: str, tokens: list[int] | None = None,
                     refused: list[str] | None = None) -> Iterator[Call]:
    import torch

    from ..kernels import moe_sort_mx_quant as K

    qdtype = {"none": None, "fp4": torch.float4_e2m1fn_x2, "fp8": _fp8(arch)}
    hidden = shape.hidden
    for experts, topk in shape.routing:
        ms = tokens if tokens is not None else token_counts(shape.max_tokens, topk)
        for quant in shape.quants:
            for ep in shape.ep_modes:
                for buf in shape.buf_modes_for(ep):
                    label = config_label(shape.name, experts, topk, quant, ep, buf)
                    for block in shape.blocks_for(quant):
                        for m in ms:
                            meta = _sort_args(m, experts, topk, hidden, block, qdtype[quant], ep, buf, "meta")
                            reason = K.unsupported_reason(**meta["gate"])
                            if reason is not None:
                                if refused is not None:
                                    refused.append(reason)
                                continue
                            args = _sort_args(m, experts, topk, hidden, block, qdtype[quant], ep, buf)
                            yield Call(label, m, lambda a=args: K.moe_sort_mx_quant(*a["pos"], **a["kw"]))


def _sort_args(m, experts, topk, hidden, block, qdtype, ep, buf, device="cpu") -> dict:
    import functools

    import torch

    empty = functools.partial(torch.empty, device=device)
    ids = empty(m, topk, dtype=torch.int32)
    w = empty(m, topk, dtype=torch.float32)
    x = empty(m, hidden, dtype=torch.bfloat16) if qdtype is not None else None
    mask = empty(experts, dtype=torch.int32) if ep != "off" else None
    nlt = empty(1, dtype=torch.int32) if ep == "on+nlt" else None
    init = empty(m, hidden, dtype=torch.bfloat16) if buf == "addend" else None
    kw = dict(expert_mask=mask, num_local_tokens=nlt, quant_input=x, quant_dtype=qdtype, moe_buf=None,
              moe_buf_init=init)
    gate = dict(topk_ids=ids, topk_weights=w, num_experts=experts, model_dim=hidden, block_size=block, **kw)
    return {"gate": gate, "pos": (ids, w, experts, hidden, torch.bfloat16, block),
            "kw": dict(kw, zero_moe_buf=buf != "keep")}


def stand_in_gemm_calls(shape: ModelShape, arch: str) -> Iterator[Call]:
    """The stand-in GEMM as its two callers launch it: AITER's entry point (the stand-in memsets,
    then the splits add) and the ``out_zeroed`` patch (no memset)."""
    import torch

    from ..kernels import blockscale_gemm_splitk as G

    fp8 = _fp8(arch)
    for n, k in shape.gemm_nk or ((shape.hidden, shape.hidden),):
        label = f"{shape.name} {STAND_IN} N{n}/K{k} {fp8}".replace("torch.", "")
        for m in GEMM_TOKENS:
            for splits in [s for s in range(1, G.MAX_SPLITS + 1) if G.valid_split(k, s)]:
                for zero_out in ((True, False) if splits == 1 else (False,)):
                    yield Call(label, m, lambda m=m, n=n, k=k, s=splits, z=zero_out: _gemm(G, fp8, m, n, k, s, z))


def _gemm(G, fp8, m, n, k, splits, zero_out):
    import torch

    a = torch.empty(m, k, dtype=fp8)
    b = torch.empty(n, k, dtype=fp8)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    a_scale = torch.empty(k // 128, m, dtype=torch.float32).t()
    b_scale = torch.empty(n // 128, k // 128, dtype=torch.float32)
    return G.blockscale_gemm_splitk(a, b, out, a_scale, b_scale, splits=splits, b_preshuffled=True, zero_out=zero_out)


def calls(shape: ModelShape, arch: str, include_stand_in: bool = False,
          tokens: list[int] | None = None, refused: list[str] | None = None) -> Iterator[Call]:
    yield from sort_quant_calls(shape, arch, tokens, refused)
    if include_stand_in:
        yield from stand_in_gemm_calls(shape, arch)
