"""The one rule both server folds use at the routed call: each condition refuses with its reason."""

import pytest
import torch

from aiter_patches.integrations import addend_offer


def bound(tokens=3, hidden=16, dtype=torch.bfloat16, output=None):
    return dict(hidden_states=torch.zeros(tokens, hidden, dtype=dtype), topk_ids=torch.zeros(tokens, 2, dtype=torch.int32),
                w2=torch.zeros(4, hidden, 8), output=output)


def same_stream(device):
    return "s0"


@pytest.mark.parametrize("change, expected", [
    (dict(), None),
    (dict(problems=["missing a required argument: 'w1'"]), "missing a required argument"),
    (dict(takes_addend=False), "moe_addend_fold's layer is not under this one"),
    (dict(output=torch.zeros(3, 16)), "a caller-owned buffer"),
    (dict(add=torch.zeros(3, 32, dtype=torch.bfloat16)), "is not fused_moe's output [tokens, w2.shape[1]]"),
    (dict(add=torch.zeros(3, 16, dtype=torch.float16)), "is not fused_moe's output [tokens, w2.shape[1]] in its dtype"),
    (dict(stream=lambda device: "s1"), "another stream than the shared experts"),
])
def test_each_rule(change, expected):
    b = bound(output=change.get("output"))
    add = change.get("add", torch.zeros(3, 16, dtype=torch.bfloat16))
    got = addend_offer.reason(b, change.get("problems", []), add, change.get("takes_addend", True),
                              change.get("stream", same_stream), "s0")
    assert got == expected if expected is None else expected in got, got


class Scope:
    def __init__(self, shared):
        self.shared, self.stream, self.offered = shared, "s0", False


class Binder:
    def __init__(self, b, problems=()):
        self.b, self.problems, self.seen = b, list(problems), None

    def bind(self, args, kwargs):
        self.seen = (args, dict(kwargs))
        return self.b, self.problems


class Counters:
    def __init__(self):
        self.reasons = []

    def fallback(self, reason):
        self.reasons.append(reason)


def test_offer_passes_the_shared_output_once_the_rule_allows_it():
    calls, add = [], torch.zeros(3, 16, dtype=torch.bfloat16)
    scope, counters = Scope(add), Counters()
    out, folded = addend_offer.offer(lambda *a, **k: calls.append((a, k)) or "out", ("x",), {"w2": 1}, scope,
                                     Binder(bound()), counters, True, same_stream)
    assert (out, folded, scope.offered, counters.reasons) == ("out", True, True, [])
    assert calls == [(("x",), {"w2": 1, "moe_addend": add})]


def test_offer_refused_calls_as_given_counts_why_and_still_marks_the_scope():
    calls = []
    scope, counters = Scope(torch.zeros(3, 16, dtype=torch.bfloat16)), Counters()
    out, folded = addend_offer.offer(lambda *a, **k: calls.append((a, k)) or "out", ("x",), {}, scope,
                                     Binder(bound()), counters, True, lambda device: "s1")
    assert (out, folded, scope.offered) == ("out", False, True)
    assert calls == [(("x",), {})] and counters.reasons == ["the routed call runs on another stream than the shared experts"]


def test_a_routed_call_short_of_an_argument_goes_as_given_with_the_binders_reason():
    """With fused_moe's real pin: no KeyError out of the rule, AITER gets the call as given (and raises its own TypeError)."""
    from aiter_patches.patches import pins
    from aiter_patches.signatures import Binder

    b = bound()
    calls, scope, counters = [], Scope(torch.zeros(3, 16, dtype=torch.bfloat16)), Counters()
    args = (b["hidden_states"], torch.zeros(4, 32, 16), b["w2"], torch.zeros(3, 2))  # no topk_ids
    out, folded = addend_offer.offer(lambda *a, **k: calls.append((a, k)) or "out", args, {}, scope,
                                     Binder(pins.FUSED_MOE[-1].signature), counters, True, same_stream)
    assert (out, folded, scope.offered) == ("out", False, True)
    assert calls == [(args, {})] and counters.reasons == ["required argument not given: topk_ids"]
