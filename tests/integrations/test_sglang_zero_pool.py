"""``sglang_gemm_zero_pool`` on SGLang 0.5.23's own ``DeepseekV2Model.forward`` and ``aiter_w8a8_block_fp8_linear``.

Both functions are read from the wheel into a test tree (over fakes of what they
import, with SGLang's gfx950 + ROCm 7.2 flags); the model's layers are fakes that
call SGLang's fp8 block linear, which calls the stand-in AITER's tuned dispatcher.
Checked: bitwise equal to SGLang's own forward, the memsets gone and one zero fill
per forward (counted launches), a poisoned pool caught, every fallback counted,
the AITER tuned-CSV facts the README states, a drifted copy skipped, revert.
"""

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aiter_patches
from aiter_patches.integrations import sglang_zero_pool as pool_mod
from aiter_patches.verify import suspended
from patches.test_gemm_out_zeroed import make_inputs

from . import server_tree, sglang_tree
from .sglang_tree import importable, write_tree

NAME = "sglang_gemm_zero_pool"
MOD = "sglang.srt.models.deepseek_v2"
FP8 = "sglang.srt.layers.quantization.fp8_utils"
GEMM = "aiter.ops.gemm_op_a8w8"
FP8_MEMBER = "sglang/srt/layers/quantization/fp8_utils.py"
FP8_FUNCTIONS = ("is_e8m0_scale", "materialize_bpreshuffle_fp8_scale", "view_aiter_fused_rms_transposed_fp8_scale",
                 "use_aiter_triton_gemm_w8a8_tuned_gfx950", "aiter_w8a8_block_fp8_linear")

_FP8_HEAD = '''"""Test tree: SGLang 0.5.23's fp8 block linear (from the wheel), gfx950 with ROCm >= 7.2 and AITER on."""
from typing import List, Optional, Tuple

import torch

from aiter.ops.gemm_op_a8w8 import gemm_a8w8_blockscale_bpreshuffle

_use_aiter = _use_aiter_gfx95 = _use_aiter_bpreshuffle_gfx95 = True
_use_aiter_gfx942 = False
_FORCE_CK_W8A8 = False
MXFP8_DENSE_PTPC_DECODE_MAX_M = 128
_AITER_GFX95_CK_W8A8_MAX_SAFE_M = {}
ck_gemm_a8w8_blockscale = triton_gemm_a8w8_blockscale = None


'''

_MODEL_HEAD = '''

# ---- DeepseekV2Model.forward's imports, as fakes (test tree)
from contextlib import nullcontext
from typing import Optional, Union
import types as _types

import sglang.srt.layers.quantization.fp8_utils  # noqa: F401  (as the real module: at its top)

PPProxyTensors = ForwardBatch = object


class BumpAllocator:
    def __init__(self, buffer_size, dtype, device):
        self.buffer = torch.zeros(buffer_size, dtype=dtype, device=device) if buffer_size else None


class IndexTopKShareState:
    def __init__(self, forward_batch, topk_indices):
        self.topk_indices = topk_indices

    def update(self, topk_indices):
        self.topk_indices = topk_indices


class AuxHiddenStatePacker:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return 0


residual_batch = _types.SimpleNamespace(start=lambda fb: None, complete_output=lambda h, fb: h,
                                        final_norm=lambda h, fb, norm: norm(h))
Phase = _types.SimpleNamespace(PREFILL="prefill")
Backend = _types.SimpleNamespace(TC_PIECEWISE="tc_piecewise")


def check_cuda_graph_backend(phase, backend):
    return True


class DeepseekV2Model(torch.nn.Module):
'''


def write_pool_tree(root: Path, edit=None) -> Path:
    """The fold's tree plus ``DeepseekV2Model.forward`` and SGLang's fp8 block linear, as the wheel has them."""
    edit = edit or (lambda q, s: s)
    write_tree(root, edit)
    ds_text, fp8_text = sglang_tree.read(sglang_tree.DS), sglang_tree.read(FP8_MEMBER)
    ds = root / sglang_tree.DS
    forward = edit("DeepseekV2Model.forward", server_tree.segment(ds_text, "DeepseekV2Model.forward"))
    ds.write_text(ds.read_text() + _MODEL_HEAD + forward)
    body = "\n\n".join(edit(f, server_tree.segment(fp8_text, f)) for f in FP8_FUNCTIONS)
    (root / FP8_MEMBER).write_text(_FP8_HEAD + body)
    return root


