"""A fake Triton driver and compiler: Triton's real binder, key and cache run; nothing is compiled or launched.

``JITFunction.run`` computes the specialization and the cache key with the installed Triton's
own code, then calls ``fn.compile`` on a miss and ``kernel.run(...)`` to launch. Here the driver
answers device/stream/target queries for a CUDA sm_90 target, ``fn.compile`` returns a
:class:`FakeCompiled` that remembers what it was compiled for (signature, constexprs,
attributes, options), and its ``run`` records each launch. So a test sees which variant Triton
picks for given arguments, and what the launcher was handed, on a machine without a GPU.

Test and benchmark support only (bench_host_overhead.py --fake-launch, tests/launch): nothing in
``aiter_patches`` imports this.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

STREAM = 0x5EED


@dataclass
class Launch:
    kernel: "FakeCompiled"
    grid: tuple
    stream: int
    args: tuple  # tensors as their data_ptr(), other values as given
    raw_types: tuple = ()  # what the launcher was handed: Tensor, or int for an unpacked pointer

    def same_as(self, other: "Launch") -> bool:
        return (self.kernel is other.kernel and self.grid == other.grid and self.stream == other.stream
                and self.args == other.args)


@dataclass(eq=False)
class FakeCompiled:
    name: str
    signature: dict
    constants: dict
    attrs: dict
    options: dict
    number: int
    launches: list = field(default_factory=list)
    function: object = field(default_factory=object)
    packed_metadata: tuple = (4, 1, 0)

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        assert function is self.function and packed is self.packed_metadata
        norm = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        self.launches.append(Launch(self, (g0, g1, g2), stream, norm, tuple(map(type, args))))
        LOG.append(self.launches[-1])


LOG: list[Launch] = []
_numbers = itertools.count()


class FakeDriver:
    def __init__(self, backend: str = "cuda"):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32) if backend == "cuda" else GPUTarget("hip", "gfx942", 64)

    def is_active(self):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return STREAM

    def get_active_torch_device(self):
        return torch.device("cpu")


def fake_compile_for(fn) -> None:
    """Make ``fn`` (a JITFunction) 'compile' into FakeCompiled objects on device 0."""
    fn.device_caches[0]  # creates the binder; it sets fn.compile, replaced next

    def compile(src, target=None, options=None, **_):
        return FakeCompiled(fn.__name__, dict(src.signature), dict(src.constants), dict(src.attrs),
                            dict(options or {}), next(_numbers))

    fn.compile = compile


@contextlib.contextmanager
def fake_triton(*fns, backend: str = "cuda"):
    """The fake driver active (a CUDA sm_90 or, ``backend="hip"``, a gfx942 target), ``fns``
    compiling fakes; restores the driver and empties LOG after."""
    from triton.runtime import driver

    from aiter_patches.kernels import fast_launch

    previous = driver._active  # None when no driver was ever made (no GPU here)
    driver.set_active(FakeDriver(backend))
    fast_launch.clear()
    LOG.clear()
    try:
        for fn in fns:
            fn.device_caches.clear()
            fake_compile_for(fn)
        yield LOG
    finally:
        for fn in fns:
            fn.device_caches.clear()
        driver._active = previous
        fast_launch.clear()
        LOG.clear()


def jit(fn):
    """``triton.jit`` even when TRITON_INTERPRET=1 is set (a real JITFunction, for the fake driver)."""
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


def variant(kernel: FakeCompiled) -> Any:
    """What distinguishes a compiled variant: its signature, constexprs, attributes, options."""
    return (tuple(sorted(kernel.signature.items())), tuple(sorted(map(str, kernel.constants.items()))),
            tuple(sorted(map(str, kernel.attrs.items()))), tuple(sorted(map(str, kernel.options.items()))))
