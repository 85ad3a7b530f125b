"""Patch: SGLang's in-tree AITER MoE-sort patch becomes a no-op while ``moe_sort_mx_quant`` is applied.

SGLang 0.5.23 calls ``apply_aiter_small_moe_sort_patch()``
(``sglang/kernels/ops/moe/moe_sorting_small.py``) from ``AiterRunnerCore.__init__``
on gfx95, with no switch. It wraps ``aiter.fused_moe.fused_moe``,
``_moe_sorting_impl`` and ``fused_dynamic_mxfp8_quant_moe_sort`` in that module
(over whatever is bound there, ours included) and takes every sort of at most
256 routing pairs without ``expert_mask``: ours is then never reached at decode,
and with MXFP4 weights its sort emits an MXFP8 quant that nothing uses while
AITER's MXFP4 quant still runs. Ours covers MXFP4 and MXFP8, EP (``expert_mask``)
and prefill in one launch, bit for bit with AITER, so by default the server's
patch is skipped (``AITER_PATCHES_DISABLE=sglang_takeover`` gives it back).

The patch needs ``moe_sort_mx_quant`` (``Patch.needs``): where that patch is
disabled, skipped or inactive, this one is skipped and SGLang's function runs
as shipped. It may be applied while ``moe_sort_mx_quant`` is still pending
(``pending_ok``): SGLang imports ``aiter.fused_moe`` only inside the very function
we intercept, so ours cannot be applied before that call. The decision is
therefore taken when SGLang calls the function (its caller imports it from the
module at call time, so the binding we replace is the one it uses): the
wrapper imports ``aiter.fused_moe`` itself first if no one has (its post-import
hook applies ours), then asks its own site (``site.needs_unmet()``); while
every need is applied the call is a no-op, counted and logged once; otherwise
(and off gfx95, where it installs nothing) SGLang's function runs. If SGLang's patch already ran when the
take-over applies (``functools.cache`` shows it was called), its wrappers that
sit directly over ours are taken off by identity (``__wrapped__`` is our
wrapper and the wrapper's own closure calls exactly it); wrappers under ours are
left in place (ours is asked first; they only see what ours hands back) and are
named in ``status()``.

Gated like an AITER target: the function's signature must equal the pin, and
its source hash the relied-on pin (checked at apply time here, since silencing
changed code could lose something SGLang added).
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import Any

from .. import foreign_layers
from ..core.aliases import unwrap_foreign
from ..drift import live_source_reason, source_hash
from ..core.declarations import Patch, Target
from . import moe_call, pins, relied_on

log = logging.getLogger("aiter_patches")

NAME = "sglang_takeover"
PRODUCER = "moe_sort_mx_quant"
SGLANG_MODULE = "sglang.kernels.ops.moe.moe_sorting_small"
ENTRY = "apply_aiter_small_moe_sort_patch"
AITER_MODULE = "aiter.fused_moe"

# SGLang 0.5.23's wrappers (read in its source), by the AITER name each replaces: what they take.
WRAPPERS = {
    "fused_moe_wrapper": (
        "fused_moe",
        "sets up a sort-time MXFP8 stage-1 quant for per_1x32 calls (quant_type by keyword) with fp4x2/fp8 "
        "w1, contiguous bf16/fp16 activations, hidden size a multiple of 2048, at most 256 routing pairs "
        "(with MXFP4 weights nothing uses it); passes every call on",
    ),
    "sorting_impl_wrapper": (
        "_moe_sorting_impl",
        "takes the sort (one Triton launch, with that quant when set up) for at most 256 routing pairs "
        "without expert_mask, num_local_tokens, output_aux, return_local_topk_ids or output=, int32 "
        "contiguous topk_ids, topk < 128, at most 256 experts (more for small or unquantized batches); "
        "other sorts pass inward",
    ),
    "mx_quant_wrapper": (
        "fused_dynamic_mxfp8_quant_moe_sort",
        "returns its sort-time MXFP8 quant to the next MXFP8 quant call with the same input shape; "
        "other calls pass inward",
    ),
}
for _name, (_attr, _takes) in WRAPPERS.items():
    for _q in (f"{ENTRY}.<locals>.{_name}", _name):  # code qualname (3.11+), code name (3.10)
        foreign_layers.register_known(SGLANG_MODULE, _q, _takes)

_logged = False


def is_sglang_wrapper(obj: Any) -> bool:
    """One of SGLang's wrappers whose ``__wrapped__`` is exactly what its closure calls."""
    if not isinstance(obj, types.FunctionType) or obj.__globals__.get("__name__") != SGLANG_MODULE:
        return False
    if obj.__code__.co_name not in WRAPPERS:
        return False
    wrapped = getattr(obj, "__wrapped__", None)
    cells = []
    for cell in obj.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            pass
    return wrapped is not None and any(c is wrapped for c in cells)


def _source_reason(target: Target, original: Any) -> str | None:
    """Apply-time gate: the source of SGLang's function hashes to the relied-on pin."""
    fn = getattr(original, "__wrapped__", original)  # under functools.cache
    pin = relied_on.SGLANG_APPLY_SMALL_MOE_SORT_PATCH
    return live_source_reason(fn, pin)


