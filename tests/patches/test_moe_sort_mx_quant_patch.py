"""The sort + MX quant patch on the stand-in AITER: same bits as AITER's multi-launch path, or AITER itself."""

import logging

import pytest
import torch

import aiter_patches
from aiter_patches import registry
from aiter_patches.patches.moe import call as moe_call
from aiter_patches.reference.moe_sorting import defined_sort_region
from aiter_patches.reference.mx_quant import mx_quant_moe_sort_reference, stage1_uses_fused_quant
from aiter_patches.verify import suspended
from helpers import registry_view

from .conftest import routing, sort_bypassing_patches

NAME = "moe_sort_mx_quant"


def stats():
    return aiter_patches.stats()[NAME]


def moe_inputs(aiter, device, M, E, topk, dim, inter, quant, seed=0, skew=None):
    g = torch.Generator().manual_seed(seed + 100)
    ids, w = routing(M, E, topk, device, seed, skew)
    x = torch.randn(M, dim, generator=g).to(torch.bfloat16).to(device)
    args = dict(hidden_states=x, topk_weight=w, topk_ids=ids)
    if quant == "bf16":
        args["w1"] = (torch.randn(E, 2 * inter, dim, generator=g) / dim**0.5).to(torch.bfloat16).to(device)
        args["w2"] = (torch.randn(E, dim, inter, generator=g) / inter**0.5).to(torch.bfloat16).to(device)
        return args
    if quant == "fp4":
        w1 = torch.randint(0, 256, (E, 2 * inter, dim // 2), generator=g, dtype=torch.uint8).view(aiter.dtypes.fp4x2)
        w2 = torch.randint(0, 256, (E, dim, inter // 2), generator=g, dtype=torch.uint8).view(aiter.dtypes.fp4x2)
    else:
        w1 = (torch.randn(E, 2 * inter, dim, generator=g)).to(aiter.dtypes.fp8)
        w2 = (torch.randn(E, dim, inter, generator=g)).to(aiter.dtypes.fp8)
    s1 = torch.randint(118, 122, (E, 2 * inter, dim // 32), generator=g, dtype=torch.uint8)
    s2 = torch.randint(118, 122, (E, dim, inter // 32), generator=g, dtype=torch.uint8)
    args.update(w1=w1.to(device), w2=w2.to(device), quant_type=aiter.QuantType.per_1x32,
                w1_scale=s1.view(aiter.dtypes.fp8_e8m0).to(device), w2_scale=s2.view(aiter.dtypes.fp8_e8m0).to(device))
    return args


def assert_same_sort_and_zeroed_buf(s0, s1, block):
    """Sort outputs equal over the region AITER defines; moe_buf all zeros."""
    assert torch.equal(s0[3], s1[3])
    n_ids, n_blocks = defined_sort_region(s0[3].cpu(), block)
    assert torch.equal(s0[0][:n_ids], s1[0][:n_ids])
    assert torch.equal(s0[1][:n_ids].view(torch.int32), s1[1][:n_ids].view(torch.int32))
    assert torch.equal(s0[2][:n_blocks], s1[2][:n_blocks])
    assert torch.equal(s1[4], torch.zeros_like(s1[4]))


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(
    "M, E, topk, quant, skew",
    [
        (1, 8, 2, "fp4", None),
        (5, 16, 4, "fp4", "hot"),
        (13, 8, 4, "fp8", "one"),
        (7, 33, 11, "fp4", None),
        (4, 16, 3, "bf16", None),
    ],
)
def test_fused_moe_patched_equals_unpatched(stub, device, M, E, topk, quant, skew):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, M, E, topk, 256, 128, quant, skew=skew)
    expected = fm.fused_moe(**args)
    report = aiter_patches.apply([NAME])
    assert report.applied == [NAME]
    got = fm.fused_moe(**args)
    assert same_bits(got, expected)
    hits = 1 if quant == "bf16" else 2  # the sort, and the stage-1 quant handed back
    assert stats()["fast"] == hits, stats()


class _Watching(aiter_patches.SortExtension):
    """Declines every sort and watches it: the chain after it decides."""

    def after_sort(self, call, outputs):
        pass


def _outcome(fn):
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - compared between patched and unpatched
        return type(exc), str(exc)
    return out.shape, out.dtype


@pytest.mark.parametrize("mode", ["plain", "addend", "extension"])
@pytest.mark.parametrize("quant", ["fp4", "fp8", "bf16"])
def test_zero_tokens_have_the_originals_outcome(stub, device, quant, mode):
    """Issue 14.10: with 0 tokens AITER's MX quant launcher fails (it divides by token_num); the
    patch handed back an empty quant and failed later with another exception type."""
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 0, 8, 2, 256, 128, quant)

    def call():
        if mode == "addend":
            addend = torch.zeros(0, 256, dtype=torch.bfloat16, device=device)
            return aiter_patches.fused_moe_with_addend(addend, **args)
        if mode == "extension":
            with aiter_patches.sort_extension(_Watching()):
                return fm.fused_moe(**args)
        return fm.fused_moe(**args)

    expected = _outcome(call)
    aiter_patches.apply()
    assert _outcome(call) == expected
    if quant != "bf16":
        assert stats()["fallback"] == {"stage-1 quant not fused: 0 tokens (AITER's quant decides the outcome)": 1}


@pytest.mark.parametrize("special", ["nan", "inf"])
@pytest.mark.parametrize("quant,fp8", [("fp8", torch.float8_e4m3fn), ("fp8", torch.float8_e4m3fnuz),
                                       ("fp4", None)], ids=["mxfp8-gfx950", "mxfp8-gfx942", "mxfp4"])
def test_non_finite_activation_rows_equal_unpatched(stub, device, monkeypatch, quant, fp8, special):
    """Issue 14.3: a NaN element was 0x7E in the stand-in, 0x7F in the kernel; the whole output
    row differed and stayed finite, so nothing flagged it. Both now write AITER's -max_pos."""
    import aiter.fused_moe as fm

    if fp8 is not None:
        monkeypatch.setattr(stub.dtypes, "fp8", fp8)  # the chip the stand-in emulates
    args = moe_inputs(stub, device, 4, 8, 2, 256, 128, quant, seed=8)
    x = args["hidden_states"].clone()
    value = float(special)
    x[1, 5], x[2, 40] = value, -value  # a NaN (or +-Inf: a group with scale 0xFF) among finite values
    args["hidden_states"] = x
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    got = fm.fused_moe(**args)
    assert stats()["fast"] == 2, stats()
    assert same_bits(got, expected)
    if special == "nan":
        assert torch.isfinite(expected.float()).all()  # a wrong NaN byte would not show as NaN


def test_num_local_tokens_and_zero_weights(stub, device):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 9, 16, 4, 256, 128, "fp4", seed=4)
    args["topk_weight"][2] = 0.0  # a token with all weights zero
    args["topk_weight"][3, 1] = 0.0  # and a mixed one
    args["num_local_tokens"] = torch.tensor([6], dtype=torch.int32, device=device)
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    got = fm.fused_moe(**args)
    assert same_bits(got[:6], expected[:6])  # rows past num_local_tokens are never written by AITER
    assert stats()["fast"] == 2


@pytest.mark.parametrize("nlt", [-3, 0, 9, 100])
def test_num_local_tokens_outside_the_batch_as_aiter(stub, device, nlt):
    """Issue 14.9: AITER's kernel writes ``num_local_tokens[0]`` as given into ``num_valid_ids[1]``
    and the padding ids (moe_sorting_opus.h); the patched sort clamped it to [0, M]."""
    import aiter.fused_moe as fm

    M, E, topk, dim, block = 9, 16, 4, 256, 32
    args = moe_inputs(stub, device, M, E, topk, dim, 128, "fp4", seed=6)
    args["num_local_tokens"] = torch.tensor([nlt], dtype=torch.int32, device=device)
    ids, w = args["topk_ids"], args["topk_weight"]

    def sort():
        return fm.moe_sorting(ids, w, E, dim, torch.bfloat16, block,
                              num_local_tokens=args["num_local_tokens"])

    s0 = sort()
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    s1 = sort()
    got = fm.fused_moe(**args)
    assert s1[3].tolist() == s0[3].tolist() and int(s0[3][1]) == nlt
    rows = min(max(nlt, 0), M)
    n_ids, n_blocks = defined_sort_region(s0[3].cpu(), block)
    assert torch.equal(s0[0][:n_ids], s1[0][:n_ids])
    assert torch.equal(s0[1][:n_ids].view(torch.int32), s1[1][:n_ids].view(torch.int32))
    assert torch.equal(s0[2][:n_blocks], s1[2][:n_blocks])
    assert torch.equal(s1[4][:rows], torch.zeros_like(s1[4][:rows]))
    assert same_bits(got[:rows], expected[:rows])  # rows past num_local_tokens are never written by AITER
    assert stats()["fast"] >= 2 and stats()["fallback"] == {}


def test_sort_outputs_and_quant_bytes_match_over_the_defined_region(stub, device):
    """The sort call and the stage-1 quant call, compared field by field with the reference's masks."""
    import aiter.fused_moe as fm

    M, E, topk, dim, block = 6, 16, 4, 512, 32
    ids, w = routing(M, E, topk, device, seed=2)
    x = (torch.randn(M, dim, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16).to(device)
    x[1, :32] = float("nan")  # an all-NaN group: the floor scale (fmaxf skips NaN), fp4 codes +-6 by the NaN sign
    x[2, 32:64] = 1e-40  # denormals

    def run():
        call = moe_call.MoeCall(hidden_states=x, quant_dtype=stub.dtypes.fp4x2)
        with moe_call.scope(call):
            s = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, block)
            q = fm.fused_dynamic_mxfp4_quant_moe_sort(x, sorted_ids=s[0], num_valid_ids=s[3], token_num=M, topk=topk,
                                                      block_size=block, sorted_weights=s[1])
        return s, q

    with suspended():
        s0, q0 = run()
    aiter_patches.apply([NAME])
    s1, q1 = run()
    assert stats()["fast"] == 2
    assert_same_sort_and_zeroed_buf(s0, s1, block)
    ref = mx_quant_moe_sort_reference(x.cpu(), s0[0].cpu(), s0[3].cpu(), s0[1].cpu(), M, stub.dtypes.fp4x2,
                                      fused=stage1_uses_fused_quant(M, topk))
    rows, sd = ref.data_defined, ref.scale_defined
    assert rows.any() and sd.any()
    for q in (q0, q1):
        assert torch.equal(q[0].cpu().view(torch.uint8)[rows], ref.data.view(torch.uint8)[rows])
        assert torch.equal(q[1].cpu().view(torch.uint8)[sd], ref.scale.view(torch.uint8)[sd])


def test_inter_stage_quant_is_not_taken(stub, device):
    """The stage-2 call of the same helper (rows token*topk+slot) must go to AITER."""
    import aiter.fused_moe as fm
    import aiter.ops.quant as quant

    calls = []
    original = quant.fused_dynamic_mx_quant_moe_sort  # what the mxfp4 helper calls inside

    def counting(*a, **k):
        calls.append(k["input"].shape[0])
        return original(*a, **k)

    quant.fused_dynamic_mx_quant_moe_sort = counting
    args = moe_inputs(stub, device, 5, 8, 2, 256, 128, "fp4")
    aiter_patches.apply([NAME])
    fm.fused_moe(**args)
    assert calls == [5 * 2], "only the inter-stage quant (token*topk rows) reached AITER"


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda a: a.update(topk_ids=a["topk_ids"].to(torch.int64)), "topk_ids not contiguous int32"),
        (lambda a: a.update(topk_ids=a["topk_ids"].t().contiguous().t()), "topk_ids not contiguous int32"),
    ],
)
def test_bad_routing_layouts_fall_back_with_a_counted_reason(stub, device, caplog, mutate, reason):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 5, 8, 2, 256, 128, "bf16")
    mutate(args)
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        got = fm.fused_moe(**args)
        fm.fused_moe(**args)
    assert same_bits(got, expected)
    assert stats()["fast"] == 0
    assert any(reason in r and n == 2 for r, n in stats()["fallback"].items()), stats()
    assert sum(reason in r.getMessage() for r in caplog.records) == 1, "a fallback reason is logged once"


def test_ck_sort_and_unknown_keywords_go_to_aiter(stub, device, monkeypatch):
    import aiter.fused_moe as fm

    ids, w = routing(4, 8, 2, device)
    aiter_patches.apply([NAME])
    monkeypatch.setattr(fm, "_USE_CK_MOE_SORTING", True)
    fm.moe_sorting(ids, w, 8, 128, torch.bfloat16, 32)
    assert any("use_opus=False" in r for r in stats()["fallback"])
    with pytest.raises(TypeError, match="surprise"):
        fm._moe_sorting_impl(ids, w, 8, 128, torch.bfloat16, 32, None, None, 0, True, surprise=1)
    assert any("unknown keyword 'surprise'" in r for r in stats()["fallback"])


@pytest.mark.parametrize("drop", ["num_experts", "topk_ids"])
def test_a_sort_short_of_an_argument_gets_aiters_type_error(stub, device, drop):
    """AITER's own TypeError, not a KeyError from the gate reading the bound arguments."""
    import aiter.fused_moe as fm

    ids, w = routing(4, 8, 2, device)
    full = dict(topk_ids=ids, topk_weights=w, num_experts=8, model_dim=128, moebuf_dtype=torch.bfloat16,
                block_size=32, expert_mask=None, num_local_tokens=None, dispatch_policy=0, use_opus=True)
    del full[drop]
    with pytest.raises(TypeError, match=drop) as original:
        fm._moe_sorting_impl(**full)
    aiter_patches.apply([NAME])
    for _ in range(2):  # decided, then kept
        with pytest.raises(TypeError, match=drop) as patched:
            fm._moe_sorting_impl(**full)
        assert str(patched.value) == str(original.value)
    assert stats()["fallback"] == {f"required argument not given: {drop}": 2} and stats()["fast"] == 0


def _sort_call(device, M=4, E=8, topk=2, model_dim=128, block=32, **kw):
    if topk <= E:
        ids, w = routing(M, E, topk, device)
    else:  # more slots than experts: repeats
        ids = torch.randint(0, E, (M, topk), generator=torch.Generator().manual_seed(1)).int().to(device)
        w = torch.rand(M, topk, generator=torch.Generator().manual_seed(2)).to(device)
    return (ids, w, E, model_dim, torch.bfloat16, block), kw


@pytest.mark.parametrize(
    "case, reason, values",
    [
        (dict(return_local_topk_ids=True), "return_local_topk_ids", None),
        (dict(E=2600, topk=2), "num_experts outside 1..2048", "num_experts=2600"),
        (dict(E=4, topk=8), "num_experts < topk", "num_experts=4, topk=8"),
        (dict(block=8), "block_size not in 16/32/64/128", "block_size=8"),
        (dict(E=128, topk=72), "topk outside 1..64", "topk=72"),
    ],
)
def test_unsupported_sort_arguments_fall_back_with_a_counted_reason(stub, device, caplog, monkeypatch, case, reason,
                                                                     values):
    """The reason names the limit; the call's values are in its DEBUG line (issue 35: reasons are categories)."""
    import aiter.fused_moe as fm

    from aiter_patches import reasons

    monkeypatch.setattr(reasons, "_logged", set())

    args, kw = _sort_call(device, **case)
    with suspended():
        expected = fm.moe_sorting(*args, **kw)
    aiter_patches.apply([NAME])
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        got = fm.moe_sorting(*args, **kw)
    assert stats()["fast"] == 0
    assert any(reason in r for r in stats()["fallback"]), stats()
    assert any(reason in r.getMessage() for r in caplog.records)
    if values is not None:
        assert all(values not in r for r in stats()["fallback"]), stats()
        assert any(reason in r.getMessage() and f"first call: {values}" in r.getMessage() for r in caplog.records)
    assert torch.equal(got[3], expected[3])  # AITER's own sort ran: the same valid count
    n = int(expected[3][0])
    assert torch.equal(got[0][:n], expected[0][:n])


def test_output_aux_goes_to_aiter(stub, device):
    import aiter.fused_moe as fm

    args, _ = _sort_call(device)
    aiter_patches.apply([NAME])
    got = fm.moe_sorting(*args, output_aux=True)  # AITER's adaptive sort: the five outputs + m_indices, reverse_sorted
    assert len(got) == 7
    assert any("output_aux" in r for r in stats()["fallback"]), stats()


def test_activations_the_kernel_cannot_quantize_leave_the_quant_to_aiter(stub, device):
    """Strided activations: the sort stays fast; the stage-1 quant is AITER's, with the reason counted."""
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 5, 8, 2, 256, 128, "fp4")
    args["hidden_states"] = torch.cat([args["hidden_states"]] * 2, 1)[:, ::2]
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    got = fm.fused_moe(**args)
    assert same_bits(got, expected)
    assert stats()["fast"] >= 1
    assert any("stage-1 quant not fused: quant_input not contiguous" in r for r in stats()["fallback"]), stats()


