"""A small subset of variants in which every pair of parameter values seen together occurs.

Why: CI cannot compile every variant of every model on two cores, but a compile failure or a
spill comes from a combination of settings, and most come from one value or from two
interacting. Per kernel and arch, greedily pick the variant that covers the most pairs
``(param a = x, param b = y)`` not yet covered (constexprs, argument specializations,
num_warps) until every pair that occurs in some variant occurs in a picked one.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import combinations


def _pairs(params: dict, varying: list[str]) -> set:
    items = [(k, repr(params.get(k))) for k in varying]
    return set(combinations(items, 2)) | {(i,) for i in items}


def pairwise_cover(variants) -> list:
    """The picked variants, grouped kernel by kernel (order of first appearance)."""
    groups: dict[tuple, list] = defaultdict(list)
    for v in variants:
        groups[(v.module, v.qualname, v.arch)].append(v)
    picked = []
    for group in groups.values():
        names = sorted({k for v in group for k in v.params})
        varying = [k for k in names if len({repr(v.params.get(k)) for v in group}) > 1]
        cover = [_pairs(v.params, varying) for v in group]
        todo = set().union(*cover) if cover else set()
        chosen: list[int] = []
        while todo:
            best = max(range(len(group)), key=lambda i: (len(cover[i] & todo), -i))
            chosen.append(best)
            todo -= cover[best]
        picked.extend(group[i] for i in sorted(chosen or [0]))
    return picked
