"""Release wheels the tests read (never install): given by an environment variable, or in the cache.

``.ci/run`` downloads each into ``$XDG_CACHE_HOME/aiter_patches/wheels`` and exports its path; then
the tests that need it must run, and a missing file fails them. Without the variable they look in
the same cache and skip, saying how to get the wheel.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aiter_patches" / "wheels"


def cached_wheel(name: str, env: str, download: str) -> Path:
    """The wheel ``name``: ``$env`` if set (it must exist), else the cached copy, else skip.
    ``download`` is the ``pip download`` arguments (without ``-d``) that fetch it."""
    given = os.environ.get(env)
    if given:
        path = Path(given)
        if not path.is_file():
            pytest.fail(f"{env}={given} does not exist (.ci/run should have downloaded it)")
        return path
    path = cache_dir() / name
    if not path.is_file():
        pytest.skip(f"{name} is not here: run .ci/run, or `pip download {download} -d {path.parent}` (or set {env})")
    return path