def test_a_sort_that_bypasses_moe_sorting_impl_is_counted(stub, device, monkeypatch):
    """FlyDSL and flat sorts never reach _moe_sorting_impl: fused_moe's result is AITER's and the miss is counted."""
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 5, 8, 2, 256, 128, "fp4")
    expected = fm.fused_moe(**args)
    unpatched_impl = fm._moe_sorting_impl
    aiter_patches.apply([NAME])
    monkeypatch.setattr(fm, "moe_sorting", sort_bypassing_patches(fm, unpatched_impl))
    got = fm.fused_moe(**args)
    assert same_bits(got, expected)
    assert stats()["fast"] == 0
    assert any("did not run through _moe_sorting_impl" in r for r in stats()["fallback"]), stats()


def test_bad_expert_ids_never_write_out_of_bounds(stub, device):
    """Negative and too-large ids are dropped (documented) by both the stand-in and the kernel."""
    import aiter.fused_moe as fm

    ids, w = routing(6, 8, 3, device)
    ids[0, 0], ids[3, 2] = -1, 8
    with suspended():
        s0 = fm.moe_sorting(ids, w, 8, 64, torch.bfloat16, 16)
    aiter_patches.apply([NAME])
    s1 = fm.moe_sorting(ids, w, 8, 64, torch.bfloat16, 16)
    assert stats()["fast"] == 1
    assert torch.equal(s0[3], s1[3])
    n = int(s0[3][0])
    assert torch.equal(s0[0][:n], s1[0][:n])
    tokens = s1[0][:n] & 0xFFFFFF
    assert int(tokens.max()) <= 6


