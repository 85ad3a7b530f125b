"""The pure parts of the AITER `.co` launcher: kernel list, tile and split choice, argument bytes, grid.

The launch itself needs ROCm on gfx942/gfx950 and is not exercised here.
"""

import struct

import pytest
import torch

from aiter_patches.kernels import hip_blockscale_asm as hb

# AITER's hsa/gfx942/fp8gemm_blockscale/fp8gemm_bf16_blockscale.csv (gfx950's lists the same rows).
CSV = """tile_m,tile_n,splitK,bpreshuffle,knl_name,co_name
128,128,1,1,_ZN5aiter43fp8gemm_bf16_blockscale_BpreShuffle_128x128E,fp8gemm_bf16_blockscale_BpreShuffle_128x128.co
32,128,1,1,_ZN5aiter42fp8gemm_bf16_blockscale_BpreShuffle_32x128E,fp8gemm_bf16_blockscale_BpreShuffle_32x128.co
48,128,1,1,_ZN5aiter42fp8gemm_bf16_blockscale_BpreShuffle_48x128E,fp8gemm_bf16_blockscale_BpreShuffle_48x128.co
64,128,1,1,_ZN5aiter42fp8gemm_bf16_blockscale_BpreShuffle_64x128E,fp8gemm_bf16_blockscale_BpreShuffle_64x128.co
80,128,1,1,_ZN5aiter42fp8gemm_bf16_blockscale_BpreShuffle_80x128E,fp8gemm_bf16_blockscale_BpreShuffle_80x128.co
96,128,1,1,_ZN5aiter42fp8gemm_bf16_blockscale_BpreShuffle_96x128E,fp8gemm_bf16_blockscale_BpreShuffle_96x128.co
"""
KERNELS = hb.parse_kernel_csv(CSV)


def tile(cfg):
    return cfg.tile_m, cfg.tile_n


def test_parse_csv():
    assert [k.tile_m for k in KERNELS] == [128, 32, 48, 64, 80, 96]
    k = KERNELS[1]
    assert (k.tile_n, k.splitK, k.bpreshuffle) == (128, 1, 1)
    assert k.knl_name == "_ZN5aiter42fp8gemm_bf16_blockscale_BpreShuffle_32x128E"
    assert k.co_name == "fp8gemm_bf16_blockscale_BpreShuffle_32x128.co"


def test_parse_csv_skips_comments_and_blank_lines():
    text = "# kernels\n" + CSV.replace("\n32,", "\n\n// a note\n32,", 1)
    assert hb.parse_kernel_csv(text) == KERNELS


def test_load_kernel_list_from_tree(tmp_path):
    d = tmp_path / "hsa" / "gfx942" / "fp8gemm_blockscale"
    d.mkdir(parents=True)
    (d / "fp8gemm_bf16_blockscale.csv").write_text(CSV)
    assert hb.load_kernel_list(str(tmp_path), "gfx942") == KERNELS


@pytest.mark.parametrize("M,N,cu,expect", [
    (1, 7168, 304, (128, 128)),    # one round everywhere, equal idle CUs: best efficiency wins
    (256, 7168, 304, (96, 128)),   # 32/48 take two rounds; 64, 80, 96 one; 96 the most efficient
    (512, 7168, 80, (128, 128)),   # fewest rounds (3 against 5 or more)
    (200, 1536, 304, (96, 128)),   # all one round: 32 has fewer idle CUs than 128, then efficiency climbs
    (100, 24576, 304, (128, 128)),  # 192 workgroups: the only one-round tile
])
def test_tile_choice(M, N, cu, expect):
    cfg, split = hb.select_kernel(M, N, 2048, KERNELS, cu)
    assert split == 1
    assert tile(cfg) == expect


def test_tile_choice_fewer_idle_cus_beats_efficiency_first_seen():
    # M=256, N=7168, 304 CUs: 128x128 (112 wg, 192 idle) is seen first, then 64x128 (224 wg, 80 idle)
    # replaces it for fewer idle CUs although its efficiency is lower.
    cfg, _ = hb.select_kernel(256, 7168, 2048, [KERNELS[0], KERNELS[3]], 304)
    assert tile(cfg) == (64, 128)


