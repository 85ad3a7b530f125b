"""The self-check of ``moe_sort_mx_quant``'s first calls per verdict (``aiter_patches/self_check.py``).

The contract is bitwise at the sort's boundary, over every position AITER defines: the sort
tables (``sorted_ids``, ``sorted_weights`` and ``sorted_expert_ids`` over the valid region,
``num_valid_ids``), ``moe_buf``'s token rows (zeros, or the addend the sort writes), and the
stage-1 MX quant's data rows and scale bytes (masked as ``reference/mx_quant.py`` says). Not
``fused_moe``'s output: AITER's atomic stage 2 makes it vary run to run.

A checked call runs the one-launch kernel into buffers of its own, then AITER's sort with the
call's own arguments (and, when the sort was to quantize, AITER's stage-1 quant helper on
AITER's sort), and hands AITER's sort outputs on: the caller gets AITER's bits on that call,
and AITER's stage 1 quantizes as usual.
"""

from __future__ import annotations

import sys

import torch

from ... import self_check
from ...aiter_contract import stage1_uses_fused_quant
from ...reference.mx_quant import mx_quant_defined

_QUANT_HELPER = {torch.float4_e2m1fn_x2: "fused_dynamic_mxfp4_quant_moe_sort"}  # any other MX dtype: MXFP8's
_MXFP8_HELPER = "fused_dynamic_mxfp8_quant_moe_sort"


def run(forget, site, step, verdict, api, launch: dict) -> bool:
    """Check this call if its verdict's plan asks for it; True: the call was served here (AITER's sort
    outputs in ``step.outputs``, or none: AITER's sort runs), False: take the fast path as usual.

    ``launch``: the keyword arguments of the one-launch kernel ``api`` for this call (the caller's
    ``moe_buf`` among them; the check writes a buffer of its own instead). ``forget``: drops the
    patch's kept verdicts (a failed check stands the patch down: every later call decides afresh)."""
    counters = site.counters
    what = self_check.begin(verdict.check, counters)
    if what == self_check.FAST:
        return False
    if what == self_check.AITER:
        return True  # step.outputs stays None: AITER's sort runs
    try:
        ours = _ours(api, launch)
    except Exception as exc:  # a compile or launch failure: AITER does the work, the plan stays unchecked
        self_check.finish_unchecked(verdict.check)
        counters.failed(exc, "moe_sort_mx_quant kernel (self-check)")
        return True
    try:
        theirs = step.call_aiter()
        quant = _aiter_quant(launch, theirs) if launch["quant_input"] is not None else None
    except BaseException:
        self_check.finish_unchecked(verdict.check)
        raise  # AITER's own error, as the unpatched call would raise it
    differs = self_check.compared(lambda: _first_difference(ours, theirs, quant, launch, verdict))
    self_check.finish(verdict.check, site, differs, where=_where(launch),
                      inputs={k: v for k, v in launch.items() if v is not None}, forget=forget)
    step.outputs = theirs
    return True


def _ours(api, launch: dict):
    given = launch["moe_buf"]
    own = dict(launch, moe_buf=torch.empty_like(given) if given is not None else None)
    return api(own.pop("topk_ids"), own.pop("topk_weights"), own.pop("num_experts"), own.pop("model_dim"),
               own.pop("moebuf_dtype"), own.pop("block_size"), checked=True, **own)


def _aiter_quant(launch: dict, theirs: tuple):
    """AITER's stage-1 quant of the activations on AITER's sort, as ``fused_moe_2stages`` asks for it."""
    x, topk_ids = launch["quant_input"], launch["topk_ids"]
    helper = getattr(sys.modules["aiter.fused_moe"], _QUANT_HELPER.get(launch["quant_dtype"], _MXFP8_HELPER))
    return helper(x, sorted_ids=theirs[0], num_valid_ids=theirs[3], token_num=x.shape[0], topk=topk_ids.shape[1],
                  block_size=launch["block_size"], sorted_weights=theirs[1])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals the same NaN): shapes, dtypes and bytes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _first_difference(ours, theirs: tuple, quant, launch: dict, verdict) -> str | None:
    """The first output that differs under the contract (module docstring), or None."""
    if not torch.equal(ours.num_valid_ids.cpu(), theirs[3].cpu()):
        return f"num_valid_ids {ours.num_valid_ids.tolist()} != AITER's {theirs[3].tolist()}"
    nv, T = (int(v) for v in theirs[3][:2].tolist())
    T = max(0, min(T, launch["topk_ids"].shape[0]))  # the token rows moe_buf holds (num_local_tokens may be off)
    block = launch["block_size"]
    for label, mine, aiters, n in (("sorted_ids", ours.sorted_ids, theirs[0], nv),
                                   ("sorted_weights", ours.sorted_weights, theirs[1], nv),
                                   ("sorted_expert_ids", ours.sorted_expert_ids, theirs[2], nv // block)):
        if not _same(mine[:n], aiters[:n]):
            return f"{label} differs within the first {n} entries"
    init = launch["moe_buf_init"]
    if verdict.zeroes or init is not None:
        want = init[:T] if init is not None else theirs[4][:T]
        if not _same(ours.moe_buf[:T], want.to(ours.moe_buf.dtype)):
            return f"moe_buf's first {T} rows differ ({'the addend' if init is not None else 'zeros'} expected)"
    if quant is not None:
        if ours.quant is None:
            return "no stage-1 quant made"
        x, topk = launch["quant_input"], launch["topk_ids"].shape[1]
        M, N = x.shape
        rows, scales = mx_quant_defined(theirs[0], theirs[3], theirs[1], M, M, N,
                                        fused=stage1_uses_fused_quant(M, topk))
        data, scale = ours.quant
        if not _same(data.view(torch.uint8)[rows], quant[0].view(torch.uint8)[rows]):
            return "stage-1 MX data rows differ"
        if not _same(scale.view(torch.uint8)[scales], quant[1].view(torch.uint8)[scales]):
            return "stage-1 MX scale bytes differ"
    return None


def _where(launch: dict) -> str:
    M, topk = launch["topk_ids"].shape
    quant = launch["quant_dtype"]
    what = "sort" + (f" + {str(quant).replace('torch.', '')} quant" if quant is not None else "")
    return (f"{what} (tokens {M}, experts {launch['num_experts']}, topk {topk}, model_dim {launch['model_dim']}, "
            f"block {launch['block_size']})")