def test_later_aiter_with_output_keyword(stub, device):
    """A later AITER adds output=None to _moe_sorting_impl: the 'output' pin matches; the sort zeroes it."""
    import aiter.fused_moe as fm

    original = fm._moe_sorting_impl

    def _moe_sorting_impl(topk_ids, topk_weights, num_experts, model_dim, moebuf_dtype, block_size, expert_mask,
                          num_local_tokens, dispatch_policy, use_opus, return_local_topk_ids=False, accumulate=True,
                          output_aux=False, output=None):
        out = original(topk_ids, topk_weights, num_experts, model_dim, moebuf_dtype, block_size, expert_mask,
                       num_local_tokens, dispatch_policy, use_opus, return_local_topk_ids, accumulate, output_aux)
        if output is not None:
            output.zero_()
            out = (*out[:4], output)
        return out

    fm._moe_sorting_impl = _moe_sorting_impl
    report = aiter_patches.apply([NAME])
    assert report[NAME]["targets"][1]["pin"] == "output"
    ids, w = routing(5, 8, 2, device)
    buf = torch.full((5, 64), 7.0, dtype=torch.bfloat16, device=device)
    out = fm._moe_sorting_impl(ids, w, 8, 64, torch.bfloat16, 16, None, None, 0, True, output=buf)
    assert out[4] is buf and torch.equal(buf, torch.zeros_like(buf))
    assert stats()["fast"] == 1


