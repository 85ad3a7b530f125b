"""The `.co` check against AITER's real block-scale GEMM code objects and altered copies of them.

Every real code object (both archs) must be accepted; every alteration that would make the
launcher's argument buffer wrong for the kernel must be refused, with a reason that names
what differs. The altered copies are made in a temporary folder from the real files.
"""

import contextlib
import logging
import os
import shutil
import struct
import threading
import time

import msgpack
import pytest

from aiter_patches.kernels import code_object as co
from aiter_patches.kernels import hip_blockscale_asm as hb
from helpers import code_object_files as cof
from helpers.aiter_tree import ARCHS, code_object_root, gemm_kernel_dir

TILES = (32, 48, 64, 80, 96, 128)


@pytest.fixture(scope="session")
def aiter_root(tmp_path_factory):
    return code_object_root(tmp_path_factory.mktemp("aiter_hsa"))


@pytest.fixture(autouse=True)
def _fresh_check_cache(monkeypatch):
    monkeypatch.setattr(hb, "_co_checks", {})


def listed(root, gfx):
    return hb.load_kernel_list(str(root), gfx)


def kernel_for_tile(root, gfx, tile_m):
    [cfg] = [k for k in listed(root, gfx) if k.tile_m == tile_m]
    return cfg


# ---------------------------------------------------------------- the real files


@pytest.mark.parametrize("tile_m", TILES)
@pytest.mark.parametrize("gfx", ARCHS)
def test_real_code_object_is_accepted(aiter_root, gfx, tile_m):
    cfg = kernel_for_tile(aiter_root, gfx, tile_m)
    assert hb.code_object_reason(str(aiter_root), gfx, cfg) is None


@pytest.mark.parametrize("gfx", ARCHS)
def test_every_code_object_in_the_tree_is_listed_and_accepted(aiter_root, gfx):
    """A kernel added to the tree later is covered too: each `.co` there is in the list and passes."""
    on_disk = sorted(p.name for p in gemm_kernel_dir(aiter_root, gfx).glob("*.co"))
    kernels = listed(aiter_root, gfx)
    assert sorted(k.co_name for k in kernels) == on_disk and on_disk
    assert {k.co_name: hb.code_object_reason(str(aiter_root), gfx, k) for k in kernels} == \
        {name: None for name in on_disk}


@pytest.mark.parametrize("gfx", ARCHS)
def test_real_metadata_reads_as_the_launcher_packs(aiter_root, gfx):
    """The reader's view of a real file, field by field (what aiter-facts.md says the note holds)."""
    cfg = kernel_for_tile(aiter_root, gfx, 64)
    obj = co.read_code_object(str(gemm_kernel_dir(aiter_root, gfx) / cfg.co_name))
    assert obj.gfx == gfx
    k = obj.kernel(cfg.knl_name)
    assert k.symbol == cfg.knl_name + ".kd"
    assert tuple(a for a in k.args if a.name != co.PAD_NAME) == hb.KERNEL_ARGS
    assert [a.name for a in hb.KERNEL_ARGS] == ["C", "A", "B", "SA", "SB", "BIAS", "M", "Ndim", "K", "PA", "PB",
                                               "PC", "KS", "scale_m", "scale_n", "scale_k"]
    assert (k.kernarg_segment_size, k.wavefront_size, k.max_flat_workgroup_size, k.reqd_workgroup_size) == \
        (256, 64, 256, (256, 1, 1))
    pads = [a for a in k.args if a.name == co.PAD_NAME]
    assert sum(a.size for a in pads) + sum(a.size for a in hb.KERNEL_ARGS) == 256  # the pads fill every slot


# ---------------------------------------------------------------- altered copies


def note_span(data: bytes) -> tuple[int, int]:
    """Where the metadata's msgpack bytes lie, found without the module under test."""
    at = data.index(struct.pack("<I", co.NT_AMDGPU_METADATA) + b"AMDGPU\0")
    descsz = struct.unpack_from("<I", data, at - 4)[0]
    return at + 12, at + 12 + descsz