@pytest.fixture
def pool_tree(tmp_path):
    with importable(write_pool_tree(tmp_path / "tree")):
        yield


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("AITER_PATCHES_INTEGRATIONS", "sglang")
    pool_mod._split_cache.clear()


class Fills(TorchDispatchMode):
    """Counts zero fills of at least ``numel`` elements (the pool's), by aten op."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("zeros", "zero_", "fill_", "new_zeros") and getattr(out, "numel", lambda: 0)() >= self.numel:
            self.count += 1
        return out


# three layers of SGLang's fp8 linear: two shapes tuned to asm split 2 / 4, one untuned (CK default)
SHAPES = ((256, 1024, 2), (384, 512, 4), (128, 512, None))


class Layer:
    def __init__(self, stub, M, N, K, device, seed, log):
        A, Bs, A_s, B_s, _ = make_inputs(stub, M, N, K, device, seed=seed)
        self.q, self.w, self.x_scale, self.w_scale, self.log = A, Bs, A_s.contiguous(), B_s, log

    def __call__(self, positions, hidden_states, forward_batch, zero_allocator, gemm_output_zero_allocator,
                 llama_4_scaling, **kw):
        linear = getattr(sys.modules[FP8], "aiter_w8a8_block_fp8_linear")
        self.log.append(linear(input=self.q, weight=self.w, block_size=[128, 128], weight_scale=self.w_scale,
                               input_scale=self.x_scale))
        return hidden_states, None


def make_model(stub, device, M, tuned, shapes=SHAPES):
    ds = sys.modules[MOD]
    model = ds.DeepseekV2Model.__new__(ds.DeepseekV2Model)
    torch.nn.Module.__init__(model)
    log = []
    layers = []
    for i, (N, K, split) in enumerate(shapes):
        if split is not None:
            tuned[(M, N, K)] = {"libtype": "asm", "splitK": split, "kernelName": ""}
        layers.append(Layer(stub, M, N, K, device, seed=i + 1, log=log))
    attrs = dict(start_layer=0, end_layer=len(layers), layers=layers, use_dsa=False, first_k_dense_replace=0,
                 pp_group=types.SimpleNamespace(is_first_rank=True, is_last_rank=True),
                 embed_tokens=lambda ids: torch.zeros(ids.shape[0], 8, device=device),
                 gemm_output_zero_allocator_size=0, llama_4_scaling_config=None, layers_to_capture=[],
                 next_full_attention_layer_id={}, norm=lambda h: h, _dsa_forward_uses_topk=lambda: False)
    for k, v in attrs.items():
        object.__setattr__(model, k, v)
    return model, log


def forward(model, M, device):
    batch = types.SimpleNamespace(can_run_tbo=False, forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    ids = torch.zeros(M, dtype=torch.long, device=device)
    return model.forward(ids, torch.arange(M, device=device), batch)


def import_all():
    importlib.import_module(MOD)
    importlib.import_module(GEMM)


def bits(ts):
    return [t.view(torch.int16).clone() for t in ts]


def same(xs, ys):
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def reference(stub, device, M, tuned, launches):
    model, log = make_model(stub, device, M, tuned)
    with suspended():
        forward(model, M, device)
    ref = bits(log)
    shipped = list(launches)
    launches.clear()
    return model, log, ref, shipped


def test_off_by_default(pool_tree, stub):
    import_all()
    report = aiter_patches.apply()
    assert report[NAME]["state"] == "disabled" and "AITER_PATCHES_INTEGRATIONS" in report[NAME]["reason"]


def test_bitwise_memsets_gone_one_fill_per_forward(pool_tree, stub, tuned, launches, device, on):
    import_all()
    M = 5
    model, log, ref, shipped = reference(stub, device, M, tuned, launches)
    assert shipped == [("memset",), ("gemm", 2), ("memset",), ("gemm", 4), ("gemm", 1)]
    report = aiter_patches.apply()
    assert report[NAME]["state"] == "applied", report[NAME]
    log.clear()
    forward(model, M, device)  # the first forward at M tokens sizes the pool: as shipped
    assert launches == shipped and same(bits(log), ref)
    assert aiter_patches.stats()[NAME]["fallback"] == {pool_mod.NOT_SIZED: 2, pool_mod.NOT_SPLIT: 1}
    need = 2 * -(-M * 256 // 128) * 128 // 2 + -(-M * 384 // 128) * 128
    for _ in range(2):
        log.clear()
        launches.clear()
        with Fills(need) as fills:
            forward(model, M, device)
        assert launches == [("gemm", 2), ("gemm", 4), ("gemm", 1)]  # 2 memsets saved
        assert fills.count == 1  # the pool's one zero fill, every forward
        assert same(bits(log), ref)
        a, b = log[0], log[1]
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one pool
        assert b.data_ptr() >= a.data_ptr() + a.numel() * 2  # disjoint slices
    s = aiter_patches.stats()
    assert s[NAME]["fast"] == 4
    assert s["gemm_dispatch_out_zeroed"]["fast"] == 4 and s["gemm_out_zeroed"]["fast"] == 4


def test_a_slice_kept_past_its_forward_is_not_overwritten(pool_tree, stub, tuned, launches, device, on):
    """A GEMM output that outlives the forward (spec-decoding hidden states, PP proxies) stays as it was."""
    import_all()
    M = 4
    model, log, ref, _ = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    forward(model, M, device)
    log.clear()
    forward(model, M, device)
    kept = list(log)
    assert aiter_patches.stats()[NAME]["fast"] == 2
    log.clear()
    forward(model, M, device)  # a new pool, a new zero fill: the kept slices are not in it
    assert kept[0].untyped_storage().data_ptr() != log[0].untyped_storage().data_ptr()
    assert same(bits(kept), ref) and same(bits(log), ref)


def test_a_poisoned_pool_is_caught(pool_tree, stub, tuned, launches, device, on, monkeypatch):
    """The contract is a zero pool: one that is not zero gives other numbers (the splits add onto it)."""
    import_all()
    M = 3
    model, log, ref, _ = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    forward(model, M, device)
    real_zeros = torch.zeros

    def poisoned(*args, **kwargs):
        return real_zeros(*args, **kwargs).fill_(0.5)

    monkeypatch.setattr(torch, "zeros", poisoned)
    log.clear()
    forward(model, M, device)
    monkeypatch.setattr(torch, "zeros", real_zeros)
    assert aiter_patches.stats()[NAME]["fast"] == 2
    got = bits(log)
    assert not torch.equal(got[0], ref[0]) and not torch.equal(got[1], ref[1])  # the two pooled GEMMs are wrong: caught
    assert torch.equal(got[2], ref[2])  # the CK one never saw the pool


def test_prefill_and_large_m_run_as_shipped(pool_tree, stub, tuned, launches, device, on, monkeypatch):
    monkeypatch.setattr(pool_mod, "MAX_M", 4)  # the bound is 256; the interpreter runs M 5 faster than M 257
    import_all()
    M = 5
    model, log, ref, shipped = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    for _ in range(2):
        log.clear()
        launches.clear()
        forward(model, M, device)
        assert launches == shipped and same(bits(log), ref)
    fb = aiter_patches.stats()[NAME]["fallback"]
    assert fb == {"tokens outside the pool's bound 1..4 (prefill or idle)": 2}


def test_the_cap_switch(pool_tree, stub, tuned, launches, device, on, monkeypatch, caplog):
    import_all()
    monkeypatch.setenv(pool_mod.CAP_ENV, "lots")  # issue 32: not a whole number: one warning, then the default
    with caplog.at_level("WARNING", logger="aiter_patches"):
        assert aiter_patches.apply()[NAME]["state"] == "applied"
    assert pool_mod.pool_cap_bytes() == pool_mod.DEFAULT_CAP_MIB << 20
    warned = [r.getMessage() for r in caplog.records if pool_mod.CAP_ENV in r.getMessage()]
    assert warned == [f"{pool_mod.CAP_ENV}='lots' ignored: the rule is a whole number of MiB, 0 or more; "
                      f"using the default ({pool_mod.DEFAULT_CAP_MIB})"]
    aiter_patches.revert()
    monkeypatch.setenv(pool_mod.CAP_ENV, "0")
    assert aiter_patches.apply()[NAME]["state"] == "applied"
    M = 2
    model, log, ref, shipped = reference(stub, device, M, tuned, launches)
    for _ in range(2):
        launches.clear()
        forward(model, M, device)
        assert launches == shipped
    assert aiter_patches.stats()[NAME]["fallback"] == {f"{pool_mod.CAP_ENV}=0: no pool": 2}


def test_more_gemms_than_learned_exhaust_the_pool(pool_tree, stub, tuned, launches, device, on):
    import_all()
    M = 2
    model, log, ref, _ = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    forward(model, M, device)
    model.layers.append(model.layers[0])  # a forward with one split-K GEMM more than the pool was sized for
    model.end_layer += 1
    log.clear()
    forward(model, M, device)
    assert same(bits(log), ref + [ref[0]])
    s = aiter_patches.stats()[NAME]
    assert s["fast"] == 2 and s["fallback"][pool_mod.EXHAUSTED] == 1
    log.clear()
    forward(model, M, device)  # learned: the next pool covers it
    assert aiter_patches.stats()[NAME]["fast"] == 5


def test_a_gemm_on_another_stream_is_not_pooled(pool_tree, stub, tuned, launches, device, on, monkeypatch):
    """The fill is ordered before the GEMMs on the forward's stream only: a GEMM on another one keeps its memset."""
    import_all()
    M = 3
    model, log, ref, shipped = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    streams = iter(range(10**6))
    monkeypatch.setattr(pool_mod, "_stream", lambda device: next(streams))  # every call: another stream
    for _ in range(2):
        log.clear()
        launches.clear()
        forward(model, M, device)
        assert launches == shipped and same(bits(log), ref)
    fb = aiter_patches.stats()[NAME]["fallback"]
    assert fb == {"another stream than the forward's (its zero fill is not ordered before this GEMM)": 6}


