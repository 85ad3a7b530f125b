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
    (dict(add=torch.zeros(3, 32, dtype=torch.bfloat16)), "is not fused_moe's output [3, 16]"),
    (dict(add=torch.zeros(3, 16, dtype=torch.float16)), "torch.float16 is not fused_moe's output"),
    (dict(stream=lambda device: "s1"), "another stream than the shared experts"),
])
def test_each_rule(change, expected):
    b = bound(output=change.get("output"))
    add = change.get("add", torch.zeros(3, 16, dtype=torch.bfloat16))
    got = addend_offer.reason(b, change.get("problems", []), add, change.get("takes_addend", True),
                              change.get("stream", same_stream), "s0")
    assert got == expected if expected is None else expected in got, got
