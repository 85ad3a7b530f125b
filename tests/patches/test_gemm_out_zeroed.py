"""``gemm_a8w8_blockscale_bpreshuffle_asm(..., out_zeroed=True)`` on the stand-in AITER.

The patched call into a zeroed ``out`` must equal AITER's own call (memset +
split-K GEMM) bit for bit; every call the fast path does not cover must be
AITER's call, with AITER's result or AITER's error. The stand-in's original runs
the Triton split-K kernel with its memset (the interpreter on CPU, natively on a GPU).
"""

import sys
import types

import pytest
import torch

import aiter_patches
from aiter_patches.reference.blockscale_gemm import (
    a_scale_aiter_layout,
    a_scale_as_read_by_asm,
    blockscale_gemm_reference,
    shuffle_weight_16x16,
)
from aiter_patches.verify import suspended
from aiter_patches_standin import blockscale_gemm_splitk as kernel
from helpers.standin import gemm_default_backend

NAME = "gemm_out_zeroed"
MODULE = "aiter.ops.gemm_op_a8w8"
ATTR = "gemm_a8w8_blockscale_bpreshuffle_asm"
VALID_SPLITS = {512: [2, 4], 1024: [2, 3, 4, 8]}  # split counts 2..8 that cut K into whole 128-wide tiles


def stats():
    return aiter_patches.stats()[NAME]


def gemm(*args, **kwargs):
    """Looked up at call time, where AITER's callers find it."""
    return getattr(sys.modules[MODULE], ATTR)(*args, **kwargs)


def bits(t):
    return t.view(torch.int16)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def triton_bf16(x):
    """fp32 -> bf16 as the GEMM rounds (kernels/rounding.py): torch's round-to-nearest-even, on every backend."""
    return x.to(torch.bfloat16)


def nan_out(M, N, device):
    return torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)


def zero_out(M, N, device):
    return torch.zeros(M, N, dtype=torch.bfloat16, device=device)


