"""Probe: what the sort's output allocations would cost the host if made in C++ instead of Python.

Why: on the H200 host the patched sort's five ``torch.empty`` (and the sort + MXFP4 quant's seven,
plus two dtype views) are the largest piece of its host time that Python cannot shrink: each is a
Python call into torch's argument parser (docs/bench/host_primitives_h200.md). Issue 15's goals
(patched <= 1.2x the AITER-equivalent floor; the sort + quant <= 20 us) need that piece smaller.
This probe builds a throwaway C++ extension that makes exactly those allocations (the same sizes,
dtypes and device as ``kernels/moe_sort_mx_quant._launch``) in one call, and times it against the
Python allocations, side by side in one run, together with the build time a first use would pay.
Nothing in the package uses it: it measures whether a native allocation step is worth building.

    python bench/native_alloc_probe.py --out native_alloc.md    # GPU; the last run: docs/bench/host_primitives_h200.md
    python bench/native_alloc_probe.py --reps 2 --out /tmp/native.md            # CPU (CPU tensors)

The build needs a C++ compiler and torch's headers (a CPU or a CUDA/ROCm wheel ships them); where
it fails, the table says so and times the Python side only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_host_overhead import Clock, publish  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>

namespace {
at::TensorOptions on(const at::Device& device, at::ScalarType dtype) {
  return at::TensorOptions().device(device).dtype(dtype);
}
}

// The sort's five outputs, as kernels/moe_sort_mx_quant._launch allocates them.
std::vector<at::Tensor> sort_outputs(int64_t n_sorted, int64_t n_blocks, int64_t M, int64_t model_dim,
                                     at::ScalarType moebuf_dtype, at::Device device) {
  return {at::empty({n_sorted}, on(device, at::kInt)), at::empty({n_sorted}, on(device, at::kFloat)),
          at::empty({n_blocks}, on(device, at::kInt)), at::empty({2}, on(device, at::kInt)),
          at::empty({M, model_dim}, on(device, moebuf_dtype))};
}

// The same, plus the MXFP4 quant's data and scales and their uint8 views (the launch's operands).
std::vector<at::Tensor> sort_quant_outputs(int64_t n_sorted, int64_t n_blocks, int64_t M, int64_t model_dim,
                                           at::ScalarType moebuf_dtype, int64_t data_cols, int64_t scale_rows,
                                           int64_t scale_cols, at::ScalarType quant_dtype, at::Device device) {
  auto out = sort_outputs(n_sorted, n_blocks, M, model_dim, moebuf_dtype, device);
  auto q = at::empty({M, data_cols}, on(device, quant_dtype));
  auto s = at::empty({scale_rows, scale_cols}, on(device, at::kFloat8_e8m0fnu));
  out.push_back(q);
  out.push_back(s);
  out.push_back(q.view(at::kByte));
  out.push_back(s.view(at::kByte));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sort_outputs", &sort_outputs);
  m.def("sort_quant_outputs", &sort_quant_outputs);
}
"""


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="markdown table here (also printed)")
    p.add_argument("--calls", type=int, default=20, help="calls between device syncs")
    p.add_argument("--reps", type=int, default=200, help="sync-separated groups of calls per measurement")
    return p.parse_args()


