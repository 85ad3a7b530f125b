"""Fixtures for the integration tests: the stand-in AITER, imported fresh for each test and gone afterwards."""

import importlib

import pytest
import torch

from aiter_patches.testing import use_stub_aiter
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