def make_inputs(stub, M, N, K, device, seed=0, exact=False):
    """(A, B pre-shuffled, A_scale [M, K/128] K-major as AITER stores it, B_scale, B plain).

    ``exact``: small integers and power-of-two scales, so every fp32 partial sum is
    exact and the reference equals the kernel's fp32 total in any order. K block 0
    adds exactly +-2**-12 to every output, so every total needs a rounding to bf16.
    """
    fp8 = stub.dtypes.fp8
    g = torch.Generator().manual_seed(seed)
    if exact:
        A = torch.randint(-2, 3, (M, K), generator=g).float()
        B = torch.randint(-2, 3, (N, K), generator=g).float()
        A[:, :128], B[:, :128] = 0.0, 0.0
        A[:, 0] = 1.0
        B[:, 0] = torch.randint(0, 2, (N,), generator=g).float() * 2 - 1
        x_scale = 2.0 ** -torch.randint(0, 2, (M, K // 128), generator=g).float()
        x_scale[:, 0] = 2.0**-12
        B_scale = 2.0 ** -torch.randint(0, 2, (N // 128, K // 128), generator=g).float()
        B_scale[:, 0] = 1.0
    else:
        A = torch.randn(M, K, generator=g) * 2
        B = torch.randn(N, K, generator=g) * 2
        x_scale = torch.rand(M, K // 128, generator=g) * 0.02 + 0.001
        B_scale = torch.rand(N // 128, K // 128, generator=g) * 0.02 + 0.001
    A, B = A.to(fp8), B.to(fp8)
    A_scale = x_scale.t().contiguous().t()  # memory K-major: element (m, kb) at kb * M + m
    return A.to(device), shuffle_weight_16x16(B).to(device), A_scale.to(device), B_scale.to(device), B.to(device)


@pytest.fixture
def gemm_op(stub, monkeypatch):
    """Counts calls of AITER's op under the Python entry point (the launcher: memset + GEMM)."""
    mod = sys.modules[MODULE]
    calls = []
    original = mod._gemm_a8w8_blockscale_bpreshuffle_asm

    def op(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(mod, "_gemm_a8w8_blockscale_bpreshuffle_asm", op)
    return calls


def capture_error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares what was raised
        return type(exc), str(exc)
    return None


# ---------------------------------------------------------------- bitwise against the original


# the default run's (M, N, K): each M, N and K and each (N, K); CI's second step (slow_ci) runs the other eight
SPLIT_CASES_DEFAULT = {(1, 128, 1024), (7, 256, 512), (16, 128, 512), (16, 256, 1024)}


@pytest.mark.parametrize("M,N,K", [pytest.param(M, N, K, marks=() if (M, N, K) in SPLIT_CASES_DEFAULT else
                                                pytest.mark.slow_ci)
                                   for M in (1, 7, 16) for N in (128, 256) for K in (512, 1024)])
def test_out_zeroed_equals_memset_gemm_at_every_split(stub, gemm_op, device, M, N, K):
    splits = [s for s in range(2, 9) if kernel.valid_split(K, s)]
    assert splits == VALID_SPLITS[K]
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=M + N + K)
    aiter_patches.apply()
    for s in splits:
        patched = zero_out(M, N, device)
        assert gemm(A, Bs, patched, A_scale, B_scale, splitK=s, out_zeroed=True) is patched
        assert gemm_op == []  # AITER's launcher (and its memset) did not run
        original = nan_out(M, N, device)
        with suspended():
            gemm(A, Bs, original, A_scale, B_scale, splitK=s)
        gemm_op.clear()
        assert not original.isnan().any()
        assert torch.equal(bits(patched), bits(original)), f"split {s}"
    assert stats()["fast"] == len(splits) and stats()["fallback"] == {} and stats()["errors"] == {}


def test_out_zeroed_matches_the_torch_reference(stub, device):
    M, N, K = 7, 256, 1024
    A, Bs, A_scale, B_scale, B = make_inputs(stub, M, N, K, device, seed=5)
    ref = blockscale_gemm_reference(A, B, A_scale, B_scale)
    aiter_patches.apply([NAME])
    for s in VALID_SPLITS[K]:
        out = zero_out(M, N, device)
        gemm(A, Bs, out, A_scale, B_scale, splitK=s, out_zeroed=True)
        assert rel_err(out, ref) <= 1e-2, f"split {s}"
    assert stats()["fast"] == len(VALID_SPLITS[K])


# ---------------------------------------------------------------- calls that stay AITER's


@pytest.mark.parametrize("flag", [{}, {"out_zeroed": False}], ids=["no-keyword", "false"])
def test_without_out_zeroed_the_original_runs(stub, gemm_op, device, flag):
    M, N, K = 7, 128, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=1)
    expected = nan_out(M, N, device)
    gemm(A, Bs, expected, A_scale, B_scale, splitK=2)
    gemm_op.clear()
    aiter_patches.apply([NAME])
    out = nan_out(M, N, device)  # AITER's memset must run: NaN left anywhere fails
    gemm(A, Bs, out, A_scale, B_scale, splitK=2, **flag)
    assert len(gemm_op) == 1
    assert torch.equal(bits(out), bits(expected))
    assert stats() == {"fast": 0, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}


@pytest.mark.parametrize("split", [{}, {"splitK": None}, {"splitK": 1}, {"splitK": 0}, {"splitK": -1}],
                         ids=["absent", "None", "1", "0", "-1"])
def test_split_count_one_runs_the_original(stub, gemm_op, device, split):
    M, N, K = 7, 128, 512
    A, Bs, A_scale, B_scale, B = make_inputs(stub, M, N, K, device, seed=2)
    aiter_patches.apply([NAME])
    out = nan_out(M, N, device)
    gemm(A, Bs, out, A_scale, B_scale, out_zeroed=True, **split)
    assert len(gemm_op) == 1
    assert rel_err(out, blockscale_gemm_reference(A, B, A_scale, B_scale)) <= 1e-2
    assert stats()["fast"] == 0
    assert list(stats()["fallback"]) == ["split count 1: the original launches no memset"]


@pytest.mark.parametrize("K,split", [(512, 3), (1024, 5), (1024, 7)])
def test_rejected_split_raises_the_same_error(stub, device, K, split):
    M, N = 7, 128
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=3)
    original = capture_error(lambda: gemm(A, Bs, zero_out(M, N, device), A_scale, B_scale, splitK=split))
    assert original is not None and "alignment" in original[1]
    aiter_patches.apply([NAME])
    for flag in ({}, {"out_zeroed": False}, {"out_zeroed": True}):
        assert capture_error(lambda: gemm(A, Bs, zero_out(M, N, device), A_scale, B_scale, splitK=split,
                                          **flag)) == original
    assert stats()["fast"] == 0


def _bad_input(stub, case, device):
    """Arguments AITER's launcher rejects: (A, B, out, A_scale, B_scale)."""
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=4)
    out = zero_out(M, N, device)
    fp8 = stub.dtypes.fp8
    if case == "A bf16":
        A = A.to(torch.bfloat16)
    elif case == "B bf16":
        Bs = Bs.to(torch.bfloat16)
    elif case == "out fp16":
        out = out.half()
    elif case == "A_scale bf16":
        A_scale = A_scale.to(torch.bfloat16)
    elif case == "N not a multiple of 128":
        N = 192
        Bs, B_scale, out = Bs[:N], torch.ones(2, K // 128, device=device), zero_out(M, N, device)
    elif case == "K not a multiple of 128":
        K = 576  # 4.5 tiles; split 2 still passes the launcher's split check
        A = torch.ones(M, K, device=device).to(fp8)
        Bs = torch.ones(N, K, device=device).to(fp8)
        A_scale = torch.ones(M, 5, device=device)
        B_scale = torch.ones(N // 128, 5, device=device)
    elif case == "A_scale shape":
        A_scale = torch.ones(M, K // 128 + 1, device=device)
    elif case == "B_scale shape":
        B_scale = torch.ones(N // 128 + 1, K // 128, device=device)
    else:
        raise AssertionError(case)
    return A, Bs, out, A_scale, B_scale


BAD = ["A bf16", "B bf16", "out fp16", "A_scale bf16", "N not a multiple of 128", "K not a multiple of 128",
       "A_scale shape", "B_scale shape"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_falls_back_to_aiters_error(stub, device, case):
    A, Bs, out, A_scale, B_scale = _bad_input(stub, case, device)
    original = capture_error(lambda: gemm(A, Bs, out, A_scale, B_scale, splitK=2))
    assert original is not None
    aiter_patches.apply([NAME])
    assert capture_error(lambda: gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True)) == original
    assert stats()["fast"] == 0 and stats()["errors"] == {}
    assert sum(stats()["fallback"].values()) == 1


@pytest.mark.parametrize("case", ["A column stride 2", "A row stride", "B not contiguous",
                                  "out column stride 2", "out row stride", "A_scale not contiguous"])
def test_strided_operands_get_aiters_result_or_error(stub, device, case):
    """Strides the kernel's arguments cannot describe fall back (counted); a row stride it can is served."""
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=9)

    def outs():
        if case == "out column stride 2":
            return zero_out(M, 2 * N, device)[:, ::2]
        if case == "out row stride":
            return zero_out(M, N + 128, device)[:, :N]
        return zero_out(M, N, device)

    if case == "A column stride 2":
        A = torch.stack([A.view(torch.uint8)] * 2, -1).reshape(M, 2 * K)[:, ::2].view(A.dtype)
    elif case == "A row stride":
        A = torch.cat([A.view(torch.uint8)] * 2, 1)[:, :K].view(A.dtype)
    elif case == "B not contiguous":
        Bs = torch.stack([Bs.view(torch.uint8)] * 2, -1).reshape(N, 2 * K)[:, ::2].view(Bs.dtype)
    elif case == "A_scale not contiguous":
        A_scale = torch.stack([A_scale.contiguous()] * 2, -1).reshape(M, -1)[:, ::2]
    out0, out1 = outs(), outs()
    err0 = capture_error(lambda: gemm(A, Bs, out0, A_scale, B_scale, splitK=2))
    aiter_patches.apply([NAME])
    err1 = capture_error(lambda: gemm(A, Bs, out1, A_scale, B_scale, splitK=2, out_zeroed=True))
    assert err1 == err0
    if err0 is None:
        assert torch.equal(bits(out0), bits(out1))
    assert stats()["errors"] == {}
    if case in ("A row stride", "out row stride"):  # row strides are kernel arguments
        assert stats()["fast"] == 1
    else:
        assert stats()["fast"] == 0 and sum(stats()["fallback"].values()) == 1, stats()


def test_real_aiter_branch_gates_operands_before_the_launch(stub, device, monkeypatch):
    """On a real AITER (not the stand-in) the operands are checked before any .co is looked for."""
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=3)
    as_aiter_passes_it = A_scale.t().contiguous().view(M, K // 128)  # x_scale.T.contiguous().view(M, K/128)
    gemm_default_backend(monkeypatch)  # served as on AMD's AITER: its .co through HIP
    aiter_patches.apply([NAME])
    capture_error(lambda: gemm(A, Bs, zero_out(M, N, device), as_aiter_passes_it, B_scale, splitK=2,
                               out_zeroed=True))
    assert [r.split(":")[0] for r in stats()["fallback"]] == ["AITER's .co cannot be launched here"], stats()
    capture_error(lambda: gemm(A, Bs, zero_out(M, N, device), A_scale, B_scale, splitK=2, out_zeroed=True))
    assert any("A_scale is not a contiguous fp32 tensor" in r for r in stats()["fallback"]), stats()
    capture_error(lambda: gemm(A, Bs, zero_out(M, N, device).half(), as_aiter_passes_it, B_scale, splitK=2,
                               out_zeroed=True))
    assert any("out is not a bf16" in r for r in stats()["fallback"]), stats()
    assert stats()["fast"] == 0 and stats()["errors"] == {}


def test_real_aiter_branch_plans_once_and_launches_without_memset(stub, device, monkeypatch):
    """The ROCm branch with the HIP runtime faked: one kernel choice per call, one launch, no memset."""
    from aiter_patches.kernels import hip_blockscale_asm as hb

    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=3)
    as_aiter_passes_it = A_scale.t().contiguous().view(M, K // 128)
    kernel = hb.AsmKernel(32, 128, 1, 1, "knl", "k.co")
    launched, chosen = [], []

    class FakeLauncher:
        def function(self, *a):
            return "fn"

        def launch(self, fn, grid, args, stream):
            launched.append(grid)

    def select(*a):
        chosen.append(a)
        return kernel, 2

    gemm_default_backend(monkeypatch)  # served as on AMD's AITER: its .co through HIP
    monkeypatch.setattr(hb, "available", lambda device, root: None)
    monkeypatch.setattr(hb, "gfx_of", lambda device: "gfx942")
    monkeypatch.setattr(hb, "load_kernel_list", lambda root, gfx: [kernel])
    monkeypatch.setattr(hb, "select_kernel", select)
    monkeypatch.setattr(hb, "code_object_reason", lambda root, gfx, cfg: None)  # a made-up .co (see test_code_object)
    monkeypatch.setattr(hb, "_get_launcher", lambda: FakeLauncher())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=80))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    out = nan_out(M, N, device)  # untouched: the fake launch writes nothing, and no memset ran
    aiter_patches.apply([NAME])
    assert gemm(A, Bs, out, as_aiter_passes_it, B_scale, splitK=2, out_zeroed=True) is out
    assert stats()["fast"] == 1 and stats()["fallback"] == {}, stats()
    assert len(chosen) == 1 and launched == [hb.launch_grid(M, N, 32, 128, 2)]
    assert out.isnan().all()


def test_out_requiring_grad_gets_the_originals_outcome(stub, gemm_op, device, caplog):
    """Issue 14.11: under grad mode AITER's in-place write into a leaf that requires grad raises;
    the patch wrote into it through the kernel's pointer. Under no_grad both write."""
    M, N, K = 7, 128, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=6)
    leaf = zero_out(M, N, device).requires_grad_()
    original = capture_error(lambda: gemm(A, Bs, leaf, A_scale, B_scale, splitK=2))
    assert original is not None and "requires grad" in original[1]
    gemm_op.clear()
    aiter_patches.apply([NAME])
    with caplog.at_level("DEBUG", logger="aiter_patches"):
        patched = zero_out(M, N, device).requires_grad_()
        assert capture_error(lambda: gemm(A, Bs, patched, A_scale, B_scale, splitK=2, out_zeroed=True)) == original
    assert torch.equal(bits(patched.detach()), bits(zero_out(M, N, device)))  # nothing written
    assert len(gemm_op) == 1 and stats()["fast"] == 0
    reason = "out requires grad under grad mode (AITER's in-place write decides the outcome)"
    assert stats()["fallback"] == {reason: 1}
    assert reason in caplog.text
    with torch.no_grad():
        expected = zero_out(M, N, device).requires_grad_()
        with suspended():
            gemm(A, Bs, expected, A_scale, B_scale, splitK=2)
        got = zero_out(M, N, device).requires_grad_()
        gemm(A, Bs, got, A_scale, B_scale, splitK=2, out_zeroed=True)
    assert torch.equal(bits(got.detach()), bits(expected.detach())) and stats()["fast"] == 1


def test_call_above_the_workspace_cap_goes_to_the_original(stub, gemm_op, device, monkeypatch):
    """Issue 14.14: the split partials are capped; a larger call is AITER's, counted."""
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=7)
    expected = nan_out(M, N, device)
    gemm(A, Bs, expected, A_scale, B_scale, splitK=2)
    gemm_op.clear()
    aiter_patches.apply([NAME])
    monkeypatch.setattr(kernel, "MAX_WORKSPACE_BYTES", kernel.workspace_bytes(M, N, 2) - 1)
    out = zero_out(M, N, device)
    gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True)
    assert len(gemm_op) == 1 and stats()["fast"] == 0
    assert torch.equal(bits(out), bits(expected))
    [reason] = stats()["fallback"]
    assert reason.startswith("split-K workspace 2*7*256*4 = 14336 bytes exceeds MAX_WORKSPACE_BYTES")
    monkeypatch.setattr(kernel, "MAX_WORKSPACE_BYTES", kernel.workspace_bytes(M, N, 2))
    gemm_op.clear()
    out = zero_out(M, N, device)
    gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True)
    assert gemm_op == [] and stats()["fast"] == 1 and torch.equal(bits(out), bits(expected))