def with_metadata(data: bytes, change) -> bytes:
    """`data` with its first kernel's metadata changed by `change(kernel_map)`, re-encoded in place."""
    start, end = note_span(data)
    meta = msgpack.unpackb(data[start:end])
    assert msgpack.packb(meta) == data[start:end]  # the re-encoding of an unchanged note is the original
    change(meta["amdhsa.kernels"][0])
    new = msgpack.packb(meta)
    assert len(new) == end - start, "an alteration must keep the note's length"
    return data[:start] + new + data[end:]


def arg(kernel, name):
    return next(a for a in kernel[".args"] if a[".name"] == name)


def rename_kernel(k):
    k[".name"] = k[".name"].replace("BpreShuffle", "BpreShufflX")
    k[".symbol"] = k[".symbol"].replace("BpreShuffle", "BpreShufflX")


ALTERATIONS = {
    "moved offset": (lambda d: with_metadata(d, lambda k: arg(k, "KS").update({".offset": 196})),
                     "argument KS: offset 196, size 4, by_value; the launcher packs offset 192, size 4, by_value"),
    "moved pointer": (lambda d: with_metadata(d, lambda k: arg(k, "SA").update({".offset": 56})),
                      "argument SA: offset 56, size 8, global_buffer; the launcher packs offset 48, size 8"),
    "renamed argument": (lambda d: with_metadata(d, lambda k: arg(k, "SA").update({".name": "SX"})),
                         "argument 'SX' at offset 48 is not one the launcher packs"),
    "resized argument": (lambda d: with_metadata(d, lambda k: arg(k, "Ndim").update({".size": 8})),
                         "argument Ndim: offset 112, size 8"),
    "pad over an argument": (lambda d: with_metadata(d, lambda k: k[".args"][1].update({".offset": 4})),
                             "pad at offset 4 (8 bytes) overlaps argument C at 0"),
    "kernarg size": (lambda d: with_metadata(d, lambda k: k.update({".kernarg_segment_size": 288})),
                     ".kernarg_segment_size is 288, the launcher passes 256 bytes"),
    "wavefront size": (lambda d: with_metadata(d, lambda k: k.update({".wavefront_size": 32})),
                       ".wavefront_size is 32, the launcher expects 64"),
    "max workgroup size": (lambda d: with_metadata(d, lambda k: k.update({".max_flat_workgroup_size": 512})),
                           ".max_flat_workgroup_size is 512, the launcher launches 256 threads"),
    "required workgroup size": (lambda d: with_metadata(d, lambda k: k.update({".reqd_workgroup_size": [256, 2, 1]})),
                                ".reqd_workgroup_size is [256, 2, 1], the launcher launches blocks of [256, 1, 1]"),
    "kernel renamed": (lambda d: with_metadata(d, rename_kernel), "is not in the code object (it has _ZN5aiter"),
    "other arch": (lambda d: d[:48] + bytes([0x3F]) + d[49:], "the code object is for gfx90a, the GPU is gfx9"),
    "not AMDGPU": (lambda d: d[:18] + struct.pack("<H", 62) + d[20:],
                   "not an AMDGPU HSA code object (e_machine 62, OS/ABI 64)"),
    "not msgpack": (lambda d: d[:note_span(d)[0]] + b"\xc1" + d[note_span(d)[0] + 1:],
                    "the metadata note is not valid msgpack"),
    "truncated in the header": (lambda d: d[:40], "truncated: 40 bytes, an ELF64 header needs 64"),
    "truncated in the note": (lambda d: d[:note_span(d)[0] + 100], "truncated: its note segment ends at byte"),
    "not ELF": (lambda d: b"#!/bin/sh\necho not a kernel\n" * 20, "not an ELF file (starts with b'#!/b')"),
    "empty": (lambda d: b"", "not an ELF file (starts with b'')"),
}


