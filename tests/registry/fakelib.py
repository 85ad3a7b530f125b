"""Builds a small importable library on disk for registry tests: a target, a re-export alias, a caller."""

import sys
import textwrap
import uuid
from pathlib import Path

CORE = '''
import enum

class Mode(enum.Enum):
    A = "a"
    B = "b"

def target(x, y=1, *, mode=Mode.A):
    return ("orig", x, y)

def other(x):
    return ("other", x)

def call_target(x):
    # looks `target` up in this module's globals at call time, as AITER's moe_sorting does
    return target(x)
'''

INIT = '''
from .core import target, other, call_target
'''

CONSUMER = '''
from {pkg}.core import target as imported_target
'''


def make(tmp_path: Path) -> str:
    """Write a fresh package (unique name) under tmp_path and put tmp_path on sys.path; returns its name."""
    pkg = f"fakelib_{uuid.uuid4().hex[:8]}"
    d = tmp_path / pkg
    d.mkdir()
    (d / "__init__.py").write_text(textwrap.dedent(INIT))
    (d / "core.py").write_text(textwrap.dedent(CORE))
    (d / "consumer.py").write_text(CONSUMER.format(pkg=pkg))
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    return pkg


def forget(pkg: str) -> None:
    for m in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
        del sys.modules[m]
