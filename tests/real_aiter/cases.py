"""The MoE call cases run through real AITER's chain and through the stand-in, and what each must show.

A case is plain data (JSON-able) so that the test process can list and
parametrize the cases while only the throw-away subprocess (``runner.py``)
imports AITER. ``expect`` is the prediction: what the patched call must do.

- ``"quant"``: the one-launch sort ran and handed its stage-1 quant back, so the
  stage-1 quant leaf is not called (fp4 or fp8 in ``quant``).
- ``"sort"``: the one-launch sort ran (it removes launches or writes the addend),
  AITER quantizes or runs stage 1 in bf16 as usual.
- ``"aiter"``: the call is left to AITER; the counted fallback reason contains
  ``reason``.

Hidden sizes are small (256-512) except for the tuned-CSV rows, whose keys name
the real model shapes; those run with experts that share one weight tensor
(``expand``), so memory stays small.
"""

from __future__ import annotations

# Tuned rows of AITER's CSVs (aiter/configs/model_configs/*, cu_num 256 = gfx950) that
# get_2stage_cfgs matches: MiniMax-M2.5 MXFP4 (w4a4, Silu) and GLM-5 MXFP8 (w8a8, Silu).
TUNED_MXFP4 = dict(model_dim=3072, inter_dim=256, experts=256, topk=8)
TUNED_MXFP8 = dict(model_dim=6144, inter_dim=512, experts=257, topk=9)

SORT_ONLY_NOTHING_SAVED = "sort only, nothing saved"


def _case(name, *, quant="mxfp4", tokens=1, experts=8, topk=2, model_dim=256, inter_dim=256, activation="Silu",
          gate_mode="separated", shuffled=False, ep=False, num_local_tokens=None, addend=False, extension=False,
          a1_scale=False, tuned=False, gfx=("gfx942", "gfx950"), expect="quant", reason=None):
    return dict(name=name, quant=quant, tokens=tokens, experts=experts, topk=topk, model_dim=model_dim,
                inter_dim=inter_dim, activation=activation, gate_mode=gate_mode, shuffled=shuffled, ep=ep,
                num_local_tokens=num_local_tokens, addend=addend, extension=extension, a1_scale=a1_scale,
                tuned=tuned, gfx=list(gfx), expect=expect, reason=reason)


def cases() -> list[dict]:
    out = []
    for quant in ("mxfp4", "mxfp8"):
        q = quant
        for tokens, experts, topk in ((1, 8, 1), (3, 16, 4), (16, 32, 8)):
            out.append(_case(f"{q}-untuned-t{tokens}-e{experts}-k{topk}", quant=q, tokens=tokens, experts=experts,
                             topk=topk))
        # Prefill-sized: one chip each (the Triton interpreter makes these the suite's cost).
        out.append(_case(f"{q}-untuned-t257-e32-k2", quant=q, tokens=257, experts=32, topk=2, model_dim=64,
                         inter_dim=64, gfx=("gfx942",) if q == "mxfp4" else ("gfx950",)))
        out.append(_case(f"{q}-t0", quant=q, tokens=0, experts=8, topk=2, expect="zero"))
        out.append(_case(f"{q}-ep", quant=q, tokens=3, experts=8, topk=4, ep=True))
        out.append(_case(f"{q}-num-local-tokens", quant=q, tokens=16, experts=8, topk=2, num_local_tokens=9))
        out.append(_case(f"{q}-addend", quant=q, tokens=3, experts=8, topk=2, addend=True))
        out.append(_case(f"{q}-extension", quant=q, tokens=3, experts=8, topk=2, extension=True))
        out.append(_case(f"{q}-prequant-dispatch-a1-scale", quant=q, tokens=3, experts=8, topk=2, a1_scale=True,
                         num_local_tokens=2))
        tuned = TUNED_MXFP4 if q == "mxfp4" else TUNED_MXFP8
        for tokens in ((1, 3) if q == "mxfp4" else (1,)):
            out.append(_case(f"{q}-tuned-t{tokens}", quant=q, tokens=tokens, tuned=True, shuffled=True,
                             gfx=("gfx950",), **tuned))
    # MXFP4 only: AITER's stage-1 dtype rules for preshuffled split-K and Swiglu.
    out.append(_case("mxfp4-preshuffled-ksplit", tokens=1, experts=32, topk=1, model_dim=512, inter_dim=128,
                     shuffled=True, expect="aiter", reason=SORT_ONLY_NOTHING_SAVED))
    out.append(_case("mxfp4-swiglu-separated-small-m-oneshot-sort", tokens=16, experts=8, topk=2,
                     activation="Swiglu", shuffled=True, expect="aiter", reason=SORT_ONLY_NOTHING_SAVED))
    out.append(_case("mxfp4-swiglu-separated-small-m-two-launch-sort", tokens=64, experts=128, topk=2,
                     activation="Swiglu", shuffled=True, model_dim=64, inter_dim=64, expect="sort"))
    out.append(_case("mxfp4-swiglu-separated-m256", tokens=257, experts=8, topk=2, activation="Swiglu",
                     model_dim=64, inter_dim=64, gfx=("gfx950",)))
    out.append(_case("mxfp4-swiglu-interleave-m256", tokens=257, experts=8, topk=2, activation="Swiglu",
                     gate_mode="interleave", model_dim=64, inter_dim=64, gfx=("gfx950",), expect="quant"))
    out.append(_case("mxfp4-swiglu-interleave-m256-gfx942", tokens=257, experts=8, topk=2, activation="Swiglu",
                     gate_mode="interleave", model_dim=64, inter_dim=64, gfx=("gfx942",), expect="aiter",
                     reason=SORT_ONLY_NOTHING_SAVED))
    return out


