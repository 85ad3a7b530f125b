"""Every cache and counter map of the package stays at its documented cap over a server's life (issue 35):
100,000 calls of distinct shapes (or, for maps keyed by how a call is written, thousands of distinct layouts)
drive each one past its cap through the host code that fills it, and the map is asserted to hold no more.

CPU only and fast: the tensors are on the meta device and nothing launches (where a cache is filled next to a
launch, the launch or the plan-making is replaced by a stub; the cache's own bookkeeping is what runs).
tests/stats/test_bounded_reasons.py does the same for the fallback reasons and the zero pool's reason.

The maps bounded by the code rather than by calls are not driven here: parsed pins, pin defaults, declared
patches and their chains, event subscribers, the pass-through code objects (one per closure size), the
stats lines' per-patch state, the foreign-layer memo (cleared past 64), the kernels' ``lru_cache``\\ s (a
``maxsize`` each, asserted below), the asm launcher's per-thread argument buffers (one per argument size).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import threading
import types

import pytest
import torch

from aiter_patches import call_key, reasons, runtime
from aiter_patches.integrations import sglang_zero_pool as pool_mod
from aiter_patches.kernels import fast_launch as fl
from aiter_patches.kernels import hip_blockscale_asm as hb
from aiter_patches.kernels import moe_sort_mx_quant as kernel
from aiter_patches.patches import moe_sort_mx_quant as msq
from aiter_patches.patches.moe import call as moe_call
from aiter_patches.patches.moe import pipeline, sort_scratch
from aiter_patches.patches.moe_sort_mx_quant import predict

CALLS = 100_000  # calls of distinct shapes
LAYOUTS = 3_000  # distinct argument layouts (each generates code once: a few thousand pass every cap)
META = dict(device="meta")


def _ids(M: int, topk: int = 8) -> torch.Tensor:
    return torch.empty(M, topk, dtype=torch.int32, **META)


# ---------------------------------------------------------------- call keys and verdicts


def test_call_key_code_per_layout_stays_at_max_keyers(monkeypatch):
    monkeypatch.setattr(call_key, "_KEYERS", {})
    monkeypatch.setattr(call_key, "_SPLITTERS", {})
    monkeypatch.setattr(call_key, "_META_KEYERS", {})
    kinds = (1, 1.5, "s", None, True)
    for n, args in enumerate(itertools.islice(itertools.product(kinds, repeat=6), LAYOUTS)):
        call_key.args_key(args, {})
        call_key.split_key((), {f"k{n}": 1})
        call_key.meta_key((), {f"k{n}": 1})
    assert len(call_key._KEYERS) == call_key.MAX_KEYERS
    assert len(call_key._SPLITTERS) == call_key.MAX_KEYERS
    assert len(call_key._META_KEYERS) == call_key.MAX_KEYERS


def test_the_fold_plans_stay_at_their_caps(monkeypatch):
    from aiter_patches import self_check
    from aiter_patches.patches.moe_addend_fold import first_calls

    monkeypatch.setenv(self_check.ENV, "1")
    monkeypatch.setattr(self_check, "_plans_made", {})
    monkeypatch.setattr(first_calls, "_PLANS", {})
    monkeypatch.setattr(first_calls, "_BY_CALL", {})
    for M in range(CALLS):
        x = torch.empty(M, 8, **META)
        first_calls.plan_for("t", pipeline.FusedMoeStep({"hidden_states": x}, {}, (None, (x,), {}), None), x)
    assert len(first_calls._PLANS) == first_calls.MAX_PLANS == 1024
    assert len(first_calls._BY_CALL) == first_calls.MAX_CALL_KEYS == 1024


def test_guarded_verdicts_stay_at_their_limit_and_per_key_cap():
    v = call_key.GuardedVerdicts("t")
    for M in range(CALLS):
        v.put(("shape", M), (), M)
    assert len(v) == v.limit == 1024 and len(v._d) == 1024
    v.clear()
    for M in range(1, 100):  # one key, other tensor metadata under it (a key that leaves shapes to the guard)
        v.put("same key", (torch.empty(M, 2, **META),), M)
    assert len(v._d["same key"]) == v.MAX_PER_KEY
    for patch_verdicts in (msq.VERDICTS, _gemm_verdicts()):
        assert patch_verdicts.limit == 1024


def _gemm_verdicts():
    from aiter_patches.patches import gemm_out_zeroed

    return gemm_out_zeroed.VERDICTS


def test_counters_and_logged_reason_values_stay_at_their_caps(caplog, monkeypatch):
    """(100,000 calls of one counter: tests/stats/test_bounded_reasons.py.)"""
    monkeypatch.setattr(reasons, "_logged", set())
    c = runtime.PatchCounters("p")
    with caplog.at_level("DEBUG", logger="aiter_patches"):
        for M in range(CALLS // 10):
            c.fallback(reasons.with_values(f"category {M % 500}", tokens=M))
    assert len(c.snapshot()["fallback"]) == runtime.MAX_REASONS + 1
    assert len(reasons._logged) == reasons.MAX_LOGGED


# ---------------------------------------------------------------- the MoE sort patch


class _Binder:
    positional = ("topk_ids", "num_experts", "dispatch_policy", "use_opus", "output_aux", "return_local_topk_ids")

    def bind(self, args, kwargs):
        return dict(zip(self.positional, args)), []


@pytest.fixture
def sort_caches(monkeypatch):
    for name in ("_OPUS_WORKSPACE", "_NOTHING_SAVED", "_SHORTCUT_LAYOUTS"):
        monkeypatch.setattr(msq, name, {})
    monkeypatch.setattr(moe_call, "aiter_module",
                        lambda: types.SimpleNamespace(moe_sorting_opus_get_workspace_size=lambda *a: 0))


def test_the_sort_shortcut_caches_stay_at_their_caps(sort_caches):
    """``nothing_to_save`` over 100,000 token counts: its answers and AITER's workspace sizes, per shape."""
    binder = _Binder()
    for M in range(1, CALLS + 1):
        step = pipeline.SortStep(binder, (_ids(M), 256, 0, True, False, False), {})
        assert msq.nothing_to_save(step).startswith("sort only, nothing saved")
    assert len(msq._NOTHING_SAVED) == 1024
    assert len(msq._OPUS_WORKSPACE) == msq.WORKSPACE_CAP == 1024
    assert len(msq._SHORTCUT_LAYOUTS) == 1
    for n in range(LAYOUTS):  # a layout per binder
        msq.nothing_to_save(pipeline.SortStep(_Binder(), (_ids(1), 256, 0, True, False, False), {}))
    assert len(msq._SHORTCUT_LAYOUTS) == 64


