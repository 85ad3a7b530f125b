"""SGLang's in-tree AITER patch, read from the SGLang wheel at test time (never copied into the repo).

``.ci/run`` downloads ``sglang==0.5.23`` (``--no-deps``, the cp311 manylinux wheel) into the same cache as
the AITER wheel and exports its path as ``AITER_PATCHES_TEST_SGLANG_WHEEL``; then these tests must run.
Without the variable they look in the cache and skip, saying how to get the wheel.

The one file the tests need, ``sglang/kernels/ops/moe/moe_sorting_small.py``, imports torch, triton and
``sglang.srt.utils.is_gfx95_supported``; the fixture writes it under a temporary ``sglang`` package whose
other modules are empty stand-ins (``is_gfx95_supported`` returns True unless ``FAKE_GFX95=0``).
"""

import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest

WHEEL_NAME = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
ENV = "AITER_PATCHES_TEST_SGLANG_WHEEL"
MEMBER = "sglang/kernels/ops/moe/moe_sorting_small.py"
MODULE = "sglang.kernels.ops.moe.moe_sorting_small"

_UTILS = '''"""Stand-in for sglang.srt.utils (tests only)."""
import os


def is_gfx95_supported():
    return os.environ.get("FAKE_GFX95", "1") == "1"
'''


@pytest.fixture(scope="session")
def sglang_wheel() -> Path:
    from helpers.wheels import cached_wheel  # here: a subprocess imports this module without tests/ on its path

    return cached_wheel(WHEEL_NAME, ENV, "--no-deps --only-binary=:all: --python-version 3.11 --implementation cp "
                                         "--abi cp311 --platform manylinux_2_34_x86_64 sglang==0.5.23")


@pytest.fixture(scope="session")
def sglang_source(sglang_wheel) -> str:
    with zipfile.ZipFile(sglang_wheel) as z:
        return z.read(MEMBER).decode("utf-8")


@pytest.fixture(scope="session")
def sglang_root(sglang_source, tmp_path_factory) -> Path:
    """A directory holding a minimal ``sglang`` package around the wheel's ``moe_sorting_small.py``."""
    root = tmp_path_factory.mktemp("sglang_tree")
    for pkg in ("sglang", "sglang/kernels", "sglang/kernels/ops", "sglang/kernels/ops/moe", "sglang/srt"):
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "sglang/srt/utils.py").write_text(_UTILS)
    (root / MEMBER).write_text(sglang_source)
    return root


def _forget_sglang() -> None:
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


@contextmanager
def sglang_importable(root: Path):
    """``import sglang...`` finds the minimal package inside the scope; every sglang module is forgotten after."""
    from aiter_patches import registry

    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        registry.revert()
        sys.path.remove(str(root))
        _forget_sglang()


def run_sglang_patch():
    """What ``AiterRunnerCore.__init__`` does (SGLang 0.5.23 moe_runner/aiter.py:171): import, then call."""
    from sglang.kernels.ops.moe.moe_sorting_small import apply_aiter_small_moe_sort_patch

    return apply_aiter_small_moe_sort_patch()


@pytest.fixture
def stub():
    """The stand-in ``aiter`` with ``aiter.fused_moe`` imported; no patch applied."""
    from helpers.standin import use_stub_aiter

    with use_stub_aiter() as aiter:
        import aiter.fused_moe  # noqa: F401

        yield aiter