def test_without_the_dispatcher_patch_nothing_is_pooled(pool_tree, stub, tuned, launches, device, on, monkeypatch):
    monkeypatch.setenv("AITER_PATCHES_DISABLE", "gemm_dispatch_out_zeroed")
    import_all()
    M = 2
    model, log, ref, shipped = reference(stub, device, M, tuned, launches)
    report = aiter_patches.apply()
    # declared need (issue 31): skipped at apply(), no longer a call-time fallback of an applied pool
    assert report[NAME]["state"] == "skipped"
    assert report[NAME]["reason"] == ("needs gemm_dispatch_out_zeroed, which is disabled: "
                                      "disabled by AITER_PATCHES_DISABLE")
    for _ in range(2):
        launches.clear()
        forward(model, M, device)
    assert launches == shipped
    assert aiter_patches.stats()[NAME] == {"fast": 0, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}


def test_outside_a_forward_and_caller_owned_out_are_untouched(pool_tree, stub, tuned, launches, device, on):
    import_all()
    aiter_patches.apply()
    A, Bs, A_s, B_s, _ = make_inputs(stub, 2, 256, 1024, device, seed=1)
    tuned[(2, 256, 1024)] = {"libtype": "asm", "splitK": 2, "kernelName": ""}
    gemm = getattr(sys.modules[GEMM], "gemm_a8w8_blockscale_bpreshuffle")
    gemm(A, Bs, A_s, B_s, torch.bfloat16)
    out = torch.empty(2, 256, dtype=torch.bfloat16, device=device)
    assert gemm(A, Bs, A_s, B_s, torch.bfloat16, out=out) is out
    assert launches == [("memset",), ("gemm", 2)] * 2
    s = aiter_patches.stats()[NAME]
    assert s["fast"] == 0 and not s["fallback"]


