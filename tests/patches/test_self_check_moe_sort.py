"""The self-check of moe_sort_mx_quant (issue 33): its first call per plan runs AITER's sort (+ quant) too.

Faults are injected on CPU with the stand-in, both ways: the patch's kernel output corrupted, and a
leaf of the stand-in AITER corrupted. Either way the first call returns AITER's bits, the patch is
``check_failed``, the inputs are saved, the next call is AITER's, and the other patches stay applied.
"""

import logging
import os
import threading

import pytest
import torch

import aiter_patches
from aiter_patches import registry, self_check
from aiter_patches.kernels import moe_sort_mx_quant as kernel

from .test_moe_sort_mx_quant_patch import moe_inputs, same_bits

NAME = "moe_sort_mx_quant"


@pytest.fixture
def checking(monkeypatch, tmp_path):
    monkeypatch.setenv(self_check.ENV, "1")
    monkeypatch.setenv(self_check.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(self_check.CALLS_ENV, raising=False)
    yield tmp_path
    registry.revert()


def stats():
    return aiter_patches.stats()[NAME]


@pytest.mark.parametrize("quant", ["fp4", "fp8"])
def test_first_call_checked_then_fast(stub, device, checking, quant):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 5, 16, 4, 256, 128, quant)
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    got = fm.fused_moe(**args)
    assert same_bits(got, expected)
    s = stats()
    assert (s["checks_passed"], s["checks_failed"], s["fast"]) == (1, 0, 0)  # the checked call is AITER's
    got = fm.fused_moe(**args)
    assert same_bits(got, expected)
    s = stats()
    assert (s["checks_passed"], s["fast"]) == (1, 2)  # then the sort and the quant hand-back, unchecked
    assert registry.state(NAME) == registry.APPLIED
    assert not os.listdir(checking)


def test_calls_per_plan(stub, device, checking, monkeypatch):
    import aiter.fused_moe as fm

    monkeypatch.setenv(self_check.CALLS_ENV, "3")
    args = moe_inputs(stub, device, 3, 8, 2, 256, 128, "fp8")
    aiter_patches.apply([NAME])
    for _ in range(4):
        fm.fused_moe(**args)
    assert (stats()["checks_passed"], stats()["fast"]) == (3, 2)


def test_off_when_asked(stub, device, checking, monkeypatch):
    import aiter.fused_moe as fm

    monkeypatch.setenv(self_check.ENV, "0")
    args = moe_inputs(stub, device, 3, 8, 2, 256, 128, "fp8")
    aiter_patches.apply([NAME])
    fm.fused_moe(**args)
    assert (stats()["checks_passed"], stats()["fast"]) == (0, 2)


