"""The PyPI AITER wheel, for the tests that check the pins against a real release.

``.ci/run`` downloads ``amd-aiter==0.1.7.post2.dev18`` into a cache and exports
its path as ``AITER_PATCHES_TEST_WHEEL``; then these tests must run, and a
missing file fails them. Without the variable they look in the same cache and
skip, saying how to get the wheel, when it is not there.
"""

from pathlib import Path

import pytest
from helpers.wheels import cached_wheel

WHEEL_NAME = "amd_aiter-0.1.7.post2.dev18-py3-none-any.whl"
ENV = "AITER_PATCHES_TEST_WHEEL"


@pytest.fixture(scope="session")
def aiter_wheel() -> Path:
    return cached_wheel(WHEEL_NAME, ENV, "--no-deps amd-aiter==0.1.7.post2.dev18")


@pytest.fixture(scope="session")
def unpacked_wheel(aiter_wheel, tmp_path_factory) -> Path:
    from helpers import fake_rocm

    return fake_rocm.unpack_wheel(aiter_wheel, tmp_path_factory.mktemp("aiter_wheel"))