def altered_tree(root, tmp_path, gfx, cfg, alter):
    """A copy of one arch's kernel folder with `cfg`'s `.co` replaced by `alter(original bytes)`."""
    d = tmp_path / "hsa" / gfx / "fp8gemm_blockscale"
    shutil.copytree(gemm_kernel_dir(root, gfx), d)
    path = d / cfg.co_name
    path.write_bytes(alter(path.read_bytes()))
    return tmp_path


@pytest.mark.parametrize("gfx", ARCHS)
@pytest.mark.parametrize("what", sorted(ALTERATIONS))
def test_altered_code_object_is_refused_with_the_reason(aiter_root, tmp_path, gfx, what, caplog):
    alter, says = ALTERATIONS[what]
    cfg = kernel_for_tile(aiter_root, gfx, 32)
    root = altered_tree(aiter_root, tmp_path, gfx, cfg, alter)
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        reason = hb.code_object_reason(str(root), gfx, cfg)
    assert reason is not None and reason.startswith(cfg.co_name + ": "), reason
    assert says in reason, reason
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert says in caplog.text and str(gemm_kernel_dir(root, gfx) / cfg.co_name) in caplog.text
    others = [k for k in listed(root, gfx) if k != cfg]
    assert all(hb.code_object_reason(str(root), gfx, k) is None for k in others)  # only the altered one


def test_missing_code_object_is_refused(aiter_root, tmp_path):
    cfg = kernel_for_tile(aiter_root, "gfx942", 48)
    root = altered_tree(aiter_root, tmp_path, "gfx942", cfg, lambda d: d)
    (gemm_kernel_dir(root, "gfx942") / cfg.co_name).unlink()
    assert hb.code_object_reason(str(root), "gfx942", cfg) == f"{cfg.co_name}: cannot be read (No such file or directory)"


def test_a_gfx950_file_in_the_gfx942_folder_is_refused(aiter_root, tmp_path):
    cfg = kernel_for_tile(aiter_root, "gfx942", 96)
    wrong = (gemm_kernel_dir(aiter_root, "gfx950") / cfg.co_name).read_bytes()
    root = altered_tree(aiter_root, tmp_path, "gfx942", cfg, lambda d: wrong)
    assert hb.code_object_reason(str(root), "gfx942", cfg).endswith("the code object is for gfx950, the GPU is gfx942")


def test_the_check_reads_each_file_once_per_process(aiter_root, tmp_path, monkeypatch, caplog):
    reads = []
    real_read = co.read_code_object
    monkeypatch.setattr(co, "read_code_object", lambda path: reads.append(path) or real_read(path))
    good = kernel_for_tile(aiter_root, "gfx942", 64)
    bad = kernel_for_tile(aiter_root, "gfx942", 80)
    root = altered_tree(aiter_root, tmp_path, "gfx942", bad, ALTERATIONS["wavefront size"][0])
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        for _ in range(5):
            assert hb.code_object_reason(str(root), "gfx942", good) is None
            assert "wavefront" in hb.code_object_reason(str(root), "gfx942", bad)
    assert sorted(reads) == sorted(str(gemm_kernel_dir(root, "gfx942") / k.co_name) for k in (good, bad))
    assert len(caplog.records) == 1  # one warning for the refused file, not one per call


def test_launcher_refuses_to_load_a_refused_code_object(aiter_root, tmp_path, monkeypatch):
    """Direct callers of the launcher (not only the patch's gate) never load a mismatched file."""
    cfg = kernel_for_tile(aiter_root, "gfx942", 128)
    root = altered_tree(aiter_root, tmp_path, "gfx942", cfg, ALTERATIONS["moved offset"][0])
    launcher = hb.AsmLauncher.__new__(hb.AsmLauncher)  # no HIP library here: the check comes before any HIP call
    launcher._functions, launcher._lock, launcher._hip = {}, threading.Lock(), None
    with pytest.raises(RuntimeError, match="argument KS: offset 196"):
        launcher.function(0, hb.code_object_path(str(root), "gfx942", cfg), cfg.knl_name, "gfx942")


# ---------------------------------------------------------------- the comparison itself


