"""Fixtures for patch tests: the stand-in AITER, imported fresh for each test and gone afterwards."""

import importlib

import pytest
import torch

from helpers import registry_view
from helpers.moe_declared import checking
from helpers.standin import use_stub_aiter


@pytest.fixture
def stub(request):
    """The stand-in ``aiter`` package with every module a patch targets imported (the registry says which); no patch applied.

    Its opus sort reports the multi-phase dispatch (two launches) at every size, so that the one-launch
    sort without a quant (which runs only where it saves launches) is exercised at these small shapes;
    tests of that rule itself are marked ``real_sort_launches``. The MoE features' steps run against
    their declared plan fields (``helpers.moe_declared.checking()``): an undeclared access fails the test.
    """
    with use_stub_aiter() as aiter, checking():
        for module in sorted({m for n in registry_view.stand_in_names() for m in registry_view.modules(n)}):
            importlib.import_module(module)
        if request.node.get_closest_marker("real_sort_launches") is None:
            aiter.moe_sorting_opus_get_workspace_size = _multi_phase_workspace
        yield aiter


def _multi_phase_workspace(tokens, num_experts, topk, dispatch_policy=0):
    return 0 if dispatch_policy == 1 else 128


@pytest.fixture
def device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def routing(M, E, topk, device, seed=0, skew=None):
    """Distinct experts per token; ``skew='one'`` sends every token to expert 0 first, ``'hot'`` favours a few."""
    g = torch.Generator().manual_seed(seed)
    if skew == "hot":
        logits = torch.randn(M, E, generator=g) + torch.linspace(6, 0, E)
    else:
        logits = torch.rand(M, E, generator=g)
    ids = logits.argsort(dim=1, descending=True)[:, :topk]
    if skew == "one":
        ids[:, 0] = 0
        ids[:, 1:] = (torch.arange(1, topk) + torch.arange(M)[:, None]) % (E - 1) + 1
    w = torch.rand(M, topk, generator=g).softmax(dim=1)
    return ids.to(torch.int32).to(device), w.to(torch.float32).to(device)


def sort_bypassing_patches(fm, unpatched_impl):
    """A ``moe_sorting`` that sorts without passing the patched ``_moe_sorting_impl``, as AITER's
    FlyDSL and flat sorts do. ``unpatched_impl``: the stand-in's own, taken before ``apply()``."""
    sorting = fm.moe_sorting

    def bypassing(*a, **k):
        patched_impl = fm._moe_sorting_impl
        fm._moe_sorting_impl = unpatched_impl
        try:
            return sorting(*a, **k)
        finally:
            fm._moe_sorting_impl = patched_impl

    return bypassing
