"""One yes/no rule for the environment, one text table, and the GEMM patch's typed launch plan."""

import sys

import pytest
import torch

from aiter_patches import auto, cli, drift, env_flags, runtime, text_table
from aiter_patches.amd import report
from aiter_patches.core import env
from aiter_patches.kernels import fast_launch


@pytest.mark.parametrize("word,yes,no", [("1", True, False), (" Yes ", True, False), ("ON", True, False),
                                         ("true", True, False), ("0", False, True), ("Off", False, True),
                                         (" no", False, True), ("FALSE", False, True), ("", False, False),
                                         ("maybe", False, False)])
def test_every_switch_reads_the_same_words(monkeypatch, word, yes, no):
    assert (env_flags.is_true(word), env_flags.is_false(word)) == (yes, no)
    monkeypatch.setattr(runtime, "_strict_override", None)
    monkeypatch.setenv("AITER_PATCHES_STRICT", word)
    assert runtime.strict() is yes
    monkeypatch.setenv("AITER_PATCHES", word)
    disabled, _ = env.disabled(["a", "b"])
    assert disabled == ({"a", "b"} if no else set())
    monkeypatch.setenv("AITER_PATCHES_FAST_LAUNCH", word)
    assert fast_launch._read_mode() == ("off" if no else "on")
    monkeypatch.setenv("AITER_PATCHES_AUTO", word)
    condition = auto.PTH_LINE.split(" and __import__")[0]  # the .pth line without its import
    scope: dict = {}
    exec(condition.replace("import os; ", "import os; result = "), scope)
    assert scope["result"] is yes


def test_unset_switches_keep_their_defaults(monkeypatch):
    for name in ("AITER_PATCHES_STRICT", "AITER_PATCHES", "AITER_PATCHES_FAST_LAUNCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "_strict_override", None)
    assert not runtime.strict() and env.disabled(["a"])[0] == set() and fast_launch._read_mode() == "on"
    monkeypatch.setenv("AITER_PATCHES_FAST_LAUNCH", " Verify")
    assert fast_launch._read_mode() == "verify"


def test_the_pth_line_spells_the_shared_words():
    assert repr(env_flags.TRUE_WORDS) in auto.PTH_LINE and "aiter_patches" not in auto.PTH_LINE.split(" and ")[0]


ROWS = [{"patch": "a", "state": "applied", "detail": ""}, {"patch": "longer_name", "state": "x", "detail": "why"}]


def test_one_table_no_trailing_space_and_every_command_prints_it():
    want = ["patch        state    detail",
            "-----------  -------  ------",
            "a            applied",
            "longer_name  x        why"]
    assert text_table.lines(["patch", "state", "detail"], [list(r.values()) for r in ROWS]) == want
    assert cli._table(ROWS, ["patch", "state", "detail"]) == "\n".join(want)
    assert report.table(ROWS, ["patch", "state", "detail"]) == "\n".join(want)
    assert drift.render._table([list(r.values()) for r in ROWS], ["patch", "state", "detail"]) == want
    assert cli._table([], ["patch"]) == "(none)" and report.table([]) == "(no variants)"


def test_the_gemm_plan_is_a_typed_result_on_the_stand_in():
    from aiter_patches.patches import gemm_out_zeroed as g
    from helpers.standin import use_stub_aiter

    with use_stub_aiter():
        import aiter.ops.gemm_op_a8w8  # noqa: F401

        M, N, K = 4, 128, 128  # one 128-wide K tile: split 1, AITER launches no memset
        bound = dict(A=torch.empty(M, K), B=torch.empty(N, K), out=torch.empty(M, N),
                     A_scale=torch.empty(M, 1), B_scale=torch.empty(1, 1), splitK=None)
        plan = g._plan(bound, g.backend_for(sys.modules["aiter"]))
    assert plan == g.HandBack("split count 1: the original launches no memset")
    assert not isinstance(plan, g.Launch)
