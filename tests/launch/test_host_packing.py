"""The asm GEMM's argument buffer, packed by one precompiled struct, is AITER's field-by-field layout."""

from __future__ import annotations

import random

import pytest

from aiter_patches.kernels import hip_blockscale_asm as hip


def field_by_field(values: dict) -> bytes:
    """Each field little-endian at its KERNEL_ARGS offset, every other byte zero."""
    buf = bytearray(hip.ARGS_SIZE)
    for a in hip.KERNEL_ARGS:
        buf[a.offset:a.offset + a.size] = values[a.name].to_bytes(a.size, "little")
    return bytes(buf)


def test_struct_packing_equals_the_field_layout():
    rng = random.Random(0)
    for _ in range(200):
        values = {a.name: rng.getrandbits(8 * a.size) for a in hip.KERNEL_ARGS}
        assert hip.pack_kernel_args(values) == field_by_field(values)
    edge = {a.name: (1 << (8 * a.size)) - 1 for a in hip.KERNEL_ARGS}
    assert hip.pack_kernel_args(edge) == field_by_field(edge)


def test_a_value_out_of_its_field_range_is_refused():
    values = {a.name: 0 for a in hip.KERNEL_ARGS}
    values["M"] = 1 << 32
    with pytest.raises(Exception, match="format|range|argument"):
        hip.pack_kernel_args(values)
    with pytest.raises(ValueError, match="missing"):
        hip.pack_kernel_args({k: v for k, v in values.items() if k != "K"})
