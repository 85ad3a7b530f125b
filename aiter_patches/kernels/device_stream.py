"""Which device queue a launch goes to, and whether it is being captured, read cheaply.

Why: buffers a kernel module keeps across calls (the split-K GEMM's tile counters, the sort outputs a
``fused_moe`` call reuses) are safe to reuse only in the stream order of one queue, and never from
inside a CUDA-graph capture, whose memory belongs to the graph. Both are read on every such call, so
they are read without making a ``torch.cuda.Stream`` object (issue 15).
"""

from __future__ import annotations

import torch

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_index() -> int:
    """The current CUDA/HIP device's index (where Triton launches)."""
    return torch.cuda.current_device()


def stream_key(device: torch.device) -> tuple[int, int]:
    """``(device index, current stream handle)``; ``(-1, 0)`` off CUDA/HIP (CPU work runs in call order)."""
    if device.type != "cuda":
        return -1, 0
    index = device.index if device.index is not None else current_index()
    if _raw_stream is not None:  # the same handle as current_stream(device).cuda_stream, without a Stream object
        return index, _raw_stream(index)
    return index, torch.cuda.current_stream(device).cuda_stream


_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def capturing(device: torch.device) -> bool:
    """Whether the current stream is capturing a CUDA (HIP) graph; never off CUDA/HIP."""
    if device.type != "cuda":
        return False
    if _is_capturing is not None:  # what torch.cuda.is_current_stream_capturing() returns, one call less
        return _is_capturing()
    return torch.cuda.is_current_stream_capturing()
