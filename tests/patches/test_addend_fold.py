"""The addend fold on the stand-in AITER: fused_moe(..., moe_addend=x) == fused_moe(...) + x, folded or added once."""

import threading

import pytest
import torch

import aiter_patches
from aiter_patches import fused_moe_with_addend
from aiter_patches.patches.moe import call as moe_call
from aiter_patches.verify import suspended

from .conftest import sort_bypassing_patches
from .test_moe_sort_mx_quant_patch import moe_inputs, same_bits

NAME = "moe_addend_fold"


def stats(name=NAME):
    return aiter_patches.stats()[name]


def addend_for(args, seed=9, scale=1.0):
    M, dim = args["topk_ids"].shape[0], args["w2"].shape[1]
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, dim, generator=g) * scale).to(torch.bfloat16).to(args["topk_ids"].device)


def rel_err(a, b):
    """2-norm relative error. Not max-abs: the fold rounds each of stage 2's topk additions at the
    magnitude of ``addend + partial sum``, so single elements differ from ``sum + addend`` by up
    to ~1% of the largest element (1.1% measured at 16 tokens x 1024 on an H200)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


def reference_with_accumulator_start(fm, args, addend):
    """The stand-in's own pipeline with moe_buf starting from the addend: the bitwise reference of the fold."""
    original = fm._moe_sorting_impl

    def sort_then_start_from_addend(*a, **k):
        out = original(*a, **k)
        out[4].copy_(addend)
        return out

    fm._moe_sorting_impl = sort_then_start_from_addend
    try:
        return fm.fused_moe(**args)
    finally:
        fm._moe_sorting_impl = original


@pytest.mark.parametrize("patches", [[NAME], [NAME, "moe_sort_mx_quant"]], ids=["aiter-sort", "one-launch-sort"])
@pytest.mark.parametrize(
    "M, quant, skew",
    [(1, "bf16", None), (6, "fp4", "hot"), (40, "bf16", "one"), (64, "fp8", None)],
)
def test_fold_is_bitwise_the_accumulator_started_from_the_addend(stub, device, patches, M, quant, skew):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, M, 16, 4, 256, 128, quant, skew=skew)
    args["topk_weight"][0] = 0.0  # a token whose routed experts all have weight 0: output = addend
    addend = addend_for(args)
    expected_bits = reference_with_accumulator_start(fm, args, addend)
    plain = fm.fused_moe(**args) + addend
    aiter_patches.apply(patches)
    got = fm.fused_moe(**args, moe_addend=addend)
    assert stats()["fast"] == 1 and stats()["fallback"] == {}, stats()
    if "moe_sort_mx_quant" in patches:
        assert stats("moe_sort_mx_quant")["fast"] >= 1, "the addend went through the one-launch sort"
    assert same_bits(got, expected_bits)
    assert rel_err(got, plain) <= 1e-2
    assert same_bits(got[0], addend[0])


@pytest.mark.parametrize("patches", [[NAME], [NAME, "moe_sort_mx_quant"]], ids=["aiter-sort", "one-launch-sort"])
def test_rows_past_num_local_tokens(stub, device, patches, monkeypatch):
    """Rows < num_local_tokens[0]: the fold. Rows past it are never written by AITER's sort or stage 2:
    after AITER's sort they hold the addend (the fold copies whole rows); after the one-launch sort they
    hold whatever the buffer held (the kernel leaves them, like AITER's zero-fill)."""
    import aiter.fused_moe as fm
    from aiter_patches.kernels import moe_sort_mx_quant as kernel

    args = moe_inputs(stub, device, 8, 16, 4, 256, 128, "bf16")
    args["num_local_tokens"] = torch.tensor([5], dtype=torch.int32, device=device)
    addend = addend_for(args)
    expected = reference_with_accumulator_start(fm, args, addend)
    poison = float("nan")
    real_empty = kernel._empty

    def poisoned_empty(*a, **k):
        t = real_empty(*a, **k)
        if t.dtype == torch.bfloat16:
            t.fill_(poison)
        return t

    monkeypatch.setattr(kernel, "_empty", poisoned_empty)
    aiter_patches.apply(patches)
    got = fm.fused_moe(**args, moe_addend=addend)
    assert same_bits(got[:5], expected[:5])
    if patches == [NAME]:
        assert same_bits(got[5:], addend[5:])
    else:
        assert torch.isnan(got[5:].float()).all()


def test_reduce_mode_adds_after_once(stub, device, monkeypatch):
    import aiter.fused_moe as fm

    monkeypatch.setenv("AITER_STUB_STAGE2_MODE", "reduce")
    args = moe_inputs(stub, device, 6, 16, 4, 256, 128, "bf16")
    addend = addend_for(args, scale=1000.0)  # distinctive: dropped or doubled would show
    expected = fm.fused_moe(**args) + addend
    aiter_patches.apply([NAME])
    got = fm.fused_moe(**args, moe_addend=addend)
    assert same_bits(got, expected)
    assert stats()["fast"] == 0
    assert stats()["fallback"] == {"stage 2 overwrites its output (accumulate=False: reduce mode)": 1}


