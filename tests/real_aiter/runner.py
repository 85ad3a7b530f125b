"""Runs the cases of ``cases.py`` in this (throw-away) process and prints one ``RESULT <json>`` line.

``python runner.py real TREE GFX CU ROCM_HOME [names...]``: real AITER from TREE, faked GFX with CU compute units.
``python runner.py stub GFX [names...]``: the stand-in AITER, emulating GFX.

Every case runs unpatched first, then (after ``aiter_patches.apply()``) patched, on
the same inputs. Per case the result holds the leaf calls of both runs, whether
the outputs are equal bit for bit (rows below ``num_local_tokens`` only: AITER
leaves the others unwritten), the exception types, the patched run's counters and
the quant dtype the prediction gave.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import cases as case_table  # noqa: E402
import chain  # noqa: E402


def _build(aiter, case, gfx):
    import torch

    dtypes = aiter.dtypes
    g = torch.Generator().manual_seed(hash(case["name"]) % (2**31))
    M, E, K = case["tokens"], case["experts"], case["topk"]
    D, I = case["model_dim"], case["inter_dim"]
    global_E = E * 2 + 1 if case["ep"] else E
    hidden = (torch.randn(M, D, generator=g) * 2).to(torch.bfloat16)
    share = case["tuned"]  # tuned rows: real model shapes, all experts share one weight tensor

    def weights(rows, cols, n):
        e = 1 if share else n
        if case["quant"] == "mxfp4":
            w = torch.randint(0, 256, (e, rows, cols // 2), generator=g, dtype=torch.uint8).view(dtypes.fp4x2)
        else:
            w = (torch.randn(e, rows, cols, generator=g) * 0.5).to(dtypes.fp8)
        s = torch.randint(118, 124, (e, rows, cols // 32), generator=g, dtype=torch.uint8).view(dtypes.fp8_e8m0)
        if share:
            w, s = w.expand(n, *w.shape[1:]), s.expand(n, *s.shape[1:])
        return w, s

    w1, w1_scale = weights(2 * I, D, E)
    w2, w2_scale = weights(D, I, E)
    if case["shuffled"]:
        w1.is_shuffled = True
        w2.is_shuffled = True
    scores = torch.rand(M, global_E, generator=g)
    if case["ep"]:
        scores[:, -1] = -1.0  # the sentinel expert is never picked
    topk_ids = scores.topk(K, dim=1).indices.to(torch.int32)
    topk_weights = torch.rand(M, K, generator=g)
    kwargs = dict(quant_type=aiter.QuantType.per_1x32, w1_scale=w1_scale, w2_scale=w2_scale,
                  activation=getattr(aiter.ActivationType, case["activation"]))
    if case["gate_mode"] != "separated":
        kwargs["gate_mode"] = case["gate_mode"]
    if case["ep"]:
        mask = torch.zeros(global_E, dtype=torch.int32)
        mask[torch.randperm(global_E - 1, generator=g)[:E]] = 1
        kwargs["expert_mask"] = mask
    if case["num_local_tokens"] is not None:
        kwargs["num_local_tokens"] = torch.tensor([case["num_local_tokens"]], dtype=torch.int32)
    if case["a1_scale"]:
        kwargs["a1_scale"] = torch.ones(M, D // 32, dtype=torch.float32)
    addend = (torch.randn(M, D, generator=g)).to(torch.bfloat16) if case["addend"] else None
    return (hidden, w1, w2, topk_weights, topk_ids), kwargs, addend


class _DecliningExtension:
    """Created lazily (needs aiter_patches): an active SortExtension that declines and counts sorts seen."""


def _extension():
    import aiter_patches

    class Watching(aiter_patches.SortExtension):
        def __init__(self):
            self.sorts = 0

        def sort(self, call):
            self.sorts += 1
            return None

    return Watching()


def _unpatched_with_addend_in_moe_buf(aiter, args, kwargs, addend):
    """The fold's bitwise reference (README, ``moe_addend_fold``): AITER's own call with ``moe_buf``
    starting from the addend instead of zeros (copied right after AITER's sort)."""
    fm = aiter.fused_moe
    sort = fm._moe_sorting_impl

    def sort_then_addend(*a, **k):
        out = sort(*a, **k)
        if out[4].numel():
            out[4].copy_(addend)
        return out

    fm._moe_sorting_impl = sort_then_addend
    try:
        return fm.fused_moe(*args, **kwargs)
    finally:
        fm._moe_sorting_impl = sort


def _run_one(aiter, case, gfx, patched):
    import torch

    import aiter_patches

    import time

    args, kwargs, addend = _build(aiter, case, gfx)
    chain.CALLS.clear()
    t0 = time.perf_counter()
    out = {"calls": None, "exc": None, "tensor": None}
    try:
        if case["addend"] and patched:
            res = aiter.fused_moe.fused_moe(*args, moe_addend=addend, **kwargs)
        elif case["extension"] and patched:
            ext = _extension()
            with aiter_patches.sort_extension(ext):
                res = aiter.fused_moe.fused_moe(*args, **kwargs)
            out["extension_sorts"] = ext.sorts
        elif case["addend"]:
            res = _unpatched_with_addend_in_moe_buf(aiter, args, kwargs, addend)
        else:
            res = aiter.fused_moe.fused_moe(*args, **kwargs)
        rows = case["num_local_tokens"] if case["num_local_tokens"] is not None else res.shape[0]
        out["tensor"] = res[:rows].contiguous().view(torch.uint8).clone()
    except Exception as exc:  # noqa: BLE001 - the exception type is part of the result
        out["exc"] = f"{type(exc).__name__}: {exc}"[:400]
        out["traceback"] = traceback.format_exc()[-3000:]
    out["calls"] = list(chain.CALLS)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"{case['name']} patched={patched} {out['seconds']}s", file=sys.stderr, flush=True)
    return out


