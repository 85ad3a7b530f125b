"""torch.compile callers reach the patched functions (design.md: wrapt proxies are invisible to Dynamo).

The replacements are plain functions, so Dynamo traces into them instead of
into AITER's original. On CPU the Triton interpreter cannot run under Dynamo
(it traces into the interpreter's own Python), so there the fast path raises,
is counted, and the call falls back to AITER: either way the wrapper was
reached and the result is AITER's bits. On a GPU the kernel itself runs.
"""

import pytest
import torch

import aiter_patches

from .test_moe_sort_mx_quant_patch import moe_inputs, same_bits


# Dynamo tracing AITER's whole fused_moe: 20-30 s on 2 cores, CI's second step (python -m pytest -m slow_ci).
# The default run's compiled callers: tests/integrations (test_torch_compile_traces_through_the_hooks,
# test_torch_compile_traces_vllms_add).
@pytest.mark.slow_ci
def test_compiled_caller_reaches_the_patch(stub, device):
    import aiter.fused_moe as fm

    args = moe_inputs(stub, device, 4, 8, 2, 256, 128, "bf16")
    expected = fm.fused_moe(**args)
    aiter_patches.apply(["moe_sort_mx_quant"])

    def step(**a):
        return fm.fused_moe(**a) * 1

    torch._dynamo.reset()
    out = torch.compile(step, backend="eager")(**args)
    s = aiter_patches.stats()["moe_sort_mx_quant"]
    reached = s["fast"] + sum(s["fallback"].values()) + sum(s["errors"].values())
    assert reached >= 1, f"the compiled caller bypassed the patched sort: {s}"
    if device.type == "cuda":
        assert s["fast"] >= 1 and not s["errors"], s
    assert same_bits(out, expected)
