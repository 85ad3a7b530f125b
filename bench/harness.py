"""Timing used by every benchmark here: GPU time per call from CUDA-graph replay (how a decode step runs).

Many back-to-back calls are captured in one graph, cycling over several input
sets so the cache does not flatter; the median over several replays is reported.
The launch floor (an empty Triton kernel) and the copy bandwidth (for byte
floors) are measured in the same run as the numbers they qualify.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch
import triton


@triton.jit
def _empty_kernel(x_ptr):
    pass


def graph_us(calls: Sequence[Callable[[], object]], n_calls: int, reps: int = 7) -> float:
    """Median microseconds per call over ``reps`` replays of a graph of ``n_calls`` calls cycling ``calls``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # warm-up and compilation outside capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / n_calls)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), after a warm-up that raises the clocks."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        x @ x
    n = 1 << 28
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us([lambda: dst.copy_(src)], 20, reps=7)
    return 2 * n / (us * 1e-6)


def launch_floor_us() -> float:
    """Replay time of an empty one-program Triton kernel: the cost of a launch inside a graph."""
    x = torch.empty(1, device="cuda")
    return graph_us([lambda: _empty_kernel[(1,)](x)], 200)


def n_sets(bytes_per_set: int, rotate_bytes: int = 256 << 20, most: int = 16) -> int:
    """How many input sets to cycle so the working set exceeds the L2 (60 MB on an H200) several times."""
    return max(2, min(most, rotate_bytes // max(bytes_per_set, 1)))


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
