"""Fakes that let a real AITER source tree be imported on a CPU machine without ROCm.

The patches must be proven against AITER's real Python code, not only against
the stand-in, yet ``import aiter`` probes ROCm at import time (see
shared/aiter-facts.md, "Where AITER comes from"). These fakes answer exactly
those probes and nothing else, so ``import aiter`` and ``import aiter.fused_moe``
succeed and report AITER's real signatures; every HIP op still fails when
called (no ``hipcc``). They change the process they are installed in for good:
install them only in a throw-away subprocess (``python_command``), never in the
test runner itself.

Test support only: nothing in ``aiter_patches`` imports this.
"""

from __future__ import annotations

import enum
import importlib.machinery
import os
import stat
import sys
import types
import zipfile
from pathlib import Path

GFX = "gfx942"
COMPUTE_UNITS = 304

# The names AITER's C++ enum module exports (aiter-facts.md; wheel: module_aiter_enum,
# later AITER: module_aiter_core).
ENUM_MODULES = ("module_aiter_enum", "module_aiter_core")

# Third-party modules `import aiter` imports at module level but never calls while
# importing. Each absent one gets an empty stand-in; a call into it raises.
OPTIONAL_DEPS = ("pandas", "einops", "psutil")


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    """Extract what ``import aiter`` reads from a wheel (or any zip) into ``dest``; returns ``dest``.

    That is ``aiter/`` and ``aiter_meta/`` (AITER puts ``aiter_meta`` on
    ``sys.path`` and imports ``csrc.cpp_itfs`` from it), without the GPU code
    objects and the vendored C++ trees, which are most of the wheel's size.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [
            n for n in zf.namelist()
            if n.startswith(("aiter/", "aiter_meta/"))
            and not n.startswith("aiter_meta/3rdparty/")
            and not n.endswith((".co", ".so"))
        ]
        zf.extractall(dest, members)
    return dest


def make_rocm_home(root: Path, gfx: str = GFX, compute_units: int = COMPUTE_UNITS) -> Path:
    """A directory with ``bin/hipconfig`` and ``bin/rocminfo`` scripts answering like one ``gfx`` GPU."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    scripts = {
        "hipconfig": "#!/bin/sh\necho 6.4.0-fake\n",
        # AITER takes the first line mentioning the arch as the arch name, and the
        # "Compute Unit" of the agent whose "Device Type" is GPU.
        "rocminfo": (
            "#!/bin/sh\n"
            "cat <<'EOF'\n"
            "Agent 1\n"
            "  Name:                    CPU\n"
            "  Device Type:             CPU\n"
            "Agent 2\n"
            f"  Name:                    {gfx}\n"
            "  Device Type:             GPU\n"
            f"  Compute Unit:            {compute_units}\n"
            "EOF\n"
        ),
    }
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return root


def _pybind_enum_str(member) -> str:
    return f"{type(member).__name__}.{member.name}"


def enum_module(name: str) -> types.ModuleType:
    """The C++ enum module AITER JIT-builds, as IntEnums with AITER's member values."""
    mod = types.ModuleType(name)
    mod.ActivationType = enum.IntEnum(
        "ActivationType", {"No": -1, "Silu": 0, "Gelu": 1, "Swiglu": 2, "Situv2": 3}
    )
    mod.QuantType = enum.IntEnum(
        "QuantType",
        {n: i for i, n in enumerate(
            ("No", "per_Tensor", "per_Token", "per_1x32", "per_1x128", "per_128x128", "per_256x128", "per_1024x128")
        )},
    )
    mod.MlaVersion = enum.IntEnum("MlaVersion", {"V32": 0, "V40": 1})
    for cls in (mod.ActivationType, mod.QuantType, mod.MlaVersion):
        # AITER's compile_ops tells a pybind11 enum from a function by this docstring prefix.
        cls.__doc__ = "Members:\n\n" + "\n".join(f"  {m.name}" for m in cls)
        # pybind11 enums print as "QuantType.per_1x32"; IntEnum prints the number on Python >= 3.11,
        # and AITER builds its tuned-config keys with str(q_type) (get_2stage_cfgs).
        cls.__str__ = _pybind_enum_str
    mod.__file__ = f"<aiter_patches fake {name}>"
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


class _AbsentDependency(types.ModuleType):
    """An importable placeholder for a dependency that is not installed; any use raises."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise RuntimeError(f"{self.__name__}.{attr}: '{self.__name__}' is a test placeholder (not installed)")


class _HipDriver:
    """Enough of a Triton driver for AITER's import-time arch queries."""

    def __init__(self, gfx: str):
        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget("hip", gfx, 64)

    def get_current_target(self):
        return self._target

    def get_current_device(self):
        return 0

    def is_active(self):
        return True


def install(rocm_home: Path, gfx: str = GFX) -> None:
    """Make this process able to ``import aiter`` on CPU. Call before importing it; irreversible."""
    os.environ["ROCM_HOME"] = str(rocm_home)
    os.environ["ROCM_PATH"] = str(rocm_home)
    os.environ["PATH"] = f"{rocm_home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.setdefault("GPU_ARCHS", gfx)
    os.environ.setdefault("CU_NUM", str(COMPUTE_UNITS))
    for dep in OPTIONAL_DEPS:
        try:
            __import__(dep)
        except ImportError:
            placeholder = _AbsentDependency(dep)
            placeholder.__spec__ = importlib.machinery.ModuleSpec(dep, None)
            sys.modules[dep] = placeholder
    for name in ENUM_MODULES:
        sys.modules[f"aiter.jit.{name}"] = enum_module(f"aiter.jit.{name}")
        sys.modules[name] = sys.modules[f"aiter.jit.{name}"]  # AITER_JIT_DIR imports it top-level
    from triton.runtime import driver

    driver.set_active(_HipDriver(gfx))


def python_command(wheel_dir: Path, rocm_home: Path, body: str) -> list[str]:
    """argv for a fresh interpreter that installs the fakes, puts ``wheel_dir`` first on
    ``sys.path`` and runs ``body`` (Python source)."""
    tests_dir = Path(__file__).resolve().parents[1]
    prologue = (
        "import sys\n"
        f"sys.path.insert(0, {str(tests_dir.parent)!r})\n"  # this checkout's aiter_patches
        f"sys.path.insert(0, {str(tests_dir)!r})\n"
        f"sys.path.insert(0, {str(wheel_dir)!r})\n"
        "from pathlib import Path\n"
        "from helpers import fake_rocm\n"
        f"fake_rocm.install(Path({str(rocm_home)!r}))\n"
    )
    return [sys.executable, "-c", prologue + body]
