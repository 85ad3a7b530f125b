"""SGLang 0.5.23's own patch (its real file, from the wheel) stacked with ours on the stand-in AITER.

Both orders (ours first: `aiter-patches run`, the vLLM-style plugin; SGLang's first: `apply()` called
late), take-over on and off: the bits equal unpatched AITER's every time; with take-over on every MX
decode call reaches our kernel; with it off `status()` names SGLang's layer and the fallback says that
layer took the sort.
"""

import logging

import pytest
import torch

import aiter_patches
from aiter_patches import process_report, registry, stats_log
from aiter_patches.core import state as core_state
from aiter_patches.patches import sglang_takeover

from .conftest import MODULE, run_sglang_patch, sglang_importable

MX = "moe_sort_mx_quant"
TAKEOVER = "sglang_takeover"
TAKEN = f"the sort was taken by outer layer {MODULE} on aiter.fused_moe._moe_sorting_impl"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOKENS = (1, 3)  # decode batches: 2 and 6 routing pairs at topk 2


def exact_bf16(shape, g):
    """Activations whose MXFP8 quant is exact (3 mantissa bits, small exponents): the interpreter's fp8 cast
    cannot round them wrong, so SGLang's Triton quant is comparable bit for bit on CPU."""
    mant = 1 + torch.randint(0, 8, shape, generator=g) / 8
    exp = torch.randint(-3, 4, shape, generator=g).float()
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return (sign * mant * 2**exp).to(torch.bfloat16)


def inputs(aiter, M, quant, E=8, topk=2, dim=2048, inter=64, seed=0):
    """A SGLang-style call: every argument by keyword (moe_runner/aiter.py:316); hidden size a multiple of 2048."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :topk].to(torch.int32)
    w = torch.rand(M, topk, generator=g).softmax(dim=1)
    if quant == "fp4":
        w1 = torch.randint(0, 256, (E, 2 * inter, dim // 2), generator=g, dtype=torch.uint8).view(aiter.dtypes.fp4x2)
        w2 = torch.randint(0, 256, (E, dim, inter // 2), generator=g, dtype=torch.uint8).view(aiter.dtypes.fp4x2)
    else:
        w1 = torch.randn(E, 2 * inter, dim, generator=g).to(aiter.dtypes.fp8)
        w2 = torch.randn(E, dim, inter, generator=g).to(aiter.dtypes.fp8)
    s1 = torch.randint(118, 122, (E, 2 * inter, dim // 32), generator=g, dtype=torch.uint8)
    s2 = torch.randint(118, 122, (E, dim, inter // 32), generator=g, dtype=torch.uint8)
    args = dict(hidden_states=exact_bf16((M, dim), g), w1=w1, w2=w2, topk_weight=w, topk_ids=ids,
                w1_scale=s1.view(aiter.dtypes.fp8_e8m0), w2_scale=s2.view(aiter.dtypes.fp8_e8m0))
    args = {k: v.to(DEVICE) for k, v in args.items()}  # SGLang's Triton kernels: a GPU, or the interpreter on CPU
    return dict(args, quant_type=aiter.QuantType.per_1x32, expert_mask=None)


def fused_moe(args):
    from aiter.fused_moe import fused_moe as f  # looked up at call time, as SGLang's runner does

    return f(**args)


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def calls(aiter, quant):
    args = [inputs(aiter, M, quant, seed=M) for M in TOKENS]
    return args, [fused_moe(a) for a in args]  # unpatched AITER, before any layer


def layers(name):
    return [f["text"] for f in registry.status()["patches"][[p.name for p in registry.patches()].index(name)]
            ["foreign_layers"]]


def stats(name):
    return aiter_patches.stats()[name]


@pytest.fixture
def quiet_report(monkeypatch):
    monkeypatch.setattr(process_report, "_last_logged", None)


@pytest.mark.parametrize("quant", ["fp8", "fp4"])
def test_sglang_patch_alone_gives_aiters_bits(stub, sglang_root, quant):
    """The harness itself: SGLang's real patch installs over the stand-in and its sort runs there."""
    import aiter.fused_moe as fm

    args, expected = calls(stub, quant)
    with sglang_importable(sglang_root):
        run_sglang_patch()
        assert fm._moe_sorting_impl.__globals__["__name__"] == MODULE  # its wrapper, not AITER's function
        for a, want in zip(args, expected):
            assert same_bits(fused_moe(a), want)