def test_drifted_sort_skips_every_patch_on_it(stub, caplog):
    import aiter.fused_moe as fm

    def _moe_sorting_impl(topk_ids, topk_weights, num_experts, model_dim, moebuf_dtype, block_size, expert_mask,
                          num_local_tokens, dispatch_policy, use_opus, accumulate=True, output_aux=False):
        raise AssertionError("never called")

    fm._moe_sorting_impl = _moe_sorting_impl
    before = fm.fused_moe
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        report = aiter_patches.apply()
    assert report.skipped == ["moe_addend_fold", "sort_extension", "moe_sort_mx_quant"]
    assert report.applied == [n for n in registry_view.stand_in_names() if "aiter.fused_moe" not in registry_view.modules(n)]
    assert fm.fused_moe is before, "all or nothing: fused_moe untouched too"
    assert all("missing parameter 'return_local_topk_ids'" in report[n]["reason"] for n in report.skipped)
    assert sum("skipped patch" in r.getMessage() for r in caplog.records) == 3


def test_wrong_quant_prediction_costs_nothing_but_time(stub, device, monkeypatch):
    """A predicted quant that stage 1 never asks for is dropped; results stay AITER's."""
    import aiter.fused_moe as fm
    from aiter_patches.patches import moe_sort_mx_quant as patch

    monkeypatch.setattr(patch, "predict_stage1_quant", lambda bound: stub.dtypes.fp4x2)
    args = moe_inputs(stub, device, 5, 8, 2, 256, 128, "bf16")
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    assert same_bits(fm.fused_moe(**args), expected)