def test_bias_goes_to_the_original(stub, gemm_op, device):
    M, N, K = 7, 128, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=6)
    bias = torch.zeros(1, N, device=device)
    original = capture_error(lambda: gemm(A, Bs, zero_out(M, N, device), A_scale, B_scale, bias, splitK=2))
    gemm_op.clear()
    aiter_patches.apply([NAME])
    patched = capture_error(lambda: gemm(A, Bs, zero_out(M, N, device), A_scale, B_scale, bias, splitK=2,
                                         out_zeroed=True))
    assert patched == original and len(gemm_op) == 1
    assert stats()["fast"] == 0 and list(stats()["fallback"]) == ["bias given"]


@pytest.mark.parametrize("given, missing", [("no B_scale", "B_scale"),
                                            ("no out, A_scale or B_scale", "out, A_scale, B_scale"),
                                            ("B_scale by keyword only", "A_scale")])
def test_missing_operand_gets_aiters_type_error(stub, device, given, missing):
    """A call short of an operand gets AITER's own TypeError (the gate used to raise a KeyError of its own)."""
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=3)
    out = zero_out(M, N, device)
    args, kwargs = {"no B_scale": ((A, Bs, out, A_scale), {}),
                    "no out, A_scale or B_scale": ((A, Bs), {}),
                    "B_scale by keyword only": ((A, Bs, out), {"B_scale": B_scale})}[given]
    original = capture_error(lambda: gemm(*args, splitK=2, **kwargs))
    assert original is not None and original[0] is TypeError
    aiter_patches.apply([NAME])
    for _ in range(2):  # decided, then kept: both hand the call back
        assert capture_error(lambda: gemm(*args, splitK=2, out_zeroed=True, **kwargs)) == original
    assert stats()["fast"] == 0 and stats()["errors"] == {}
    (reason, count), = stats()["fallback"].items()
    assert count == 2 and reason.startswith("required argument") and reason.endswith(f"not given: {missing}")


