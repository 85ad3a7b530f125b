"""Direct launches (kernels/fast_launch.py) hand the launcher exactly what Triton's own launch does.

Triton's real binder, key and kernel cache run on a fake driver (bench/fake_triton.py): every
"compiled" variant is an object that remembers what it was specialized for and records its
launches. Each check launches the same arguments the ordinary way and the direct way and
compares the variant picked, the grid, the stream and every argument handed to the launcher.
Same variant + same arguments = same bits on a GPU (the GPU test in test_fast_launch_gpu.py
runs the real kernels both ways).
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl

from aiter_patches.kernels import fast_launch as fl
from bench import fake_triton as ft


def _probe(x_ptr, y_ptr, n, s, f, b, opt, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


probe = ft.jit(_probe)


@pytest.fixture
def fake():
    fl.set_mode(None)
    with ft.fake_triton(probe) as log:
        yield log
    fl.set_mode(None)


def both_ways(fn, grid, *args, **kwargs):
    """(ordinary launch, direct launch) records for the same call; the direct one after a warm-up."""
    fl.set_mode("off")
    fl.launch(fn, grid, *args, **kwargs)
    ordinary = ft.LOG[-1]
    fl.set_mode("on")
    fl.launch(fn, grid, *args, **kwargs)  # may be the key's first sight: an ordinary launch
    before = fl.stats()["direct"]
    fl.launch(fn, grid, *args, **kwargs)
    assert fl.stats()["direct"] == before + 1, "the second call with this key was not direct"
    return ordinary, ft.LOG[-1]


def buffers():
    x = torch.zeros(256)
    return {"x": x, "y": torch.zeros(256), "x_off": x[1:], "h": torch.zeros(256, dtype=torch.float16)}


# every row flips at least one thing Triton specializes on
CASES = [
    dict(x="x", y="y", n=10, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=True),
    dict(x="x", y="y", n=1, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=True),            # n == 1
    dict(x="x", y="y", n=32, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=True),           # n % 16
    dict(x="x", y="y", n=2**31, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=True),        # i64
    dict(x="x", y="y", n=2**63, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=True),        # u64
    dict(x="x", y="y", n=-16, s=17, f=1.5, b=False, opt=None, BLOCK=32, FLAG=True),
    dict(x="x_off", y="y", n=10, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=True),       # misaligned
    dict(x="h", y="y", n=10, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=True),           # dtype
    dict(x="x", y="y", n=10, s=16, f=1.5, b=True, opt="y", BLOCK=32, FLAG=True),            # None -> tensor
    dict(x="x", y="y", n=10, s=16, f=1.5, b=True, opt=3, BLOCK=32, FLAG=True),              # None -> int
    dict(x="x", y="y", n=10, s=16, f=1.5, b=True, opt=None, BLOCK=64, FLAG=True),           # constexpr
    dict(x="x", y="y", n=10, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=False),
    dict(x="x", y="y", n=10, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=True, num_warps=8),
    dict(x="x", y="y", n=10, s=16, f=1.5, b=True, opt=None, BLOCK=32, FLAG=True, num_stages=2),
]


def call_args(case, bufs):
    c = dict(case)
    args = [bufs[c.pop("x")], bufs[c.pop("y")], c.pop("n"), c.pop("s"), c.pop("f"), c.pop("b")]
    opt = c.pop("opt")
    args.append(bufs[opt] if isinstance(opt, str) else opt)
    return args, c


@pytest.mark.parametrize("grid", [(3,), (2, 5), (2, 3, 4)])
def test_direct_launch_hands_the_launcher_what_triton_does(fake, grid):
    bufs = buffers()
    variants = set()
    for case in CASES:
        args, kwargs = call_args(case, bufs)
        ordinary, direct = both_ways(probe, grid, *args, **kwargs)
        assert direct.same_as(ordinary), (case, ordinary, direct)
        variants.add(id(ordinary.kernel))
    # the cases really reached different Triton variants (else the test proves nothing)
    assert len(variants) >= 12


def test_a_misaligned_view_does_not_reuse_the_aligned_variant(fake):
    bufs = buffers()
    args, kw = call_args(CASES[0], bufs)
    _, aligned = both_ways(probe, (1,), *args, **kw)
    args[0] = bufs["x_off"]
    ordinary, direct = both_ways(probe, (1,), *args, **kw)
    assert direct.kernel is ordinary.kernel is not aligned.kernel
    assert aligned.kernel.attrs[(0,)] and not direct.kernel.attrs[(0,)]  # tt.divisibility only when aligned
    assert direct.args[0] == bufs["x"].data_ptr() + 4


def test_verify_mode_finds_no_mismatch_and_catches_a_wrong_key(fake):
    bufs = buffers()
    fl.set_mode("verify")
    for case in CASES:
        args, kw = call_args(case, bufs)
        fl.launch(probe, (1,), *args, **kw)
        fl.launch(probe, (1,), *args, **kw)
    assert fl.stats()["direct"] == len(CASES)
    # corrupt one kept kernel: verify mode must notice
    compiled = fl._kernels[id(probe)][1].devices[0][0]
    key, kernel = next(iter(compiled.items()))
    other = next(k for k in compiled.values() if k is not kernel)
    compiled[key] = other
    args, kw = call_args(CASES[0], bufs)
    with pytest.raises(fl.DispatchMismatch):
        fl.launch(probe, (1,), *args, **kw)


def test_ordinary_launch_when_the_fast_path_cannot_prove_it_is_the_same(fake, monkeypatch):
    from triton import knobs

    bufs = buffers()
    args, kw = call_args(CASES[0], bufs)
    fl.launch(probe, (1,), *args, **kw)
    fl.launch(probe, (1,), *args, **kw)
    assert fl.stats()["direct"] == 1
    n = len(ft.LOG)

    def still_ordinary(grid=(1,), a=args, k=kw):
        d = fl.stats()["direct"]
        fl.launch(probe, grid, *a, **k)
        assert fl.stats()["direct"] == d and len(ft.LOG) > n

    still_ordinary(grid=lambda meta: (1,))                      # callable grid
    still_ordinary(grid=[1])                                   # not a tuple
    still_ordinary(a=[*args[:6], (1, 2)])                      # a tuple argument
    fl.set_mode("off")
    still_ordinary()
    fl.set_mode("on")
    hook = lambda *a, **k: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        still_ordinary()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    probe.add_pre_run_hook(hook)
    try:
        still_ordinary()
    finally:
        probe.pre_run_hooks.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    still_ordinary()


def test_interpreted_kernels_launch_the_ordinary_way():
    """In the interpreter (this CPU run) the sort kernel is no JITFunction: launch() calls it as is."""
    from triton.runtime.jit import JITFunction

    from aiter_patches.kernels import moe_sort_mx_quant as k

    if isinstance(k._sort_quant_kernel, JITFunction):
        pytest.skip("kernels are compiled here (GPU)")
    fl.clear()
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    res = k.moe_sort_mx_quant(ids, torch.rand(1, 2), 4, 32, torch.bfloat16, 16)
    assert res.num_valid_ids.tolist() == [32, 1]
    assert fl.stats()["direct"] == 0 and fl._kernels[id(k._sort_quant_kernel)][1] is None


def test_a_triton_with_another_launch_convention_turns_the_fast_path_off(fake, monkeypatch):
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):  # a launch convention this module does not know
        kernel = self.device_caches[0][0]
        return kernel

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setitem(fl._status, "available", None)
    ok, why = fl.available()
    assert not ok and "launch convention unknown" in why
    fl.clear()
    assert fl._kernel_state(probe) is None
    monkeypatch.undo()
    fl._status["available"] = None
    assert fl.available()[0]


def test_unknown_option_in_triton_run_turns_it_off(monkeypatch):
    import inspect

    from triton.runtime.jit import JITFunction

    src = inspect.getsource(JITFunction.run)
    monkeypatch.setattr(inspect, "getsource", lambda obj: src.replace(
        'kwargs["debug"]', 'kwargs["new_knob"] = 1\n        kwargs["debug"]'))
    assert "new_knob" in fl._check_triton()


def _tensors_reachable(roots, limit=20000) -> list:
    seen, stack, found = set(), list(roots), []
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, type(gc))):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
            continue
        stack.extend(gc.get_referents(o))
    return found


def test_the_cache_holds_no_tensor_and_syncs_nothing_even_during_a_capture(fake, monkeypatch):
    """Kept state is compiled kernels and Python scalars: nothing a CUDA-graph capture made can outlive it."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_sync(*a, **k):
        raise AssertionError("device sync in a launch")

    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # pointers get unpacked
    bufs = buffers()
    for case in CASES:
        args, kw = call_args(case, bufs)
        for _ in range(2):
            fl.launch(probe, (1,), *args, **kw)
    assert fl.stats()["direct"] == len(CASES)
    state = fl._kernels[id(probe)][1]
    kept = [state.devices, state.layouts]
    assert not _tensors_reachable(kept)
    direct = ft.LOG[-1]
    assert torch.Tensor not in direct.raw_types and int in direct.raw_types  # pointers, not tensors