def orders(default):
    """(takeover, quant) of both take-over settings and both quants; the default run takes ``default`` (one quant
    per setting), CI's second step (slow_ci) the other two: each call is SGLang's Triton code in the interpreter."""
    return [pytest.param(takeover, quant, id=f"{'takeover' if takeover else 'no-takeover'}-{quant}",
                         marks=() if (takeover, quant) in default else pytest.mark.slow_ci)
            for quant in ("fp8", "fp4") for takeover in (True, False)]


@pytest.mark.parametrize("takeover,quant", orders({(True, "fp4"), (False, "fp8")}))
def test_ours_first(stub, sglang_root, monkeypatch, quiet_report, caplog, quant, takeover):
    """apply() before SGLang's runner starts (aiter-patches run, the plugin, sitecustomize)."""
    if not takeover:
        monkeypatch.setenv("AITER_PATCHES_DISABLE", TAKEOVER)
    monkeypatch.setattr(sglang_takeover, "_logged", False)  # logged once per process
    args, expected = calls(stub, quant)
    with sglang_importable(sglang_root), caplog.at_level(logging.INFO, logger="aiter_patches"):
        report = aiter_patches.apply()
        assert report[TAKEOVER]["state"] == ("pending" if takeover else "disabled")
        import sglang.kernels.ops.moe.moe_sorting_small  # noqa: F401  (the take-over's hook runs here)

        run_sglang_patch()
        for a, want in zip(args, expected):
            assert same_bits(fused_moe(a), want)
        mx, foreign = stats(MX), layers(MX)
        summary = process_report.summary_line(process_report.status_record())
        if takeover:
            assert stats(TAKEOVER) == {"fast": 1, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}
            assert mx["fast"] == 2 * len(TOKENS) and mx["fallback"] == {}, mx  # each call: the sort + its quant
            assert foreign == [] and "foreign" not in summary
            assert any("sglang_takeover: SGLang's apply_aiter_small_moe_sort_patch() not run" in r.getMessage()
                       for r in caplog.records)
        else:
            assert mx["fast"] == 0 and mx["fallback"] == {TAKEN: len(TOKENS)}, mx
            assert "flat or FlyDSL" not in str(mx)
            sort_layer = [f for f in foreign if "on aiter.fused_moe._moe_sorting_impl" in f]
            assert sort_layer == [
                f"outer layer {MODULE} (apply_aiter_small_moe_sort_patch.<locals>.sorting_impl_wrapper) on "
                f"aiter.fused_moe._moe_sorting_impl: {sglang_takeover.WRAPPERS['sorting_impl_wrapper'][1]}"]
            assert any(f.startswith(f"outer layer {MODULE} (apply_aiter_small_moe_sort_patch.<locals>."
                                    "fused_moe_wrapper) on aiter.fused_moe.fused_moe") for f in foreign)
            assert "; foreign layers: " in summary and f"outer {MODULE} on aiter.fused_moe._moe_sorting_impl (" in summary
            assert "foreign_layers" in stats(MX)
            (line,) = [r for r in stats_log.records() if r["patch"] == MX]  # what the exit line carries
            assert line["fallback"] == {TAKEN: len(TOKENS)} and sort_layer[0] in line["foreign_layers"]
            assert len(stats_log.line(line).encode()) <= stats_log.MAX_LINE