@pytest.mark.parametrize("qualname, old, new, where", [
    ("DeepseekV2Model.forward", "device = positions.device", "device = positions.device  # drifted",
     "DeepseekV2Model.forward: source changed"),
    ("aiter_w8a8_block_fp8_linear", "dtype=output_dtype,\n    )", "dtype=output_dtype,\n        out=None,\n    )",
     "aiter_w8a8_block_fp8_linear: source changed"),
    ("DeepseekV2Model.forward", "input_embeds: torch.Tensor = None,", "input_embeds: torch.Tensor = None, extra=1,",
     "signature drifted"),
])
def test_a_drifted_copy_is_skipped(tmp_path, stub, on, qualname, old, new, where):
    def edit(q, src):
        if q == qualname:
            assert old in src
            return src.replace(old, new)
        return src

    with importable(write_pool_tree(tmp_path / "drifted", edit)):
        import_all()
        report = aiter_patches.apply()
        assert report[NAME]["state"] == "skipped" and where in report[NAME]["reason"], report[NAME]
        assert getattr(sys.modules[MOD].DeepseekV2Model.forward, "__aiter_patches__", None) is None
        assert report["gemm_dispatch_out_zeroed"]["state"] == "applied"  # AITER's own patches are not held back


def test_revert_restores_the_forward_and_the_dispatcher(pool_tree, stub, on):
    import_all()
    cls, gemm = sys.modules[MOD].DeepseekV2Model, sys.modules[GEMM]
    before = (cls.forward, gemm.gemm_a8w8_blockscale_bpreshuffle, sys.modules[FP8].gemm_a8w8_blockscale_bpreshuffle)
    aiter_patches.apply()
    assert cls.forward is not before[0] and sys.modules[FP8].gemm_a8w8_blockscale_bpreshuffle is not before[2]
    rec = next(p for p in aiter_patches.status()["patches"] if p["name"] == NAME)
    assert rec["state"] == "applied" and rec.get("opt_in", "sglang") == "sglang"
    aiter_patches.revert()
    assert (cls.forward, gemm.gemm_a8w8_blockscale_bpreshuffle,
            sys.modules[FP8].gemm_a8w8_blockscale_bpreshuffle) == before



