"""Sort outputs reused between fused_moe calls (sort_scratch.py): only where nothing reads them after the call.

Every reuse is checked for AITER's bits with the reused set poisoned first, and every case that must not
reuse (a sort called on its own or under moe_call.scope, an active extension, a capture, the switch off,
the byte limit) is checked to allocate, through the pool's counters and the outputs a caller keeps.
"""

import functools
import sys
import types

import pytest
import torch

import aiter_patches
from aiter_patches.kernels import moe_sort_mx_quant as kernel
from aiter_patches.patches.moe import sort_scratch as sort_scratch
from aiter_patches.patches.moe import call as moe_call
from aiter_patches.patches.moe_sort_mx_quant import FEATURE
from aiter_patches.patches.sort_extension import SortExtension, sort_extension
from aiter_patches.verify import suspended

from .conftest import routing
from .test_moe_sort_mx_quant_patch import NAME, moe_inputs, same_bits

SHAPE = (3, 8, 2, 256, 128)  # tokens, experts, topk, model dim, inter dim


def counts():
    s = sort_scratch.stats()
    return s["leased"], s["made"]


def free_sets():
    return [got for e in sort_scratch._pool.values() for got in e[1]]


def free_bytes():
    """The device bytes of the free sets in the pool, read off the tensors themselves."""
    return sum(t.numel() * t.element_size() for got in free_sets()
               for t in (got.sorted_ids, got.sorted_weights, got.sorted_expert_ids, got.num_valid_ids,
                         *(got.quant or ())))


def poison(got):
    for t in (got.sorted_ids, got.sorted_weights, got.sorted_expert_ids, got.num_valid_ids, got.q_u8, got.s_u8):
        t.view(torch.uint8).fill_(0x7F)


@pytest.fixture
def fm(stub):
    import aiter.fused_moe as fm

    sort_scratch.clear()
    base = dict(sort_scratch._stats)
    yield fm
    sort_scratch.clear()
    sort_scratch._stats.update(base)


@pytest.fixture
def two_calls(stub, device):
    """Two fused_moe calls of one shape (other routing, other activations) and AITER's outputs for them."""
    import aiter.fused_moe as fm

    a = moe_inputs(stub, device, *SHAPE, "fp4", seed=1)
    b = moe_inputs(stub, device, *SHAPE, "fp4", seed=2)
    assert not torch.equal(a["topk_ids"], b["topk_ids"])
    return a, b, fm.fused_moe(**a), fm.fused_moe(**b)


def test_a_reused_set_gives_aiters_bits_whatever_it_held(fm, two_calls):
    a, b, want_a, want_b = two_calls
    aiter_patches.apply([NAME])
    assert same_bits(fm.fused_moe(**a), want_a)  # the verdict's first launch allocates (its plan is kept)
    leased, made = counts()
    assert same_bits(fm.fused_moe(**a), want_a)
    assert counts() == (leased + 1, made + 1)
    for _ in range(2):
        for got in free_sets():
            poison(got)
        assert same_bits(fm.fused_moe(**b), want_b)
        assert same_bits(fm.fused_moe(**a), want_a)
    assert counts() == (leased + 5, made + 1), "one set, leased call after call"
    assert aiter_patches.stats()[NAME]["fallback"] == {}


def test_the_set_is_the_calls_until_aiters_fused_moe_returns(fm, two_calls, stub, monkeypatch):
    """A call that starts while another holds its set (a nested call here: another thread's on the same
    stream alike) gets a set of its own, and both get AITER's bits."""
    import aiter.ops._leaf_kernels as leaf

    a, b, want_a, want_b = two_calls
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    fm.fused_moe(**a)
    assert len(free_sets()) == 1
    stage1, seen = leaf.moe_stage1, {}

    def stage1_with_another_call(*args, **kwargs):
        if not seen:
            seen["free while leased"] = len(free_sets())
            seen["inner"] = fm.fused_moe(**b)
        return stage1(*args, **kwargs)

    monkeypatch.setattr(leaf, "moe_stage1", stage1_with_another_call)
    leased, made = counts()
    assert same_bits(fm.fused_moe(**a), want_a)
    assert seen["free while leased"] == 0
    assert same_bits(seen["inner"], want_b)
    assert counts() == (leased + 2, made + 1)
    assert len(free_sets()) == 2