def test_default_follows_rocm_torch(monkeypatch):
    monkeypatch.delenv(self_check.ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert self_check.enabled() is False
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert self_check.enabled() is True


def test_a_bad_value_warns_once_and_keeps_the_default(monkeypatch, caplog):
    monkeypatch.setenv(self_check.ENV, "maybe")
    monkeypatch.setattr(torch.version, "hip", None)
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        assert self_check.enabled() is False
        assert self_check.enabled() is False
    assert [r.getMessage() for r in caplog.records if self_check.ENV in r.getMessage()] == [
        "AITER_PATCHES_SELF_CHECK='maybe' ignored: the rule is 1/true/yes/on or 0/false/no/off; "
        "using the default (off: not a ROCm torch)"]


def _corrupt_kernel(monkeypatch, field):
    real = kernel.moe_sort_mx_quant

    def corrupted(*a, **k):
        res = real(*a, **k)
        if field == "scale":
            res.quant[1].view(torch.uint8).view(-1)[0] ^= 1
        else:
            res.sorted_weights.view(torch.int32)[0] ^= 1
        return res

    monkeypatch.setattr(kernel, "moe_sort_mx_quant", corrupted)


@pytest.mark.parametrize("quant, field, what", [("fp4", "scale", "stage-1 MX scale bytes differ"),
                                                ("fp8", "weights", "sorted_weights differs")])
def test_a_corrupted_kernel_output_stands_the_patch_down(stub, device, checking, monkeypatch, caplog, quant, field,
                                                         what):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 5, 16, 4, 256, 128, quant)
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME, "gemm_out_zeroed"])
    _corrupt_kernel(monkeypatch, field)
    with caplog.at_level(logging.ERROR, logger="aiter_patches"):
        got = fm.fused_moe(**args)
    assert same_bits(got, expected)  # the failing call itself returns AITER's bits
    assert registry.state(NAME) == registry.CHECK_FAILED
    reason = registry.status()["patches"][[p["name"] for p in registry.status()["patches"]].index(NAME)]["reason"]
    assert reason.startswith("self-check failed at sort + ") and what in reason
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(f"aiter_patches: {NAME} stood down (check_failed): ")
    saved = os.listdir(checking)
    assert len(saved) == 1 and saved[0].startswith(f"aiter_patches_check_failed_{NAME}_")
    dump = torch.load(os.path.join(checking, saved[0]))
    assert dump["patch"] == NAME and torch.equal(dump["inputs"]["topk_ids"], args["topk_ids"].cpu())
    assert (stats()["checks_failed"], stats()["fast"]) == (1, 0)
    got = fm.fused_moe(**args)  # AITER's path from now on, counted
    assert same_bits(got, expected) and stats()["fast"] == 0
    assert stats()["fallback"].get(self_check.STOOD_DOWN) == 1
    assert registry.state("gemm_out_zeroed") == registry.APPLIED  # the others go on
    aiter_patches.apply([NAME])  # stays down for the process's life
    assert registry.state(NAME) == registry.CHECK_FAILED
    registry.revert([NAME])  # an operator's revert makes it inactive: the next apply() starts afresh
    assert registry.state(NAME) == registry.INACTIVE


def test_a_corrupted_aiter_leaf_stands_the_patch_down(stub, device, checking, monkeypatch):
    """AITER is the reference: a stand-in leaf gone wrong at one shape is AITER's answer, served as is."""
    import aiter.fused_moe as fm
    import aiter.ops.quant as quant_ops

    real = quant_ops.fused_dynamic_mx_quant_moe_sort

    def leaf(*a, **k):
        data, scale = real(*a, **k)
        if k["token_num"] == 5:  # this shape only
            data.view(torch.uint8)[0, 0] ^= 0x11
        return data, scale

    monkeypatch.setattr(quant_ops, "fused_dynamic_mx_quant_moe_sort", leaf)
    other = moe_inputs(stub, device, 3, 16, 4, 256, 128, "fp8", seed=1)
    args = moe_inputs(stub, device, 5, 16, 4, 256, 128, "fp8")
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    fm.fused_moe(**other)
    assert stats()["checks_passed"] == 1 and registry.state(NAME) == registry.APPLIED
    got = fm.fused_moe(**args)
    assert same_bits(got, expected)
    assert registry.state(NAME) == registry.CHECK_FAILED
    assert "stage-1 MX data rows differ" in registry.status()["patches"][0]["reason"] or any(
        "stage-1 MX data rows differ" in p["reason"] for p in registry.status()["patches"])


def test_two_threads_meet_a_new_plan_one_checks(stub, device, checking, monkeypatch):
    """The second thread to meet a plan being checked takes AITER's path, counted."""
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 3, 8, 2, 256, 128, "fp8")
    aiter_patches.apply([NAME])
    real = kernel.moe_sort_mx_quant
    inside, go = threading.Event(), threading.Event()

    def slow(*a, **k):
        inside.set()
        go.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(kernel, "moe_sort_mx_quant", slow)
    first = threading.Thread(target=fm.fused_moe, kwargs=args)
    first.start()
    assert inside.wait(30)
    monkeypatch.setattr(kernel, "moe_sort_mx_quant", real)
    fm.fused_moe(**args)  # meets the plan while the first thread checks it
    go.set()
    first.join(60)
    s = stats()
    assert s["checks_passed"] == 1
    assert s["fallback"].get(self_check.BUSY_REASON) == 1


