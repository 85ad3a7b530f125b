"""Output allocations that start as 0xAB bytes, for tests that patch a kernel's ``_empty``: a byte the kernel
never writes shows as 0xAB (no real scale, code or index of these tests has that value)."""

from __future__ import annotations

import torch


def poisoned_empty(*size, dtype, device):
    """``torch.empty``'s signature (sizes as arguments or one sequence), every byte 0xAB."""
    if len(size) == 1 and not isinstance(size[0], int):
        size = tuple(size[0])
    t = torch.empty(*size, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(0xAB)
    return t
