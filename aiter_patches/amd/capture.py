"""Record the Triton variants a launch would compile on a ROCm device, without a device.

Why: the exact variant a launcher compiles (its signature, constexprs, divisibility and
pointer-range attributes, options) is decided inside ``JITFunction.run`` from the launch
arguments and the active driver's target. Rebuilding that by hand would drift from what a
server compiles; instead a fake driver answers ``GPUTarget("hip", arch, 64)`` and
``knobs.runtime.jit_cache_hook`` records what ``run`` is about to compile and returns True,
so nothing compiles and nothing launches. What it records, ``specialization_data``, is the
serialization ``JITFunction.preload`` reads, so ``compile`` rebuilds the same source,
attributes and options, and hence the same cache key, that ``run`` would use.

The launchers are driven with CPU tensors: Triton's binder reads only their dtype, data
pointer alignment and storage size, and nothing launches.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field


class TritonTooOld(RuntimeError):
    """The installed Triton lacks an API the capture needs (named in the message)."""


@dataclass
class Variant:
    """One compile a launch would trigger: kernel, arch and everything that keys it."""

    module: str
    qualname: str
    arch: str
    key: str  # JITFunction.run's in-memory key (specialization + options)
    specialization_data: str  # JSON, the format JITFunction.preload reads
    params: dict  # name -> constexpr value, or the specialization of a runtime argument
    configs: set = field(default_factory=set)  # labels of the model configurations that launch it
    tokens: set = field(default_factory=set)  # token counts that launch it

    @property
    def kernel(self) -> str:
        return self.qualname

    @property
    def ident(self) -> tuple:
        return (self.module, self.qualname, self.arch, self.key)


def _triton_api():
    """The Triton pieces the capture uses, or TritonTooOld naming the missing one."""
    try:
        import triton
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.backends.driver import DriverBase
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except ImportError as exc:
        raise TritonTooOld(f"triton {_version()}: {exc} (aiter-patches compile needs triton >= 3.4)") from None
    if not hasattr(knobs, "runtime") or not hasattr(knobs.runtime, "jit_cache_hook"):
        raise TritonTooOld(f"triton {triton.__version__} has no knobs.runtime.jit_cache_hook")
    if not hasattr(driver, "set_active"):
        raise TritonTooOld(f"triton {triton.__version__} has no triton.runtime.driver.set_active")
    return triton, knobs, GPUTarget, DriverBase, driver, JITFunction


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:
        return "?"


def check_not_interpreted() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: the kernels would run in the interpreter instead of "
                           "compiling; unset it for `aiter-patches compile`")


def fake_hip_driver(arch: str, device: int = 0):
    """A driver that reports ``GPUTarget("hip", arch, 64)`` and can launch nothing."""
    triton, knobs, GPUTarget, DriverBase, driver, JITFunction = _triton_api()

    class CompileOnlyHIPDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return GPUTarget("hip", arch, 64)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("the compile-only driver cannot run kernels")

        def get_current_device(self):
            return device

        def get_current_stream(self, device=None):
            return 0

        def set_current_device(self, device):
            pass

    return CompileOnlyHIPDriver()


@contextlib.contextmanager
def active_driver(drv):
    """Make ``drv`` Triton's active driver for the block, then restore the previous one."""
    _, _, _, _, driver, _ = _triton_api()
    previous = getattr(driver, "_active", None)  # None: no driver chosen yet (reset_active would probe)
    driver.set_active(drv)
    try:
        yield drv
    finally:
        driver._active = previous


class Recorder:
    """Collects the variants ``JITFunction.run`` is asked to compile under :func:`capturing`."""

    def __init__(self, arch: str):
        self.arch = arch
        self.variants: dict[tuple, Variant] = {}
        self.label = ""
        self.tokens = 0
        self.launches = 0

    def hook(self, *, key, fn, compile, **_):
        self.launches += 1
        jit = fn.jit_function
        spec = compile.get("specialization_data")
        if spec is None:
            raise TritonTooOld("jit_cache_hook got no specialization_data (triton changed its hook arguments)")
        module, qualname = jit.fn.__module__, jit.fn.__qualname__
        ident = (module, qualname, self.arch, str(key))
        v = self.variants.get(ident)
        if v is None:
            v = self.variants[ident] = Variant(module, qualname, self.arch, str(key), spec, _params(jit, spec))
        v.configs.add(self.label)
        v.tokens.add(self.tokens)
        return True  # "handled": run compiles nothing and launches nothing


def _params(jit, spec_json: str) -> dict:
    """Kernel parameter -> its constexpr value, or ``type:attrs`` of a runtime argument; plus the options
    that select a variant (num_warps, num_stages)."""
    spec = json.loads(spec_json)
    names = list(jit.arg_names)
    consts = {tuple(k): v for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    out = {}
    for i, name in enumerate(names):
        ty = spec["signature"].get(name)
        if ty == "constexpr":
            val = consts.get((i,))
            out[name] = val["constexpr"] if isinstance(val, dict) and "constexpr" in val else val
        else:
            tags = "".join("D" if a[0] == "tt.divisibility" else "S" if a[0] == "tt.pointer_range" else "?"
                           for a in attrs.get((i,), []))
            out[name] = f"{ty}:{tags}" if tags else ty
    opts = spec["options"]
    out["num_warps"] = opts.get("num_warps")
    out["num_stages"] = opts.get("num_stages")
    return out


@contextlib.contextmanager
def capturing(arch: str):
    """Inside: launches record their variants into the yielded :class:`Recorder` and do nothing."""
    check_not_interpreted()
    triton, knobs, GPUTarget, DriverBase, driver, JITFunction = _triton_api()
    rec = Recorder(arch)
    # a distinct device index per arch: JITFunction caches its binder (and target) per device
    device = 0x4000 + int("".join(c for c in arch if c.isdigit()) or 0)
    previous_hook = knobs.runtime.jit_cache_hook
    with active_driver(fake_hip_driver(arch, device)):
        knobs.runtime.jit_cache_hook = rec.hook
        try:
            yield rec
        finally:
            knobs.runtime.jit_cache_hook = previous_hook