def test_kernel_failure_falls_back_and_strict_reraises(stub, device, monkeypatch, caplog):
    import aiter.fused_moe as fm
    from aiter_patches.kernels import moe_sort_mx_quant as kernel

    def broken(*a, **k):
        raise RuntimeError("simulated Triton compile failure")

    monkeypatch.setattr(kernel, "moe_sort_mx_quant", broken)
    args = moe_inputs(stub, device, 3, 8, 2, 256, 128, "fp4")
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        got = fm.fused_moe(**args)
    assert same_bits(got, expected)
    assert list(stats()["errors"].values()) == [1]
    assert any("simulated Triton compile failure" in r.getMessage() for r in caplog.records)
    registry.revert()
    aiter_patches.apply([NAME], strict=True)
    with pytest.raises(RuntimeError, match="simulated"):
        fm.fused_moe(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp4", "fp8", "bf16"])
def test_cuda_graph_capture_replays_eager_result(stub, quant):
    import aiter.fused_moe as fm

    dev = torch.device("cuda")
    args = moe_inputs(stub, dev, 16, 64, 8, 1024, 256, quant)
    aiter_patches.apply([NAME])
    fm.fused_moe(**args)  # compile outside capture
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fm.fused_moe(**static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(**static)
    for seed in (1, 2):
        new = moe_inputs(stub, dev, 16, 64, 8, 1024, 256, quant, seed=seed)
        for k in ("hidden_states", "topk_weight", "topk_ids"):
            static[k].copy_(new[k])
        graph.replay()
        torch.cuda.synchronize()
        with suspended():
            eager = fm.fused_moe(**{**args, **{k: new[k] for k in ("hidden_states", "topk_weight", "topk_ids")}})
        assert same_bits(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 7, 64, 257, 1024, 2048, 8192])
@pytest.mark.parametrize("E, topk, dim", [(256, 8, 7168), (128, 4, 6144), (896, 16, 3584), (513, 11, 2048)])
def test_full_size_sort_and_quant_bitwise(stub, M, E, topk, dim):
    """Full-size shapes on the GPU: the one-launch (or prefill) path against the stand-in's multi-launch path."""
    import aiter.fused_moe as fm

    dev = torch.device("cuda")
    ids, w = routing(M, E, topk, dev, seed=M)
    x = torch.randn(M, dim, device=dev).to(torch.bfloat16)
    block = 32 if M < 1024 else 64
    for qd in (stub.dtypes.fp4x2, stub.dtypes.fp8):
        def run():
            call = moe_call.MoeCall(hidden_states=x, quant_dtype=qd)
            helper = fm.fused_dynamic_mxfp4_quant_moe_sort if qd == stub.dtypes.fp4x2 \
                else fm.fused_dynamic_mxfp8_quant_moe_sort
            with moe_call.scope(call):
                s = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, block)
                q = helper(x, sorted_ids=s[0], num_valid_ids=s[3], token_num=M, topk=topk, block_size=block,
                           sorted_weights=s[1])
            return s, q

        with suspended():
            s0, q0 = run()
        registry.revert()
        aiter_patches.apply([NAME])
        before = stats()["fast"]
        s1, q1 = run()
        assert stats()["fast"] == before + 2, stats()
        assert_same_sort_and_zeroed_buf(s0, s1, block)
        ref = mx_quant_moe_sort_reference(x.cpu(), s0[0].cpu(), s0[3].cpu(), s0[1].cpu(), M, qd,
                                          fused=stage1_uses_fused_quant(M, topk))
        rows, sd = ref.data_defined.to(dev), ref.scale_defined.to(dev)
        assert torch.equal(q0[0].view(torch.uint8)[rows], q1[0].view(torch.uint8)[rows])
        assert torch.equal(q0[1].view(torch.uint8)[sd], q1[1].view(torch.uint8)[sd])


