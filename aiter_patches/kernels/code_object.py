"""Read an AMDGPU code object's kernel metadata, and compare it with a launcher's argument layout.

A `.co` launched through `hipModuleLaunchKernel` with a packed argument buffer gets exactly
the bytes the launcher wrote; nothing on the way checks that the kernel reads its arguments
where the launcher put them. If AITER moves, renames, resizes or adds an argument, a
launcher written for the old layout would hand the kernel wrong pointers: a memory fault or
wrong numbers, silently. The code object says what it expects: the `NT_AMDGPU_METADATA` ELF
note (msgpack, code object v3 and later) lists each kernel's `.args` (name, offset, size,
value kind), its `.kernarg_segment_size`, `.wavefront_size` and work-group sizes. This
module reads that note and compares it with the layout a launcher declares, and says in one
sentence what differs, so the caller can refuse the launch with that reason.

The ELF part is a few `struct` reads (header, program headers, PT_NOTE records), each
bounds-checked so that a truncated or foreign file gives a reason, never an exception of
another kind. The msgpack part uses the `msgpack` package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1
ELFOSABI_AMDGPU_HSA = 64
EM_AMDGPU = 224
PT_NOTE = 4
NT_AMDGPU_METADATA = 32
NOTE_OWNER = b"AMDGPU"
EF_AMDGPU_MACH = 0x0FF
# EF_AMDGPU_MACH values (LLVM's ELF.h / amd_hsa_elf.h) of the archs this project names.
MACH_NAMES = {0x030: "gfx908", 0x03F: "gfx90a", 0x04C: "gfx942", 0x04F: "gfx950"}
MACH_NAMES_BY_GFX = {v: k for k, v in MACH_NAMES.items()}
PAD_NAME = "pad"  # AITER's asm kernels list the unused bytes of each 16-byte slot as arguments named "pad"

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_NHDR = struct.Struct("<III")


class CodeObjectError(ValueError):
    """The file is not a code object this module can read; the message says why."""


class KernelArg(NamedTuple):
    """One kernel argument as a launcher packs it, or as the metadata lists it (None: the metadata omits it)."""

    name: str
    offset: int
    size: int
    value_kind: str


@dataclass(frozen=True)
class KernelMetadata:
    """The fields of one `amdhsa.kernels` entry a launcher must agree with."""

    name: str
    symbol: str | None
    args: tuple[KernelArg, ...]
    kernarg_segment_size: int | None
    wavefront_size: int | None
    max_flat_workgroup_size: int | None
    reqd_workgroup_size: tuple[int, ...] | None


@dataclass(frozen=True)
class CodeObject:
    path: str
    mach: int  # e_flags & EF_AMDGPU_MACH
    kernels: tuple[KernelMetadata, ...]

    @property
    def gfx(self) -> str:
        return MACH_NAMES.get(self.mach, f"EF_AMDGPU_MACH 0x{self.mach:03x}")

    def kernel(self, name: str) -> KernelMetadata | None:
        """The kernel whose `.name` (or `.symbol` without `.kd`) is `name`."""
        for k in self.kernels:
            if name and name in (k.name, (k.symbol or "").removesuffix(".kd")):
                return k
        return None


@dataclass(frozen=True)
class LaunchLayout:
    """What a launcher passes: its argument buffer (every non-pad argument), its size, its block shape."""

    args: tuple[KernelArg, ...]
    kernarg_size: int
    wavefront_size: int
    block: tuple[int, int, int]


def read_code_object(path: str) -> CodeObject:
    """Parse the file at `path`; `CodeObjectError` says what is wrong with it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CodeObjectError(f"cannot be read ({exc.strerror or exc})") from None
    return parse_code_object(data, path)


def parse_code_object(data: bytes, path: str = "<bytes>") -> CodeObject:
    """Parse a code object's bytes (`path` only labels the result); reasons do not repeat the path."""
    if len(data) < 4 or data[:4] != ELF_MAGIC:
        raise CodeObjectError(f"not an ELF file (starts with {data[:4]!r})")
    if len(data) < _EHDR.size:
        raise CodeObjectError(f"truncated: {len(data)} bytes, an ELF64 header needs {_EHDR.size}")
    (ident, _type, machine, _version, _entry, phoff, _shoff, flags, _ehsize, phentsize, phnum,
     _shentsize, _shnum, _shstrndx) = _EHDR.unpack_from(data)
    if ident[4] != ELFCLASS64 or ident[5] != ELFDATA2LSB:
        raise CodeObjectError(f"not a little-endian ELF64 file (class {ident[4]}, data {ident[5]})")
    if machine != EM_AMDGPU or ident[7] != ELFOSABI_AMDGPU_HSA:
        raise CodeObjectError(f"not an AMDGPU HSA code object (e_machine {machine}, OS/ABI {ident[7]})")
    desc = _metadata_note(data, phoff, phentsize, phnum)
    return CodeObject(path=path, mach=flags & EF_AMDGPU_MACH, kernels=_kernels(_unpack(desc)))


def _metadata_note(data: bytes, phoff: int, phentsize: int, phnum: int) -> bytes:
    if phnum and phentsize != _PHDR.size:
        raise CodeObjectError(f"program header entries of {phentsize} bytes, ELF64 has {_PHDR.size}")
    end = phoff + phnum * _PHDR.size
    if end > len(data):
        raise CodeObjectError(f"truncated: its program headers end at byte {end}, "
                              f"the file has {len(data)}")
    for i in range(phnum):
        p_type, _flags, offset, _vaddr, _paddr, filesz, _memsz, align = _PHDR.unpack_from(data, phoff + i * _PHDR.size)
        if p_type != PT_NOTE:
            continue
        if offset + filesz > len(data):
            raise CodeObjectError(f"truncated: its note segment ends at byte {offset + filesz}, "
                                  f"the file has {len(data)}")
        for owner, n_type, desc in _notes(data[offset:offset + filesz], 8 if align == 8 else 4):
            if owner == NOTE_OWNER and n_type == NT_AMDGPU_METADATA:
                return desc
    raise CodeObjectError("no NT_AMDGPU_METADATA note (code object v2, or not a kernel file)")


