"""Issue 18's server call patterns: the expected fast-path outcome of each, on the stand-in and on
real AITER's chain (``cases.PREDICTIONS``; the README prints the same table)."""

import pytest

from .cases import PREDICTIONS, cases
from .expectations import check_case

BY_NAME = {c["name"]: c for c in cases()}
OUTCOME = {"quant fp4": "quant", "quant fp8": "quant", "sort only": "sort", "AITER (counted)": "aiter"}


def _params():
    for pattern, name, outcome, _why in PREDICTIONS:
        for gfx in BY_NAME[name]["gfx"]:
            yield pytest.param(BY_NAME[name], gfx, outcome, id=f"{gfx}-{name}")


@pytest.mark.parametrize("case,gfx,outcome", list(_params()))
@pytest.mark.parametrize("backend", ["stand_in", "real"])
def test_prediction(case, gfx, outcome, backend, request):
    assert OUTCOME[outcome] == case["expect"]
    chain = request.getfixturevalue("real_chain" if backend == "real" else "stand_in_chain")
    report = chain(gfx)
    check_case(case, report)
    predicted = report["cases"][case["name"]]["predicted"]
    if outcome.startswith("quant"):
        assert ("float8" if outcome.endswith("fp8") else "float4") in predicted


def test_every_pattern_names_a_case():
    assert all(name in BY_NAME for _, name, _, _ in PREDICTIONS)