def test_the_verify_check_passes_and_fails_when_it_must(pool_tree, stub, device, on, monkeypatch):
    import_all()
    aiter_patches.apply()
    res = pool_mod.check(device)
    assert res.ok and res.kind == "bitwise" and "pool slice" in res.detail, res
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: real_zeros(*a, **k).fill_(1.0))
    res = pool_mod.check(device)
    assert not res.ok and res.detail == "outputs differ"


# ---- the facts README "SGLang" states: SGLang's Triton list (the wheel) and AITER's tuned CSVs (the fixture tree)

def test_the_triton_list_is_sglangs():
    import ast

    from aiter_patches.integrations.facts import sglang_gemm_reach as reach

    src = server_tree.segment(sglang_tree.read(FP8_MEMBER), "use_aiter_triton_gemm_w8a8_tuned_gfx950")
    lists = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.List)]
    assert len(lists) == 1 and set(ast.literal_eval(lists[0])) == reach.TRITON_NK


def test_which_deepseek_gemms_reach_asm_split_k(tmp_path):
    from aiter_patches.integrations.facts import sglang_gemm_reach as reach
    from helpers.aiter_tree import aiter_part

    root = aiter_part(tmp_path, lambda p: len(p) >= 2 and p[0] == "aiter" and p[1] == "configs",
                      "aiter/configs/a8w8_blockscale_bpreshuffle_tuned_gemm.csv")
    rows = {(r["tp"], r["name"]): r for r in reach.report(root, "gfx950", 256, 256)}
    o_proj = rows[(1, "o_proj")]  # attention TP 1 (DP attention): 61 of them per forward
    assert o_proj["dispatcher"] and set(o_proj["splits"]) == set(range(33, 49)) | set(range(65, 257))
    assert set(rows[(4, "dense gate_up_proj")]["splits"]) == set(range(1, 129))
    # TP 8 without DP attention: every linear that asm would split is on SGLang's Triton list
    assert all(not r["dispatcher"] or not r["splits"] for (tp, _), r in rows.items() if tp == 8)
    assert rows[(8, "kv_b_proj")]["dispatcher"] and not rows[(8, "kv_b_proj")]["splits"]