def test_no_split_unless_asked():
    # AITER's `value_or(0) ?: 1` makes the heuristic evaluate split 1 only.
    for M in (1, 16, 64):
        assert hb.select_kernel(M, 7168, 16384, KERNELS, 304)[1] == 1
        assert hb.select_kernel(M, 7168, 16384, KERNELS, 304, splitK=-1)[1] == 1
    assert hb.select_kernel(1, 7168, 16384, KERNELS, 304, splitK=0)[1] == 1


def test_explicit_split_checked_like_aiter():
    assert hb.select_kernel(1, 7168, 7168, KERNELS, 304, splitK=3)[1] == 3
    assert hb.select_kernel(1, 7168, 7168, KERNELS, 304, splitK=5)[1] == 5
    assert hb.aligned_split(7168, 16) == 14
    with pytest.raises(ValueError, match="alignment"):
        hb.select_kernel(1, 7168, 7168, KERNELS, 304, splitK=16)
    with pytest.raises(ValueError, match="alignment"):
        hb.select_kernel(1, 7168, 1024, KERNELS, 304, splitK=5)


def test_kernel_name_overrides_heuristic():
    name = "_ZN5aiter42fp8gemm_bf16_blockscale_BpreShuffle_64x128E"
    cfg, split = hb.select_kernel(1, 7168, 2048, KERNELS, 304, splitK=4, kernelName=name)
    assert tile(cfg) == (64, 128) and split == 4
    cfg, split = hb.select_kernel(1, 7168, 2048, KERNELS, 304, kernelName=name)
    assert split == 1
    with pytest.raises(ValueError, match="not find kernel"):
        hb.select_kernel(1, 7168, 2048, KERNELS, 304, kernelName="nope")


def test_no_kernel_for_n():
    with pytest.raises(ValueError, match="no asm kernel"):
        hb.select_kernel(1, 7168 + 64, 2048, KERNELS, 304)
    with pytest.raises(ValueError, match="no asm kernel"):
        hb.select_kernel(1, 7168, 2048, KERNELS, 304, bpreshuffle=False)


def test_grid():
    assert hb.launch_grid(7, 7168, 32, 128, 4) == (224, 1, 1)
    assert hb.launch_grid(4096, 1536, 128, 128, 1) == (12, 32, 1)
    assert hb.launch_grid(129, 256, 64, 128, 3) == (6, 3, 1)


def _expected_args(fields_ptr, fields_u32):
    buf = bytearray(256)
    for i, p in enumerate(fields_ptr):
        struct.pack_into("<Q", buf, 16 * i, p)
    for j, v in enumerate(fields_u32):
        struct.pack_into("<I", buf, 96 + 16 * j, v)
    return bytes(buf)


def test_pack_kernel_args_layout():
    ptrs = [0x7F0000001000 + 0x100 * i for i in range(6)]
    ints = [7, 7168, 2048, 2048, 2048, 14336, 4, 7, 56, 16]
    names = ["C", "A", "B", "SA", "SB", "BIAS", "M", "Ndim", "K", "PA", "PB", "PC", "KS", "scale_m", "scale_n", "scale_k"]
    got = hb.pack_kernel_args(dict(zip(names, ptrs + ints)))
    assert len(got) == 256
    assert got == _expected_args(ptrs, ints)
    # ptr_C first, scale_k last: field order as in AITER's KernelArgs.
    assert struct.unpack_from("<Q", got, 0)[0] == ptrs[0]
    assert struct.unpack_from("<I", got, 240)[0] == 16