def test_a_backend_without_native_tensor_specialization_is_asked_per_tensor(monkeypatch):
    """AMD adds 'S' (buffer ops: storage within 2 GB) to a pointer's specialization: a tensor
    that flips it must not reuse the other variant."""
    from triton.backends.amd.compiler import HIPBackend

    from triton import knobs

    big = set()
    monkeypatch.setattr(HIPBackend, "is_within_2gb", staticmethod(lambda t: t.data_ptr() not in big))
    monkeypatch.setattr(knobs.amd, "use_buffer_ops", True)  # Triton 3.5 adds 'S' only then
    fl.set_mode(None)
    with ft.fake_triton(probe, backend="hip"):
        bufs = buffers()
        args, kw = call_args(CASES[0], bufs)
        _, small = both_ways(probe, (1,), *args, **kw)
        other = torch.zeros(256)
        big.add(other.data_ptr())
        args[0] = other
        ordinary, direct = both_ways(probe, (1,), *args, **kw)
        assert direct.kernel is ordinary.kernel is not small.kernel


class _NoSpecializationAPI:
    """A backend offering neither specialization API any known Triton binder asks for."""

    _missing = ("supports_native_tensor_specialization", "get_tensor_specialization", "get_arg_specialization")

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name in self._missing:
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_backend_without_a_known_specialization_api_gets_ordinary_launches(fake, caplog):
    """Never an AttributeError at launch: ordinary launches, each counted, one warning."""
    bufs = buffers()
    args, kw = call_args(CASES[0], bufs)
    probe[(1,)](*args, **kw)  # makes the device cache
    entry = probe.device_caches[0]
    probe.device_caches[0] = (*entry[:3], _NoSpecializationAPI(entry[3]), *entry[4:])
    fl.set_mode("on")
    ft.LOG.clear()
    with caplog.at_level(logging.WARNING, logger=fl.__name__):
        for _ in range(3):
            fl.launch(probe, (1,), *args, **kw)
    st = fl.stats()
    assert (st["direct"], st["ordinary"], st["backend_refused"]) == (0, 3, 3)
    assert len(ft.LOG) == 3  # Triton launched each call
    warned = [r for r in caplog.records if "_NoSpecializationAPI" in r.getMessage()]
    assert len(warned) == 1 and "ordinary Triton launches" in warned[0].getMessage()