def _notes(seg: bytes, align: int) -> Iterator[tuple[bytes, int, bytes]]:
    pos = 0
    while pos + _NHDR.size <= len(seg):
        namesz, descsz, n_type = _NHDR.unpack_from(seg, pos)
        name_at = pos + _NHDR.size
        desc_at = name_at + _aligned(namesz, align)
        if desc_at + descsz > len(seg):
            raise CodeObjectError(f"truncated: a note of {descsz} bytes runs past the end of its segment")
        yield seg[name_at:name_at + namesz].rstrip(b"\0"), n_type, seg[desc_at:desc_at + descsz]
        pos = desc_at + _aligned(descsz, align)


def _aligned(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _unpack(desc: bytes) -> dict:
    try:
        import msgpack
    except ImportError:
        raise CodeObjectError("the msgpack package is not installed (pip install msgpack)") from None
    try:
        meta = msgpack.unpackb(desc, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for malformed data
        raise CodeObjectError(f"the metadata note is not valid msgpack ({type(exc).__name__}: {exc})") \
            from None
    if not isinstance(meta, dict) or not isinstance(meta.get("amdhsa.kernels"), list):
        raise CodeObjectError("the metadata has no amdhsa.kernels list")
    return meta


def _kernels(meta: dict) -> tuple[KernelMetadata, ...]:
    out = []
    for k in meta["amdhsa.kernels"]:
        if not isinstance(k, dict):
            raise CodeObjectError("an amdhsa.kernels entry is not a map")
        args = []
        for a in k.get(".args") or ():
            if not isinstance(a, dict):
                raise CodeObjectError(f"kernel {k.get('.name')}: an .args entry is not a map")
            args.append(KernelArg(a.get(".name", ""), _int(a.get(".offset")), _int(a.get(".size")),
                                  a.get(".value_kind", "")))
        reqd = k.get(".reqd_workgroup_size")
        out.append(KernelMetadata(
            name=str(k.get(".name", "")), symbol=k.get(".symbol"), args=tuple(args),
            kernarg_segment_size=_int(k.get(".kernarg_segment_size")),
            wavefront_size=_int(k.get(".wavefront_size")),
            max_flat_workgroup_size=_int(k.get(".max_flat_workgroup_size")),
            reqd_workgroup_size=tuple(reqd) if isinstance(reqd, list) else None,
        ))
    return tuple(out)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def layout_mismatch(co: CodeObject, kernel_name: str, gfx: str, expect: LaunchLayout) -> str | None:
    """Why a launch of `kernel_name` from `co` with `expect`'s buffer and block would be wrong, or None.

    Every non-pad argument of the kernel must be one the launcher packs, at the same offset with
    the same size and value kind, and every argument the launcher packs must be there; `pad`
    entries must lie outside the launcher's fields. Then the kernarg segment size, the wavefront
    size and the work-group sizes must equal the launcher's.
    """
    if co.mach != MACH_NAMES_BY_GFX.get(gfx, -1):
        return f"the code object is for {co.gfx}, the GPU is {gfx}"
    k = co.kernel(kernel_name)
    if k is None:
        return f"kernel {kernel_name} is not in the code object (it has {', '.join(x.name for x in co.kernels)})"
    wanted = {a.name: a for a in expect.args}
    seen = set()
    for a in k.args:
        if a.offset is None or a.size is None:
            return f"argument {a.name!r} has no .offset or .size"
        if a.name == PAD_NAME:
            hit = next((w for w in expect.args if _overlap(a, w)), None)
            if hit is not None:
                return f"pad at offset {a.offset} ({a.size} bytes) overlaps argument {hit.name} at {hit.offset}"
            continue
        w = wanted.get(a.name)
        if w is None:
            return f"argument {a.name!r} at offset {a.offset} is not one the launcher packs"
        if (a.offset, a.size, a.value_kind) != (w.offset, w.size, w.value_kind):
            return (f"argument {a.name}: offset {a.offset}, size {a.size}, {a.value_kind}; the launcher "
                    f"packs offset {w.offset}, size {w.size}, {w.value_kind}")
        seen.add(a.name)
    missing = [w.name for w in expect.args if w.name not in seen]
    if missing:
        return f"argument(s) {', '.join(missing)} the launcher packs are not in the kernel's .args"
    if k.kernarg_segment_size != expect.kernarg_size:
        return (f".kernarg_segment_size is {_shown(k.kernarg_segment_size)}, the launcher passes "
                f"{expect.kernarg_size} bytes")
    if k.wavefront_size != expect.wavefront_size:
        return f".wavefront_size is {_shown(k.wavefront_size)}, the launcher expects {expect.wavefront_size}"
    threads = expect.block[0] * expect.block[1] * expect.block[2]
    if k.max_flat_workgroup_size != threads:
        return (f".max_flat_workgroup_size is {_shown(k.max_flat_workgroup_size)}, the launcher launches "
                f"{threads} threads")
    if k.reqd_workgroup_size is not None and k.reqd_workgroup_size != expect.block:
        return (f".reqd_workgroup_size is {list(k.reqd_workgroup_size)}, the launcher launches blocks of "
                f"{list(expect.block)}")
    return None


def _shown(v: int | None) -> str:
    return "missing" if v is None else str(v)


def _overlap(a: KernelArg, b: KernelArg) -> bool:
    return a.offset < b.offset + b.size and b.offset < a.offset + a.size