def test_nothing_unchecked_in_torch_compile_tracing(stub, device, checking, monkeypatch):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 3, 8, 2, 256, 128, "fp8")
    aiter_patches.apply([NAME])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(self_check, "_unsafe_now", lambda: self_check.TRACING_REASON)
    fm.fused_moe(**args)
    assert stats()["checks_passed"] == 0 and stats()["fallback"].get(self_check.TRACING_REASON, 0) >= 1


def test_the_operator_sees_it_in_status_stats_lines_and_from_log(stub, device, checking, monkeypatch, caplog,
                                                                 tmp_path, capsys):
    """status(), stats(), the status and stats lines, and ``status --from-log`` over the lines."""
    import aiter.fused_moe as fm

    from aiter_patches import process_report, stats_log

    args = moe_inputs(stub, device, 5, 16, 4, 256, 128, "fp8")
    other = moe_inputs(stub, device, 3, 16, 4, 256, 128, "fp8", seed=2)
    with caplog.at_level(logging.INFO, logger="aiter_patches"):
        aiter_patches.apply([NAME])
        fm.fused_moe(**other)  # a plan checked: equal
        _corrupt_kernel(monkeypatch, "weights")
        fm.fused_moe(**args)  # another plan: different, stood down
        stats_log.log_stats("exit")
    assert (stats()["checks_passed"], stats()["checks_failed"]) == (1, 1)
    lines = [r.getMessage() for r in caplog.records]
    summary = [line for line in lines if "check_failed 1 (moe_sort_mx_quant)" in line]
    assert summary, lines
    stats_lines = [line for line in lines if line.startswith(stats_log.MARKER) and NAME in line]
    assert '"checks_passed":1' in stats_lines[-1] and '"checks_failed":1' in stats_lines[-1]
    log_file = tmp_path / "server.log"
    log_file.write_text("\n".join(lines) + "\n")
    assert process_report.print_log_status(str(log_file), as_json=False) == 0
    out = capsys.readouterr().out
    assert "check_failed 1 (moe_sort_mx_quant)" in out
    assert f"{NAME}: 0 fast-path hits, 0 fallbacks, 0 errors over 1 processes; self-check: 1 calls equal to " \
           "AITER's, 1 different" in out


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp4", "fp8"])
def test_capture_takes_the_fast_path_only_for_checked_plans(stub, checking, quant):
    """As SGLang and vLLM do: each batch size eagerly first, then captured. The checked plan is captured
    with the fast path (every replay runs it); a plan not yet checked is captured with AITER's, counted."""
    import aiter.fused_moe as fm

    dev = torch.device("cuda")
    inputs = {M: moe_inputs(stub, dev, M, 64, 8, 1024, 256, quant) for M in (16, 8)}
    for args in inputs.values():
        fm.fused_moe(**args)  # AITER's own kernels compiled before any capture
    aiter_patches.apply([NAME])
    graphs = {}
    for M, warm in ((16, True), (8, False)):
        args = inputs[M]
        if warm:
            fm.fused_moe(**args)  # the eager warm-up: the check
            fm.fused_moe(**args)  # the fast path's first launch, outside capture
        before = stats()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                out = fm.fused_moe(**args)
        torch.cuda.current_stream().wait_stream(s)
        after = stats()
        captured_fast = after["fast"] - before["fast"]
        gated = after["fallback"].get(self_check.CAPTURE_REASON, 0) - before["fallback"].get(self_check.CAPTURE_REASON, 0)
        assert (captured_fast, gated) == ((2, 0) if warm else (0, 1)), (M, before, after)
        graphs[M] = (graph, out, args)
    for M, (graph, out, args) in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        with registry.suspended():
            eager = fm.fused_moe(**args)
        assert same_bits(out, eager), M
    assert stats()["checks_failed"] == 0 and registry.state(NAME) == registry.APPLIED