def test_a_failing_call_gives_its_set_back(fm, two_calls, monkeypatch):
    import aiter.ops._leaf_kernels as leaf

    a, _, want_a, _ = two_calls
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    fm.fused_moe(**a)

    def boom(*args, **kwargs):
        raise RuntimeError("stage 1 failed")

    stage1 = leaf.moe_stage1
    monkeypatch.setattr(leaf, "moe_stage1", boom)
    with pytest.raises(RuntimeError, match="stage 1 failed"):
        fm.fused_moe(**a)
    assert len(free_sets()) == 1
    monkeypatch.setattr(leaf, "moe_stage1", stage1)
    _, made = counts()
    assert same_bits(fm.fused_moe(**a), want_a)
    assert counts()[1] == made


def test_a_sort_called_on_its_own_or_under_a_scope_keeps_its_outputs(fm, stub, device):
    M, E, topk, dim, _ = SHAPE
    ids, w = routing(M, E, topk, device, seed=1)
    ids2, w2 = routing(M, E, topk, device, seed=2)
    x = torch.randn(M, dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    aiter_patches.apply([NAME])
    kept = []
    for _ in range(3):
        for i, wt in ((ids, w), (ids2, w2)):
            with moe_call.scope(moe_call.MoeCall(hidden_states=x, quant_dtype=stub.dtypes.fp4x2)):
                kept.append(fm.moe_sorting(i, wt, E, dim, torch.bfloat16, 32))
            kept.append(fm.moe_sorting(i, wt, E, dim, torch.bfloat16, 32))
    assert aiter_patches.stats()[NAME]["fast"] >= 6
    assert counts() == (0, 0)
    with suspended():
        want = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, 32)
    first = kept[0]
    n = int(want[3][0])
    assert torch.equal(first[3], want[3]) and torch.equal(first[0][:n], want[0][:n]), "overwritten by a later sort"


def test_no_reuse_while_an_extension_sees_the_outputs(fm, two_calls):
    class Keeps(SortExtension):
        def __init__(self):
            self.outputs = []

        def sort(self, call):
            return None

        def after_sort(self, call, outputs):
            self.outputs.append(outputs)

    a, b, want_a, want_b = two_calls
    aiter_patches.apply(["sort_extension", NAME])
    ext = Keeps()
    with sort_extension(ext):
        for _ in range(2):
            assert same_bits(fm.fused_moe(**a), want_a)
            assert same_bits(fm.fused_moe(**b), want_b)
    assert counts() == (0, 0)
    assert len({id(o[0]) for o in ext.outputs}) == len(ext.outputs)
    assert aiter_patches.stats()[NAME]["fast"] >= 2


@pytest.mark.parametrize("why", ["capturing", "a graph tree", "switched off", "over the byte limit"])
def test_no_reuse_where_it_could_be_read_or_is_refused(fm, two_calls, monkeypatch, why):
    a, _, want_a, _ = two_calls
    if why == "capturing":
        monkeypatch.setattr(sort_scratch.device_stream, "capturing", lambda dev: True)
    elif why == "a graph tree":
        monkeypatch.setattr(sort_scratch, "_kept_after_the_call", lambda dev: True)
    elif why == "switched off":
        monkeypatch.setenv("AITER_PATCHES_SORT_SCRATCH", "0")
    else:
        monkeypatch.setattr(sort_scratch, "MAX_BYTES", 1024)
    aiter_patches.apply([NAME])
    before = sort_scratch.stats()["refused"]
    for _ in range(3):
        assert same_bits(fm.fused_moe(**a), want_a)
    assert counts() == (0, 0)
    assert sort_scratch.stats()["refused"] - before == (2 if why == "over the byte limit" else 0)
    assert aiter_patches.stats()[NAME]["fast"] == 6  # three sorts, three hand-backs


def test_sets_are_per_stream(fm, two_calls, monkeypatch):
    a, b, want_a, want_b = two_calls
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    fm.fused_moe(**a)
    stream = [7]
    real = sort_scratch.device_stream.stream_key
    monkeypatch.setattr(sort_scratch.device_stream, "stream_key", lambda dev: (real(dev)[0], stream[0]))
    leased, made = counts()
    assert same_bits(fm.fused_moe(**b), want_b)
    stream[0] = 8
    assert same_bits(fm.fused_moe(**a), want_a)
    stream[0] = 7
    assert same_bits(fm.fused_moe(**a), want_a)
    assert counts() == (leased + 3, made + 2)
    assert len(sort_scratch._pool) == 3