# Issue 18's server call patterns: (pattern, case that replays it, expected outcome, why).
# README "What is proven against real AITER" prints the same table.
PREDICTIONS = [
    ("SGLang Quark MXFP4 W4A4 (DeepSeek-R1/V3), TP, decode", "mxfp4-untuned-t3-e16-k4", "quant fp4",
     "stage 1 quantizes to MXFP4 (fused_dynamic_mxfp4_quant_moe_sort): the sort hands it back"),
    ("SGLang / vLLM Quark MXFP4 W4A4, EP (expert_mask of E+1 with a sentinel)", "mxfp4-ep", "quant fp4",
     "the same quant; the sort drops the masked experts' pairs"),
    ("SGLang online MXFP4, prefill (257 tokens)", "mxfp4-untuned-t257-e32-k2", "quant fp4",
     "the same quant, large-M split path (quant + scale sort) replaced too"),
    ("MXFP4 with preshuffled weights and ksplit > 1 (untuned decode, no FlyDSL)", "mxfp4-preshuffled-ksplit",
     "AITER (counted)", "CK-Tile split-K stage 1 runs on bf16: no quant to fuse, and AITER's one-shot sort is "
     "one launch already: the sort-only path would save nothing"),
    ("SGLang MXFP8 / vLLM MXFP8 MoE (w8a8)", "mxfp8-untuned-t3-e16-k4", "quant fp8",
     "MXFP8 weights: stage 1 quantizes to MXFP8 (fused_dynamic_mxfp8_quant_moe_sort)"),
    ("gpt-oss MXFP4, Swiglu with interleaved gates, M >= 256, gfx950", "mxfp4-swiglu-interleave-m256", "quant fp8",
     "AITER quantizes stage 1 to MXFP8 on gfx950 from AITER_BF16_FP8_MOE_BOUND (256) tokens"),
    ("gpt-oss MXFP4, Swiglu with interleaved gates, M >= 256, gfx942", "mxfp4-swiglu-interleave-m256-gfx942",
     "AITER (counted)", "bf16 stage 1 on gfx942 (no quant); AITER's one-shot sort is one launch already"),
    ("Swiglu with separated gates, M >= 256", "mxfp4-swiglu-separated-m256", "quant fp4",
     "from GPTOSS_SWIGLU_MXFP4_BF16_BOUND (256) tokens AITER quantizes stage 1 to MXFP4"),
    ("Swiglu (separated), M < 256, AITER's sort one-shot", "mxfp4-swiglu-separated-small-m-oneshot-sort",
     "AITER (counted)", "bf16 stage 1; AITER's one-shot sort already zero-fills moe_buf in one launch"),
    ("Swiglu (separated), M < 256, AITER's sort multi-phase", "mxfp4-swiglu-separated-small-m-two-launch-sort",
     "sort only", "bf16 stage 1; AITER's sort takes two launches, the one-launch sort one (with under 256 experts, "
     "today's such models; with 256-2047, past 512-1024 routing pairs it takes three and the call is AITER's, counted)"),
    ("pre-quantized dispatch (vLLM MoRI/DeepEP): a1_scale given, num_local_tokens", "mxfp4-prequant-dispatch-a1-scale",
     "quant fp4", "bf16 activations: AITER ignores a1_scale at stage 1 and quantizes (num_rows=num_local_tokens)"),
]