# ---------------------------------------------------------------- a non-zero out: the splits add onto it


@pytest.mark.parametrize("split", [2, 4])
def test_non_zero_out_accumulates_with_one_rounding(stub, device, split):
    """Kernel contract: the last split adds ``out``'s value once to the fp32 sum of the splits, rounds once.

    Exact data make the reference equal that fp32 sum, so the expectation is bitwise.
    """
    M, N, K = 16, 256, 1024
    A, Bs, A_scale, B_scale, B = make_inputs(stub, M, N, K, device, seed=8, exact=True)
    total = blockscale_gemm_reference(A, B, A_scale, B_scale)
    halves = torch.randint(-100, 101, (M, N), generator=torch.Generator().manual_seed(9))
    start = (halves / 2).to(torch.bfloat16).to(device)  # exact in bf16; keeps the 2**-12 bit of every sum
    aiter_patches.apply([NAME])
    memset = nan_out(M, N, device)
    with suspended():
        gemm(A, Bs, memset, A_scale, B_scale, splitK=split)
    assert torch.equal(bits(memset), bits(triton_bf16(total)))  # the data are exact: reference == kernel's sum
    out = start.clone()
    gemm(A, Bs, out, A_scale, B_scale, splitK=split, out_zeroed=True)
    once = triton_bf16(total + start.float())
    twice = triton_bf16(memset.float() + start.float())
    assert not torch.equal(bits(once), bits(twice))  # the data tell one rounding from two
    assert torch.equal(bits(out), bits(once))
    assert stats()["fast"] == 1


