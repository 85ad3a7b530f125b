"""``AITER_PATCHES_INTEGRATIONS``: server integrations are off until named, by group, by patch name or ``all``."""

import pytest

import aiter_patches
from aiter_patches.core import env as switch

NAME = "sglang_shared_expert_fold"


@pytest.mark.parametrize("value, on", [("", False), ("sglang", True), ("vllm", False), (NAME, True),
                                       (" all ", True), ("vllm, sglang", True)])
def test_the_switch_names_groups_and_patches(monkeypatch, value, on):
    monkeypatch.setenv(switch.ENV, value)
    assert (NAME not in switch.not_switched_on(p for p in aiter_patches.registry.patches())) is on


def test_an_unknown_word_is_an_error_naming_the_known_ones(monkeypatch):
    monkeypatch.setenv(switch.ENV, "sglang,sglnag")
    with pytest.raises(ValueError, match=r"unknown integration\(s\) sglnag; known: .*sglang"):
        aiter_patches.apply()


def test_status_says_how_to_turn_it_on(monkeypatch):
    monkeypatch.delenv(switch.ENV, raising=False)
    aiter_patches.apply()
    rec = next(p for p in aiter_patches.status()["patches"] if p["name"] == NAME)
    assert rec["state"] == "disabled" and f"{switch.ENV}=sglang" in rec["reason"]