def build(workdir: Path):
    """``(module, seconds, None)`` or ``(None, seconds, why)``: the extension compiled with g++ against
    torch's headers and libraries (no ninja needed), the way a first use would pay for it."""
    import importlib.util

    from torch.utils import cpp_extension

    name = "aiter_patches_native_alloc_probe"
    src = workdir / f"{name}.cpp"
    src.write_text(SOURCE)
    target = workdir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [os.environ.get("CXX", "g++"), "-O2", "-shared", "-fPIC", "-std=c++20", "-w",
           f"-DTORCH_EXTENSION_NAME={name}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
           str(src), "-o", str(target),
           *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        return None, seconds, proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else "build failed"
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, seconds, None


def shapes(E: int, K: int, D: int, M: int, block: int = 32) -> dict:
    """The allocation sizes ``_launch`` makes for a decode call: AITER's padding rules, MXFP4 quant."""
    from aiter_patches import aiter_contract as contract

    n_sorted, n_blocks = contract.sort_buffer_sizes(M * K, K, E, block)
    scale_rows, scale_cols = contract.mx_scale_shape(n_sorted, D)
    return dict(n_sorted=n_sorted, n_blocks=n_blocks, M=M, model_dim=D, data_cols=D // 2,
                scale_rows=scale_rows, scale_cols=scale_cols)


def python_sort(sz, dev):
    e = torch.empty
    return (e(sz["n_sorted"], dtype=torch.int32, device=dev), e(sz["n_sorted"], dtype=torch.float32, device=dev),
            e(sz["n_blocks"], dtype=torch.int32, device=dev), e(2, dtype=torch.int32, device=dev),
            e(sz["M"], sz["model_dim"], dtype=torch.bfloat16, device=dev))


def python_sort_quant(sz, dev):
    out = python_sort(sz, dev)
    q = torch.empty(sz["M"], sz["data_cols"], dtype=torch.float4_e2m1fn_x2, device=dev)
    s = torch.empty(sz["scale_rows"], sz["scale_cols"], dtype=torch.float8_e8m0fnu, device=dev)
    return (*out, q, s, q.view(torch.uint8), s.view(torch.uint8))


def run(args) -> str:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    clock = Clock(dev, args.calls, args.reps)
    with tempfile.TemporaryDirectory(prefix="aiter_patches_native_probe_") as tmp:
        native, build_s, why = build(Path(tmp))
        rows = []
        for E, K, D in ((256, 8, 7168), (128, 4, 6144)):
            for M in (1, 64):
                sz = shapes(E, K, D, M)
                a = (sz["n_sorted"], sz["n_blocks"], sz["M"], sz["model_dim"], torch.bfloat16)
                qa = (*a, sz["data_cols"], sz["scale_rows"], sz["scale_cols"], torch.float4_e2m1fn_x2)
                if native is not None:
                    _same(python_sort_quant(sz, dev), native.sort_quant_outputs(*qa, dev))
                cases = {"sort (5 tensors)": (lambda: python_sort(sz, dev),
                                              None if native is None else (lambda: native.sort_outputs(*a, dev))),
                         "sort + MXFP4 quant (7 tensors, 2 views)": (
                             lambda: python_sort_quant(sz, dev), None if native is None else (lambda: native.sort_quant_outputs(*qa, dev)))}
                for name, (py, cc) in cases.items():
                    py_us, cc_us = [], []
                    for _ in range(4):  # alternating: the host's drift hits both alike
                        py_us.append(clock.host_us(py))
                        if cc is not None:
                            cc_us.append(clock.host_us(cc))
                    rows.append((name, f"({E},{K},{D})", M, sorted(py_us)[len(py_us) // 2],
                                 sorted(cc_us)[len(cc_us) // 2] if cc_us else None))
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (CPU tensors)"
    lines = [f"Host µs per set of allocations (median of 4 alternating measurements; eager; a device sync every "
             f"{args.calls} calls). Device: {where}; torch {torch.__version__}, Python {sys.version.split()[0]}.",
             "",
             f"Build of the C++ extension (g++, torch's headers): {build_s:.0f} s"
             + (f"; failed: {why}" if why else "") + ".",
             "",
             "| allocations | model (E, topk, dim) | tokens | Python `torch.empty` µs | C++ `at::empty`, one call µs | saved µs |",
             "|---|---|---:|---:|---:|---:|"]
    for name, model, M, py, cc in rows:
        lines.append(f"| {name} | {model} | {M} | {py:.1f} | {'-' if cc is None else f'{cc:.1f}'} | "
                     f"{'-' if cc is None else f'{py - cc:.1f}'} |")
    lines += ["", f"Command: `python bench/native_alloc_probe.py {' '.join(sys.argv[1:])}`"]
    return "\n".join(lines) + "\n"


def _same(py, cc) -> None:
    """The C++ allocations are the Python ones (shapes, dtypes, devices, strides), or the probe stops."""
    got = [(t.shape, t.dtype, t.device, t.stride()) for t in cc]
    want = [(t.shape, t.dtype, t.device, t.stride()) for t in py]
    if got != want:
        raise SystemExit(f"the C++ allocations differ from the Python ones: {got} != {want}")


def main():
    args = _parse()
    publish(run(args), args.out)


if __name__ == "__main__":
    main()
