"""``aiter-patches verify --model NAME``: the self-check at every token bucket of a model preset, before serving.

Why: the self-check (``self_check.py``) proves each plan on its first call while a server
runs; an operator bringing a model up on a new GPU or a new AITER build wants that answer
before the server takes traffic. This runs the same check (forced on, one call per plan) on
this GPU and this AITER for the preset's routings (``amd/presets.py``, the ``compile``
presets), both MX quants, and the token buckets ``compile`` covers (``token_counts``), and
prints one row per patch and bucket: ``ok`` (equal to AITER's), ``FAIL`` (the first
difference; the patch stood down) or ``AITER`` (the patch hands this bucket to AITER: why).

Covered: ``moe_sort_mx_quant`` (the sort, ``moe_buf``'s fill and the stage-1 MX quant). The
GEMM patches have no model shapes in the presets; ``verify``'s own check covers them.
"""

from __future__ import annotations

import os
from typing import Any

from . import registry, self_check

NAME = "moe_sort_mx_quant"
COLUMNS = ["patch", "routing", "quant", "tokens", "result", "detail"]


def block_for(tokens: int) -> int:
    """The MoE block size AITER's tuned MX configs choose around this token count (32 at decode)."""
    return 32 if tokens < 1024 else 64 if tokens < 8192 else 128


def run(model: str, device: str | None = None, max_tokens: int | None = None) -> tuple[list[dict], str]:
    """``(rows, the AITER used)``; raises ``ValueError`` for an unknown model (the message names the presets)."""
    from . import verify
    from .amd import presets

    shape = presets.preset(model)
    limit = min(shape.max_tokens, max_tokens or shape.max_tokens)
    saved = {k: os.environ.get(k) for k in (self_check.ENV, self_check.CALLS_ENV)}
    os.environ[self_check.ENV], os.environ[self_check.CALLS_ENV] = "1", "1"
    try:
        return verify.with_aiter(device, lambda dev: _rows(shape, dev, limit))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rows(shape, dev, limit: int) -> list[dict]:
    import sys

    import torch

    from .amd.presets import token_counts
    from .patches import checks

    registry.revert([NAME])  # a patch that stood down earlier in this process is checked afresh
    registry.apply([NAME])
    if registry.state(NAME) != registry.APPLIED:
        reason = next(r["reason"] for r in registry.status()["patches"] if r["name"] == NAME)
        return [_row("-", "-", "-", "SKIP", f"{registry.state(NAME)}: {reason}")]
    aiter, fm = sys.modules["aiter"], sys.modules["aiter.fused_moe"]
    rows: list[dict] = []
    for experts, topk in shape.routing:
        for label, qd in (("MXFP4", getattr(aiter.dtypes, "fp4x2", None)), ("MXFP8", getattr(aiter.dtypes, "fp8", None))):
            routing = f"{experts}x{topk}, hidden {shape.hidden}"
            for tokens in token_counts(limit, topk):
                if registry.state(NAME) != registry.APPLIED:
                    rows.append(_row(routing, label, tokens, "SKIP", f"{NAME} is {registry.state(NAME)}"))
                    break
                rows.append(_one(fm, checks, torch, dev, routing, label, qd, experts, topk, shape.hidden, tokens))
    return rows


def _one(fm, checks, torch, dev, routing: str, label: str, qd, experts: int, topk: int, hidden: int,
         tokens: int) -> dict:
    ids, w = checks.routing(tokens, experts, topk, dev, seed=tokens)
    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(torch.bfloat16).to(dev)
    before = registry.stats()[NAME]
    try:
        checks.sort_and_quant(fm, ids, w, experts, x, block_for(tokens), qd)
    except Exception as exc:  # AITER's own path raised (this build has no such quant, say)
        return _row(routing, label, tokens, "AITER", f"AITER raised {type(exc).__name__}: {exc}")
    after = registry.stats()[NAME]
    raised = [e for e, n in after["errors"].items() if n > before["errors"].get(e, 0)]
    if raised:  # the one-launch kernel raised: AITER served, but this GPU cannot run the patch's kernel here
        return _row(routing, label, tokens, "FAIL", f"the patch's kernel raised: {'; '.join(raised)}")
    if after["checks_failed"] > before["checks_failed"]:
        reason = next(r["reason"] for r in registry.status()["patches"] if r["name"] == NAME)
        return _row(routing, label, tokens, "FAIL", reason)
    if after["checks_passed"] > before["checks_passed"]:
        return _row(routing, label, tokens, "ok", "sort, moe_buf and MX quant equal to AITER's")
    new = [r for r, n in after["fallback"].items() if n > before["fallback"].get(r, 0)]
    return _row(routing, label, tokens, "AITER", "; ".join(new) or "not checked: no fast path taken")


def _row(routing: Any, quant: Any, tokens: Any, result: str, detail: str) -> dict:
    return {"patch": NAME, "routing": routing, "quant": quant, "tokens": tokens, "result": result, "detail": detail}
