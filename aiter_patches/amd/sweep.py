"""The launcher calls a server makes for one model, as the patches make them.

Why: a variant count or a compile check is only as good as the calls it is made from. These
are the calls ``patches/moe_sort_mx_quant.py`` makes into ``kernels.moe_sort_mx_quant`` for
each configuration a server fixes at start-up (routing shape, stage-1 quant dtype, expert
mask and ``num_local_tokens``, how ``moe_buf`` is prepared) over what varies call by call
(the token count, and AITER's block size), with CPU tensors of the real shapes and dtypes.
(The GEMM patch launches AITER's own code object on AMD: it compiles no Triton kernel there.)

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


def calls(shape: ModelShape, arch: str, tokens: list[int] | None = None,
          refused: list[str] | None = None) -> Iterator[Call]:
    yield from sort_quant_calls(shape, arch, tokens, refused)