def test_the_pipelines_pickers_stay_at_their_cap(monkeypatch):
    monkeypatch.setattr(pipeline, "_PICKERS", {})
    for n in range(LAYOUTS):
        pipeline._straight_picker((n, f"name{n}"))
    assert len(pipeline._PICKERS) == 256


class _Enum(enum.Enum):
    pass


def test_the_stage1_predictions_caches_stay_at_their_caps(monkeypatch):
    monkeypatch.setattr(predict, "CONFIGS", {})
    monkeypatch.setattr(predict, "_MEMBERS", {})
    many = enum.Enum("Many", {f"v{i}": i for i in range(LAYOUTS)})
    for i in range(LAYOUTS):
        predict._member(many, i)
    assert len(predict._MEMBERS) == 256
    fm = types.SimpleNamespace(
        get_2stage_cfgs=lambda *a, **k: object(), get_inter_dim=lambda w1, w2: (w1[0], w2[1], w2[2]),
        get_padded_M=lambda M: M, QuantType=many, ActivationType=many, GateMode=_Gate)
    monkeypatch.setattr(predict, "_PER_1X32", 1)
    w1, w2 = torch.empty(8, 256, 128, **META), torch.empty(8, 128, 128, **META)
    for M in range(1, CALLS // 10 + 1):  # 10,000: each miss asks the stub through AITER's full argument list
        bound = {"w1": w1, "w2": w2, "topk_ids": _ids(M), "activation": 0, "gate_mode": None}
        assert predict._kernel_config(fm, bound, torch.float8_e4m3fn, torch.bfloat16) is not None
    assert len(predict.CONFIGS) == predict.MAXCONFIGS == 1024


class _Gate(enum.Enum):
    separated = "separated"


def test_the_sort_kernels_plans_stay_at_their_cap(monkeypatch):
    """``moe_sort_mx_quant`` over 100,000 token counts, its plan-making and launch stubbed: the plan cache."""
    monkeypatch.setattr(kernel, "_plans", {})
    monkeypatch.setattr(kernel, "_make_plan", lambda key: object())
    monkeypatch.setattr(kernel, "_launch", lambda *a, **k: None)
    w = {}
    for M in range(1, CALLS + 1):
        kept = []
        kernel.moe_sort_mx_quant(_ids(M, 2), w.get(M) or torch.empty(M, 2, **META), 8, 64, torch.bfloat16, 32,
                                 checked=True, kept=kept)
        assert bool(kept) == (M <= kernel.MAX_PLANS)  # a plan past the cap is not handed out to be kept
    assert len(kernel._plans) == kernel.MAX_PLANS == 1024


# ---------------------------------------------------------------- the sort-output pool


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(sort_scratch, "_pool", {})
    monkeypatch.setattr(sort_scratch, "_held", [0])
    monkeypatch.setattr(sort_scratch, "_tick", [0])
    monkeypatch.setattr(sort_scratch, "_switch", [True])
    monkeypatch.setattr(sort_scratch, "_stats", dict.fromkeys(sort_scratch._stats, 0))
    monkeypatch.setattr(sort_scratch, "bindings_ours", lambda: True)
    monkeypatch.setattr(sort_scratch, "_kept_after_the_call", lambda dev: False)
    monkeypatch.setattr(sort_scratch, "device_stream", types.SimpleNamespace(capturing=lambda dev: False,
                                                                             stream_key=lambda dev: (0, 0)))
    monkeypatch.setattr(kernel, "new_outputs", lambda plan, M, dev, q: ("a set of", M))
    return monkeypatch


def _lease_many(n: int, size) -> None:
    ids = _ids(1)
    plans = []  # alive while pooled, as the kernel's plan cache keeps them
    for i in range(n):
        plans.append(types.SimpleNamespace(size=size(i)))
        call = types.SimpleNamespace(scratch=[], own_sort=True)
        assert sort_scratch.lease(call, plans[-1], ids, None) is not None or size(i) > sort_scratch.MAX_BYTES
        sort_scratch.release(call)
        assert len(sort_scratch._pool) <= sort_scratch.MAX_KEYS and sort_scratch._held[0] <= sort_scratch.MAX_BYTES


def test_the_pool_stays_at_its_key_cap_with_small_sets(pool):
    pool.setattr(kernel, "outputs_bytes", lambda plan, M, q: plan.size)
    _lease_many(3_000, lambda i: 256)  # plans of tiny sets: the count binds, not the bytes
    assert len(sort_scratch._pool) == sort_scratch.MAX_KEYS
    assert sort_scratch._held[0] == 256 * sort_scratch.MAX_KEYS


def test_the_pool_stays_at_its_byte_cap_with_large_sets(pool):
    pool.setattr(kernel, "outputs_bytes", lambda plan, M, q: plan.size)
    _lease_many(2_000, lambda i: (1 << 20) + i)
    assert sort_scratch.MAX_BYTES - (2 << 20) < sort_scratch._held[0] <= sort_scratch.MAX_BYTES


# ---------------------------------------------------------------- fast launches


def _jit():
    from triton.runtime.jit import JITFunction

    def k(a, b, c, d, e, f, BLOCK: "tl.constexpr" = 4):  # noqa: F821 - a signature only, never compiled
        pass

    return JITFunction(k)


def test_fast_launch_maps_stay_at_their_caps(monkeypatch):
    monkeypatch.setattr(fl, "_kernels", {})
    monkeypatch.setattr(fl, "available", lambda: (True, ""))
    fns = [object() for _ in range(2 * fl.MAX_KERNELS)]
    for fn in fns:  # kernels made at run time: past the cap, Triton launches them
        fl._kernel_state(fn)
    assert len(fl._kernels) == fl.MAX_KERNELS

    st = fl._Kernel(_jit())
    kinds = (int, float, bool, type(None), torch.Tensor)
    for types_ in itertools.islice(itertools.product(kinds, repeat=6), fl.MAX_VARIANTS + 500):
        st.layout(types_)
    assert len(st.layouts) == fl.MAX_VARIANTS

    compiled_kernel = types.SimpleNamespace(run=None, function=None, packed_metadata=None, launch_metadata=None)

    class Fn:
        def __getitem__(self, grid):
            return lambda *a, **k: compiled_kernel

    compiled: dict = {}
    for M in range(fl.MAX_VARIANTS + 1000):
        fl._ordinary(Fn(), (1,), (M,), {}, compiled, ("key", M))
    assert len(compiled) == fl.MAX_VARIANTS

    monkeypatch.setattr(fl, "launch", lambda fn, grid, *a, **k: compiled_kernel)
    prep = fl.Prepared(object(), (1,), (), (1,), {})
    for M in range(1000):
        prep._through_launch((), ("key", M))
    assert len(prep._kernels) == 64


# ---------------------------------------------------------------- the GEMM's asm launcher


def test_the_asm_launchers_maps_stay_at_their_caps(monkeypatch):
    monkeypatch.setattr(hb, "_co_checks", {})
    monkeypatch.setattr(hb, "_check_code_object", lambda path, knl, gfx, warn: None)
    for i in range(CALLS):
        assert hb._checked_code_object(f"/aiter/hsa/{i}.co", "k", "gfx942") is None
    assert len(hb._co_checks) == hb.MAX_CODE_OBJECTS

    monkeypatch.setattr(hb, "_zero_bias", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for N in range(1, CALLS + 1):
        assert hb._zero_bias_of(torch.device("meta"), N).shape == (1, N)
    assert len(hb._zero_bias) == hb.MAX_ZERO_BIASES

    launcher = object.__new__(hb.AsmLauncher)
    launcher._functions, launcher._lock = {}, threading.Lock()
    launcher._hip = types.SimpleNamespace(hipModuleLoad=lambda m, p: 0, hipModuleGetFunction=lambda f, m, n: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda i: contextlib.nullcontext())
    refused = 0
    for i in range(2 * hb.MAX_CODE_OBJECTS):
        try:
            launcher.function(0, f"/aiter/hsa/{i}.co", "k", "gfx942")
        except RuntimeError as exc:
            refused += 1
            assert "code objects loaded already" in str(exc)
    assert len(launcher._functions) == hb.MAX_CODE_OBJECTS and refused == hb.MAX_CODE_OBJECTS
    launcher.function(0, "/aiter/hsa/0.co", "k", "gfx942")  # a loaded one is still served

    cached = [f for f in vars(hb).values() if isinstance(f, functools._lru_cache_wrapper)]
    assert cached and all(f.cache_parameters()["maxsize"] is not None for f in cached)


# ---------------------------------------------------------------- SGLang's zero pool


def test_the_zero_pools_maps_stay_at_their_caps(monkeypatch):
    monkeypatch.setattr(pool_mod, "_split_cache", {})
    dispatch = types.SimpleNamespace(get_CKGEMM_config=lambda M, N, K, tuned: None)
    monkeypatch.setitem(__import__("sys").modules, pool_mod.dispatch.MODULE, dispatch)
    for M in range(1, CALLS + 1):
        assert pool_mod.asm_split_reason(M % pool_mod.MAX_M + 1, 7168, 2048 + 128 * M) is not None
    assert len(pool_mod._split_cache) == pool_mod.SPLIT_CACHE_CAP

    from aiter_patches.integrations import compile_state

    monkeypatch.setattr(compile_state, "tracing", lambda: False)
    monkeypatch.setattr(compile_state, "in_compiled_region", lambda: False)
    monkeypatch.setattr(pool_mod, "pool_cap_bytes", lambda: 1 << 20)
    monkeypatch.setattr(pool_mod, "_demand", __import__("weakref").WeakKeyDictionary())

    class Model:
        pass

    model = Model()

    def inner(*args, **kwargs):
        scope = pool_mod._scope.get()
        if scope is not None:  # a forward the pool serves: it asks for one more element each time
            scope.demand += 1
        return "AITER's"

    counters = runtime.PatchCounters(pool_mod.NAME)
    binder = types.SimpleNamespace(bind=lambda args, kwargs: ({"positions": args[0], "self": model}, []))
    forward = pool_mod._forward_wrapper(inner, types.SimpleNamespace(binder=binder, counters=counters))
    for n in range(1, CALLS // 10 + 1):  # 10,000 forwards: a pool scope each (a CPU tensor made per scope)
        forward(torch.empty(n % (2 * pool_mod.MAX_M) + 1))
    assert len(pool_mod._demand[model]) == pool_mod.MAX_M  # one entry per token count the pool serves
