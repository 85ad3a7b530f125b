"""The PyPI AITER wheel, for the tests that check the pins against a real release.

``.ci/run`` downloads ``amd-aiter==0.1.7.post2.dev18`` into a cache and exports
its path as ``AITER_PATCHES_TEST_WHEEL``; then these tests must run, and a
missing file fails them. Without the variable they look in the same cache and
skip, saying how to get the wheel, when it is not there.
"""

import os
from pathlib import Path

import pytest

WHEEL_NAME = "amd_aiter-0.1.7.post2.dev18-py3-none-any.whl"
ENV = "AITER_PATCHES_TEST_WHEEL"


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aiter_patches" / "wheels" / WHEEL_NAME


@pytest.fixture(scope="session")
def aiter_wheel() -> Path:
    given = os.environ.get(ENV)
    if given:
        path = Path(given)
        if not path.is_file():
            pytest.fail(f"{ENV}={given} does not exist (.ci/run should have downloaded it)")
        return path
    path = _cache_path()
    if not path.is_file():
        pytest.skip(
            f"the AITER wheel is not here: run .ci/run, or `pip download --no-deps amd-aiter==0.1.7.post2.dev18 "
            f"-d {path.parent}` (or set {ENV})"
        )
    return path


@pytest.fixture(scope="session")
def unpacked_wheel(aiter_wheel, tmp_path_factory) -> Path:
    from helpers import fake_rocm

    return fake_rocm.unpack_wheel(aiter_wheel, tmp_path_factory.mktemp("aiter_wheel"))
