"""Sort outputs reused between fused_moe calls (sort_scratch.py): only where nothing reads them after the call.

Every reuse is checked for AITER's bits with the reused set poisoned first, and every case that must not
reuse (a sort called on its own or under moe_call.scope, an active extension, a capture, the switch off,
the byte limit) is checked to allocate, through the pool's counters and the outputs a caller keeps.
"""

import pytest
import torch

import aiter_patches
from aiter_patches.patches import moe_call, sort_scratch
from aiter_patches.patches.sort_extension import SortExtension, sort_extension
from aiter_patches.verify import suspended

from .conftest import routing
from .test_moe_sort_mx_quant_patch import NAME, moe_inputs, same_bits

SHAPE = (3, 8, 2, 256, 128)  # tokens, experts, topk, model dim, inter dim


def counts():
    s = sort_scratch.stats()
    return s["leased"], s["made"]


def free_sets():
    return [got for _, free in sort_scratch._pool.values() for got in free]


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


@pytest.mark.parametrize("why", ["capturing", "switched off", "over the byte limit"])
def test_no_reuse_where_it_could_be_read_or_is_refused(fm, two_calls, monkeypatch, why):
    a, _, want_a, _ = two_calls
    if why == "capturing":
        monkeypatch.setattr(sort_scratch.device_stream, "capturing", lambda dev: True)
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
