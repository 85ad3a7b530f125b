"""The patches on real AITER's own MoE call chain (its Python control flow, on CPU).

Every case of ``cases.py`` runs through real ``aiter.fused_moe.fused_moe`` (faked
gfx942 / gfx950, compiled leaf ops replaced by the stand-in's torch kernels, every
other compiled op a tripwire), unpatched and patched, in one subprocess per chip.
Each case shows: the patches on AITER's modules ``applied``; patched == unpatched
bit for bit; the fast path (or the counted fallback) that the prediction names,
seen in the counters and in the leaf calls (the stage-1 quant leaf is not called
when the sort's quant was handed back).
"""

import pytest

from .cases import cases
from .expectations import check_case

PARAMS = [pytest.param(c, gfx, id=f"{gfx}-{c['name']}") for c in cases() for gfx in c["gfx"]]


@pytest.mark.parametrize("case,gfx", PARAMS)
def test_case_on_real_aiter(case, gfx, real_chain):
    check_case(case, real_chain(gfx))


def test_the_harness_replaced_only_compiled_ops_and_nothing_tripped(real_chain):
    for gfx in ("gfx942", "gfx950"):
        report = real_chain(gfx)
        assert report["tripped"] == []
        assert report["aiter_file"].startswith(report["tree"])