def test_the_addend_fold_is_checked_within_its_bound_and_stands_down_when_stage_2_overwrites(stub, device, checking,
                                                                                              monkeypatch):
    """An AITER whose stage 2 overwrites moe_buf instead of adding into it loses a folded addend: the first
    folded call returns AITER's fused_moe + the addend, and the fold stands down (the keyword still works)."""
    import aiter.fused_moe as fm

    from aiter_patches.patches.moe_addend_fold import NAME as FOLD

    args = moe_inputs(stub, device, 5, 16, 4, 256, 128, "bf16")
    addend = torch.randn(5, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(device)
    expected = fm.fused_moe(**args) + addend
    aiter_patches.apply([FOLD])
    got = fm.fused_moe(**args, moe_addend=addend)
    assert same_bits(got, expected)  # the checked call returns AITER's fused_moe + the addend
    fold = aiter_patches.stats()[FOLD]
    assert (fold["checks_passed"], fold["fast"]) == (1, 0)
    fm.fused_moe(**args, moe_addend=addend)
    assert aiter_patches.stats()[FOLD]["fast"] == 1  # then folded, unchecked

    registry.revert()
    aiter_patches.apply([FOLD])  # applied afresh: its plans are checked again
    real_copy = torch.Tensor.copy_
    # as a stage 2 that overwrites moe_buf would: the addend the fold starts moe_buf from never reaches the output
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: real_copy(self, src * 0, *a, **k)
                        if src is addend else real_copy(self, src, *a, **k))
    got = fm.fused_moe(**args, moe_addend=addend)
    monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
    assert same_bits(got, expected)
    assert registry.state(FOLD) == registry.CHECK_FAILED
    got = fm.fused_moe(**args, moe_addend=addend)  # the keyword still works: added after, counted
    assert same_bits(got, expected)
    assert aiter_patches.stats()[FOLD]["fallback"].get(self_check.STOOD_DOWN) == 1


def test_the_checks_per_patch_are_capped(monkeypatch):
    monkeypatch.setenv(self_check.ENV, "1")
    monkeypatch.setattr(self_check, "MAX_PLANS", 2)
    monkeypatch.setattr(self_check, "_plans_made", {})
    assert [self_check.new_plan("p") is not None for _ in range(3)] == [True, True, False]
    assert self_check.new_plan("q") is not None


def test_outputs_that_cannot_even_be_compared_stand_the_patch_down(stub, device, checking, monkeypatch):
    """A kernel whose quant comes back a row short: the comparison fails, never the caller's call."""
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 5, 16, 4, 256, 128, "fp8")
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    real = kernel.moe_sort_mx_quant

    def short(*a, **k):
        res = real(*a, **k)
        return res._replace(quant=(res.quant[0][:-1], res.quant[1]))

    monkeypatch.setattr(kernel, "moe_sort_mx_quant", short)
    got = fm.fused_moe(**args)
    assert same_bits(got, expected)
    assert registry.state(NAME) == registry.CHECK_FAILED
    assert "comparing the outputs raised" in next(p["reason"] for p in registry.status()["patches"] if p["name"] == NAME)