def test_non_zero_out_accumulates_general_data(stub, device):
    M, N, K = 7, 128, 1024
    A, Bs, A_scale, B_scale, B = make_inputs(stub, M, N, K, device, seed=10)
    total = blockscale_gemm_reference(A, B, A_scale, B_scale)
    start = (torch.randn(M, N, generator=torch.Generator().manual_seed(11)) * total.abs().mean()).to(
        torch.bfloat16).to(device)
    aiter_patches.apply([NAME])
    out = start.clone()
    gemm(A, Bs, out, A_scale, B_scale, splitK=4, out_zeroed=True)
    expected = total + start.float()
    assert rel_err(out, expected) <= 1e-2
    assert rel_err(out, total) > 0.5  # the starting values were not dropped


def test_stand_in_reads_a_scale_as_aiters_asm_does(stub, device):
    M, N, K = 7, 128, 512
    A, Bs, A_scale, B_scale, B = make_inputs(stub, M, N, K, device, seed=13)
    arg = a_scale_aiter_layout(A_scale)  # x_scale.t().contiguous().view(M, K/128), as AITER's callers build it
    assert arg.is_contiguous() and torch.equal(a_scale_as_read_by_asm(arg), A_scale)
    ref = blockscale_gemm_reference(A, B, A_scale, B_scale)
    out = nan_out(M, N, device)
    gemm(A, Bs, out, arg, B_scale, splitK=2)
    assert rel_err(out, ref) <= 1e-2


