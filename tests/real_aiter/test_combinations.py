"""Every combination of the three MoE features on real AITER's call chain (and the stand-in), one case.

The case (runner.COMBINATION_CASE, MXFP4 decode with a shared-expert addend) is run
with each of the 2^3 subsets applied, the addend being produced by an extension's
after-sort work (``DeferredWork``): the one interaction of all three. Each subset must
give the bits its features promise one at a time: the sort + quant and the extension
hook never change bits; the fold starts ``moe_buf`` from the addend's value after the
sort's after-work (the extension's work runs there when ``sort_extension`` is applied,
at scope exit otherwise, when the addend still holds zeros); without the fold the
addend is added after the call. The counters and AITER's leaf calls say which engaged.
"""

import itertools

import pytest

from .expectations import SORT_LEAVES
from .runner import COMBINATION_GFX, MOE_FEATURES

FOLD, EXT, SORT = MOE_FEATURES
SUBSETS = [c for r in range(4) for c in itertools.combinations(MOE_FEATURES, r)]


def expected_reference(subset) -> str:
    if FOLD in subset:
        return "fold" if EXT in subset else "aiter"  # a zero addend: moe_buf starts from zeros, AITER's own start
    return "aiter+addend" if EXT in subset else "aiter+zeros"


def check(report, subset):
    combos = report["combinations"]
    assert not combos["_refs"]["fold == aiter+addend"], "the case cannot tell the fold from the add"
    res = combos["+".join(subset)]
    assert expected_reference(subset) in res["equals"], (subset, res["equals"])
    stats = res["stats"]
    assert all(not s["errors"] for s in stats.values()), stats
    assert stats[FOLD]["fast"] == (1 if FOLD in subset else 0), stats[FOLD]
    assert stats[SORT]["fast"] == (2 if SORT in subset else 0), stats[SORT]  # the sort and its quant's hand-back
    assert res["ran"] == ([1, 0] if EXT in subset else [0, 1])
    assert any(c in SORT_LEAVES for c in res["calls"]) == (SORT not in subset), res["calls"]


@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "+".join(s) or "none")
def test_combination_on_real_aiter(subset, real_chain):
    check(real_chain(COMBINATION_GFX), subset)


@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "+".join(s) or "none")
def test_combination_on_the_stand_in(subset, stand_in_chain):
    check(stand_in_chain(COMBINATION_GFX), subset)