def test_apply_and_revert_drop_the_pool(fm, two_calls):
    a, _, want_a, _ = two_calls
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    fm.fused_moe(**a)
    assert sort_scratch.stats()["plans"] == 1 and sort_scratch.stats()["bytes"] > 0
    aiter_patches.revert()
    aiter_patches.apply([NAME])
    assert sort_scratch.stats()["plans"] == 0 and sort_scratch.stats()["bytes"] == 0
    assert same_bits(fm.fused_moe(**a), want_a)
    assert same_bits(fm.fused_moe(**a), want_a)
    assert sort_scratch.stats()["plans"] == 1


def test_no_reuse_while_aiters_bench_hook_keeps_the_stage_launches(fm, two_calls, monkeypatch):
    """AITER's ``kernel_bench_callable`` (None in production) keeps every stage launch, with the sort tables
    and the quant it reads, to replay after the call: a set handed to such a launch must stay its own."""
    import aiter.ops._leaf_kernels as leaf

    a, b, want_a, want_b = two_calls
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    fm.fused_moe(**a)
    kept = []
    monkeypatch.setattr(fm, "kernel_bench_callable", kept, raising=False)
    stage1 = leaf.moe_stage1

    def keeps_the_launch(*args, **kwargs):  # what AITER's hook keeps: the stage-1 call with its arguments
        kept.append(functools.partial(stage1, *args, **kwargs))
        return stage1(*args, **kwargs)

    monkeypatch.setattr(leaf, "moe_stage1", keeps_the_launch)
    leased, made = counts()
    assert same_bits(fm.fused_moe(**a), want_a)
    replay_a = kept[-1]
    out = replay_a.args[5]  # stage 1 writes its output in place
    out.zero_()
    replay_a()
    first = out.clone()
    assert same_bits(fm.fused_moe(**b), want_b)  # another layer or step of the same shape
    out.zero_()
    replay_a()
    assert torch.equal(out, first), "the kept launch read another call's sort tables"
    assert counts() == (leased, made)


def test_a_failed_allocation_is_not_counted(fm, two_calls, monkeypatch):
    """A set whose allocation raised (an out-of-memory) is not in the pool's bytes: AITER does that call,
    and the next one leases within the same limit."""
    a, _, want_a, _ = two_calls
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    new_outputs, fails = kernel.new_outputs, [3]

    def out_of_memory(*args, **kwargs):
        if fails[0]:
            fails[0] -= 1
            raise torch.OutOfMemoryError("simulated: out of memory")
        return new_outputs(*args, **kwargs)

    monkeypatch.setattr(kernel, "new_outputs", out_of_memory)
    for _ in range(3):
        assert same_bits(fm.fused_moe(**a), want_a)
    assert sort_scratch.stats()["bytes"] == 0 and counts() == (0, 0)
    assert sum(aiter_patches.stats()[NAME]["errors"].values()) == 3
    assert same_bits(fm.fused_moe(**a), want_a)
    assert same_bits(fm.fused_moe(**a), want_a)
    assert counts() == (2, 1) and sort_scratch.stats()["bytes"] == free_bytes() > 0


def test_the_pool_dropped_while_a_call_holds_a_set(fm, two_calls, monkeypatch):
    """apply() or revert() in another thread while a call holds a set: that set is freed when its call ends,
    and the bytes counted are those of the sets the pool holds."""
    import aiter.ops._leaf_kernels as leaf

    a, b, want_a, want_b = two_calls
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    fm.fused_moe(**a)
    stage1, done = leaf.moe_stage1, []

    def meanwhile(*args, **kwargs):
        if not done:
            done.append(1)
            FEATURE.forget()  # what apply() and revert() do to the pool
            assert same_bits(fm.fused_moe(**b), want_b)
            assert same_bits(fm.fused_moe(**b), want_b)
        return stage1(*args, **kwargs)

    monkeypatch.setattr(leaf, "moe_stage1", meanwhile)
    assert same_bits(fm.fused_moe(**a), want_a)
    assert len(free_sets()) == 1
    assert sort_scratch.stats()["bytes"] == free_bytes() > 0