TRITON35 = os.environ.get("AITER_PATCHES_TEST_TRITON35", "")


@pytest.mark.skipif(not TRITON35 or os.environ.get("AITER_PATCHES_IN_TRITON35_RUN") == "1",
                    reason="set AITER_PATCHES_TEST_TRITON35 to an unpacked Triton 3.5.x site dir")
def test_direct_launches_match_triton_3_5(tmp_path):
    """Triton 3.5's backends ask get_arg_specialization(arg, ty): this file's checks, on that Triton
    (CUDA and HIP targets), in a subprocess with the 3.5 site first on the path."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TRITON35, str(repo)]),
           "AITER_PATCHES_IN_TRITON35_RUN": "1"}
    probe_cmd = ("import triton; from aiter_patches.kernels import fast_launch as fl; "
                 "print(triton.__version__, fl.available(), fl._status['spec_api'])")
    out = subprocess.run([sys.executable, "-c", probe_cmd], env=env, capture_output=True, text=True,
                         timeout=120, cwd=repo)
    assert out.stdout.startswith("3.5") and "(True, '') arg" in out.stdout, out.stdout + out.stderr
    # the interpreter test is left out: Triton 3.5's interpreter predates this venv's numpy
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "not interpreted"], env=env, capture_output=True, text=True, timeout=300,
                         cwd=repo)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "\n11 passed" in run.stdout, run.stdout[-500:]