def _unmet(site) -> str | None:
    """None while every patch this one needs is applied; else which is not, as the site says."""
    unmet = site.needs_unmet()
    if unmet is not None and AITER_MODULE not in sys.modules:
        try:  # SGLang's function would import it now; its post-import hook applies what we need
            importlib.import_module(AITER_MODULE)
        except Exception:  # the original, if it runs, reports its own import problem
            return unmet
        unmet = site.needs_unmet()
    return unmet


def _on_gfx95() -> bool:
    """SGLang's own first test (its function returns at once elsewhere): a no-op there saves nothing to count."""
    probe = getattr(sys.modules.get(SGLANG_MODULE), "is_gfx95_supported", None)
    try:
        return probe is None or bool(probe())
    except Exception:
        return True


def _log_once() -> None:
    global _logged
    if not _logged:
        _logged = True
        log.info(
            "aiter_patches: %s: SGLang's %s() not run: %s covers its calls (MXFP4 and MXFP8, EP, prefill, "
            "bitwise); AITER_PATCHES_DISABLE=%s gives them back to SGLang", NAME, ENTRY, PRODUCER, NAME,
        )


def _after_earlier_run(sites: list[tuple[Any, Any]]) -> None:
    """After the take-over is committed, if SGLang's patch ran before it: take its layers over ours off by identity
    (put back when the take-over is reverted), report the rest."""
    for site, inner in sites:
        info = getattr(inner, "cache_info", None)
        try:
            ran = info is not None and info().currsize > 0
        except Exception:
            ran = False
        if not ran:
            continue
        restored = []
        for attr, _ in WRAPPERS.values():
            restored += unwrap_foreign(AITER_MODULE, attr, is_sglang_wrapper, owner=NAME)
        if restored:
            text = ("SGLang's patch ran before the take-over; its wrappers over ours were taken off at "
                    f"{', '.join(restored)}")
        else:
            text = "SGLang's patch ran before the take-over; its wrappers stay where they are (status names them)"
        site.counters.fallback(text)
        log.info("aiter_patches: %s: %s", NAME, text)


def _takeover_wrapper(inner, site):
    def apply_aiter_small_moe_sort_patch(*args, **kwargs):
        if not _on_gfx95():
            site.counters.fallback("not gfx95: SGLang's patch installs nothing here")
            return inner(*args, **kwargs)
        unmet = _unmet(site)
        if unmet is not None:
            site.counters.fallback(f"{unmet}: SGLang's patch installed")
            return inner(*args, **kwargs)
        site.counters.hit()
        _log_once()
        return None

    return moe_call.like(apply_aiter_small_moe_sort_patch, inner)


PATCH = Patch(
    name=NAME,
    summary="SGLang's in-tree AITER MoE-sort patch becomes a no-op while moe_sort_mx_quant is applied",
    targets=(
        Target(SGLANG_MODULE, ENTRY, pins.SGLANG_APPLY_SMALL_MOE_SORT_PATCH, _takeover_wrapper,
               "Imported from its module by AiterRunnerCore.__init__ at call time: a no-op while "
               "moe_sort_mx_quant is applied, SGLang's own function otherwise."),
    ),
    kernel_module=None,
    order=35,
    needs=(PRODUCER,),
    pending_ok=(PRODUCER,),  # SGLang's function, which we intercept, is what imports aiter.fused_moe
    relies_on=relied_on.SGLANG_TAKEOVER,
    requires="sglang",
    precheck=_source_reason,
    after_apply=_after_earlier_run,
)


def check_source(text: str, where: str = SGLANG_MODULE) -> list[str]:
    """The drift check for SGLang's file (its text, e.g. read from a wheel): one line per problem, [] when all match.

    The same machinery as for AITER: the ``def``'s signature against the pins
    (``signatures.from_ast``), each relied-on function's ``drift.source_hash``.
    """
    import ast

    from ..signatures import from_ast, match

    tree = ast.parse(text)
    lines = text.splitlines()
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    problems = []
    node = defs.get(ENTRY)
    if node is None:
        return [f"{where}: {ENTRY} is not defined"]
    pin, differences = match(from_ast(node), pins.SGLANG_APPLY_SMALL_MOE_SORT_PATCH)
    if pin is None:
        problems.append(f"{where}.{ENTRY} signature drifted: {'; '.join(differences)}")
    for sp in relied_on.SGLANG_TAKEOVER:
        n = defs.get(sp.qualname)
        if n is None:
            problems.append(f"{where}.{sp.qualname} missing")
            continue
        first = min([n.lineno] + [d.lineno for d in n.decorator_list])
        found = source_hash(lines[first - 1:n.end_lineno])
        if found != sp.sha256 and found not in sp.also:
            problems.append(f"{where}.{sp.qualname} changed: source hash {found[:12]} != pinned {sp.sha256[:12]}")
    return problems