def _predicted(aiter, case, gfx):
    import inspect

    from aiter_patches.patches import moe_sort_mx_quant

    args, kwargs, _ = _build(aiter, case, gfx)
    bound = inspect.signature(aiter.fused_moe.fused_moe).bind(*args, **kwargs)
    bound.apply_defaults()
    q = moe_sort_mx_quant.predict_stage1_quant(dict(bound.arguments))
    return None if q is None else str(q)


COMBINATION_GFX = "gfx950"
COMBINATION_CASE = "mxfp4-addend"
MOE_FEATURES = ("moe_addend_fold", "sort_extension", "moe_sort_mx_quant")


def combinations(aiter, gfx):
    """Every subset of the three MoE features on one case: the addend, made by an extension's after-sort work.

    Per subset: which of the references the output equals bit for bit (AITER's output plus the
    addend or plus zeros, AITER's output with ``moe_buf`` started from the addend), the
    counters, and when the extension's work ran. The test says which reference each subset
    must give (tests/real_aiter/test_combinations.py).
    """
    import itertools

    import torch

    import aiter_patches
    from aiter_patches import registry
    from aiter_patches.extensions import DeferredWork

    case = next(c for c in case_table.cases() if c["name"] == COMBINATION_CASE)
    registry.revert()
    args, kwargs, real = _build(aiter, case, gfx)
    plain = aiter.fused_moe.fused_moe(*args, **kwargs)
    refs = {"aiter+addend": plain.clone().add_(real), "aiter+zeros": plain.clone().add_(torch.zeros_like(real)),
            "aiter": plain, "fold": _unpatched_with_addend_in_moe_buf(aiter, args, kwargs, real)}
    out = {"_refs": {"fold == aiter+addend": bool(torch.equal(refs["fold"].view(torch.uint8),
                                                              refs["aiter+addend"].view(torch.uint8)))}}
    for r in range(len(MOE_FEATURES) + 1):
        for subset in itertools.combinations(MOE_FEATURES, r):
            registry.revert()
            aiter_patches.apply(list(subset))
            registry.reset_stats()
            addend = torch.zeros_like(real)
            ext = DeferredWork(lambda: addend.copy_(real))
            chain.CALLS.clear()
            with aiter_patches.sort_extension(ext):
                got = aiter_patches.fused_moe_with_addend(addend, *args, **kwargs)
            out["+".join(subset)] = {
                "equals": sorted(n for n, ref in refs.items() if torch.equal(got.view(torch.uint8), ref.view(torch.uint8))),
                "stats": {n: registry.stats()[n] for n in MOE_FEATURES},
                "ran": [ext.ran_after_sort, ext.ran_at_exit],
                "calls": list(chain.CALLS),
            }
    registry.revert()
    return out


