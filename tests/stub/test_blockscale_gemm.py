"""The stand-in's split-K block-scale fp8 GEMM (``aiter_patches_standin.blockscale_gemm_splitk``): the Triton kernel
against the torch reference.

Small shapes run everywhere (Triton interpreter on CPU, natively on a GPU); the
full-size sweep is marked `gpu`.
"""

import math

import pytest
import torch

from aiter_patches.reference.blockscale_gemm import (
    a_scale_aiter_layout,
    a_scale_as_read_by_asm,
    blockscale_gemm_reference,
    shuffle_weight_16x16,
    unshuffle_weight_16x16,
)
from aiter_patches_standin import blockscale_gemm_splitk as bg

HAS_GPU = torch.cuda.is_available()
DEV = "cuda" if HAS_GPU else "cpu"
FP8 = torch.float8_e4m3fn
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")]


def make_inputs(M, N, K, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    A = (torch.randn(M, K, generator=g) * 2).to(FP8)
    B = (torch.randn(N, K, generator=g) * 2).to(FP8)
    x_scale = torch.rand(M, K // 128, generator=g) * 0.02 + 0.001
    B_scale = torch.rand(N // 128, K // 128, generator=g) * 0.02 + 0.001
    # A_scale as AITER stores it: K-major memory, logical [M, K/128] with strides (1, M).
    A_scale = x_scale.t().contiguous().t()
    return A.to(device), B.to(device), A_scale.to(device), B_scale.to(device)


def poisoned(M, N, device=DEV):
    return torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)


def bits(t):
    return t.view(torch.int16)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def valid_splits(K, upto):
    return [s for s in range(1, upto + 1) if bg.valid_split(K, s)]


# ---------------------------------------------------------------- reference and layouts


def test_reference_matches_dequantized_float64():
    A, B, A_scale, B_scale = make_inputs(5, 256, 384, device="cpu")
    a = A.double() * A_scale.double().repeat_interleave(128, dim=1)
    b = B.double() * B_scale.double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    ref = blockscale_gemm_reference(A, B, A_scale, B_scale)
    assert ref.dtype == torch.float32
    torch.testing.assert_close(ref.double(), a @ b.T, rtol=1e-5, atol=1e-5)


def test_shuffle_layout_and_roundtrip():
    N, K = 32, 64
    B = torch.arange(N * K, dtype=torch.int32).remainder(251).to(torch.uint8).view(N, K)
    Bs = shuffle_weight_16x16(B).reshape(-1)
    for n, k in [(0, 0), (3, 17), (17, 5), (31, 63), (20, 40)]:
        flat = (n // 16) * 16 * K + (k // 32) * 512 + ((k % 32) // 16) * 256 + (n % 16) * 16 + k % 16
        assert Bs[flat] == B[n, k]
    assert torch.equal(unshuffle_weight_16x16(shuffle_weight_16x16(B)), B)
    f8 = B.view(FP8)
    assert shuffle_weight_16x16(f8).dtype == FP8


def test_a_scale_aiter_argument_is_read_k_major():
    x = torch.rand(7, 4)
    arg = a_scale_aiter_layout(x)
    assert arg.is_contiguous() and tuple(arg.shape) == (7, 4)
    assert torch.equal(arg.reshape(-1), x.t().reshape(-1))  # memory: ptr[kb * M + m]
    logical = a_scale_as_read_by_asm(arg)
    assert logical.stride() == (1, 7) and torch.equal(logical, x)
    assert logical.data_ptr() == arg.data_ptr()


# ---------------------------------------------------------------- split rules


def test_valid_split_follows_aiter_alignment():
    assert valid_splits(256, 8) == [1, 2]
    assert valid_splits(1024, 8) == [1, 2, 3, 4, 8]  # 3 -> runs of 3,3,2 tiles
    assert valid_splits(384, 8) == [1, 2, 3]
    assert bg.k_tiles_per_split(1024, 3) == 3


@pytest.mark.parametrize("M,N,K", [(1, 7168, 2048), (16, 4608, 7168), (64, 24576, 1536), (4096, 7168, 16384)])
def test_choose_splits_triton_is_valid(M, N, K):
    s = bg.choose_splits_triton(M, N, K, 132)
    assert 1 <= s <= bg.MAX_SPLITS and bg.valid_split(K, s)


# ---------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("K", [256, 512, 1024])
@pytest.mark.parametrize("N", [128, 256])
@pytest.mark.parametrize("M", [1, 7, 16])
def test_matches_reference_at_every_split(M, N, K):
    A, B, A_scale, B_scale = make_inputs(M, N, K)
    ref = blockscale_gemm_reference(A, B, A_scale, B_scale)
    Bs = shuffle_weight_16x16(B)
    for s in valid_splits(K, 8):
        out = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), A_scale, B_scale, splits=s)
        assert not out.isnan().any(), s
        assert rel_err(out, ref) <= 1e-2, s


@pytest.mark.parametrize("M,N,K", [(7, 256, 1024), (20, 128, 384), (33, 128, 256)])
def test_memset_equals_prezeroed_bitwise(M, N, K):
    A, B, A_scale, B_scale = make_inputs(M, N, K, seed=1)
    Bs = shuffle_weight_16x16(B)
    for s in valid_splits(K, 8):
        memset = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), A_scale, B_scale, splits=s, zero_out=True)
        zeroed = torch.zeros(M, N, dtype=torch.bfloat16, device=DEV)
        bg.blockscale_gemm_splitk(A, Bs, zeroed, A_scale, B_scale, splits=s, zero_out=False)
        assert torch.equal(bits(memset), bits(zeroed)), s
        again = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), A_scale, B_scale, splits=s, zero_out=True)
        assert torch.equal(bits(memset), bits(again)), s


