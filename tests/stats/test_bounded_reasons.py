"""Fallback reasons stay bounded over a server's life (issue 35 item 3): a reason names a category, at most
MAX_REASONS distinct ones per patch (past it, one "other reasons" entry), and a stats line is built in time
linear in its record (asserted through what it holds, never by a clock)."""

import logging
import types

import pytest

from aiter_patches import runtime, stats_log
from aiter_patches.integrations import sglang_zero_pool as pool_mod


def test_distinct_reasons_past_the_cap_go_to_one_other_entry(caplog):
    c = runtime.PatchCounters("p")
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        for i in range(100_000):
            c.fallback(f"{i} tokens: a per-call number")
            if i % 1000 == 0:
                c.failed(ValueError(str(i)), f"site {i}")
    snap = c.snapshot()
    assert len(snap["fallback"]) == runtime.MAX_REASONS + 1
    assert snap["fallback"][runtime.OTHER_REASONS] == 100_000 - runtime.MAX_REASONS
    assert sum(snap["fallback"].values()) == 100_000
    assert len(snap["errors"]) == runtime.MAX_REASONS + 1 and sum(snap["errors"].values()) == 100
    assert snap["errors"][runtime.OTHER_ERRORS] == 100 - runtime.MAX_REASONS
    assert "99999 tokens: a per-call number" in caplog.text  # the value is in the DEBUG log, not the counts
    c.fallback("0 tokens: a per-call number")  # a kept reason is still counted as itself
    assert c.snapshot()["fallback"]["0 tokens: a per-call number"] == 2
    line = stats_log.line({"pid": 1, "patch": "p", "at": "exit", **snap, "foreign_layers": []})
    assert len(line.encode()) <= stats_log.MAX_LINE


def test_the_zero_pool_reason_is_a_category_with_the_count_at_debug(monkeypatch, caplog):
    """3,000 prefills of distinct lengths through sglang_gemm_zero_pool's forward wrapper: one reason."""
    from aiter_patches.integrations import compile_state

    monkeypatch.setattr(compile_state, "tracing", lambda: False)
    monkeypatch.setattr(compile_state, "in_compiled_region", lambda: False)
    monkeypatch.setattr(pool_mod, "pool_cap_bytes", lambda: 1 << 20)
    counters = runtime.PatchCounters(pool_mod.NAME)
    binder = types.SimpleNamespace(bind=lambda args, kwargs: ({"positions": args[0], "self": None}, []))
    forward = pool_mod._forward_wrapper(lambda *a, **k: "AITER's", types.SimpleNamespace(binder=binder,
                                                                                        counters=counters))
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        for n in range(pool_mod.MAX_M + 1, pool_mod.MAX_M + 3001):
            assert forward(types.SimpleNamespace(shape=(n,))) == "AITER's"
    fb = counters.snapshot()["fallback"]
    assert fb == {f"tokens outside the pool's bound 1..{pool_mod.MAX_M} (prefill or idle)": 3000}
    assert f"{pool_mod.MAX_M + 3000} tokens outside" in caplog.text


@pytest.mark.parametrize("n", [3000])
def test_a_line_of_many_reasons_folds_the_rarest_and_keeps_the_total(n):
    """A record holding thousands of reasons (a log of an older release, or counters filled before the cap)
    gives one line under the limit, the rarest folded, every call counted."""
    fallback = {f"reason {i:05d} " + "x" * 40: i + 1 for i in range(n)}
    errors = {f"site {i}: E": 1 for i in range(n // 3)}
    foreign = [f"outer layer {i} " + "y" * 60 for i in range(10)]
    line = stats_log.line({"pid": 1, "patch": "p", "at": "exit", "fast": 3, "fallback": fallback,
                           "errors": errors, "foreign_layers": foreign})
    assert len(line.encode()) <= stats_log.MAX_LINE
    import json

    rec = json.loads(line[len(stats_log.MARKER):])
    assert sum(rec["fallback"].values()) + rec["fallback_more"]["calls"] == sum(fallback.values())
    assert len(rec["fallback"]) + rec["fallback_more"]["reasons"] == n
    assert sum(rec["errors"].values()) + rec.get("errors_more", {}).get("calls", 0) == len(errors)
    assert min(rec["fallback"].values()) >= max(v for k, v in fallback.items() if k not in rec["fallback"])
    assert rec["foreign_layers"] == foreign
    assert len(line.encode()) > stats_log.MAX_LINE - 300  # filled, not emptied
