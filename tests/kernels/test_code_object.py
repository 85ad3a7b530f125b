"""The `.co` check against AITER's real block-scale GEMM code objects and altered copies of them.

Every real code object (both archs) must be accepted; every alteration that would make the
launcher's argument buffer wrong for the kernel must be refused, with a reason that names
what differs. The altered copies are made in a temporary folder from the real files.
"""

import contextlib
import logging
import shutil
import struct
import threading

import msgpack
import pytest

from aiter_patches.kernels import code_object as co
from aiter_patches.kernels import hip_blockscale_asm as hb
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
