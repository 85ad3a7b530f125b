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
another kind. The msgpack part uses the `msgpack` package; every field this module reads is
type-checked before use (`_Fields`), so malformed metadata (an `.args` that is a number, a
`.name` that is a list) is refused with `CodeObjectError` naming the kernel and the field,
never a `TypeError` from deeper down: the GEMM gate remembers a refusal, not a crash.
"""

from __future__ import annotations

import os
import stat
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


MAX_FILE_BYTES = 64 << 20  # AITER's GEMM code objects are ~17 KB; a larger "code object" is refused unread


class CodeObjectError(ValueError):
    """The file is not a code object this module can read; the message says why (for malformed metadata:
    which kernel and which field). `path` is the file: the message does not repeat it, its callers name it."""

    path: str | None = None


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
    """Parse the file at `path`; `CodeObjectError` (with `.path`) says what is wrong with it.

    Only a regular file is opened (a FIFO would block the caller, a device never end), and one
    of at most `MAX_FILE_BYTES`."""
    try:
        data = _read(path)
    except CodeObjectError as exc:
        exc.path = path
        raise
    return parse_code_object(data, path)


def _read(path: str) -> bytes:
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size <= MAX_FILE_BYTES:
            with open(path, "rb") as f:
                return f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise CodeObjectError(f"cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # a path with a NUL byte
        raise CodeObjectError(f"cannot be read ({exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CodeObjectError("not a regular file")
    raise CodeObjectError(f"{st.st_size} bytes, more than a code object's {MAX_FILE_BYTES}")


def parse_code_object(data: bytes, path: str = "<bytes>") -> CodeObject:
    """Parse a code object's bytes (`path` labels the result and the error); reasons do not repeat the path."""
    try:
        return _parse(data, path)
    except CodeObjectError as exc:
        exc.path = path
        raise


def _parse(data: bytes, path: str) -> CodeObject:
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
    return CodeObject(path=path, mach=flags & EF_AMDGPU_MACH, kernels=_kernels(_unpack(bytes(desc))))


def _metadata_note(data: bytes, phoff: int, phentsize: int, phnum: int) -> bytes:
    if phnum and phentsize != _PHDR.size:
        raise CodeObjectError(f"program header entries of {phentsize} bytes, ELF64 has {_PHDR.size}")
    end = phoff + phnum * _PHDR.size
    if end > len(data):
        raise CodeObjectError(f"truncated: its program headers end at byte {end}, "
                              f"the file has {len(data)}")
    view, seen, scanned = memoryview(data), set(), 0
    for i in range(phnum):
        p_type, _flags, offset, _vaddr, _paddr, filesz, _memsz, align = _PHDR.unpack_from(data, phoff + i * _PHDR.size)
        if p_type != PT_NOTE:
            continue
        if offset + filesz > len(data):
            raise CodeObjectError(f"truncated: its note segment ends at byte {offset + filesz}, "
                                  f"the file has {len(data)}")
        if (offset, filesz, align) in seen:
            continue
        seen.add((offset, filesz, align))
        scanned += filesz
        if scanned > len(data):  # each byte read at most once, however many headers point at it
            raise CodeObjectError(f"its note segments overlap (program header {i})")
        for owner, n_type, desc in _notes(view[offset:offset + filesz], 8 if align == 8 else 4):
            if owner == NOTE_OWNER and n_type == NT_AMDGPU_METADATA:
                return desc
    raise CodeObjectError("no NT_AMDGPU_METADATA note (code object v2, or not a kernel file)")


def _notes(seg: memoryview, align: int) -> Iterator[tuple[bytes, int, memoryview]]:
    pos = 0
    while pos + _NHDR.size <= len(seg):
        namesz, descsz, n_type = _NHDR.unpack_from(seg, pos)
        name_at = pos + _NHDR.size
        desc_at = name_at + _aligned(namesz, align)
        if desc_at + descsz > len(seg):
            raise CodeObjectError(f"truncated: a note of {descsz} bytes runs past the end of its segment")
        yield bytes(seg[name_at:name_at + namesz]).rstrip(b"\0"), n_type, seg[desc_at:desc_at + descsz]
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
    for i, k in enumerate(meta["amdhsa.kernels"]):
        if not isinstance(k, dict):
            raise CodeObjectError(f"amdhsa.kernels[{i}] is {_kind(k)}, expected a map")
        f = _Fields(k, f"amdhsa.kernels[{i}]")
        name = f.get(".name", str, "a string")
        if name is not None:
            f.where = f"kernel {_short(name)}: "
        args = []
        for j, a in enumerate(f.get(".args", list, "a list") or ()):
            if not isinstance(a, dict):
                raise CodeObjectError(f"{f.where}.args[{j}] is {_kind(a)}, expected a map")
            g = _Fields(a, f"{f.where}.args[{j}]")
            args.append(KernelArg(g.get(".name", str, "a string") or "", g.count(".offset"), g.count(".size"),
                                  g.get(".value_kind", str, "a string") or ""))
        reqd = f.get(".reqd_workgroup_size", list, "a list")
        if reqd is not None and (len(reqd) != 3 or not all(_is_count(x) for x in reqd)):
            raise CodeObjectError(f"{f.where}.reqd_workgroup_size is {_short(reqd)}, expected 3 integers >= 0")
        out.append(KernelMetadata(
            name=name or "", symbol=f.get(".symbol", str, "a string"), args=tuple(args),
            kernarg_segment_size=f.count(".kernarg_segment_size"), wavefront_size=f.count(".wavefront_size"),
            max_flat_workgroup_size=f.count(".max_flat_workgroup_size"),
            reqd_workgroup_size=tuple(reqd) if reqd is not None else None,
        ))
    return tuple(out)


class _Fields:
    """The fields of one metadata map, each checked for its type before it is used.

    A field that is absent (or nil) reads as None, which the comparison reports as missing; a
    field of the wrong type (a bool is not an integer) raises `CodeObjectError` naming it:
    `where` + the key, e.g. "kernel 'k': .args[3]" + ".name"."""

    def __init__(self, m: dict, where: str):
        self.m, self.where = m, where

    def get(self, key: str, typ: type, expected: str) -> Any:
        v = self.m.get(key)
        if v is None or (isinstance(v, typ) and not isinstance(v, bool)):
            return v
        raise CodeObjectError(f"{self.where}{key} is {_kind(v)}, expected {expected}")

    def count(self, key: str) -> int | None:
        """An integer field that counts bytes or lanes: absent, or an integer >= 0."""
        v = self.get(key, int, "an integer >= 0")
        if v is not None and v < 0:
            raise CodeObjectError(f"{self.where}{key} is {v}, expected an integer >= 0")
        return v


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _kind(v: Any) -> str:
    """`v`'s msgpack type and a short view of it, for a reason."""
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", bytes: "binary data",
             list: "a list", dict: "a map"}
    return f"{names.get(type(v), type(v).__name__)} ({_short(v)})"


def _short(v: Any, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        names = [_short(x.name) if len(x.name) > 60 else x.name for x in co.kernels[:4]]
        more = f" and {len(co.kernels) - 4} more" if len(co.kernels) > 4 else ""
        return f"kernel {kernel_name} is not in the code object (it has {', '.join(names)}{more})"
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