def layout(args, size=256, wave=64, block=(256, 1, 1)):
    return co.LaunchLayout(tuple(args), size, wave, block)


def meta(args, *, size=256, wave=64, max_flat=256, reqd=(256, 1, 1), name="k", mach=0x04C):
    kernel = co.KernelMetadata(name, name + ".kd", tuple(args), size, wave, max_flat, reqd)
    return co.CodeObject("x.co", mach, (kernel,))


A0 = co.KernelArg("p", 0, 8, "global_buffer")
A1 = co.KernelArg("n", 16, 4, "by_value")


@pytest.mark.parametrize("obj, says", [
    (meta([A0]), "argument(s) n the launcher packs are not in the kernel's .args"),
    (meta([A0, A1._replace(value_kind="global_buffer")]), "argument n: offset 16, size 4, global_buffer"),
    (meta([A0, A1, co.KernelArg("hidden_block_count_x", 24, 4, "hidden_block_count_x")]),
     "argument 'hidden_block_count_x' at offset 24 is not one the launcher packs"),
    (meta([A0, A1._replace(offset=None)]), "argument 'n' has no .offset or .size"),
    (meta([A0, A1], size=None), ".kernarg_segment_size is missing"),
    (meta([A0, A1], wave=None), ".wavefront_size is missing"),
    (meta([A0, A1], max_flat=None), ".max_flat_workgroup_size is missing"),
    (meta([A0, A1], mach=0x041), "the code object is for EF_AMDGPU_MACH 0x041, the GPU is gfx942"),
])
def test_mismatch_reasons(obj, says):
    reason = co.layout_mismatch(obj, "k", "gfx942", layout([A0, A1]))
    assert reason is not None and reason.startswith(says), reason


def test_match_with_pads_and_without_a_required_size():
    pads = [co.KernelArg("pad", 8, 8, "by_value"), co.KernelArg("pad", 20, 12, "by_value")]
    assert co.layout_mismatch(meta([A0, pads[0], A1, pads[1]], reqd=None), "k", "gfx942", layout([A0, A1])) is None
    assert co.layout_mismatch(meta([A0, A1]), "k.kd", "gfx942", layout([A0, A1])) is not None
    assert co.layout_mismatch(meta([A0, A1]), "k", "gfx942", layout([A0, A1])) is None


def test_packing_and_layout_are_one_table():
    """Every value lands at the offset the layout declares, with the declared width."""
    values = {a.name: (0x1122334455667788 if a.size == 8 else 0x0A0B0C0D) + i for i, a in enumerate(hb.KERNEL_ARGS)}
    buf = hb.pack_kernel_args(values)
    assert len(buf) == hb.ARGS_SIZE == hb.LAUNCH_LAYOUT.kernarg_size == 256
    covered = set()
    for a in hb.KERNEL_ARGS:
        assert int.from_bytes(buf[a.offset:a.offset + a.size], "little") == values[a.name]
        covered.update(range(a.offset, a.offset + a.size))
    assert all(buf[i] == 0 for i in range(256) if i not in covered)
    with pytest.raises(ValueError, match=r"missing \['KS'\], unknown \['ks'\]"):
        hb.pack_kernel_args({**{k: v for k, v in values.items() if k != "KS"}, "ks": 1})


def test_a_failed_load_is_not_tried_again(aiter_root, monkeypatch):
    """A code object HIP refuses to load (or a refused one) costs one driver call, not one per call:
    later calls raise the same error at once, and the caller hands them to AITER."""
    cfg = kernel_for_tile(aiter_root, "gfx942", 128)
    loads = []

    class FakeHip:
        def hipModuleLoad(self, module, path):
            loads.append(path)
            return 98  # hipErrorInvalidImage

        def hipGetErrorString(self, err):
            return b"invalid device image"

    monkeypatch.setattr(hb.torch.cuda, "device", lambda index: contextlib.nullcontext())
    launcher = hb.AsmLauncher.__new__(hb.AsmLauncher)
    launcher._functions, launcher._lock, launcher._hip = {}, threading.Lock(), FakeHip()
    path = hb.code_object_path(aiter_root, "gfx942", cfg)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="hipModuleLoad failed: invalid device image"):
            launcher.function(0, path, cfg.knl_name, "gfx942")
    assert len(loads) == 1
    with pytest.raises(RuntimeError, match="hipModuleLoad failed"):
        launcher.function(1, path, cfg.knl_name, "gfx942")  # another device: its own load
    assert len(loads) == 2