def test_expert_parallel_adds_after_once(stub, device):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 6, 16, 4, 256, 128, "bf16")
    mask = torch.zeros(16, dtype=torch.int32, device=device)
    mask[::2] = 1
    local = args["w1"][::2].contiguous(), args["w2"][::2].contiguous()
    args.update(w1=local[0], w2=local[1], expert_mask=mask)
    addend = addend_for(args, scale=1000.0)
    expected = fm.fused_moe(**args) + addend
    aiter_patches.apply([NAME])
    got = fm.fused_moe(**args, moe_addend=addend)
    assert same_bits(got, expected)
    assert list(stats()["fallback"]) == ["expert_mask (EP): AITER's EP stage 2 may switch to reduce mode"]


def test_a_sort_that_bypasses_moe_sorting_impl_adds_after_once(stub, device, monkeypatch):
    """FlyDSL and flat sorts never reach _moe_sorting_impl: the addend is added after the call, once, counted."""
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 6, 16, 4, 256, 128, "bf16")
    addend = addend_for(args, scale=1000.0)
    expected = fm.fused_moe(**args) + addend
    unpatched_impl = fm._moe_sorting_impl
    aiter_patches.apply([NAME, "moe_sort_mx_quant"])
    monkeypatch.setattr(fm, "moe_sorting", sort_bypassing_patches(fm, unpatched_impl))
    got = fm.fused_moe(**args, moe_addend=addend)
    assert same_bits(got, expected)
    assert stats()["fast"] == 0
    assert list(stats()["fallback"]) == ["the sort did not run through _moe_sorting_impl (flat or FlyDSL sort)"]


def test_an_output_other_than_moe_buf_gets_the_addend_once(stub, device, monkeypatch):
    """A stage 2 that writes a fresh buffer (not the sort's moe_buf): the addend is added to what it returns."""
    import aiter.fused_moe as fm

    original = fm.fused_moe_2stages

    def into_a_fresh_buffer(*a, **k):
        a = list(a)
        a[8] = torch.zeros_like(a[8])  # moe_buf
        return original(*a, **k)

    monkeypatch.setattr(fm, "fused_moe_2stages", into_a_fresh_buffer)
    args = moe_inputs(stub, device, 6, 16, 4, 256, 128, "bf16")
    addend = addend_for(args, scale=1000.0)
    expected = fm.fused_moe(**args) + addend
    aiter_patches.apply([NAME])
    got = fm.fused_moe(**args, moe_addend=addend)
    assert same_bits(got, expected)
    assert stats()["fast"] == 0
    assert list(stats()["fallback"]) == ["fused_moe returned another tensor than the sort's moe_buf"]


@pytest.mark.parametrize("change, reason", [
    (dict(output_aux=True), "output_aux"),
    (dict(return_local_topk_ids=True), "return_local_topk_ids"),
    (dict(moebuf_dtype=torch.float32), "moe_buf dtype torch.float32 differs"),
    (dict(model_dim=128), "moe_buf shape differs"),
    (dict(accumulate=False), "accumulate=False"),
    (dict(expert_mask=torch.ones(16, dtype=torch.int32)), "expert_mask (EP)"),
])
def test_every_fold_blocker_names_its_reason(change, reason):
    from aiter_patches.patches.moe_addend_fold import fold_blocker

    call = moe_call.MoeCall(hidden_states=None)
    call.addend = torch.zeros(6, 256, dtype=torch.bfloat16)
    bound = dict(topk_ids=torch.zeros(6, 4, dtype=torch.int32), model_dim=256, moebuf_dtype=torch.bfloat16,
                 accumulate=True)
    assert fold_blocker(bound, call) is None
    assert reason in fold_blocker({**bound, **change}, call)


def test_deferred_work_that_computes_the_addend_is_seen(stub, device):
    """Work run right after the sort launch (DeferredWork) may produce the addend itself: the one-launch
    sort must not read it before that work ran; the fold copies it afterwards instead."""
    import aiter.fused_moe as fm
    from aiter_patches.extensions.deferred_work import DeferredWork

    args = moe_inputs(stub, device, 6, 16, 4, 256, 128, "bf16")
    real = addend_for(args, scale=1000.0)
    expected = reference_with_accumulator_start(fm, args, real)
    aiter_patches.apply([NAME, "sort_extension", "moe_sort_mx_quant"])
    shared = torch.zeros_like(real)
    with aiter_patches.sort_extension(DeferredWork(lambda: shared.copy_(real))):
        got = fm.fused_moe(**args, moe_addend=shared)
    assert same_bits(got, expected)
    assert stats()["fast"] == 1
    assert stats("moe_sort_mx_quant")["fast"] >= 1