@pytest.mark.parametrize("takeover,quant", orders({(True, "fp8"), (False, "fp4")}))
def test_sglang_first(stub, sglang_root, monkeypatch, quant, takeover):
    """apply() after SGLang's runner patched AITER: SGLang's wrappers sit under ours; ours is asked first."""
    if not takeover:
        monkeypatch.setenv("AITER_PATCHES_DISABLE", TAKEOVER)
    args, expected = calls(stub, quant)
    with sglang_importable(sglang_root):
        run_sglang_patch()
        report = aiter_patches.apply()
        assert report[TAKEOVER]["state"] == ("applied" if takeover else "disabled")
        for a, want in zip(args, expected):
            assert same_bits(fused_moe(a), want)
        mx = stats(MX)
        assert mx["fast"] == 2 * len(TOKENS) and mx["fallback"] == {}, mx
        assert f"inner layer {MODULE} (apply_aiter_small_moe_sort_patch.<locals>.sorting_impl_wrapper) on " \
               "aiter.fused_moe._moe_sorting_impl: takes the sort" in "\n".join(layers(MX))
        if takeover:
            assert stats(TAKEOVER)["fallback"] == {
                "SGLang's patch ran before the take-over; its wrappers stay where they are (status names them)": 1}


def test_takeover_applied_after_sglang_wrapped_ours_unwraps_by_identity(stub, sglang_root, monkeypatch):
    """Ours, then SGLang's over ours, then the take-over: SGLang's wrappers come off; every call reaches ours."""
    import aiter.fused_moe as fm

    args, expected = calls(stub, "fp8")
    with sglang_importable(sglang_root):
        monkeypatch.setenv("AITER_PATCHES_DISABLE", TAKEOVER)
        aiter_patches.apply()
        run_sglang_patch()
        assert any(f.startswith("outer layer") for f in layers(MX))
        theirs = {attr: getattr(fm, attr) for attr in ("fused_moe", "_moe_sorting_impl",
                                                       "fused_dynamic_mxfp8_quant_moe_sort")}
        assert all(f.__globals__["__name__"] == MODULE for f in theirs.values())
        monkeypatch.delenv("AITER_PATCHES_DISABLE")
        assert aiter_patches.apply([TAKEOVER])[TAKEOVER]["state"] == "applied"
        for attr in ("fused_moe", "_moe_sorting_impl", "fused_dynamic_mxfp8_quant_moe_sort"):
            assert getattr(fm, attr) is core_state.chains[("aiter.fused_moe", attr)].current
        assert layers(MX) == []
        assert stats(TAKEOVER)["fallback"] == {
            "SGLang's patch ran before the take-over; its wrappers over ours were taken off at "
            "aiter.fused_moe.fused_moe, aiter.fused_moe._moe_sorting_impl, "
            "aiter.fused_moe.fused_dynamic_mxfp8_quant_moe_sort": 1}
        for a, want in zip(args, expected):
            assert same_bits(fused_moe(a), want)
        assert stats(MX)["fast"] == 2 * len(TOKENS)
        aiter_patches.revert([TAKEOVER])  # SGLang's wrappers go back where the take-over took them off
        for attr, theirs_fn in theirs.items():
            assert getattr(fm, attr) is theirs_fn, attr
        assert aiter_patches.apply([TAKEOVER])[TAKEOVER]["state"] == "applied"  # and come off again
        assert layers(MX) == []
        aiter_patches.revert()  # all: SGLang's wrappers stay, over ours disarmed (they pass every call to AITER)
        for attr, theirs_fn in theirs.items():
            assert getattr(fm, attr) is theirs_fn, attr
        for a, want in zip(args, expected):
            assert same_bits(fused_moe(a), want)


def test_takeover_imports_aiter_fused_moe_when_sglang_calls_first(sglang_root):
    """apply() before `import aiter.fused_moe`: SGLang's call imports it (as its own function would) and
    finds moe_sort_mx_quant applied by then."""
    from helpers.standin import use_stub_aiter

    with use_stub_aiter(), sglang_importable(sglang_root):
        import sys

        aiter_patches.apply()
        assert "aiter.fused_moe" not in sys.modules and registry.state(MX) == "pending"
        run_sglang_patch()
        assert registry.state(MX) == "applied"
        assert stats(TAKEOVER) == {"fast": 1, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}
        assert sys.modules["aiter.fused_moe"]._moe_sorting_impl.__globals__["__name__"] != MODULE