def test_the_sets_used_longest_ago_make_room(fm, stub, device, monkeypatch):
    """Past MAX_BYTES, free sets of batch sizes not seen lately are dropped for the size in use now."""
    aiter_patches.apply([NAME])
    hot = moe_inputs(stub, device, 1, 8, 2, 256, 128, "fp4", seed=4)
    with suspended():
        want = fm.fused_moe(**hot)
    for M in (2, 3, 4):  # a warm-up sweep: each size seen twice, then not again (each set larger than hot's)
        args = moe_inputs(stub, device, M, 8, 2, 256, 128, "fp4")
        fm.fused_moe(**args)
        fm.fused_moe(**args)
    assert len(free_sets()) == 3
    monkeypatch.setattr(sort_scratch, "MAX_BYTES", sort_scratch.stats()["bytes"])  # the pool is full
    fm.fused_moe(**hot)
    leased = counts()[0]
    for _ in range(4):
        for got in free_sets():
            poison(got)
        assert same_bits(fm.fused_moe(**hot), want)
    assert counts()[0] == leased + 4, "the size in use leases its set every call"
    assert sort_scratch.stats()["evicted"] == 1 and sort_scratch.stats()["refused"] == 0
    assert sorted(got.quant[0].shape[0] for got in free_sets()) == [1, 3, 4], "the size used longest ago went"
    assert sort_scratch.stats()["plans"] == 3
    assert sort_scratch.stats()["bytes"] == free_bytes() <= sort_scratch.MAX_BYTES


def test_a_set_that_cannot_fit_drops_nothing(fm, stub, device, monkeypatch):
    """A set larger than what dropping every other free set would make room for is refused at once: the
    sets of the sizes in use stay."""
    big = moe_inputs(stub, device, 4, 8, 2, 1024, 128, "fp4")  # a wider layer: more bytes than both small sets
    want = fm.fused_moe(**big)
    aiter_patches.apply([NAME])
    small = [moe_inputs(stub, device, M, 8, 2, 256, 128, "fp4") for M in (1, 2)]
    for args in small:
        fm.fused_moe(**args)
        fm.fused_moe(**args)
    monkeypatch.setattr(sort_scratch, "MAX_BYTES", sort_scratch.stats()["bytes"] + 64)
    for _ in range(3):
        assert same_bits(fm.fused_moe(**big), want)
    s = sort_scratch.stats()
    assert (s["evicted"], s["refused"], len(free_sets())) == (0, 2, 2)


@pytest.mark.parametrize("again", [False, True])
def test_a_set_whose_plan_was_dropped_while_leased(fm, stub, device, monkeypatch, again):
    """Room made while a call holds a set drops that plan's entry: the set is uncounted when it comes back,
    or filed into the plan's new entry if the same size leased again meanwhile."""
    import aiter.ops._leaf_kernels as leaf

    aiter_patches.apply([NAME])
    a, c, b = (moe_inputs(stub, device, M, 8, 2, 256, 128, "fp4") for M in (2, 3, 1))  # b's set: the smallest
    for args in (a, c):
        fm.fused_moe(**args)
        fm.fused_moe(**args)
    monkeypatch.setattr(sort_scratch, "MAX_BYTES", sort_scratch.stats()["bytes"])
    fm.fused_moe(**b)  # its verdict's first launch (no lease yet)
    stage1, seen = leaf.moe_stage1, {}

    def meanwhile(*args, **kwargs):
        if not seen:  # inside a's call, which holds a's set
            seen["plans"] = sort_scratch.stats()["plans"]
            fm.fused_moe(**c)  # c leased later than a
            fm.fused_moe(**b)  # b makes room: a's entry (no free set) and c's set go
            seen["after"] = sorted(got.quant[0].shape[0] for got in free_sets())
            if again:  # a call of a's size (another one: the same activations would join a's call)
                fm.fused_moe(**moe_inputs(stub, device, 2, 8, 2, 256, 128, "fp4", seed=9))
        return stage1(*args, **kwargs)

    monkeypatch.setattr(leaf, "moe_stage1", meanwhile)
    fm.fused_moe(**a)
    assert seen["after"] == [1]
    assert sorted(got.quant[0].shape[0] for got in free_sets()) == ([2, 2] if again else [1])
    assert sort_scratch.stats()["bytes"] == free_bytes() <= sort_scratch.MAX_BYTES


