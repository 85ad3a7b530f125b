"""The ROCm branch of ``gemm_out_zeroed`` refuses a ``.co`` whose metadata does not match the launcher.

The HIP runtime is faked (no AMD GPU here); the kernel list, the tile choice and the code
objects are AITER's real ones, read from an AITER tree at test time. A refused code object
sends the call to AITER's original with the named reason in ``stats()`` and one warning in the
log; the check reads each file once, however many calls follow.
"""

import logging
import shutil
import struct
import sys
import types

import msgpack
import pytest
import torch

import aiter_patches
from aiter_patches.kernels import code_object as co
from aiter_patches.kernels import hip_blockscale_asm as hb
from aiter_patches.reference.blockscale_gemm import shuffle_weight_16x16
from helpers import code_object_files as cof
from helpers.aiter_tree import code_object_root, gemm_kernel_dir
from helpers.standin import gemm_default_backend

NAME = "gemm_out_zeroed"
MODULE = "aiter.ops.gemm_op_a8w8"
M, N, K, SPLIT, CUS = 7, 256, 512, 2, 304


@pytest.fixture(scope="session")
def real_root(tmp_path_factory):
    return code_object_root(tmp_path_factory.mktemp("aiter_hsa"))


def copy_tree(real_root, tmp_path, device, alter=None):
    """AITER's gfx942 kernel folder under ``tmp_path/hsa`` (``alter(bytes)`` rewrites every ``.co``); the
    kernel a call on ``device`` picks."""
    dst = gemm_kernel_dir(tmp_path, "gfx942")
    shutil.copytree(gemm_kernel_dir(real_root, "gfx942"), dst)
    if alter is not None:
        for path in dst.glob("*.co"):
            path.write_bytes(alter(path.read_bytes()))
    cus = torch.cuda.get_device_properties(device).multi_processor_count
    cfg, _ = hb.select_kernel(M, N, K, hb.load_kernel_list(str(tmp_path), "gfx942"), cus, SPLIT)
    return cfg


def wavefront_32(data: bytes) -> bytes:
    at = data.index(struct.pack("<I", co.NT_AMDGPU_METADATA) + b"AMDGPU\0")
    start, end = at + 12, at + 12 + struct.unpack_from("<I", data, at - 4)[0]
    meta = msgpack.unpackb(data[start:end])
    meta["amdhsa.kernels"][0][".wavefront_size"] = 32
    new = msgpack.packb(meta)
    assert len(new) == end - start
    return data[:start] + new + data[end:]


@pytest.fixture
def rocm(stub, monkeypatch, tmp_path):
    """A faked ROCm gfx942 device whose AITER keeps its code objects under ``tmp_path/hsa``."""
    loads, launches = [], []

    class FakeLauncher:
        def function(self, device_index, co_path, knl_name, gfx):
            loads.append(co_path)
            return "fn"

        def launch(self, fn, grid, args, stream):
            launches.append(grid)

    gemm_default_backend(monkeypatch)  # served as on AMD's AITER: its .co through HIP
    monkeypatch.setitem(sys.modules, "aiter.jit.core", types.SimpleNamespace(AITER_ASM_DIR=f"{tmp_path}/hsa/"))
    monkeypatch.setattr(hb, "available", lambda device, root: None)
    monkeypatch.setattr(hb, "gfx_of", lambda device: "gfx942")
    monkeypatch.setattr(hb, "_get_launcher", lambda: FakeLauncher())
    monkeypatch.setattr(hb, "_co_checks", {})
    if not torch.cuda.is_available():  # on a GPU (CUDA here) the stand-in's original runs on the real ones
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d: types.SimpleNamespace(multi_processor_count=CUS))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: types.SimpleNamespace(cuda_stream=0))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return types.SimpleNamespace(loads=loads, launches=launches, root=tmp_path)


