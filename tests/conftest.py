"""Test session set-up: run Triton kernels in the interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before ``triton`` is imported anywhere, so it
is decided here, at collection start. Tests marked ``gpu`` are skipped without a
GPU; on the device machine run them with ``pytest -m gpu``.
"""

import os

import pytest

try:
    import torch

    _HAS_GPU = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a dependency
    _HAS_GPU = False

if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (run `pytest -m gpu` on a CUDA/ROCm machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _registry_clean():
    """Every test starts and ends with no patch applied and no pending hook."""
    from aiter_patches import registry, runtime

    registry.revert()
    runtime.set_strict(None)
    registry.reset_stats()
    yield
    registry.revert()
    runtime.set_strict(None)