def test_a_call_that_returned_lends_no_more_sets(fm, two_calls, monkeypatch):
    """A sort under ``moe_call.scope`` of a call object kept past its return keeps its outputs: nothing
    would give a set back."""
    import aiter.ops._leaf_kernels as leaf

    a, _, want_a, _ = two_calls
    aiter_patches.apply([NAME])
    seen, stage1 = [], leaf.moe_stage1

    def keep_the_call(*args, **kwargs):
        seen.append((moe_call.current(), moe_call.current().scratch))
        return stage1(*args, **kwargs)

    monkeypatch.setattr(leaf, "moe_stage1", keep_the_call)
    for _ in range(2):
        assert same_bits(fm.fused_moe(**a), want_a)
    call, during = seen[-1]
    assert during is not None and call.scratch is None
    leased, made = counts()
    outs = []
    for _ in range(3):
        with moe_call.scope(call):
            outs.append(fm.moe_sorting(a["topk_ids"], a["topk_weight"], 8, 256, torch.bfloat16, 32))
    assert counts() == (leased, made) and call.scratch is None
    assert len({id(o[0]) for o in outs}) == 3


def test_the_pool_dropped_between_a_leases_reads(fm, two_calls, monkeypatch):
    """apply() or revert() in another thread between a lease's reads, and a call that fills the new pool
    meanwhile: the set taken from the new pool is counted there and filed back there."""
    a, b, want_a, want_b = two_calls
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    fm.fused_moe(**a)
    fired = []

    class Meanwhile(dict):
        def get(self, key, default=None):
            if not fired:
                fired.append(1)
                sort_scratch.clear()  # what apply() and revert() do to the pool
                assert same_bits(fm.fused_moe(**b), want_b)  # leaves a set of the new pool free
                assert same_bits(fm.fused_moe(**b), want_b)
            return dict.get(self, key, default)

    monkeypatch.setattr(sort_scratch, "_pool", Meanwhile(sort_scratch._pool))
    assert same_bits(fm.fused_moe(**a), want_a)
    assert fired and len(free_sets()) == 1
    assert sort_scratch.stats()["bytes"] == free_bytes() > 0


class _Tree:
    def __init__(self, manager):
        self.tree_manager = manager


@pytest.mark.parametrize("trees,expected", [
    (None, False),  # torch.compile's CUDA-graph trees never imported
    ({}, False),  # imported, no tree on this device in this thread
    ({0: _Tree(None)}, False),
    ({0: _Tree(object())}, True),  # reduce-overhead ran on this device: its warm-ups allocate to its pool
    ({1: _Tree(object())}, False),  # another device's
    ("unreadable", True),  # a torch whose trees are not read this way: assume one is there
])
def test_no_reuse_beside_cudagraph_trees(monkeypatch, trees, expected):
    name = "torch._inductor.cudagraph_trees"
    if trees is None:
        monkeypatch.delitem(sys.modules, name, raising=False)
    else:
        fake = types.ModuleType(name)
        fake.local = object()
        if trees != "unreadable":
            fake.get_obj = lambda local, attr: trees if attr == "tree_manager_containers" else None
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.delitem(sys.modules, "aiter.fused_moe", raising=False)
    assert sort_scratch._kept_after_the_call(torch.device("cuda", 0)) is expected
    monkeypatch.setattr(sort_scratch.device_stream, "current_index", lambda: 0)
    assert sort_scratch._kept_after_the_call(torch.device("cuda")) is expected  # no index: the current device
    assert sort_scratch._kept_after_the_call(torch.device("cpu")) is False


