"""The Triton range pyproject declares (issue 32) is the one the code states and the one installed here."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def declared_floor() -> tuple[int, int]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(r"triton\b", d)]
    m = re.fullmatch(r"triton>=(\d+)\.(\d+)", spec.replace(" ", ""))
    assert m, f"{spec!r}: a floor and no cap (a cap could make pip replace the user's torch)"
    return int(m[1]), int(m[2])


def test_the_floor_is_what_compile_asks_for_and_this_triton_meets_it():
    import triton

    floor = declared_floor()
    assert f"needs triton >= {floor[0]}.{floor[1]})" in (ROOT / "aiter_patches/amd/capture.py").read_text()
    assert tuple(int(p) for p in triton.__version__.split(".")[:2]) >= floor
