"""Rewrite the kernel metadata of a real AMDGPU code object, at any length (test-only).

The reader under test (`aiter_patches.kernels.code_object`) is not used here: the ELF and
note layout is read with `struct` from what the ELF64 and AMDGPU note formats fix (program
headers at `e_phoff`, `e_phentsize`/`e_phnum` at bytes 54/56; a note is namesz, descsz, type,
the name and the desc, each padded to the segment's alignment). A new metadata note is
appended to the file and the PT_NOTE program header is pointed at it, so the ELF stays
well-formed whatever the new metadata's length; the old note stays in place, unreferenced.
"""

from __future__ import annotations

import struct

import msgpack

PT_NOTE = 4
NT_AMDGPU_METADATA = 32


def note_span(data: bytes) -> tuple[int, int]:
    """Where the metadata's msgpack bytes lie in ``data``."""
    at = data.index(struct.pack("<I", NT_AMDGPU_METADATA) + b"AMDGPU\0")
    descsz = struct.unpack_from("<I", data, at - 4)[0]
    return at + 12, at + 12 + descsz


def metadata(data: bytes) -> dict:
    start, end = note_span(data)
    return msgpack.unpackb(data[start:end], raw=False, strict_map_key=False)


def _note_header(data: bytes) -> int:
    """The byte offset of the program header of the PT_NOTE segment holding the metadata note."""
    start, _ = note_span(data)
    phoff, = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    for i in range(phnum):
        at = phoff + i * phentsize
        p_type, = struct.unpack_from("<I", data, at)
        offset, = struct.unpack_from("<Q", data, at + 8)
        filesz, = struct.unpack_from("<Q", data, at + 32)
        if p_type == PT_NOTE and offset <= start < offset + filesz:
            return at
    raise AssertionError("no PT_NOTE segment holds the metadata note")


def with_metadata_bytes(data: bytes, desc: bytes) -> bytes:
    """``data`` whose PT_NOTE segment is one AMDGPU metadata note holding ``desc`` (appended at the end)."""
    ph = _note_header(data)
    align = 8 if struct.unpack_from("<Q", data, ph + 48)[0] == 8 else 4

    def padded(b: bytes) -> bytes:
        return b + b"\0" * (-len(b) % align)

    note = struct.pack("<III", 7, len(desc), NT_AMDGPU_METADATA) + padded(b"AMDGPU\0") + padded(desc)
    body = data + b"\0" * (-len(data) % 8)
    offset = len(body)
    header = bytearray(body + note)
    struct.pack_into("<Q", header, ph + 8, offset)  # p_offset
    struct.pack_into("<QQ", header, ph + 32, len(note), len(note))  # p_filesz, p_memsz
    return bytes(header)


def with_metadata(data: bytes, meta) -> bytes:
    """``data`` with ``meta`` (any msgpack-able value) as its metadata."""
    return with_metadata_bytes(data, msgpack.packb(meta, use_bin_type=True))