def test_the_fold_check_ignores_rows_aiter_leaves_undefined_and_matching_nans(stub, device, checking):
    import aiter.fused_moe as fm

    from aiter_patches.patches.moe_addend_fold import NAME as FOLD

    args = moe_inputs(stub, device, 5, 16, 4, 256, 128, "bf16")
    args["hidden_states"][2] = float("nan")  # a padded batch's garbage row: NaN on both sides
    addend = torch.randn(5, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(device)
    aiter_patches.apply([FOLD])
    fm.fused_moe(**args, moe_addend=addend)
    assert registry.state(FOLD) == registry.APPLIED and aiter_patches.stats()[FOLD]["checks_passed"] == 1


def _counted_walk(name):
    real = getattr(dict, name)

    def walk(self):
        _CountedArguments.walks[0] += 1
        return real(self)

    return walk


class _CountedArguments(dict):
    """A bound-arguments dict that counts every walk over its items (what a plan key built from them costs)."""

    walks = [0]
    items, keys, values, __iter__ = map(_counted_walk, ("items", "keys", "values", "__iter__"))


@pytest.mark.parametrize("check", ["1", "0"])
def test_a_known_fold_plan_costs_no_walk_over_the_arguments(stub, device, checking, monkeypatch, check):
    """After a plan's check (or with the check off), a fused_moe(moe_addend=) call finds its plan by the call's
    guarded key: it never walks the bound arguments to build the plan key again (the fast path after the check
    is unchanged: docs/self_check.md)."""
    import aiter.fused_moe as fm

    from aiter_patches import signatures
    from aiter_patches.patches.moe_addend_fold import NAME as FOLD

    monkeypatch.setenv(self_check.ENV, check)
    args = moe_inputs(stub, device, 5, 16, 4, 256, 128, "bf16")
    addend = torch.randn(5, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(device)
    aiter_patches.apply([FOLD])
    real_bind = signatures.Binder.bind
    walks = _CountedArguments.walks
    walks[0] = 0

    def counted_bind(self, a, k):
        bound, problems = real_bind(self, a, k)
        return _CountedArguments(bound), problems

    monkeypatch.setattr(signatures.Binder, "bind", counted_bind)
    fm.fused_moe(**args, moe_addend=addend)  # the plan met: its key built once (and checked, with the check on)
    first = walks[0]
    for _ in range(5):
        fm.fused_moe(**args, moe_addend=addend)
    assert walks[0] == first  # no plan key built again
    fold = aiter_patches.stats()[FOLD]
    assert (fold["checks_passed"], fold["fast"]) == ((1, 5) if check == "1" else (0, 6))


def test_a_new_fold_plan_is_checked_whatever_the_calls_before_it(stub, device, checking):
    """Another token count or another argument given: a new plan, with its own first-call check; a call the plan
    key does not tell apart from a checked one (an addend of other strides) is not checked again."""
    import aiter.fused_moe as fm

    from aiter_patches.patches.moe_addend_fold import NAME as FOLD

    def inputs(M):
        args = moe_inputs(stub, device, M, 16, 4, 256, 128, "bf16")
        return args, torch.randn(M, 256, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16).to(device)

    def counts():
        fold = aiter_patches.stats()[FOLD]
        return fold["checks_passed"], fold["fast"]

    aiter_patches.apply([FOLD])
    args5, add5 = inputs(5)
    fm.fused_moe(**args5, moe_addend=add5)
    fm.fused_moe(**args5, moe_addend=add5)
    assert counts() == (1, 1)
    args7, add7 = inputs(7)
    expected = fm.fused_moe(**args7) + add7
    got = fm.fused_moe(**args7, moe_addend=add7)  # another token count: checked, AITER's result
    assert same_bits(got, expected) and counts() == (2, 1)
    fm.fused_moe(**args7, moe_addend=add7)
    assert counts() == (2, 2)
    for given in ({"doweight_stage1": True}, {"dtype": torch.bfloat16}):
        before = counts()
        fm.fused_moe(**args5, moe_addend=add5, **given)  # another argument given: another plan, checked
        fm.fused_moe(**args5, moe_addend=add5, **given)
        assert counts() == (before[0] + 1, before[1] + 1), given
    wide = torch.zeros(5, 512, dtype=torch.bfloat16, device=device)
    wide[:, :256] = add5
    fm.fused_moe(**args5, moe_addend=wide[:, :256])  # other strides, the same plan: not checked again
    fm.fused_moe(**args5, moe_addend=wide[:, :256])
    assert counts() == (4, 6) and registry.state(FOLD) == registry.APPLIED