@pytest.mark.parametrize("change", ["other values", "other buffers"])
def test_quant_is_handed_back_only_for_the_call_it_was_made_for(stub, device, change):
    import aiter.fused_moe as fm

    M, E, topk, dim, block = 4, 8, 2, 256, 32
    ids, w = routing(M, E, topk, device)
    x = torch.randn(M, dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    other = (x * 3).contiguous()
    aiter_patches.apply([NAME])
    call = moe_call.MoeCall(hidden_states=x, quant_dtype=stub.dtypes.fp4x2)
    with moe_call.scope(call):
        s = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, block)
        inp, sw = (other, s[1]) if change == "other values" else (x, s[1].clone())
        got = fm.fused_dynamic_mxfp4_quant_moe_sort(inp, sorted_ids=s[0], num_valid_ids=s[3], token_num=M,
                                                    topk=topk, block_size=block, sorted_weights=sw)
    with suspended():
        want = fm.fused_dynamic_mxfp4_quant_moe_sort(inp, sorted_ids=s[0], num_valid_ids=s[3], token_num=M,
                                                     topk=topk, block_size=block, sorted_weights=sw)
    assert stats()["fast"] == 1, "the sort ran fast; the quant was not handed back"
    assert any("stage-1 quant not taken from the sort" in r for r in stats()["fallback"])
    n = int(s[3][0])
    rows = (s[0][:n] & 0xFFFFFF).unique()
    rows = rows[rows < M].long()
    assert torch.equal(got[0].view(torch.uint8)[rows], want[0].view(torch.uint8)[rows])


def test_a_quant_helper_call_short_of_an_argument_gets_aiters_type_error(stub, device):
    """The hand-back is only for a call AITER would serve: without ``topk`` AITER raises its TypeError,
    and the patched helper lets it (it used to hand the sort's quant back to that call)."""
    import aiter.fused_moe as fm

    M, E, topk, dim, block = 4, 8, 2, 256, 32
    ids, w = routing(M, E, topk, device)
    x = torch.randn(M, dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    aiter_patches.apply([NAME])
    call = moe_call.MoeCall(hidden_states=x, quant_dtype=stub.dtypes.fp4x2)
    with moe_call.scope(call):
        s = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, block)
        assert call.stage1_quant is not None and stats()["fast"] == 1
        with pytest.raises(TypeError, match="topk"):
            fm.fused_dynamic_mxfp4_quant_moe_sort(x, sorted_ids=s[0], num_valid_ids=s[3], token_num=M,
                                                  block_size=block, sorted_weights=s[1])
    assert not call.stage1_quant.consumed and stats()["fast"] == 1
    assert any(r.startswith("stage-1 quant not taken from the sort: required argument not given: topk")
               for r in stats()["fallback"]), stats()["fallback"]