def operands(stub, device):
    g = torch.Generator().manual_seed(5)
    A = (torch.randn(M, K, generator=g) * 2).to(stub.dtypes.fp8)
    B = shuffle_weight_16x16((torch.randn(N, K, generator=g) * 2).to(stub.dtypes.fp8))
    A_scale = (torch.rand(K // 128, M, generator=g) * 0.02 + 0.001).contiguous().view(M, K // 128)
    B_scale = torch.rand(N // 128, K // 128, generator=g) * 0.02 + 0.001
    return tuple(t.to(device) for t in (A, B, A_scale, B_scale))


def gemm(*args, **kwargs):
    return getattr(sys.modules[MODULE], "gemm_a8w8_blockscale_bpreshuffle_asm")(*args, **kwargs)


def stats():
    return aiter_patches.stats()[NAME]


def test_real_code_object_passes_the_check_and_is_launched(rocm, stub, real_root, device):
    cfg = copy_tree(real_root, rocm.root, device)
    A, B, A_scale, B_scale = operands(stub, device)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
    aiter_patches.apply([NAME])
    assert gemm(A, B, out, A_scale, B_scale, splitK=SPLIT, out_zeroed=True) is out
    assert stats()["fast"] == 1 and stats()["fallback"] == {}, stats()
    assert rocm.loads == [str(gemm_kernel_dir(rocm.root, "gfx942") / cfg.co_name)]
    assert rocm.launches == [hb.launch_grid(M, N, cfg.tile_m, cfg.tile_n, SPLIT)]


def test_refused_code_object_hands_the_call_back_with_the_reason(rocm, stub, real_root, device, monkeypatch,
                                                                   caplog):
    cfg = copy_tree(real_root, rocm.root, device, alter=wavefront_32)
    reads = []
    real_read = co.read_code_object
    monkeypatch.setattr(co, "read_code_object", lambda path: reads.append(path) or real_read(path))
    A, B, A_scale, B_scale = operands(stub, device)
    expected = torch.zeros(M, N, dtype=torch.bfloat16, device=device)
    gemm(A, B, expected, A_scale, B_scale, splitK=SPLIT)  # AITER's own call (the stand-in's kernel)
    aiter_patches.apply([NAME])
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        for _ in range(3):
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
            assert gemm(A, B, out, A_scale, B_scale, splitK=SPLIT, out_zeroed=True) is out
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # AITER's result, memset included
    reason = f"AITER's .co refused: {cfg.co_name}: .wavefront_size is 32, the launcher expects 64"
    assert stats() == {**stats(), "fast": 0, "fallback": {reason: 3}, "errors": {}, "checks_passed": 0, "checks_failed": 0}, stats()
    assert rocm.loads == [] and rocm.launches == []
    assert reads == [str(gemm_kernel_dir(rocm.root, "gfx942") / cfg.co_name)]  # checked once for three calls
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and ".wavefront_size is 32, the launcher expects 64" in warnings[0].getMessage()
    assert any(reason in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)


MALFORMED = {  # issue 35 item 4: each raised TypeError/AttributeError from the check, on every call
    ".args an integer": (lambda k: k.update({".args": 5}), ".args is an integer (5), expected a list"),
    ".symbol an integer": (lambda k: k.update({".symbol": 7}), ".symbol is an integer (7), expected a string"),
    "argument .name a list": (lambda k: k[".args"][0].update({".name": ["C"]}),
                              ".args[0].name is a list (['C']), expected a string"),
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_malformed_metadata_is_a_remembered_refusal(rocm, stub, real_root, device, monkeypatch, what):
    """Every call goes to AITER's original with the refusal counted; the file is read once."""
    change, says = MALFORMED[what]

    def alter(data):
        meta = cof.metadata(data)
        change(meta["amdhsa.kernels"][0])
        return cof.with_metadata(data, meta)

    cfg = copy_tree(real_root, rocm.root, device, alter=alter)
    reads = []
    real_read = co.read_code_object
    monkeypatch.setattr(co, "read_code_object", lambda path: reads.append(path) or real_read(path))
    A, B, A_scale, B_scale = operands(stub, device)
    expected = torch.zeros(M, N, dtype=torch.bfloat16, device=device)
    gemm(A, B, expected, A_scale, B_scale, splitK=SPLIT)
    aiter_patches.apply([NAME])
    for _ in range(3):
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
        assert gemm(A, B, out, A_scale, B_scale, splitK=SPLIT, out_zeroed=True) is out
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    [(reason, n)] = stats()["fallback"].items()
    assert n == 3 and reason.startswith(f"AITER's .co refused: {cfg.co_name}: kernel ") and says in reason, stats()
    assert stats()["fast"] == 0 and stats()["errors"] == {}, stats()
    assert rocm.loads == [] and reads == [str(gemm_kernel_dir(rocm.root, "gfx942") / cfg.co_name)]


def test_split_one_never_reads_a_code_object(rocm, stub, real_root, device, monkeypatch):
    """A call that goes to AITER anyway (one split) costs no file read."""
    copy_tree(real_root, rocm.root, device, alter=wavefront_32)
    monkeypatch.setattr(co, "read_code_object", lambda path: pytest.fail("read a code object"))
    A, B, A_scale, B_scale = operands(stub, device)
    aiter_patches.apply([NAME])
    gemm(A, B, torch.zeros(M, N, dtype=torch.bfloat16, device=device), A_scale, B_scale, splitK=1, out_zeroed=True)
    assert list(stats()["fallback"]) == ["split count 1: the original launches no memset"]


# ------------------------------------------------------------------ kept verdicts of the .co branch (issue 15)

def spy_decide(monkeypatch):
    """Count the gate's full decisions (a kept verdict's hit does not decide)."""
    from aiter_patches.patches import gemm_out_zeroed as patch

    decided, real = [], patch._decide
    monkeypatch.setattr(patch, "_decide", lambda *a: decided.append(1) or real(*a))
    return decided


def kept_once(rocm, stub, real_root, device, monkeypatch):
    """The `.co` branch applied, one call decided and kept, and one hit: the operands, the decisions spy,
    a maker of zeroed outputs."""
    copy_tree(real_root, rocm.root, device)
    A, B, A_scale, B_scale = operands(stub, device)
    decided = spy_decide(monkeypatch)
    aiter_patches.apply([NAME])
    zeros = lambda: torch.zeros(M, N, dtype=torch.bfloat16, device=device)  # noqa: E731
    for _ in range(2):
        gemm(A, B, zeros(), A_scale, B_scale, splitK=SPLIT, out_zeroed=True)
    return A, B, A_scale, B_scale, decided, zeros


def test_co_verdict_is_kept_and_a_hit_launches_the_same_kernel(rocm, stub, real_root, device, monkeypatch):
    cfg = copy_tree(real_root, rocm.root, device)
    A, B, A_scale, B_scale = operands(stub, device)
    decided = spy_decide(monkeypatch)
    aiter_patches.apply([NAME])
    outs = [torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(3)]
    for out in outs:
        assert gemm(A, B, out, A_scale, B_scale, splitK=SPLIT, out_zeroed=True) is out
    assert decided == [1] and stats()["fast"] == 3 and stats()["fallback"] == {}, stats()
    grid = hb.launch_grid(M, N, cfg.tile_m, cfg.tile_n, SPLIT)
    assert rocm.launches == [grid] * 3
    assert rocm.loads == [str(gemm_kernel_dir(rocm.root, "gfx942") / cfg.co_name)] * 3


def test_co_verdict_follows_what_the_gate_reads(rocm, stub, real_root, device, monkeypatch):
    """After a kept launch, each thing the gate reads is changed in turn: the call is decided again,
    and the gate's own answer (a new launch, or its reason counted) is what the call gets."""
    A, B, A_scale, B_scale, decided, zeros = kept_once(rocm, stub, real_root, device, monkeypatch)
    assert len(decided) == 1 and stats()["fast"] == 2
    gemm(A, B, zeros(), A_scale, B_scale, splitK=1, out_zeroed=True)  # a value: split 1, handed back
    assert len(decided) == 2 and list(stats()["fallback"]) == ["split count 1: the original launches no memset"]
    gemm(A[:3], B, zeros()[:3], A_scale[:3], B_scale, splitK=SPLIT, out_zeroed=True)  # a shape
    assert len(decided) == 3 and stats()["fast"] == 3
    other = rocm.root / "other"
    copy_tree(real_root, other, device)
    monkeypatch.setitem(sys.modules, "aiter.jit.core", types.SimpleNamespace(AITER_ASM_DIR=f"{other}/hsa/"))
    gemm(A, B, zeros(), A_scale, B_scale, splitK=SPLIT, out_zeroed=True)  # another AITER tree
    assert len(decided) == 4 and str(other) in rocm.loads[-1]
    monkeypatch.setattr(hb, "available", lambda device, root: "no HIP here (test)")  # a HIP-side answer
    gemm(A, B, zeros(), A_scale, B_scale, splitK=SPLIT, out_zeroed=True)
    assert len(decided) == 5 and stats()["fallback"].get(
        "AITER's .co cannot be launched here: no HIP here (test)") == 1, stats()
    grad = torch.is_grad_enabled()
    with torch.set_grad_enabled(not grad):
        gemm(A, B, zeros(), A_scale, B_scale, splitK=SPLIT, out_zeroed=True)  # the grad mode: a new key
    assert len(decided) == 6
    out = zeros().requires_grad_()
    with torch.enable_grad(), pytest.raises(RuntimeError, match="requires grad"):  # the gate's autograd rule:
        gemm(A, B, out, A_scale, B_scale, splitK=SPLIT, out_zeroed=True)  # AITER's in-place write refuses
    assert len(decided) == 7 and any("requires grad" in r for r in stats()["fallback"]), stats()


def test_co_branch_with_an_unhashable_part_is_decided_every_call(rocm, stub, real_root, device, monkeypatch):
    copy_tree(real_root, rocm.root, device)
    A, B, A_scale, B_scale = operands(stub, device)

    class Unhashable:  # a replaced HIP-side function that does not hash (defines __eq__ only)
        def __eq__(self, other):
            return self is other

        def __call__(self, device, root):
            return None

    monkeypatch.setattr(hb, "available", Unhashable())
    decided = spy_decide(monkeypatch)
    aiter_patches.apply([NAME])
    for _ in range(3):
        gemm(A, B, torch.zeros(M, N, dtype=torch.bfloat16, device=device), A_scale, B_scale, splitK=SPLIT,
             out_zeroed=True)
    assert decided == [1, 1, 1] and stats()["fast"] == 3


@pytest.mark.parametrize("name", ["select_kernel", "load_kernel_list", "aligned_split", "code_object_path",
                                  "plan_launch", "gfx_of", "unsupported_reason"])
def test_co_verdict_is_decided_again_when_a_rocm_side_function_is_replaced(rocm, stub, real_root, device,
                                                                           monkeypatch, name):
    A, B, A_scale, B_scale, decided, zeros = kept_once(rocm, stub, real_root, device, monkeypatch)
    assert decided == [1]
    real = getattr(hb, name)
    monkeypatch.setattr(hb, name, lambda *a, **kw: real(*a, **kw))
    gemm(A, B, zeros(), A_scale, B_scale, splitK=SPLIT, out_zeroed=True)
    assert decided == [1, 1] and stats()["fast"] == 3, stats()