def test_without_our_sort_sglangs_patch_runs(stub, sglang_root, monkeypatch):
    import aiter.fused_moe as fm

    monkeypatch.setenv("AITER_PATCHES_DISABLE", MX)
    with sglang_importable(sglang_root):
        import sglang.kernels.ops.moe.moe_sorting_small  # noqa: F401

        report = aiter_patches.apply()
        # declared need (issue 31): skipped at apply(), no longer a call-time fallback of an applied take-over
        assert report[TAKEOVER]["state"] == "skipped"
        assert report[TAKEOVER]["reason"] == f"needs {MX}, which is disabled: disabled by AITER_PATCHES_DISABLE"
        run_sglang_patch()
        assert stats(TAKEOVER) == {"fast": 0, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}
        assert fm._moe_sorting_impl.__globals__["__name__"] == MODULE


def _variant(tmp_path, source, old, new):
    from .conftest import MEMBER

    assert old in source
    root = tmp_path / "variant"
    for pkg in ("sglang", "sglang/kernels", "sglang/kernels/ops", "sglang/kernels/ops/moe", "sglang/srt"):
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "sglang/srt/utils.py").write_text("def is_gfx95_supported():\n    return True\n")
    (root / MEMBER).write_text(source.replace(old, new))
    return root


@pytest.mark.parametrize("old, new, reason", [
    ('logger.info("aiter small-batch MoE sorting patch applied")',
     'logger.info("aiter small-batch MoE sorting patch applied!")', "source changed (hash "),
    ("def apply_aiter_small_moe_sort_patch() -> None:", "def apply_aiter_small_moe_sort_patch(force=False) -> None:",
     "signature drifted"),
])
def test_takeover_skips_a_changed_sglang(stub, sglang_source, tmp_path, caplog, old, new, reason):
    root = _variant(tmp_path, sglang_source, old, new)
    with sglang_importable(root), caplog.at_level(logging.WARNING, logger="aiter_patches"):
        import sglang.kernels.ops.moe.moe_sorting_small as sm

        report = aiter_patches.apply()
        assert report[TAKEOVER]["state"] == "skipped" and reason in report[TAKEOVER]["reason"]
        assert report[MX]["state"] == "applied"
        assert "skipped patch 'sglang_takeover'" in caplog.text
        assert sglang_takeover.check_source(sm.__loader__.get_source(sm.__name__)) != []


def test_drift_check_of_the_wheels_file(sglang_source):
    assert sglang_takeover.check_source(sglang_source) == []
    changed = sglang_source.replace("p <= 256", "p <= 512")
    assert sglang_takeover.check_source(changed) == [
        f"{MODULE}._small_sort_supported changed: source hash "
        f"{sglang_takeover.check_source(changed)[0].split('hash ')[1][:12]} != pinned 4d469a6fa0fe"]


def test_disabled_by_name_leaves_sglang_alone(stub, sglang_root, monkeypatch):
    monkeypatch.setenv("AITER_PATCHES_DISABLE", TAKEOVER)
    with sglang_importable(sglang_root):
        import sglang.kernels.ops.moe.moe_sorting_small as sm

        original = sm.apply_aiter_small_moe_sort_patch
        assert aiter_patches.apply()[TAKEOVER]["state"] == "disabled"
        assert sm.apply_aiter_small_moe_sort_patch is original


def test_sglang_module_imported_before_apply(stub, sglang_root):
    import aiter.fused_moe as fm

    with sglang_importable(sglang_root):
        import sglang.kernels.ops.moe.moe_sorting_small  # noqa: F401

        assert aiter_patches.apply()[TAKEOVER]["state"] == "applied"  # at once: the module is there
        run_sglang_patch()
        assert stats(TAKEOVER) == {"fast": 1, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}
        assert fm._moe_sorting_impl is core_state.chains[("aiter.fused_moe", "_moe_sorting_impl")].current


def test_off_gfx95_the_call_is_sglangs_own_and_counted_so(stub, sglang_root, monkeypatch):
    import aiter.fused_moe as fm

    monkeypatch.setenv("FAKE_GFX95", "0")
    with sglang_importable(sglang_root):
        aiter_patches.apply()
        run_sglang_patch()
        assert stats(TAKEOVER) == {"fast": 0, "fallback": {"not gfx95: SGLang's patch installs nothing here": 1},
                                   "errors": {}, "checks_passed": 0, "checks_failed": 0}
        assert fm._moe_sorting_impl is core_state.chains[("aiter.fused_moe", "_moe_sorting_impl")].current
