"""The compile command's pieces that need no compile: imports, presets, token sampling, covering, parsing."""

import subprocess
import sys

import pytest

from aiter_patches.amd import covering, presets, report, resources
from aiter_patches.amd.capture import Variant


def test_import_and_cli_parser_import_no_triton():
    code = ("import sys, aiter_patches, aiter_patches.cli; aiter_patches.cli.build_parser(); "
            "bad = [m for m in sys.modules if m == 'triton' or m.startswith('triton.') "
            "or m in ('aiter_patches.amd.capture', 'aiter_patches.amd.compile', 'aiter_patches.amd.sweep')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_presets_state_the_published_shapes():
    assert presets.preset("deepseek-r1").routing[0] == (256, 8) and presets.preset("DeepSeek-V3").hidden == 7168
    assert (presets.preset("Qwen3-235B").routing, presets.preset("Qwen3-235B").hidden) == (((128, 8),), 4096)
    assert presets.preset("MiniMax-M3").routing[0] == (128, 4) and presets.preset("MiniMax-M3").hidden == 6144
    assert (presets.preset("Kimi-K3").routing, presets.preset("Kimi-K3").hidden) == (((896, 16),), 3584)
    with pytest.raises(ValueError, match="unknown model"):
        presets.preset("Llama")


def test_shapes_parser_names_the_bad_field():
    s = presets.parse_shapes("experts=64/65,topk=6/7,hidden=2048,tokens=512,quant=fp4,ep=on,buf=zero")
    assert s.routing == ((64, 6), (65, 7)) and s.max_tokens == 512 and s.quants == ("fp4",)
    assert s.ep_modes == ("on",)
    for bad, msg in [("experts=8,topk=2", "needs hidden"), ("experts=8,topk=2,hidden=64,quant=int4", "quant=int4"),
                     ("experts=8,topk=2,hidden=64,colour=red", "unknown key"), ("experts=x,topk=2,hidden=6", "integer")]:
        with pytest.raises(ValueError, match=msg):
            presets.parse_shapes(bad)


def test_buf_modes_follow_aiter():
    m = presets.preset("Qwen3-235B-A22B")  # no shared expert: no addend; with a mask AITER always zeroes
    assert m.buf_modes_for("off") == ("zero", "keep") and m.buf_modes_for("on") == ("zero",)
    assert presets.preset("Kimi-K3").buf_modes_for("on+nlt") == ("zero", "addend")


@pytest.mark.parametrize("topk", [1, 2, 5, 9, 16])
def test_token_counts_meet_every_power_of_two_and_16_class(topk):
    """Each class (interval between powers of two of M and of M * topk, M % 16 == 0, M == 1)
    that occurs in 1..N has a representative, the largest N included."""
    n = 3000
    ms = presets.token_counts(n, topk)

    def cls(m):  # next and previous powers of two of M and of M * topk
        p = m * topk
        return ((m - 1).bit_length(), m.bit_length(), (p - 1).bit_length(), p.bit_length(), m % 16 == 0, m == 1)

    assert {cls(m) for m in range(1, n + 1)} == {cls(m) for m in ms}
    assert ms[-1] == n and len(ms) < 150


def _v(params, kernel="k", arch="gfx942"):
    return Variant("mod", kernel, arch, repr(sorted(params.items())), "{}", params)


def test_pairwise_cover_covers_every_pair_and_is_smaller():
    import itertools

    vs = [_v({"A": a, "B": b, "C": c, "D": d}) for a, b, c, d in itertools.product(range(3), range(3), range(2), (0, 1))]
    picked = covering.pairwise_cover(vs)
    assert len(picked) < len(vs)
    for p, q in itertools.combinations("ABCD", 2):
        seen = {(v.params[p], v.params[q]) for v in vs}
        assert {(v.params[p], v.params[q]) for v in picked} == seen, (p, q)
    # kernels and archs are covered separately
    other = covering.pairwise_cover(vs + [_v({"A": 0}, kernel="k2"), _v({"A": 0}, arch="gfx950")])
    assert {(v.qualname, v.arch) for v in other} == {("k", "gfx942"), ("k2", "gfx942"), ("k", "gfx950")}


AMDGCN = """
; Occupancy: 6
\t.amdhsa_group_segment_fixed_size 0
amdhsa.kernels:
  - .agpr_count:     4
    .group_segment_fixed_size: 1024
    .private_segment_fixed_size: 16
    .sgpr_count:     96
    .sgpr_spill_count: 12
    .vgpr_count:     100
    .vgpr_spill_count: 3
\tv_cvt_pk_bf16_f32 v0, v1, v2
"""
LLIR = "%5 = fptosi float %4 to i32\n%6 = fptrunc float %5 to bfloat\ncall <2 x i16> @llvm.amdgcn.cvt.pk.f32.fp8(i32 %1)\n"


def test_amdgcn_resources_and_verdict():
    r = resources.parse_amdgcn(AMDGCN, shared=60 * 1024, num_warps=8, arch="gfx942", llir=LLIR)
    assert (r.vgprs, r.agprs, r.sgprs, r.sgpr_spills, r.vgpr_spills, r.scratch) == (100, 4, 96, 12, 3, 16)
    assert r.lds == 61 * 1024 and not r.lds_over and r.lds_limit == 64 * 1024
    assert r.occupancy == 2  # one 8-wave workgroup fits the CU's LDS: 2 waves per SIMD (registers allow 6)
    assert (r.fp_to_int, r.float_narrowing, r.bf16_hw_cvt) == (1, 1, 1)  # the fp8 -> f32 widening is not counted
    from aiter_patches.amd.compile import Outcome

    why = report.failures(Outcome(("m",), "gfx942", True, 0.1, r))
    assert any("scratch" in w for w in why) and any("float->int" in w for w in why) and any("narrowing" in w for w in why)
    over = resources.parse_amdgcn(AMDGCN, shared=64 * 1024, num_warps=4, arch="gfx942")
    assert over.lds_over and any("LDS" in w for w in report.failures(Outcome(("m",), "gfx942", True, 0.1, over)))
    assert resources.parse_amdgcn(AMDGCN, shared=64 * 1024, num_warps=4, arch="gfx950").lds_over is False
    assert report.failures(Outcome(("m",), "gfx942", False, 0.1, None, "boom")) == ["compile error"]


def test_decoding_a_variant_needs_no_jit_function_registry(monkeypatch):
    """Triton 3.6 (a ROCm torch's) has no ``_triton_jit_function_registry``: a variant without a
    jit-function constexpr must decode there (the import was unconditional and failed every variant)."""
    import triton.runtime.jit as jit

    from aiter_patches.amd.compile import _decode

    monkeypatch.delattr(jit, "_triton_jit_function_registry", raising=False)
    spec = {"constant_keys": [[3]], "constant_vals": [{"constexpr": 64}], "attrs_keys": [], "attrs_vals": [],
            "signature": {"x_ptr": "*fp32", "BLOCK": "constexpr"}, "options": {"num_warps": 4}}
    signature, constexprs, attrs, options = _decode(None, spec)
    assert constexprs[(3,)].value == 64 and signature["x_ptr"] == "*fp32" and options == {"num_warps": 4}