@pytest.mark.gpu
def test_gpu_cuda_graph_captures_the_fill(pool_tree, stub, tuned, launches, on):
    """As SGLang captures a decode graph (two eager warm-ups, then capture): each replay re-zeroes the pool.

    Between replays the pooled outputs (the graph's own slices) are poisoned with NaN; the
    replay must give the eager, unpatched result bit for bit, which it can only if the
    zero fill runs inside the graph before the split-K GEMMs.
    """
    device = torch.device("cuda")
    import_all()
    M = 8
    model, log, ref, _ = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            log.clear()
            forward(model, M, device)
    torch.cuda.current_stream().wait_stream(stream)
    log.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(model, M, device)
    captured = list(log)
    assert aiter_patches.stats()[NAME]["fast"] == 4  # warm-up 2 + capture 2 (the first warm-up sized the pool)
    for _ in range(3):
        for t in captured[:2]:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same(bits(captured), ref)


class _Owner:
    """A weak-referenceable stand-in for the model whose demand a direct pool scope learns."""


def _direct_gemm(stub, tuned, device, M, N, K, dtype=torch.bfloat16, libtype="asm"):
    A, Bs, A_s, B_s, _ = make_inputs(stub, M, N, K, device, seed=7)
    tuned[(M, N, K)] = {"libtype": libtype, "splitK": 2, "kernelName": ""}
    gemm = getattr(sys.modules[GEMM], "gemm_a8w8_blockscale_bpreshuffle")
    return lambda: gemm(A, Bs, A_s.contiguous(), B_s, dtype)


