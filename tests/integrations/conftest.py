"""Fixtures for the integration tests: the stand-in AITER, imported fresh for each test and gone afterwards."""

import importlib
import sys

import pytest
import torch

from helpers.standin import use_stub_aiter
from helpers import registry_view


@pytest.fixture
def stub():
    """The stand-in ``aiter`` with every module a stand-in patch targets imported; no patch applied."""
    with use_stub_aiter() as aiter:
        for module in sorted({m for n in registry_view.stand_in_names() for m in registry_view.modules(n)}):
            importlib.import_module(module)
        yield aiter


@pytest.fixture
def device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture
def launches(stub, monkeypatch):
    """Every launch of the stand-in's block-scale GEMM kernel: ('memset',) for a split-K zero fill, ('gemm', splits)."""
    from aiter_patches_standin import blockscale_gemm_splitk as kernel

    seen = []
    original = kernel.run_plan  # every one-launch call: the API's and the out_zeroed gates' kept-plan hits alike

    def counted(plan, *tensors):
        if plan.zero_out and plan.splits > 1:
            seen.append(("memset",))
        seen.append(("gemm", plan.splits))
        return original(plan, *tensors)

    monkeypatch.setattr(kernel, "run_plan", counted)
    return seen


@pytest.fixture
def tuned(stub, monkeypatch):
    """The stand-in dispatcher's tuned table, empty: a test points a shape at a kernel (and split count) here."""
    table = {}
    monkeypatch.setattr(sys.modules["aiter.ops.gemm_op_a8w8"], "TUNED", table)
    return table