# ---------------------------------------------------------------- the package alias and revert


def test_package_alias_is_rebound_and_restored(stub, monkeypatch, device):
    mod = sys.modules[MODULE]
    original, original_op = getattr(mod, ATTR), mod._gemm_a8w8_blockscale_bpreshuffle_asm
    assert getattr(stub, ATTR) is original
    server = types.ModuleType("a_server_module")  # `from aiter import gemm_a8w8_...` in a server
    setattr(server, ATTR, original)
    monkeypatch.setitem(sys.modules, server.__name__, server)
    report = aiter_patches.apply([NAME])
    assert report.applied == [NAME]
    patched = getattr(mod, ATTR)
    assert patched is not original
    assert getattr(stub, ATTR) is patched and getattr(server, ATTR) is patched
    aliases = report[NAME]["targets"][0]["aliases"]
    assert f"aiter.{ATTR}" in aliases and f"a_server_module.{ATTR}" in aliases
    M, N, K = 1, 128, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device)
    out = zero_out(M, N, device)
    assert getattr(stub, ATTR)(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True) is out
    assert stats()["fast"] == 1
    assert aiter_patches.revert([NAME]) == [NAME]
    assert getattr(mod, ATTR) is original and getattr(stub, ATTR) is original and getattr(server, ATTR) is original
    assert mod._gemm_a8w8_blockscale_bpreshuffle_asm is original_op
    with pytest.raises(TypeError, match="out_zeroed"):
        getattr(stub, ATTR)(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True)