def test_torch_compile_traces_through_the_hooks(pool_tree, stub, tuned, launches, device, on, monkeypatch):
    """SGLang's tc_piecewise backend compiles the model's forward with fullgraph=True: the hooks must trace."""
    from aiter_patches_standin import blockscale_gemm_splitk as kernel

    def traceable(A, B, out, A_scale, B_scale, *, splits, zero_out=True, **kw):  # the interpreter does not trace
        return out.copy_((A.float()[:, :1] * B.float()[:, 0]).to(out.dtype))

    monkeypatch.setattr(kernel, "blockscale_gemm_splitk", traceable)
    import_all()
    M = 2
    model, log, ref, shipped = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    batch = types.SimpleNamespace(can_run_tbo=False, forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    ids, pos = torch.zeros(M, dtype=torch.long, device=device), torch.arange(M, device=device)
    torch._dynamo.reset()
    try:
        for _ in range(2):
            log.clear()
            torch.compile(lambda: model.forward(ids, pos, batch), backend="eager", fullgraph=True)()
            assert same(bits(log), ref)
    finally:
        torch._dynamo.reset()
    s = aiter_patches.stats()[NAME]
    assert s["fast"] == 0 and not s["fallback"]  # traced: as shipped, nothing counted from inside the trace


def test_inside_a_compiled_region_no_pool_is_opened(pool_tree, stub, tuned, launches, device, on, monkeypatch):
    from aiter_patches.integrations import compile_state

    assert compile_state.in_compiled_region() is False
    seen = []

    def probe(x):
        torch._dynamo.graph_break()
        seen.append(compile_state.in_compiled_region())  # runs eagerly between two graphs
        return x + 1

    torch._dynamo.reset()
    try:
        torch.compile(probe, backend="eager")(torch.ones(1))
    finally:
        torch._dynamo.reset()
    assert seen == [True]
    import_all()
    M = 2
    model, log, ref, shipped = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    monkeypatch.setattr(compile_state, "in_compiled_region", lambda: True)
    for _ in range(2):
        launches.clear()
        forward(model, M, device)
        assert launches == shipped
    assert aiter_patches.stats()[NAME]["fallback"] == {compile_state.IN_COMPILED_REGION: 2}


def test_fp16_another_thread_and_large_m_keep_their_memset(pool_tree, stub, tuned, launches, device, on, monkeypatch):
    import contextvars
    import threading

    import_all()
    aiter_patches.apply()
    monkeypatch.setattr(pool_mod, "MAX_M", 4)
    owner = _Owner()
    fp16 = _direct_gemm(stub, tuned, device, 2, 256, 512, dtype=torch.float16, libtype="ck")  # asm is bf16 only
    large = _direct_gemm(stub, tuned, device, 5, 256, 512)
    small = _direct_gemm(stub, tuned, device, 2, 128, 512)
    for _ in range(2):
        with pool_mod.pool_scope(owner, device, 2, 1 << 20):
            with pytest.raises(RuntimeError, match="must be bfloat16"):  # the stand-in's kernels are bf16 only
                fp16()
            large()
            ctx = contextvars.copy_context()
            t = threading.Thread(target=ctx.run, args=(small,))
            t.start()
            t.join()
    assert launches.count(("memset",)) == 4  # the large and the threaded GEMM, twice
    fb = aiter_patches.stats()[NAME]["fallback"]
    assert fb == {"output dtype torch.float16: AITER's asm kernel writes bf16 only (the memset stays with the kernel "
                  "picked)": 2, "M outside the pool's bound 1..4": 2,
                  "another thread than the forward's (the scope's cursor is not shared across threads)": 2}, fb


def test_a_slice_the_dispatcher_does_not_pass_on_is_not_counted_as_saved(pool_tree, stub, tuned, launches, device, on,
                                                                         monkeypatch):
    """A prediction that disagrees with the dispatcher (here: the CK-tuned shape) costs nothing and is counted."""
    import_all()
    M = 2
    model, log, ref, shipped = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    monkeypatch.setattr(pool_mod, "asm_split_reason", lambda M, N, K: None)
    for _ in range(3):
        log.clear()
        forward(model, M, device)
        assert same(bits(log), ref)
    s = aiter_patches.stats()[NAME]
    assert s["fast"] == 4 and s["fallback"][pool_mod.NOT_TAKEN] == 2, s


def test_a_forward_short_of_an_argument_gets_pythons_type_error(pool_tree, stub, tuned, launches, device, on):
    """Not the hook's KeyError: the call goes to SGLang's forward as given, counted with the binder's reason."""
    import_all()
    model, _ = make_model(stub, device, 5, tuned)
    aiter_patches.apply()
    with pytest.raises(TypeError):
        model.forward(torch.zeros(5, dtype=torch.long, device=device))
    s = aiter_patches.stats()[NAME]
    assert s["fast"] == 0 and list(s["fallback"]) == ["required arguments not given: positions, forward_batch"], s


def test_the_pooled_gemms_are_self_checked(pool_tree, stub, tuned, launches, device, on, monkeypatch):
    """Issue 33: with the self-check on, the integration's split-K GEMMs into the pool are checked against AITER's
    memset + GEMM on their first call (AITER's bits that call), then served from the pool."""
    monkeypatch.setenv("AITER_PATCHES_SELF_CHECK", "1")
    import_all()
    M = 5
    model, log, ref, _ = reference(stub, device, M, tuned, launches)
    aiter_patches.apply()
    for _ in range(3):
        log.clear()
        forward(model, M, device)
        assert same(bits(log), ref)
    s = aiter_patches.stats()["gemm_out_zeroed"]
    assert (s["checks_passed"], s["checks_failed"]) == (2, 0)  # the two asm split-K shapes, once each
    assert s["fast"] == 2  # the third forward: both from the pool, unchecked
    aiter_patches.revert()
