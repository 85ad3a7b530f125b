"""What a case's report must show, shared by the real-chain, drift and prediction tests."""

from __future__ import annotations

SORT_LEAVES = ("moe_sorting_opus_fwd", "moe_sorting_fwd")
QUANT_LEAVES = ("fused_dynamic_mx_quant_moe_sort_hip", "per_1x32_mx_quant_hip", "mxfp4_moe_sort_hip")
ZERO_TOKENS = "0 tokens: the patched call must end as the unpatched one does (issue 14 item 10)"


def aiter_patch_names(report: dict) -> list[str]:
    """The patches whose targets live in AITER's modules (a take-over patch of a server's module is not one)."""
    return sorted(n for n, mods in report["targets"].items() if mods and all(m.split(".")[0] == "aiter" for m in mods))


def without_fast_path(calls: list[str], quant: bool) -> list[str]:
    """The unpatched leaf sequence with the sort removed and, when ``quant``, the stage-1 quant
    (the quant leaves between the sort and the first other op)."""
    out = list(calls)
    i = next(i for i, c in enumerate(out) if c in SORT_LEAVES)
    del out[i]
    if quant:
        while i < len(out) and out[i] in QUANT_LEAVES:
            del out[i]
    return out


def check_case(case: dict, report: dict) -> None:
    """Assert everything the case's prediction says about one backend's report."""
    res = report["cases"][case["name"]]
    for name in aiter_patch_names(report):
        assert report["apply"][name] == "applied", (name, report["apply"])
    assert not report["tripped"], f"compiled ops reached without a CPU stand-in: {report['tripped']}"
    if case["expect"] == "zero":
        if res["unpatched_exc"] or res["patched_exc"]:
            u = (res["unpatched_exc"] or "").split(":")[0]
            p = (res["patched_exc"] or "").split(":")[0]
            assert u == p, (f"unpatched raised {res['unpatched_exc']!r}, patched {res['patched_exc']!r}; "
                            f"{ZERO_TOKENS}")
        else:
            assert res["equal"], ZERO_TOKENS
        return
    assert res["unpatched_exc"] is None, res["unpatched_tb"]
    assert res["patched_exc"] is None, res["patched_tb"]
    assert res["equal"] is True, "patched output differs from unpatched"
    stats = res["stats"]["moe_sort_mx_quant"]
    assert not stats["errors"], stats
    unpatched, patched = res["unpatched_calls"], res["patched_calls"]
    if case["expect"] == "quant":
        assert res["predicted"] is not None, "the prediction gave no stage-1 quant"
        assert (case["quant"] == "mxfp8" or case["activation"] == "Swiglu" and case["gate_mode"] != "separated") \
            == ("float8" in res["predicted"]), res["predicted"]
        assert patched == without_fast_path(unpatched, quant=True), (unpatched, patched)
        assert stats["fast"] >= 2, stats  # the sort, and the hand-back of its quant
    elif case["expect"] == "sort":
        assert res["predicted"] is None
        assert patched == without_fast_path(unpatched, quant=False), (unpatched, patched)
        assert stats["fast"] >= 1, stats
    else:
        assert case["expect"] == "aiter"
        assert patched == unpatched
        assert stats["fast"] == 0, stats
        assert any(case["reason"] in r for r in stats["fallback"]), stats["fallback"]
    if case["addend"]:
        assert res["stats"]["moe_addend_fold"]["fast"] >= 1, res["stats"]["moe_addend_fold"]
    if case["extension"]:
        assert res["extension_sorts"] == 1