# ---------------------------------------------------------------- GPU: the issue's shapes, CUDA graphs

ISSUE_NK = [(7168, 2048), (4608, 7168), (24576, 1536), (7168, 16384), (1536, 7168)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("N,K", ISSUE_NK, ids=[f"N{n}-K{k}" for n, k in ISSUE_NK])
@pytest.mark.parametrize("M", [1, 7, 16, 64, 512, 4096])
def test_gpu_issue_shapes(stub, M, N, K):
    device = torch.device("cuda")
    A, Bs, A_scale, B_scale, B = make_inputs(stub, M, N, K, device, seed=M)
    ref = blockscale_gemm_reference(A, B, A_scale, B_scale)
    splits = [s for s in (2, 3, 4, 8) if kernel.valid_split(K, s)][:3]
    aiter_patches.apply()
    for s in splits:
        patched = zero_out(M, N, device)
        gemm(A, Bs, patched, A_scale, B_scale, splitK=s, out_zeroed=True)
        original = nan_out(M, N, device)
        with suspended():
            gemm(A, Bs, original, A_scale, B_scale, splitK=s)
        assert torch.equal(bits(patched), bits(original)), f"split {s}"
        assert rel_err(patched, ref) <= 1e-2, f"split {s}"
    over_cap = [s for s in splits if kernel.workspace_reason(M, N, s) is not None]
    assert stats()["fast"] == len(splits) - len(over_cap)
    assert sum(n for r, n in stats()["fallback"].items() if "MAX_WORKSPACE_BYTES" in r) == len(over_cap)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("split", [2, 4])
def test_gpu_cuda_graph_producer_zeroing_then_out_zeroed(stub, split):
    """The graph holds a producer's zeroing of ``out`` and the memset-free GEMM; replays follow new inputs."""
    device = torch.device("cuda")
    M, N, K = 16, 7168, 2048
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=1)
    fresh = [make_inputs(stub, M, N, K, device, seed=s)[0] for s in (2, 3)]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=device)
    aiter_patches.apply([NAME])

    def step():
        out.zero_()  # the producer's zeroing kernel
        gemm(A, Bs, out, A_scale, B_scale, splitK=split, out_zeroed=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    hits = stats()["fast"]
    for new_A in fresh + fresh:  # each input twice: a replay that did not zero would double the result
        A.copy_(new_A)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = nan_out(M, N, device)
        with suspended():
            gemm(A, Bs, expected, A_scale, B_scale, splitK=split)
        assert torch.equal(bits(out), bits(expected))
    assert stats()["fast"] == hits  # replays do not run Python


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_second_graph_on_a_stream_does_not_depend_on_the_first(stub):
    """Counters first needed inside a capture are per graph (zeroed by the graph itself), never cached:
    a server capturing one graph per batch size may replay them in any order."""
    device = torch.device("cuda")
    M, N, K, split = 16, 256, 1024, 2
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=12)
    expected = nan_out(M, N, device)
    gemm(A, Bs, expected, A_scale, B_scale, splitK=split)  # AITER's call, eagerly (and the kernel compiled)
    aiter_patches.apply([NAME])
    for _ in range(64):  # torch hands out pooled streams: find one no earlier call has used
        stream = torch.cuda.Stream()
        key = (torch.cuda.current_device(), stream.cuda_stream)
        if key not in kernel._counters:
            break
    else:
        pytest.skip("every pooled CUDA stream already has split-K counters")
    outs = [zero_out(M, N, device) for _ in range(2)]
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    for graph, out in zip(graphs, outs):
        with torch.cuda.graph(graph, stream=stream):
            out.zero_()
            gemm(A, Bs, out, A_scale, B_scale, splitK=split, out_zeroed=True)
    assert key not in kernel._counters, "nothing allocated inside a capture is cached for later launches"
    graphs[1].replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(outs[1]), bits(expected))
    graphs[0].replay()
    graphs[1].replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(outs[0]), bits(expected)) and torch.equal(bits(outs[1]), bits(expected))