def test_prefill_sizes_through_the_four_launch_sort(stub, device, monkeypatch):
    """The multi-launch sort path writes the addend as moe_buf's fill too (thresholds lowered for the CPU)."""
    import aiter.fused_moe as fm
    from aiter_patches.kernels import moe_sort_mx_quant as kernel

    monkeypatch.setattr(kernel, "ONE_LAUNCH_MAX_PAIRS", 16)
    monkeypatch.setattr(kernel, "CHUNK_PAIRS", 32)
    args = moe_inputs(stub, device, 37, 16, 4, 256, 128, "fp4", skew="hot")
    addend = addend_for(args)
    expected = reference_with_accumulator_start(fm, args, addend)
    aiter_patches.apply([NAME, "moe_sort_mx_quant"])
    got = fm.fused_moe(**args, moe_addend=addend)
    assert same_bits(got, expected)
    assert stats()["fast"] == 1 and stats("moe_sort_mx_quant")["fast"] >= 1


def test_no_addend_is_exactly_the_original(stub, device):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 5, 8, 2, 256, 128, "fp4")
    expected = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    assert same_bits(fm.fused_moe(**args), expected)
    assert fm.fused_moe(**args, moe_addend=None) is not None
    assert stats() == {"fast": 0, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}


def test_fused_moe_with_addend_is_the_same_either_way(stub, device):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 7, 16, 4, 256, 128, "bf16")
    addend = addend_for(args)
    unpatched = fused_moe_with_addend(addend, **args)
    assert same_bits(unpatched, fm.fused_moe(**args) + addend)
    aiter_patches.apply([NAME])
    folded = fused_moe_with_addend(addend, **args)
    assert stats()["fast"] == 1
    assert rel_err(folded, unpatched) <= 1e-2


@pytest.mark.parametrize(
    "make_bad, rule",
    [
        (lambda a, x: x[:-1], r"moe_addend must have shape \[tokens, model_dim\]"),
        (lambda a, x: x.float(), "moe_addend must have the output dtype"),
        (lambda a, x: a["hidden_states"], "must not share memory with hidden_states"),
        (lambda a, x: "nope", "moe_addend must be a torch.Tensor"),
        (lambda a, x: torch.empty(x.shape, dtype=x.dtype, device="meta"), "moe_addend must be on"),
    ],
)
def test_misuse_is_a_value_error_naming_the_rule(stub, device, make_bad, rule):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 4, 8, 2, 256, 128, "bf16")
    args["w2"] = args["w2"][:, :256]  # model_dim 256 == hidden: hidden_states has the addend's shape
    aiter_patches.apply([NAME])
    with pytest.raises(ValueError, match=rule):
        fm.fused_moe(**args, moe_addend=make_bad(args, addend_for(args)))


def test_threads_with_different_addends_do_not_mix(stub, device):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 4, 8, 2, 256, 128, "bf16")
    base = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    barrier = threading.Barrier(6)
    results, errors = {}, []

    def worker(i):
        try:
            addend = torch.full_like(base, float(1000 * (i + 1)))
            barrier.wait()
            for _ in range(3):
                results[i] = (fm.fused_moe(**args, moe_addend=addend), addend)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, (out, addend) in results.items():
        assert rel_err(out, base + addend) <= 1e-2, i
    assert moe_call.current() is None


@pytest.mark.gpu
def test_cuda_graph_with_addend(stub):
    import aiter.fused_moe as fm

    dev = torch.device("cuda")
    args = moe_inputs(stub, dev, 16, 64, 8, 1024, 256, "fp4")
    addend = addend_for(args)
    aiter_patches.apply([NAME, "moe_sort_mx_quant"])
    fm.fused_moe(**args, moe_addend=addend)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    static_add = addend.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fm.fused_moe(**static, moe_addend=static_add)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(**static, moe_addend=static_add)
    for seed in (1, 2):
        # New activations and routing only: the captured weights stay those of `args`.
        fresh = moe_inputs(stub, dev, 16, 64, 8, 1024, 256, "fp4", seed=seed)
        new = {**args, **{k: fresh[k] for k in ("hidden_states", "topk_weight", "topk_ids")}}
        new_add = addend_for(new, seed=seed)
        for k in ("hidden_states", "topk_weight", "topk_ids"):
            static[k].copy_(new[k])
        static_add.copy_(new_add)
        graph.replay()
        torch.cuda.synchronize()
        eager = fm.fused_moe(**new, moe_addend=new_add)
        assert same_bits(out, eager)
        with suspended():
            plain = fm.fused_moe(**new) + new_add
        assert rel_err(out, plain) <= 1e-2


def test_overlap_is_same_storage_and_overlapping_bytes():
    """Same storage and overlapping byte spans: both must hold (the storage test runs first, the cheaper one)."""
    from aiter_patches.patches.moe_addend_fold import _overlaps

    base = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert _overlaps(base[:4], base[3:])  # one shared row
    assert not _overlaps(base[:4], base[4:])  # adjacent rows of one storage
    assert _overlaps(base[:, :8], base[:, 8:])  # interleaved rows: the spans overlap (the rule is conservative)
    assert not _overlaps(base, base.clone())
    assert not _overlaps(base[:0], base)
    view = torch.zeros(64, dtype=torch.bfloat16)
    assert _overlaps(view[8:40].view(2, 16), view[32:].view(2, 16))
