"""The out_zeroed gate's verdicts kept per call key (patches/gemm_out_zeroed.py, aiter_patches/call_key.py).

A repeated call is decided once: its next calls skip the checks and launch the kept plan. Every
field the gate reads must be in the key: changing one after a hit must be decided again (a
fallback with the gate's own reason, or another plan), bits must equal AITER's memset + GEMM,
and the kept verdicts never hold a tensor.
"""

import gc
import sys

import pytest
import torch

import aiter_patches
from aiter_patches import call_key
from aiter_patches.patches import gemm_out_zeroed as patch
from aiter_patches.verify import suspended
from aiter_patches_standin import blockscale_gemm_splitk as kernel
from helpers.standin import gemm_default_backend

from .test_gemm_out_zeroed import bits, gemm, make_inputs, nan_out, stats, zero_out

NAME = "gemm_out_zeroed"


@pytest.fixture
def fresh(stub, monkeypatch):
    monkeypatch.setattr(patch, "VERDICTS", call_key.GuardedVerdicts(NAME))
    aiter_patches.apply([NAME])
    return patch.VERDICTS


def original(A, Bs, A_scale, B_scale, split, device):
    out = nan_out(A.shape[0], Bs.shape[0], device)
    with suspended():
        gemm(A, Bs, out, A_scale, B_scale, splitK=split)
    return out


def test_a_repeated_call_is_decided_once_and_keeps_the_bits(stub, fresh, device, monkeypatch):
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=1)
    expected = original(A, Bs, A_scale, B_scale, 2, device)
    decided = []
    real = patch._plan
    monkeypatch.setattr(patch, "_plan", lambda *a: decided.append(1) or real(*a))
    for _ in range(3):
        out = zero_out(M, N, device)
        assert gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True) is out
        assert torch.equal(bits(out), bits(expected))
    assert decided == [1] and fresh.hits == 2 and len(fresh) == 1
    assert stats()["fast"] == 3 and stats()["fallback"] == {}


@pytest.mark.parametrize("change", ["requires grad", "grad mode", "A_scale layout", "split", "bias",
                                    "workspace cap", "backend", "keyword"])
def test_a_change_of_what_the_gate_reads_is_decided_again(stub, fresh, device, monkeypatch, change):
    """After a hit, each change below must reach the gate again (its own reason, or a new verdict)."""
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=2)
    grad_out = change == "grad mode"  # first under no_grad, into an out that requires grad: no autograd refusal
    with torch.set_grad_enabled(not grad_out):
        for _ in range(2):
            gemm(A, Bs, zero_out(M, N, device).requires_grad_(grad_out), A_scale, B_scale, splitK=2, out_zeroed=True)
    assert stats()["fast"] == 2 and fresh.hits == 1
    out = zero_out(M, N, device).requires_grad_(grad_out)
    kw = {"splitK": 2}
    if change == "requires grad":
        out.requires_grad_()
    elif change == "A_scale layout":
        A_scale = torch.empty(K // 128 * 2, M, device=device)[::2].t()  # neither contiguous nor strides (1, M)
    elif change == "split":
        kw = {"splitK": 4}
    elif change == "bias":
        kw["bias"] = torch.zeros(1, N, device=device)
    elif change == "workspace cap":
        monkeypatch.setattr(kernel, "MAX_WORKSPACE_BYTES", kernel.workspace_bytes(M, N, 2) - 1)
    elif change == "backend":  # the stand-in's Triton backend, then AITER's .co (what AMD's AITER is served by)
        gemm_default_backend(monkeypatch)  # served as on AMD's AITER: its .co through HIP
    elif change == "keyword":
        kw = {"splitK": 2, "kernelName": None}
    try:
        gemm(A, Bs, out, A_scale, B_scale, out_zeroed=True, **kw)
    except Exception:  # noqa: BLE001 - AITER's own outcome for the changed call
        pass
    # the first call and the changed one (real AITER's branch keys its verdicts on what it reads instead)
    assert fresh.misses == 2, change
    reasons = stats()["fallback"]
    expected = {
        "requires grad": "out requires grad under grad mode",
        "grad mode": "out requires grad under grad mode",
        "A_scale layout": "A_scale must occupy M*K/128 consecutive elements",
        "bias": "bias given",
        "workspace cap": "split-K workspace 2*7*256*4",
        "backend": "A_scale is not a contiguous fp32 tensor",  # AITER's .co backend: its own operand rule
    }.get(change)
    if expected is None:  # still a fast call, under a verdict of its own
        assert stats()["fast"] == 3 and reasons == {}, (change, stats())
    else:
        assert stats()["fast"] == 2 and [r for r in reasons if r.startswith(expected)], (change, stats())


def test_an_unkeyable_argument_runs_the_gate_every_call(stub, fresh, device):
    class Sub(torch.Tensor):
        pass

    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=3)
    expected = original(A, Bs, A_scale, B_scale, 2, device)
    for _ in range(2):
        out = zero_out(M, N, device).as_subclass(Sub)
        gemm(A, Bs, out, A_scale, B_scale, splitK=2, out_zeroed=True)
        assert torch.equal(bits(out.as_subclass(torch.Tensor)), bits(expected))
    assert len(fresh) == 0 and fresh.hits == 0 and stats()["fast"] == 2


def test_kept_verdicts_hold_no_tensor(stub, fresh, device):
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=4)
    gemm(A, Bs, zero_out(M, N, device), A_scale, B_scale, splitK=2, out_zeroed=True)
    with pytest.raises(NotImplementedError):  # the stand-in's own answer to a bias
        gemm(A, Bs, zero_out(M, N, device), A_scale, B_scale, splitK=2, bias=torch.zeros(1, N), out_zeroed=True)
    assert len(fresh) == 2
    seen, todo = set(), [fresh._d]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type) or type(obj).__name__ == "module":
            continue
        seen.add(id(obj))
        assert not isinstance(obj, torch.Tensor), "a kept verdict holds a tensor"
        if isinstance(obj, (dict, tuple, list)) or hasattr(obj, "_fields"):
            todo += list(obj.values()) + list(obj.keys()) if isinstance(obj, dict) else list(obj)
        elif callable(obj) and getattr(obj, "__closure__", None):
            todo += [c.cell_contents for c in obj.__closure__]
    gc.collect()


def test_applying_again_decides_afresh(stub, fresh, device):
    M, N, K = 7, 256, 512
    A, Bs, A_scale, B_scale, _ = make_inputs(stub, M, N, K, device, seed=1)
    gemm(A, Bs, zero_out(M, N, device), A_scale, B_scale, splitK=2, out_zeroed=True)
    assert len(patch.VERDICTS) == 1
    aiter_patches.revert([NAME])
    aiter_patches.apply([NAME])
    assert len(patch.VERDICTS) == 0