def test_kernel_args_from_tensors():
    M, N, K = 5, 256, 384
    A = torch.zeros(M, K, dtype=torch.uint8)
    B = torch.zeros(N, K, dtype=torch.uint8)
    out_big = torch.zeros(M, N + 64, dtype=torch.bfloat16)
    out = out_big[:, :N]
    A_scale = torch.zeros(M, K // 128)
    B_scale = torch.zeros(N // 128, K // 128)
    bias = torch.zeros(1, N)
    got = hb.kernel_args(A, B, out, A_scale, B_scale, bias, split=3)
    expect = _expected_args(
        [out.data_ptr(), A.data_ptr(), B.data_ptr(), A_scale.data_ptr(), B_scale.data_ptr(), bias.data_ptr()],
        [M, N, K, K, K, (N + 64) * 2, 3, M, N // 128, K // 128],
    )
    assert got == expect


def test_available_says_why_here():
    reason = hb.available("cpu", "/nonexistent")
    assert reason is not None
    if torch.version.hip is None:
        assert "ROCm" in reason


def _operands(M=4, N=256, K=512):
    fp8 = torch.float8_e4m3fn
    A = torch.zeros(M, K, dtype=fp8)
    B = torch.zeros(N, K, dtype=fp8)
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    A_scale = torch.ones(K // 128, M).t().contiguous().view(M, K // 128)  # as AITER passes it
    B_scale = torch.ones(N // 128, K // 128)
    return dict(A=A, B=B, out=out, A_scale=A_scale, B_scale=B_scale)


@pytest.mark.parametrize("change, says", [
    (lambda o: o.update(A=o["A"].to(torch.bfloat16)), "A is not a 2-D fp8 tensor"),
    (lambda o: o.update(B=torch.zeros(256, 1024, dtype=torch.float8_e4m3fn)[:, ::2]), "B rows are not contiguous"),
    (lambda o: o.update(out=o["out"].half()), "out is not a bf16"),
    (lambda o: o.update(out=torch.zeros(4, 512, dtype=torch.bfloat16)[:, ::2]), "out is not a bf16"),
    (lambda o: o.update(B=torch.zeros(128, 512, dtype=torch.float8_e4m3fn)), "shapes"),
    (lambda o: o.update(A=torch.zeros(4, 576, dtype=torch.float8_e4m3fn),
                        B=torch.zeros(256, 576, dtype=torch.float8_e4m3fn)), "must be multiples of 128"),
    (lambda o: o.update(B=torch.zeros(512, 256, dtype=torch.float8_e4m3fn).t()), "B rows are not contiguous"),
    (lambda o: o.update(A_scale=torch.ones(4, 4).t().contiguous().t()), "A_scale is not a contiguous fp32"),
    (lambda o: o.update(A_scale=torch.ones(4, 5)), "A_scale is not a contiguous fp32 tensor of M x K/128 values"),
    (lambda o: o.update(B_scale=o["B_scale"].double()), "B_scale is not a contiguous fp32"),
    (lambda o: o.update(B_scale=torch.ones(2, 5)), "B_scale is not a contiguous fp32 tensor of N/128 x K/128 values"),
    (lambda o: o.update(out=torch.zeros(4, 256, dtype=torch.bfloat16, device="meta")), "out is not on A's device"),
])
def test_operand_gate_names_the_argument(change, says):
    ops = _operands()
    assert hb.unsupported_reason(**ops) is None
    change(ops)
    assert says in hb.unsupported_reason(**ops)


def test_a_row_stride_is_an_argument_not_a_reason():
    ops = _operands()
    ops["A"] = torch.zeros(4, 1024, dtype=torch.float8_e4m3fn)[:, :512]
    assert hb.unsupported_reason(**ops) is None


def test_zero_bias_made_under_graph_capture_is_not_cached(monkeypatch):
    """A zeros buffer allocated during capture holds zeros only once the graph replays: never reuse it eagerly."""
    launched = []

    class FakeLauncher:
        def function(self, *a):
            return "fn"

        def launch(self, fn, grid, args, stream):
            launched.append(args)

    cfg = KERNELS[0]
    monkeypatch.setattr(hb, "available", lambda device, root: None)
    monkeypatch.setattr(hb, "gfx_of", lambda device: "gfx942")
    monkeypatch.setattr(hb, "load_kernel_list", lambda root, gfx: KERNELS)
    monkeypatch.setattr(hb, "select_kernel", lambda *a: (cfg, 2))
    monkeypatch.setattr(hb, "_get_launcher", lambda: FakeLauncher())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    monkeypatch.setattr(hb, "_zero_bias", {})
    ops = _operands()
    for capturing, cached in ((True, 0), (True, 0), (False, 1), (True, 1)):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        hb.gemm_a8w8_blockscale_asm(**ops, aiter_root="/x", cu_num=80)
        assert len(hb._zero_bias) == cached
    assert len(launched) == 4


def test_aiter_root_is_where_aiter_keeps_hsa(tmp_path, monkeypatch):
    """AITER's .co files live beside its package (a checkout) or in aiter_meta/ (a wheel), never inside it."""
    import sys
    import types

    monkeypatch.delitem(sys.modules, "aiter.jit.core", raising=False)
    checkout = tmp_path / "checkout"
    (checkout / "aiter").mkdir(parents=True)
    (checkout / "hsa").mkdir()
    pkg = types.SimpleNamespace(__file__=str(checkout / "aiter" / "__init__.py"))
    assert hb.aiter_root_of(pkg) == str(checkout)
    site = tmp_path / "site-packages"
    (site / "aiter").mkdir(parents=True)
    (site / "aiter_meta" / "hsa").mkdir(parents=True)
    assert hb.aiter_root_of(types.SimpleNamespace(__file__=str(site / "aiter" / "__init__.py"))) == \
        str(site / "aiter_meta")
    bare = tmp_path / "bare"
    (bare / "aiter").mkdir(parents=True)
    assert hb.aiter_root_of(types.SimpleNamespace(__file__=str(bare / "aiter" / "__init__.py"))) == str(bare)
    assert hb.aiter_root_of(None) is None
    # AITER's own answer (aiter.jit.core.AITER_ASM_DIR, which honours AITER_META_DIR) wins
    monkeypatch.setitem(sys.modules, "aiter.jit.core", types.SimpleNamespace(AITER_ASM_DIR=f"{tmp_path}/meta/hsa/"))
    assert hb.aiter_root_of(pkg) == str(tmp_path / "meta")


def test_asm_launcher_hands_hip_exactly_this_calls_arguments_from_kept_buffers():
    """The kept per-thread buffers: every launch sees its own bytes and size, whatever ran before."""
    import ctypes
    import threading

    seen = []

    class FakeHip:
        def hipModuleLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shm, stream, params, extra):
            assert extra[0] == hb.HIP_LAUNCH_PARAM_BUFFER_POINTER and extra[2] == hb.HIP_LAUNCH_PARAM_BUFFER_SIZE
            assert extra[4] == hb.HIP_LAUNCH_PARAM_END
            size = ctypes.c_size_t.from_address(extra[3]).value
            seen.append((threading.get_ident(), (gx, gy, gz), ctypes.string_at(extra[1], size)))
            return 0

    launcher = hb.AsmLauncher.__new__(hb.AsmLauncher)
    launcher._hip, launcher._tls = FakeHip(), threading.local()
    calls = [(b"\x01" * 8, (1, 1, 1)), (b"\x02" * 8, (2, 1, 1)), (b"\x03" * 4, (3, 1, 1)), (b"\x04" * 8, (4, 1, 1))]
    for args, grid in calls:
        launcher.launch(ctypes.c_void_p(1), grid, args, 0)
    assert [(g, a) for _, g, a in seen] == [(g, a) for a, g in calls]
    other = threading.Thread(target=lambda: launcher.launch(ctypes.c_void_p(1), (5, 1, 1), b"\x05" * 8, 0))
    other.start()
    other.join()
    launcher.launch(ctypes.c_void_p(1), (6, 1, 1), b"\x06" * 8, 0)
    assert seen[-2][2] == b"\x05" * 8 and seen[-2][0] != seen[-1][0] and seen[-1][2] == b"\x06" * 8