def test_nonzero_out_is_accumulated_onto():
    M, N, K = 7, 256, 1024
    A, B, A_scale, B_scale = make_inputs(M, N, K, seed=2)
    ref = blockscale_gemm_reference(A, B, A_scale, B_scale)
    Bs = shuffle_weight_16x16(B)
    base = (torch.randn(M, N, generator=torch.Generator().manual_seed(3)) * ref.abs().mean().cpu()).to(
        torch.bfloat16).to(DEV)
    for s in valid_splits(K, 8):
        out = base.clone()
        bg.blockscale_gemm_splitk(A, Bs, out, A_scale, B_scale, splits=s, zero_out=False)
        expect = base.float() + ref
        assert rel_err(out, expect) <= 1e-2, s
        plain = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), A_scale, B_scale, splits=s)
        assert rel_err(plain, expect) > 0.1, s


def test_preshuffled_and_plain_give_same_bits():
    M, N, K = 16, 256, 512
    A, B, A_scale, B_scale = make_inputs(M, N, K, seed=4)
    for s in valid_splits(K, 4):
        a = bg.blockscale_gemm_splitk(A, shuffle_weight_16x16(B), poisoned(M, N), A_scale, B_scale, splits=s)
        b = bg.blockscale_gemm_splitk(A, B, poisoned(M, N), A_scale, B_scale, splits=s, b_preshuffled=False)
        assert torch.equal(bits(a), bits(b)), s


def test_scale_strides_are_honoured():
    M, N, K = 7, 128, 512
    A, B, A_scale, B_scale = make_inputs(M, N, K, seed=5)
    Bs = shuffle_weight_16x16(B)
    k_major = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), A_scale, B_scale, splits=2)
    row_major = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), A_scale.contiguous(), B_scale.t().contiguous().t(),
                                          splits=2)
    assert torch.equal(bits(k_major), bits(row_major))
    via_aiter_arg = a_scale_as_read_by_asm(a_scale_aiter_layout(A_scale.contiguous()))
    out = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), via_aiter_arg, B_scale, splits=2)
    assert torch.equal(bits(out), bits(k_major))


