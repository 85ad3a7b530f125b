"""Host cost of the pieces a patched call is made of, on this machine's device: allocations, tensor
metadata reads, stream queries, launches.

Why: the host-overhead benchmark (bench_host_overhead.py) times whole calls; deciding which piece
of a call to take out (an allocation, a view, a metadata read) needs the price of each piece on the
same host, and the CPU proxy (host_proxy_cpu.py) prices CUDA's caching allocator and the driver's
launch wrongly. Median µs of one operation, eager, a device sync every ``--calls`` operations
outside the timing.

    python bench/host_primitives.py --out /tmp/host_primitives.md    # GPU (the CPU runs it too)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aiter_patches.kernels import fast_launch  # noqa: E402
from bench import harness  # noqa: E402
from bench.bench_host_overhead import Clock, publish  # noqa: E402


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--reps", type=int, default=40)
    return p.parse_args()


def rows(dev: torch.device, calls: int, reps: int) -> list[tuple[str, float]]:
    clock = Clock(dev, calls, reps, warmup=5)
    t = torch.empty(4096, dtype=torch.int32, device=dev)
    u8 = torch.empty(1 << 16, dtype=torch.uint8, device=dev)
    i32 = torch.int32
    out = []

    def add(name, fn):
        out.append((name, clock.host_us(fn)))

    add("`torch.empty(n, dtype, device)`", lambda: torch.empty(8192, dtype=i32, device=dev))
    add("`torch.empty(m, n, dtype, device)`", lambda: torch.empty(64, 3584, dtype=torch.uint8, device=dev))
    add("`t.new_empty(n)`", lambda: t.new_empty(8192))
    add("`torch.zeros(n)`", lambda: torch.zeros(8192, dtype=i32, device=dev))
    add("`out.zero_()` (a memset launch)", lambda: t.zero_())
    add("`t.view(dtype)`", lambda: u8.view(torch.int32))
    add("`t.as_strided(size, stride, offset)`", lambda: u8.as_strided((256, 32), (32, 1), 512))
    add("`t[a:b]`", lambda: u8[512:1024])
    add("`torch.split_with_sizes` (4 pieces)", lambda: torch.split_with_sizes(u8, [1024, 1024, 4096, 59392]))
    add("`t.data_ptr()`", t.data_ptr)
    add("`t.dtype`", lambda: t.dtype)
    add("`t.device`", lambda: t.device)
    add("`t.shape`", lambda: t.shape)
    add("`t.stride()`", t.stride)
    add("`t.is_cuda`", lambda: t.is_cuda)
    if dev.type == "cuda":
        add("`torch.cuda.current_device()`", torch.cuda.current_device)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            add("`torch._C._cuda_getCurrentRawStream(i)`", lambda: raw(0))
        add("`torch.cuda.is_current_stream_capturing()`", torch.cuda.is_current_stream_capturing)
    x1 = torch.empty(1, device=dev)
    try:
        fast_launch.set_mode("off")
        add("empty Triton launch, Triton's own", lambda: harness._empty_kernel[(1,)](x1))
        fast_launch.set_mode("on")
        add("empty Triton launch, direct (`fast_launch.launch`)",
            lambda: fast_launch.launch(harness._empty_kernel, (1,), x1))
        prep = fast_launch.Prepared(harness._empty_kernel, (1,), (0,), (None,), {})
        add("empty Triton launch, prepared (`fast_launch.Prepared`)", lambda: prep(x1))
    finally:
        fast_launch.set_mode(None)
    return out


def main():
    args = _parse()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter for the launches)"
    lines = [f"Host µs per operation (median; eager; a device sync every {args.calls}). Device: {where}; torch "
             f"{torch.__version__}, Python {sys.version.split()[0]}.", "", "| operation | µs |", "|---|---:|"]
    lines += [f"| {n} | {v:.2f} |" for n, v in rows(dev, args.calls, args.reps)]
    lines += ["", "Command: `python bench/host_primitives.py " + " ".join(sys.argv[1:]) + "`"]
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
