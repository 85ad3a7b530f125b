"""A parameter the gates read by value, given as a tensor: handed back, counted, never a kept verdict.

A kept verdict is keyed on a tensor's metadata only, so a 0-d tensor flag whose value changed
between calls would replay a verdict for the other value (and reading it syncs the device).
"""

import torch

from aiter_patches.verify import suspended

from .test_gemm_out_zeroed import bits, gemm, make_inputs, zero_out
from .test_gemm_out_zeroed import stats as gstats
from .test_gemm_out_zeroed_verdicts import fresh, original  # noqa: F401  (fixtures)
from .test_sort_verdicts import decided, impl, sort_args  # noqa: F401  (fixture)
from .test_sort_verdicts import stats as sstats


def test_sort_flags_given_as_tensors_go_to_aiter(stub, device, decided):
    for name, first, second in (("accumulate", False, True), ("output_aux", False, True)):
        a = sort_args(device)
        a["return_local_topk_ids"] = False
        a["accumulate"] = True
        a[name] = torch.tensor(second)
        with suspended():
            expected = impl(a)
        a[name] = torch.tensor(first)
        impl(a)
        a[name] = torch.tensor(second)
        got = impl(a)
        assert len(got) == len(expected) and all(
            tuple(g.shape) == tuple(e.shape) for g, e in zip(got, expected) if isinstance(g, torch.Tensor)), name
        assert any(f"{name} is a tensor" in r for r in sstats()["fallback"]), sstats()


def test_gemm_bpreshuffle_given_as_a_tensor_goes_to_aiter(stub, fresh, device):
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, B = make_inputs(stub, M, N, K, device, seed=1)
    with suspended():
        expected = zero_out(M, N, device)
        gemm(A, B, expected, A_scale, B_scale, splitK=2, bpreshuffle=torch.tensor(0))
    gemm(A, Bs, zero_out(M, N, device), A_scale, B_scale, splitK=2, bpreshuffle=torch.tensor(1), out_zeroed=True)
    out = zero_out(M, N, device)
    gemm(A, B, out, A_scale, B_scale, splitK=2, bpreshuffle=torch.tensor(0), out_zeroed=True)
    assert torch.equal(bits(out), bits(expected))
    assert any("bpreshuffle is a tensor" in r for r in gstats()["fallback"]), gstats()