def run(aiter, selected, gfx):
    import torch

    import aiter_patches
    from aiter_patches import registry

    table = [c for c in case_table.cases() if gfx in c["gfx"] and (not selected or c["name"] in selected)
             and not (c["tuned"] and getattr(aiter, "IS_AITER_PATCHES_STAND_IN", False))]  # no tuned CSVs there
    unpatched = {c["name"]: _run_one(aiter, c, gfx, patched=False) for c in table}
    applied = aiter_patches.apply()
    report = {"apply": {n: r["state"] for n, r in applied.items()},
              "targets": {p["name"]: sorted({t["location"].rsplit(".", 1)[0] for t in p["targets"]})
                          for p in registry.status()["patches"]},
              "cases": {}}
    for c in table:
        registry.reset_stats()
        predicted = _predicted(aiter, c, gfx)
        registry.reset_stats()
        p = _run_one(aiter, c, gfx, patched=True)
        u = unpatched[c["name"]]
        equal = None
        if u["tensor"] is not None and p["tensor"] is not None:
            equal = bool(torch.equal(u["tensor"], p["tensor"]))
        report["cases"][c["name"]] = {
            "equal": equal,
            "unpatched_exc": u["exc"], "patched_exc": p["exc"],
            "unpatched_tb": u.get("traceback"), "patched_tb": p.get("traceback"),
            "unpatched_calls": u["calls"], "patched_calls": p["calls"],
            "stats": registry.stats(),
            "predicted": predicted,
            "extension_sorts": p.get("extension_sorts"),
            "seconds": [u["seconds"], p["seconds"]],
        }
    if gfx == COMBINATION_GFX and not selected:
        report["combinations"] = combinations(aiter, gfx)
    report["tripped"] = list(chain.TRIPPED)
    report["aiter_file"] = str(Path(aiter.__file__).resolve())
    return report


def main(argv):
    os.environ.setdefault("AITER_LOG_LEVEL", "WARNING")
    backend = argv[0]
    if backend == "real":
        tree, gfx, cu, home = Path(argv[1]), argv[2], int(argv[3]), Path(argv[4])
        selected = argv[5:]
        aiter = chain.import_real_aiter(tree, gfx, cu, home)
        chain.install_leaves(aiter)
    else:
        gfx = argv[1]
        selected = argv[2:]
        os.environ["AITER_STUB_GFX"] = gfx
        from aiter_patches_standin import use as use_stub_aiter

        scope = use_stub_aiter()  # held for the life of this process
        scope.__enter__()
        import aiter
        import aiter.fused_moe  # noqa: F401

        chain.install_stand_in_recorders(aiter)
    report = run(aiter, selected, gfx)
    report["tree"] = str(Path(argv[1]).resolve()) if backend == "real" else str(Path(aiter.__file__).resolve().parent)
    print("RESULT " + json.dumps(report), flush=True)
    os._exit(0)  # nothing to tear down in a throw-away process


if __name__ == "__main__":
    main(sys.argv[1:])
