"""The drift check on the only PyPI release, amd-aiter 0.1.7.post2.dev18 (the wheel).

The wheel (AITER 05a0d1f060, 2025-11-18) predates everything the patches are
written against, so the exact expected outcome is: every patch drifts or is
missing, for these reasons:

- ``fused_moe`` drifts: it ends at ``bias2``; ``splitk`` .. ``shared_expert_id``
  (10 parameters) came later.
- ``_moe_sorting_impl`` is missing: the wheel's ``moe_sorting`` calls the op directly.
- ``fused_dynamic_mxfp4/mxfp8_quant_moe_sort`` are missing: the wheel has no
  fused MX quant + sort helpers at all.
- ``gemm_a8w8_blockscale_bpreshuffle_asm`` is missing (the wheel has
  ``mi350_a8w8_blockscale_asm`` instead).
- Relied-on source: ``_fused_moe_impl``, ``stage2_uses_route_reduce`` and both
  GEMM functions are missing; ``moe_sorting`` and ``fused_moe_2stages`` changed.
"""

import json

from aiter_patches import cli, drift

FUSED_MOE_WHEEL = (
    "(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=ActivationType.Silu, "
    "quant_type=QuantType.No, doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None, "
    "block_size_M=None, num_local_tokens=None, moe_sorting_dispatch_policy=0, dtype=None, hidden_pad=0, "
    "intermediate_pad=0, bias1=None, bias2=None)"
)
LATER = ["splitk", "swiglu_limit", "beta", "linear_beta", "gate_mode", "shared_w1", "shared_w2",
         "shared_w1_scale", "shared_w2_scale", "shared_expert_id"]
FUSED_MOE_DIFF = [f"vs pin v0.1.20: missing parameter '{n}' (position {21 + i})" for i, n in enumerate(LATER)]

EXPECTED_TARGETS = {
    "aiter.fused_moe.fused_moe": ("drift", "; ".join(FUSED_MOE_DIFF)),
    "aiter.fused_moe._moe_sorting_impl": ("missing", "_moe_sorting_impl is not defined in aiter/fused_moe.py"),
    "aiter.fused_moe.fused_dynamic_mxfp4_quant_moe_sort":
        ("missing", "fused_dynamic_mxfp4_quant_moe_sort is not defined in aiter/fused_moe.py"),
    "aiter.fused_moe.fused_dynamic_mxfp8_quant_moe_sort":
        ("missing", "fused_dynamic_mxfp8_quant_moe_sort is not defined in aiter/fused_moe.py"),
    "aiter.ops.gemm_op_a8w8.gemm_a8w8_blockscale_bpreshuffle_asm":
        ("missing", "gemm_a8w8_blockscale_bpreshuffle_asm is not defined in aiter/ops/gemm_op_a8w8.py"),
    # the dispatcher predates its out= buffer (gemm_dispatch_out_zeroed)
    "aiter.ops.gemm_op_a8w8.gemm_a8w8_blockscale_bpreshuffle": ("drift", "vs pin e4048607a5: missing parameter 'out' (position 5)"),
}
EXPECTED_RELIED_ON = {
    "aiter.fused_moe._fused_moe_impl": "missing",
    "aiter.fused_moe.moe_sorting": "changed",
    "aiter.fused_moe.fused_moe_2stages": "changed",
    "aiter.fused_moe.stage2_uses_route_reduce": "missing",
    "aiter.ops.gemm_op_a8w8.gemm_a8w8_blockscale_bpreshuffle_asm": "missing",
    "aiter.ops.gemm_op_a8w8._gemm_a8w8_blockscale_bpreshuffle_asm": "missing",
    "aiter.ops.gemm_op_a8w8.gemm_a8w8_blockscale_bpreshuffle": "changed",
}


def test_wheel_drift_report_is_exactly_the_expected_one(aiter_wheel, capsys):
    code = cli.main(["drift", "--wheel", str(aiter_wheel), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 1 and rep["exit_code"] == 1
    assert rep["aiter"]["version"] == "0.1.7.post2.dev18"
    got = {}
    for t in rep["targets"]:
        got.setdefault(t["target"], set()).add((t["status"], t["reason"]))
    assert got == {k: {v} for k, v in EXPECTED_TARGETS.items()}
    fm = next(t for t in rep["targets"] if t["target"] == "aiter.fused_moe.fused_moe")
    assert fm["found"] == FUSED_MOE_WHEEL and fm["defined_at"] == "aiter/fused_moe.py:87"
    assert fm["differences"] == FUSED_MOE_DIFF
    relied = {f"{r['module']}.{r['qualname']}": r["status"] for r in rep["relied_on"]}
    assert relied == EXPECTED_RELIED_ON
    assert len(rep["warnings"]) == len(EXPECTED_RELIED_ON)


def test_wheel_file_and_unpacked_tree_agree(aiter_wheel, unpacked_wheel):
    a = drift.check(drift.open_source(wheel=aiter_wheel))
    b = drift.check(drift.open_source(unpacked_wheel))
    key = lambda r: [(t.patch, t.target, t.status, t.reason, t.found) for t in r.targets]  # noqa: E731
    assert key(a) == key(b)
    assert [x.found_sha256 for x in a.relied_on] == [x.found_sha256 for x in b.relied_on]


def test_wheel_table_output(aiter_wheel, capsys):
    code = cli.main(["drift", "--wheel", str(aiter_wheel)])
    out = capsys.readouterr().out
    assert code == 1
    assert "(version 0.1.7.post2.dev18)" in out
    assert f"found    {FUSED_MOE_WHEEL}" in out
    assert out.rstrip().endswith("DRIFT: some targets do not match")
