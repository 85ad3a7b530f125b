"""Serve the sort+quant launcher "on a ROCm device" from a Triton cache and report every compile.

Run as a script in a fresh process (TRITON_INTERPRET unset, TRITON_CACHE_DIR set):
``python serve_from_cache.py ARCH_STRING CONFIG_JSON``. The active driver answers as a ROCm
device: triton's own ``HIPDriver.get_current_target`` runs on device properties carrying the
arch string a real HIP driver reports (feature suffixes included, e.g.
``gfx942:sramecc+:xnack-``); the launcher object it hands out launches nothing. Each call goes
through ``JITFunction.run`` exactly as on the server: ``knobs.compilation.listener`` records
each ``triton.compile`` with its cache hash and whether it hit; a compile that misses the cache
is stopped at its first stage and counted. Prints one JSON object.

Test support only: nothing in ``aiter_patches`` imports this.
"""

import json
import sys


def main(arch_string: str, config: dict) -> dict:
    import torch
    from triton import knobs
    from triton.backends.amd import compiler as amd_compiler
    from triton.backends.amd.driver import HIPDriver
    from triton.backends.driver import GPUDriver
    from triton.runtime.driver import driver

    class Utils:
        def get_device_properties(self, device):
            return {"arch": arch_string, "warpSize": 64, "max_shared_mem": 64 * 1024,
                    "multiprocessor_count": 304, "sm_clock_rate": 0, "mem_clock_rate": 0, "mem_bus_width": 0}

        def load_binary(self, name, kernel, shared, device):
            return 1, 1, 0, 0, 1024  # module, function, n_regs, n_spills, n_max_threads

        def unload_module(self, module):
            pass

    class NoLaunch:
        def __init__(self, src, metadata):
            pass

        def __call__(self, *args):
            launched.append(1)

    class FakeRocmDriver(GPUDriver):
        """Triton's HIP driver as far as choosing the target goes; launches nothing."""

        def __init__(self):  # not GPUDriver.__init__: it binds torch.cuda, absent on this torch
            self.utils = Utils()
            self.launcher_cls = NoLaunch

        get_current_target = HIPDriver.get_current_target  # the real normalisation of the arch string
        map_python_to_cpp_type = HIPDriver.map_python_to_cpp_type

        @staticmethod
        def is_active():
            return True

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            raise RuntimeError("no device interface")

        def get_benchmarker(self):
            raise RuntimeError("no benchmarker")

    class CompileAttempted(RuntimeError):
        pass

    def no_compile(*args, **kwargs):
        raise CompileAttempted("a kernel missed the cache and started compiling")

    compiles, launched = [], []

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        compiles.append({"kernel": src.name, "hash": metadata["hash"], "cache_hit": bool(cache_hit)})

    amd_compiler.HIPBackend.make_ttir = staticmethod(no_compile)
    knobs.compilation.listener = listener
    driver.set_active(FakeRocmDriver())
    target = driver.active.get_current_target()

    from aiter_patches.amd import sweep
    from aiter_patches.amd.presets import parse_shapes

    misses, calls = 0, 0
    shape = parse_shapes(config["shapes"])
    for call in sweep.sort_quant_calls(shape, target.arch, config["tokens"]):
        calls += 1
        try:
            call.run()
        except CompileAttempted:
            misses += 1
    return {"target": [target.backend, target.arch, target.warp_size], "calls": calls, "launches": len(launched),
            "misses": misses, "compiles": compiles}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))))
