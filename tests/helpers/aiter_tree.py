"""Parts of AITER's real tree (code objects, Triton kernels), found at test time (never copied into the repo).

In order: an AITER checkout named by ``AITER_PATCHES_TEST_AITER_SRC``; else the fixture
tarball ``../shared/fixtures/aiter-e4048607a5.tar.xz`` beside the repository (or beside a
folder above it, as for a git worktree kept in a subfolder), of which only the part a test
needs is unpacked into a temporary folder; else the test is skipped with both places named.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

ENV = "AITER_PATCHES_TEST_AITER_SRC"
REPO = Path(__file__).resolve().parents[2]
TARBALL_NAME = "aiter-e4048607a5.tar.xz"
TARBALL = REPO.parent / "shared" / "fixtures" / TARBALL_NAME


def find_tarball() -> Path | None:
    for folder in REPO.parents:
        path = folder / "shared" / "fixtures" / TARBALL_NAME
        if path.is_file():
            return path
    return None


ARCHS = ("gfx942", "gfx950")


def aiter_part(tmp_dir: Path, wanted, must_have: str) -> Path:
    """The root of an AITER tree holding ``must_have``: the checkout ``$AITER_PATCHES_TEST_AITER_SRC``,
    or ``tmp_dir`` after unpacking the tarball members whose path (without a leading ``./``) ``wanted`` accepts."""
    given = os.environ.get(ENV)
    if given:
        root = Path(given)
        if not (root / must_have).exists():
            pytest.fail(f"{ENV}={given} has no {must_have}")
        return root
    tarball = find_tarball()
    if tarball is None:
        pytest.skip(f"no AITER tree: set {ENV} to an AITER checkout, or provide {TARBALL}")
    with tarfile.open(tarball, "r:xz") as tar:
        members = [m for m in tar.getmembers() if (m.isfile() or m.isdir()) and wanted(_parts(m.name))]
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_dir, members=members, **kwargs)
    return tmp_dir


def _parts(name: str) -> tuple[str, ...]:
    parts = Path(name).parts
    return parts[1:] if parts and parts[0] == "." else parts


def code_object_root(tmp_dir: Path) -> Path:
    """A folder holding ``hsa/<gfx>/fp8gemm_blockscale/``."""
    return aiter_part(tmp_dir, lambda p: len(p) >= 3 and p[0] == "hsa" and p[2] == "fp8gemm_blockscale", "hsa")


def gemm_kernel_dir(root: Path, gfx: str) -> Path:
    return root / "hsa" / gfx / "fp8gemm_blockscale"
