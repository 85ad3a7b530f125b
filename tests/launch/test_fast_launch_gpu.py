"""On a GPU: direct launches give the same bits as ordinary ones, eagerly and in a CUDA graph.

Run with ``pytest -m gpu tests/launch``. ``verify`` mode also asks Triton, on every direct
launch, which compiled kernel it would have picked (fast_launch.DispatchMismatch otherwise).
"""

from __future__ import annotations

import pytest
import torch

from aiter_patches.kernels import fast_launch as fl
from aiter_patches.kernels import moe_sort_mx_quant as k

pytestmark = pytest.mark.gpu

SHAPES = [(1, 8, 256, 7168), (64, 16, 896, 3584), (16, 4, 128, 6144), (300, 8, 128, 4096)]


def _inputs(M, K, E, D, offset):
    g = torch.Generator().manual_seed(M * 31 + K)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).cuda()
    w = torch.rand(M * K + offset, generator=g).cuda()[offset:].view(M, K)
    x = torch.randn(M, D, generator=g).to(torch.bfloat16).cuda()
    return ids, w, x


@pytest.fixture(autouse=True)
def _zeroed_outputs(monkeypatch):
    """Every output starts as zeros, so unwritten bytes compare equal too and the whole buffers are checked."""
    real = k._empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        t.view(torch.uint8).zero_()
        return t

    monkeypatch.setattr(k, "_empty", empty)


def _run(ids, w, x, E, D):
    r = k.moe_sort_mx_quant(ids, w, E, D, torch.bfloat16, 32, quant_input=x, quant_dtype=torch.float4_e2m1fn_x2)
    return [t.view(torch.uint8) if t.dtype.itemsize == 1 else t
            for t in (r.sorted_ids, r.sorted_weights, r.sorted_expert_ids, r.num_valid_ids, r.moe_buf, *r.quant)]


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("M,K,E,D", SHAPES)
def test_direct_equals_ordinary_bitwise(M, K, E, D, offset):
    ids, w, x = _inputs(M, K, E, D, offset)
    fl.set_mode("off")
    ref = _run(ids, w, x, E, D)
    fl.set_mode("verify")
    try:
        for _ in range(3):
            got = _run(ids, w, x, E, D)
            assert _same(ref, got)
    finally:
        fl.set_mode(None)
    assert fl.stats()["direct"] > 0


def test_direct_launch_in_a_cuda_graph():
    M, K, E, D = SHAPES[0]
    ids, w, x = _inputs(M, K, E, D, 0)
    fl.set_mode("off")
    ref = _run(ids, w, x, E, D)
    fl.set_mode("on")
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _run(ids, w, x, E, D)  # the key's first sight outside the capture
        torch.cuda.current_stream().wait_stream(s)
        before = fl.stats()["direct"]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _run(ids, w, x, E, D)
        assert fl.stats()["direct"] > before
        graph.replay()
        torch.cuda.synchronize()
        assert _same(ref, out)
    finally:
        fl.set_mode(None)


def test_a_launch_on_another_gpu_than_the_current_one_is_refused(monkeypatch):
    """Triton launches on the current device; AITER's ops guard their tensors' device. Tensors on another GPU
    (faked here: the current device reads as cuda:7) get WrongDevice, naming both devices and the fix, on the
    first launch of a shape and on a kept plan's direct launch alike, never a kernel on the wrong device."""
    ids, w, x = _inputs(16, 4, 128, 6144, 0)
    _run(ids, w, x, 128, 6144)
    _run(ids, w, x, 128, 6144)  # its plan's kernels kept: the next call is a direct launch
    from triton.runtime import driver

    drv = driver.active
    direct = fl.stats()["direct"]
    monkeypatch.setattr(drv, "get_current_device", lambda: 7)
    monkeypatch.setattr(fl.device_stream, "current_index", lambda: 7)
    with pytest.raises(fl.WrongDevice, match=r"on cuda:0, the current device is cuda:7.*torch.cuda.device\(0\)"):
        _run(ids, w, x, 128, 6144)  # kept plan: Prepared
    with pytest.raises(fl.WrongDevice, match="on cuda:0, the current device is cuda:7"):
        _run(*_inputs(5, 4, 128, 6144, 0), 128, 6144)  # a new shape: its first launch, through launch()
    assert fl.stats()["direct"] == direct