# ---------------------------------------------------------------- malformed metadata (issue 35 item 4)


def _kernel0(change):
    """A change of the first kernel's map, as a change of the whole metadata."""
    return lambda meta: change(meta["amdhsa.kernels"][0])


MALFORMED = {
    ".args an integer": (_kernel0(lambda k: k.update({".args": 5})), ".args is an integer (5), expected a list"),
    ".args a map": (_kernel0(lambda k: k.update({".args": {"C": 0}})), ".args is a map ({'C': 0}), expected a list"),
    ".symbol an integer": (_kernel0(lambda k: k.update({".symbol": 7})), ".symbol is an integer (7), expected a string"),
    "argument .name a list": (_kernel0(lambda k: k[".args"][0].update({".name": ["C"]})),
                              ".args[0].name is a list (['C']), expected a string"),
    "argument .offset a string": (_kernel0(lambda k: k[".args"][2].update({".offset": "16"})),
                                  ".args[2].offset is a string ('16'), expected an integer >= 0"),
    "argument .size negative": (_kernel0(lambda k: k[".args"][2].update({".size": -8})),
                                ".args[2].size is -8, expected an integer >= 0"),
    "argument .size a float": (_kernel0(lambda k: k[".args"][2].update({".size": 8.0})),
                               ".args[2].size is a float (8.0), expected an integer >= 0"),
    "argument .value_kind binary": (_kernel0(lambda k: k[".args"][2].update({".value_kind": b"by_value"})),
                                    ".args[2].value_kind is binary data (b'by_value'), expected a string"),
    "an .args entry a string": (_kernel0(lambda k: k[".args"].insert(1, "pad")),
                                ".args[1] is a string ('pad'), expected a map"),
    ".wavefront_size a boolean": (_kernel0(lambda k: k.update({".wavefront_size": True})),
                                  ".wavefront_size is a boolean (True), expected an integer >= 0"),
    ".kernarg_segment_size a string": (_kernel0(lambda k: k.update({".kernarg_segment_size": "256"})),
                                       ".kernarg_segment_size is a string ('256'), expected an integer >= 0"),
    ".max_flat_workgroup_size a list": (_kernel0(lambda k: k.update({".max_flat_workgroup_size": [256]})),
                                        ".max_flat_workgroup_size is a list ([256]), expected an integer >= 0"),
    ".reqd_workgroup_size of strings": (_kernel0(lambda k: k.update({".reqd_workgroup_size": ["256", 1, 1]})),
                                        ".reqd_workgroup_size is ['256', 1, 1], expected 3 integers >= 0"),
    ".reqd_workgroup_size a map": (_kernel0(lambda k: k.update({".reqd_workgroup_size": {"x": 256}})),
                                   ".reqd_workgroup_size is a map ({'x': 256}), expected a list"),
    "kernel .name a list": (_kernel0(lambda k: k.update({".name": [1]})),
                            "amdhsa.kernels[0].name is a list ([1]), expected a string"),
    "a kernel an integer": (lambda meta: meta["amdhsa.kernels"].insert(0, 3),
                            "amdhsa.kernels[0] is an integer (3), expected a map"),
    "amdhsa.kernels a map": (lambda meta: meta.update({"amdhsa.kernels": {"k": 1}}),
                             "the metadata has no amdhsa.kernels list"),
}


def malformed(change):
    """An alteration of a file's bytes: its metadata changed by `change(meta)` (any length)."""
    def alter(data):
        meta = cof.metadata(data)
        change(meta)
        return cof.with_metadata(data, meta)
    return alter