def test_padded_out_rows_and_untouched_padding():
    M, N, K = 7, 128, 256
    A, B, A_scale, B_scale = make_inputs(M, N, K, seed=6)
    big = torch.full((M, N + 64), 7.0, dtype=torch.bfloat16, device=DEV)
    out = big[:, :N]
    bg.blockscale_gemm_splitk(A, shuffle_weight_16x16(B), out, A_scale, B_scale, splits=2)
    ref = blockscale_gemm_reference(A, B, A_scale, B_scale)
    assert rel_err(out, ref) <= 1e-2
    assert (big[:, N:] == 7.0).all()


def test_counters_return_to_zero():
    M, N, K = 20, 256, 1024
    A, B, A_scale, B_scale = make_inputs(M, N, K, seed=7)
    out = bg.blockscale_gemm_splitk(A, shuffle_weight_16x16(B), poisoned(M, N), A_scale, B_scale, splits=8)
    key = bg._stream_key(A.device)
    assert all(int(c.abs().sum()) == 0 for c in bg._counters[key])
    assert not out.isnan().any()


@pytest.mark.parametrize("zero_out", [True, False])
def test_workspace_cap_splits_rows_over_launches_same_bits(monkeypatch, zero_out):
    """Above MAX_WORKSPACE_BYTES the kernel runs over row blocks (issue 14.14): the same bits, and no
    allocation of the partials beyond the cap (rounded up to one row block)."""
    M, N, K, splits = 150, 128, 256, 2  # BLOCK_M 128: two launches, the second of 22 rows
    A, B, A_scale, B_scale = make_inputs(M, N, K, seed=11)
    Bs = shuffle_weight_16x16(B)
    start = torch.randn(M, N, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    whole = start.clone()
    bg.blockscale_gemm_splitk(A, Bs, whole, A_scale, B_scale, splits=splits, zero_out=zero_out)
    block_m = bg.block_config(M)["BLOCK_M"]
    cap = bg.workspace_bytes(block_m, N, splits)  # one row block of partials per launch
    monkeypatch.setattr(bg, "MAX_WORKSPACE_BYTES", cap)
    sizes, empty = [], torch.empty

    def spy(*size, **kw):
        t = empty(*size, **kw)
        if t.dtype == torch.float32:
            sizes.append(t.numel() * 4)
        return t

    monkeypatch.setattr(torch, "empty", spy)
    chunked = start.clone()
    bg.blockscale_gemm_splitk(A, Bs, chunked, A_scale, B_scale, splits=splits, zero_out=zero_out)
    assert sizes and max(sizes) <= cap < bg.workspace_bytes(M, N, splits)
    assert torch.equal(bits(chunked), bits(whole))


def test_empty_m_is_a_no_op():
    A, B, A_scale, B_scale = make_inputs(1, 128, 256)
    out = torch.empty(0, 128, dtype=torch.bfloat16, device=DEV)
    res = bg.blockscale_gemm_splitk(A[:0], B, out, A_scale[:0], B_scale, splits=2)
    assert res is out


# ---------------------------------------------------------------- refusals


def _args(M=7, N=256, K=512):
    A, B, A_scale, B_scale = make_inputs(M, N, K, device="cpu")
    return dict(A=A, B=B, out=torch.empty(M, N, dtype=torch.bfloat16), A_scale=A_scale, B_scale=B_scale,
                splits=2, b_preshuffled=True)


@pytest.mark.parametrize("change,needle", [
    (lambda a: a.update(A=a["A"].float()), "fp8"),
    (lambda a: a.update(B=a["B"].view(torch.uint8)), "fp8"),
    (lambda a: a.update(out=a["out"].half()), "bfloat16"),
    (lambda a: a.update(A_scale=a["A_scale"].double()), "float32"),
    (lambda a: a.update(B_scale=a["B_scale"][:, :2]), "B_scale"),
    (lambda a: a.update(A_scale=a["A_scale"][:3]), "A_scale"),
    (lambda a: a.update(out=a["out"][:, :128]), "out"),
    (lambda a: a.update(B=a["B"][:, :384].contiguous()), "K differs"),
    (lambda a: a.update(A=a["A"][:, :320], B=a["B"][:, :320].contiguous()), "multiples of 128"),
    (lambda a: a.update(A=a["A"].t().contiguous().t()), "unit stride"),
    (lambda a: a.update(B=a["B"].t().contiguous().t()), "contiguous"),
    (lambda a: a.update(out=a["out"].t().contiguous().t()), "unit stride"),
    (lambda a: a.update(splits=0), "splits"),
    (lambda a: a.update(splits=17), "splits"),
    (lambda a: a.update(splits=3), "splits=3"),
    (lambda a: a.update(splits=2.0), "splits"),
    (lambda a: a.update(b_preshuffled="yes"), "b_preshuffled"),
    (lambda a: a.update(A=a["A"][:, None]), "2-D"),
])
def test_unsupported_reason_says_why(change, needle):
    args = _args()
    assert bg.unsupported_reason(**args) is None
    change(args)
    reason = bg.unsupported_reason(**args)
    assert reason is not None and needle in reason
    kwargs = dict(splits=args.pop("splits"), b_preshuffled=args.pop("b_preshuffled"))
    with pytest.raises(ValueError, match="blockscale_gemm_splitk"):
        bg.blockscale_gemm_splitk(*args.values(), **kwargs)


def test_n_not_multiple_of_128_refused():
    A, B, A_scale, B_scale = make_inputs(7, 256, 256, device="cpu")
    B = B[:192]
    reason = bg.unsupported_reason(A, B, torch.empty(7, 192, dtype=torch.bfloat16), A_scale, B_scale[:1], 1, True)
    assert "multiples of 128" in reason


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_mixed_devices_refused():
    args = _args()
    args["out"] = args["out"].cuda()
    assert "devices" in bg.unsupported_reason(**args)


# ---------------------------------------------------------------- full size (GPU)

SHAPES = [(7168, 2048), (4608, 7168), (24576, 1536), (7168, 16384), (1536, 7168)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [1, 7, 16, 64, 512, 4096])
def test_gpu_full_size_deterministic(M, N, K):
    A, B, A_scale, B_scale = make_inputs(M, N, K, seed=M + N + K)
    ref = blockscale_gemm_reference(A, B, A_scale, B_scale)
    Bs = shuffle_weight_16x16(B)
    splits = valid_splits(K, 16) if M <= 64 else [s for s in (1, 2, 3, 4, 8, 16) if bg.valid_split(K, s)]
    for s in splits:
        first = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), A_scale, B_scale, splits=s)
        second = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), A_scale, B_scale, splits=s)
        zeroed = torch.zeros(M, N, dtype=torch.bfloat16, device=DEV)
        bg.blockscale_gemm_splitk(A, Bs, zeroed, A_scale, B_scale, splits=s, zero_out=False)
        assert not first.isnan().any(), s
        assert rel_err(first, ref) <= 1e-2, s
        assert torch.equal(bits(first), bits(second)), s
        assert torch.equal(bits(first), bits(zeroed)), s


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_gpu_cuda_graph_replay(splits):
    M, N, K = 16, 7168, 2048
    A, B, A_scale, B_scale = make_inputs(M, N, K, seed=9)
    Bs = shuffle_weight_16x16(B)
    eager = bg.blockscale_gemm_splitk(A, Bs, poisoned(M, N), A_scale, B_scale, splits=splits)
    out = torch.zeros(M, N, dtype=torch.bfloat16, device=DEV)
    bg.blockscale_gemm_splitk(A, Bs, out, A_scale, B_scale, splits=splits, zero_out=False)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bg.blockscale_gemm_splitk(A, Bs, out, A_scale, B_scale, splits=splits, zero_out=False)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(eager))
    assert all(int(c.abs().sum()) == 0 for cs in bg._counters.values() for c in cs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_gpu_default_split_is_accurate():
    for N, K in SHAPES:
        for M in (1, 16, 64):
            A, B, A_scale, B_scale = make_inputs(M, N, K, seed=11)
            s = bg.choose_splits_triton(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
            out = bg.blockscale_gemm_splitk(A, shuffle_weight_16x16(B), poisoned(M, N), A_scale, B_scale, splits=s)
            assert rel_err(out, blockscale_gemm_reference(A, B, A_scale, B_scale)) <= 1e-2
            assert math.isfinite(out.float().abs().max().item())