@pytest.mark.gpu
def test_a_captured_call_leases_nothing_and_replays_beside_eager_reuse(stub):
    """On a GPU: eager calls reuse their set; a CUDA-graph capture of the same call leases none (its
    buffers are the graph's), and its replays stay AITER's while eager calls reuse their set between them."""
    import aiter.fused_moe as fm

    dev = torch.device("cuda")
    sort_scratch.clear()
    args = moe_inputs(stub, dev, 16, 64, 8, 1024, 256, "fp4")
    aiter_patches.apply([NAME])
    for _ in range(3):
        fm.fused_moe(**args)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fm.fused_moe(**static)
    torch.cuda.current_stream().wait_stream(s)
    leased = sort_scratch.stats()["leased"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        out = fm.fused_moe(**static)
    assert sort_scratch.stats()["leased"] == leased
    for seed in (1, 2):
        new = moe_inputs(stub, dev, 16, 64, 8, 1024, 256, "fp4", seed=seed)
        for k in ("hidden_states", "topk_weight", "topk_ids"):
            static[k].copy_(new[k])
        graph.replay()
        with torch.cuda.stream(s):  # eager reuse on the capture's own stream, queued after the replay
            other = moe_inputs(stub, dev, 16, 64, 8, 1024, 256, "fp4", seed=seed + 10)
            fm.fused_moe(**other)
        torch.cuda.synchronize()
        with suspended():
            eager = fm.fused_moe(**{**args, **{k: new[k] for k in ("hidden_states", "topk_weight", "topk_ids")}})
        assert same_bits(out, eager)
    assert sort_scratch.stats()["leased"] > leased


def _patched_and_warm(stub, dev, calls: int):
    """``(aiter.fused_moe, arguments, AITER's output)`` of a full-size call, after ``calls`` patched calls with
    AITER's bits (a set is free in the pool from the second)."""
    import aiter.fused_moe as fm

    sort_scratch.clear()
    args = moe_inputs(stub, dev, 16, 64, 8, 1024, 256, "fp4")
    with suspended():
        want = fm.fused_moe(**args)
    aiter_patches.apply([NAME])
    for _ in range(calls):
        assert same_bits(fm.fused_moe(**args), want)
    return fm, args, want


@pytest.mark.gpu
def test_no_reuse_once_torch_compile_keeps_cudagraph_trees_on_the_device(stub):
    """On a GPU: after a ``torch.compile(mode="reduce-overhead")`` function ran on this device in this thread,
    its graph trees' warm-ups may route allocations into their private pool: fused_moe leases nothing
    (AITER's bits), until the trees are reset."""
    from torch._inductor import cudagraph_trees

    dev = torch.device("cuda")
    fm, args, want = _patched_and_warm(stub, dev, 3)
    leased = sort_scratch.stats()["leased"]
    assert leased > 0
    compiled = torch.compile(lambda t: t * 2 + 1, mode="reduce-overhead")
    x = torch.randn(64, device=dev)
    try:
        for _ in range(3):
            compiled(x)
        assert sort_scratch._kept_after_the_call(x.device) and sort_scratch._kept_after_the_call(dev)
        for _ in range(3):
            assert same_bits(fm.fused_moe(**args), want)
        assert sort_scratch.stats()["leased"] == leased
    finally:
        cudagraph_trees.reset_cudagraph_trees()
    assert not sort_scratch._kept_after_the_call(x.device)
    fm.fused_moe(**args)
    assert sort_scratch.stats()["leased"] == leased + 1


@pytest.mark.gpu
def test_tensors_on_another_gpu_than_the_current_one_are_aiters(stub, monkeypatch):
    """On a GPU: a fused_moe call whose tensors are not on the current device (faked: it reads as cuda:7) is
    AITER's, bit for bit, with the reason counted; the set it leased goes back unwritten."""
    from triton.runtime import driver

    from aiter_patches.kernels import fast_launch

    fm, args, want = _patched_and_warm(stub, torch.device("cuda"), 2)
    leased = sort_scratch.stats()["leased"]
    monkeypatch.setattr(driver.active, "get_current_device", lambda: 7)
    monkeypatch.setattr(fast_launch.device_stream, "current_index", lambda: 7)
    for _ in range(2):
        assert same_bits(fm.fused_moe(**args), want)
    errors = aiter_patches.stats()[NAME]["errors"]
    assert errors.get("moe_sort_mx_quant kernel: WrongDevice") == 2, errors
    assert sort_scratch.stats()["leased"] == leased + 2 and len(free_sets()) == 1  # leased, given back unused


# ---------------------------------------------------------------- issue 35 item 2: nothing pooled leaves the pipeline


def _bytes(ts):
    """Bitwise copies of tensors (a NaN compares unequal to itself: compare bytes)."""
    return [t.detach().contiguous().view(torch.uint8).clone() for t in ts]


def _unchanged(ts, copies):
    return all(torch.equal(t.detach().contiguous().view(torch.uint8), c) for t, c in zip(ts, copies))


@pytest.mark.parametrize("where", ["_moe_sorting_impl", "fused_dynamic_mxfp4_quant_moe_sort"])
def test_a_foreign_layer_over_the_sort_or_the_quant_keeps_what_it_was_handed(fm, two_calls, monkeypatch, where):
    """An outer layer (tracing, debug dump, router statistics) installed after the pool engaged keeps what our
    wrapper returns it: the next call with other routing leaves it as it was, and both calls keep AITER's bits."""
    a, b, want_a, want_b = two_calls
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    fm.fused_moe(**a)
    assert len(free_sets()) == 1  # the pool is engaged
    ours, kept = getattr(fm, where), []

    @functools.wraps(ours)
    def keeps(*args, **kwargs):
        out = ours(*args, **kwargs)
        ts = [t for t in (out[:4] if where == "_moe_sorting_impl" else out) if isinstance(t, torch.Tensor)]
        kept.append((ts, _bytes(ts)))
        return out

    monkeypatch.setattr(fm, where, keeps)
    assert same_bits(fm.fused_moe(**a), want_a)
    assert same_bits(fm.fused_moe(**b), want_b)
    assert kept and all(_unchanged(ts, copies) for ts, copies in kept), "a kept output was overwritten"
    assert aiter_patches.stats()[NAME]["fast"] >= 4  # still the one-launch sort and its hand-back
    monkeypatch.setattr(fm, where, ours)  # the layer gone: the pool engages again
    leased = counts()[0]
    assert same_bits(fm.fused_moe(**a), want_a)
    assert counts()[0] == leased + 1


def test_a_foreign_layer_under_a_quant_helper_is_handed_no_pooled_table(fm, stub, device):
    """A foreign function under our quant-helper wrapper is handed the sort tables as arguments whenever our
    wrapper hands a call back: with one there, nothing is leased."""
    aiter_patches.revert()
    mxfp4 = fm.fused_dynamic_mxfp4_quant_moe_sort

    @functools.wraps(mxfp4)
    def traced(*args, **kwargs):
        return mxfp4(*args, **kwargs)

    fm.fused_dynamic_mxfp4_quant_moe_sort = traced
    try:
        a = moe_inputs(stub, device, *SHAPE, "fp4", seed=1)
        want = fm.fused_moe(**a)
        aiter_patches.apply([NAME])
        assert {p["name"]: p["state"] for p in aiter_patches.status()["patches"]}[NAME] == "applied"
        for _ in range(3):
            assert same_bits(fm.fused_moe(**a), want)
        assert counts() == (0, 0)
        assert aiter_patches.stats()[NAME]["fast"] == 6
    finally:
        aiter_patches.revert()
        fm.fused_dynamic_mxfp4_quant_moe_sort = mxfp4


@pytest.mark.parametrize("when", ["before the call's sort", "after the call's sort"])
def test_a_sort_called_directly_inside_a_call_keeps_its_outputs(fm, two_calls, stub, device, monkeypatch, when):
    """``moe_sorting(...)`` called on its own from inside a ``fused_moe`` call (a hook AITER calls before its
    sort, or a stage): what it returns is its caller's; the next calls, with other routing, leave it as it was."""
    import aiter.ops._leaf_kernels as leaf

    a, b, want_a, want_b = two_calls
    M, E, topk, dim, _ = SHAPE
    aiter_patches.apply([NAME])
    fm.fused_moe(**a)
    fm.fused_moe(**a)
    assert len(free_sets()) == 1
    ids, w = routing(M, E, topk, device, seed=5)
    kept = []
    if when == "before the call's sort":
        host, name = fm, "get_2stage_cfgs"
    else:
        host, name = leaf, "moe_stage1"
    inner = getattr(host, name)

    def sorts_on_its_own(*args, **kwargs):
        out = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, 32)
        kept.append((out[:4], _bytes(out[:4])))
        return inner(*args, **kwargs)

    monkeypatch.setattr(host, name, sorts_on_its_own)
    assert same_bits(fm.fused_moe(**a), want_a)
    assert same_bits(fm.fused_moe(**b), want_b)
    assert same_bits(fm.fused_moe(**a), want_a)
    assert len(kept) >= 3 and all(_unchanged(ts, copies) for ts, copies in kept), "a kept sort was overwritten"
    with suspended():
        want = fm.moe_sorting(ids, w, E, dim, torch.bfloat16, 32)
    n = int(want[3][0])
    assert torch.equal(kept[0][0][3], want[3]) and torch.equal(kept[0][0][0][:n], want[0][:n])