def test_a_rewritten_note_of_another_length_reads_as_the_original(aiter_root):
    """The helper the malformed cases use: the same metadata, moved to a note at the end, is still accepted."""
    cfg = kernel_for_tile(aiter_root, "gfx942", 64)
    data = (gemm_kernel_dir(aiter_root, "gfx942") / cfg.co_name).read_bytes()
    moved = cof.with_metadata(data, {**cof.metadata(data), "padding": "x" * 1000})
    assert len(moved) > len(data) + 1000
    assert co.layout_mismatch(co.parse_code_object(moved), cfg.knl_name, "gfx942", hb.LAUNCH_LAYOUT) is None


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_malformed_metadata_is_refused_naming_the_field(aiter_root, tmp_path, what, caplog, monkeypatch):
    """A field of the wrong type is a refusal (CodeObjectError naming the file and the field), remembered
    like any other: never a TypeError/AttributeError that the gate would not catch nor remember."""
    change, says = MALFORMED[what]
    cfg = kernel_for_tile(aiter_root, "gfx942", 32)
    root = altered_tree(aiter_root, tmp_path, "gfx942", cfg, malformed(change))
    path = str(gemm_kernel_dir(root, "gfx942") / cfg.co_name)
    with pytest.raises(co.CodeObjectError) as exc:
        co.read_code_object(path)
    assert says in str(exc.value) and exc.value.path == path, str(exc.value)
    reads = []
    real_read = co.read_code_object
    monkeypatch.setattr(co, "read_code_object", lambda p: reads.append(p) or real_read(p))
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        reasons = {hb.code_object_reason(str(root), "gfx942", cfg) for _ in range(3)}
    [reason] = reasons
    assert reason.startswith(cfg.co_name + ": ") and says in reason, reason
    assert reads == [path]  # refused once, remembered
    assert len(caplog.records) == 1 and path in caplog.text


def test_a_directory_or_a_fifo_in_place_of_a_code_object_is_refused_at_once(aiter_root, tmp_path):
    """A FIFO would block the first GEMM call for good (open waits for a writer); a folder is no file."""
    cfg = kernel_for_tile(aiter_root, "gfx942", 32)
    root = altered_tree(aiter_root, tmp_path, "gfx942", cfg, lambda d: d)
    path = gemm_kernel_dir(root, "gfx942") / cfg.co_name
    path.unlink()
    path.mkdir()
    assert hb.code_object_reason(str(root), "gfx942", cfg) == f"{cfg.co_name}: not a regular file"
    path.rmdir()
    os.mkfifo(path)
    hb._co_checks.clear()
    found = []
    reader = threading.Thread(target=lambda: found.append(hb.code_object_reason(str(root), "gfx942", cfg)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader: a writer opens and closes the FIFO
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading a FIFO blocked")
    assert found == [f"{cfg.co_name}: not a regular file"]


def test_overlapping_note_segments_are_read_in_bounded_time(aiter_root):
    """Hundreds of PT_NOTE headers over one large note segment: each byte is read once, not once per header."""
    cfg = kernel_for_tile(aiter_root, "gfx942", 32)
    data = bytearray((gemm_kernel_dir(aiter_root, "gfx942") / cfg.co_name).read_bytes())
    seg_at = len(data)
    data += struct.pack("<III", 0, 0, 1) * 80_000  # empty notes of another type: 960 KB to walk
    phnum = 300
    phoff = len(data)
    for i in range(phnum):  # each header: the segment from a different start (no two spans alike)
        data += struct.pack("<IIQQQQQQ", 4, 4, seg_at + 12 * i, 0, 0, 12 * (80_000 - i), 0, 4)
    struct.pack_into("<Q", data, 32, phoff)
    struct.pack_into("<HH", data, 54, 56, phnum)
    t0 = time.perf_counter()
    with pytest.raises(co.CodeObjectError, match="note segments overlap"):
        co.parse_code_object(bytes(data))
    assert time.perf_counter() - t0 < 2
