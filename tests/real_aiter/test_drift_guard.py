"""Drift guard: the stand-in calls the same leaf ops, in the same order, as real AITER.

Every case (untuned: the stand-in has no tuned CSVs) runs through both, unpatched
and patched; the recorded leaf sequences (the AITER-level ops the chain calls:
sort, MX quant helpers' kernels, stage GEMMs, activations) must be equal. A
stand-in that drifts from AITER's branches fails here.
"""

import pytest

from .cases import cases

PARAMS = [pytest.param(c, gfx, id=f"{gfx}-{c['name']}") for c in cases() if not c["tuned"] for gfx in c["gfx"]]


@pytest.mark.parametrize("case,gfx", PARAMS)
def test_same_leaf_sequence_as_real_aiter(case, gfx, real_chain, stand_in_chain):
    real = real_chain(gfx)["cases"][case["name"]]
    stub = stand_in_chain(gfx)["cases"][case["name"]]
    assert stub["unpatched_calls"] == real["unpatched_calls"]
    assert stub["patched_calls"] == real["patched_calls"]
    assert stub["predicted"] == real["predicted"]
    assert (stub["unpatched_exc"] or "").split(":")[0] == (real["unpatched_exc"] or "").split(":")[0]
