"""call_key: a call's key holds what a gate may read of its arguments, and nothing else."""

import enum

import pytest
import torch

from aiter_patches import call_key


class Mode(enum.Enum):
    A = 1


def flat(args, kwargs=None):
    """The key args_key must give: each argument's value_key fields, then each keyword's name and fields."""
    out = [f for a in args for f in call_key.value_key(a)]
    for k, v in (kwargs or {}).items():
        out += [k, *call_key.value_key(v)]
    return tuple(out)


def test_the_generated_keyer_gives_value_key_per_argument():
    t = torch.zeros(3, 4)
    p = torch.nn.Parameter(torch.zeros(2))
    args = (t, p, None, True, 1, 2.0, "s", torch.bfloat16, torch.device("cpu"))
    assert call_key.args_key(args, {}) == flat(args)
    assert call_key.args_key(args, {}) == call_key.args_key(args, {})  # the kept keyer
    assert call_key.args_key((Mode.A, t), {"k": t}) == flat((Mode.A, t), {"k": t})  # value_key per argument


def test_the_flat_key_keeps_every_argument_apart():
    """One flat tuple per call (issue 15): an argument's fields start with its type, a keyword with its
    name, so neither a value that looks like a tensor's field nor a str that looks like a keyword meets
    another call's key."""
    t = torch.zeros(3, 4)
    assert call_key.args_key((t, "x", 1), {}) != call_key.args_key((t,), {"x": 1})
    assert call_key.args_key((t, 1), {}) != call_key.args_key((t,), {"int": 1})
    assert call_key.args_key((1, 2), {}) != call_key.args_key((1,), {"a": 2})
    assert call_key.args_key((None, t), {}) != call_key.args_key((t, None), {})
    assert call_key.args_key((t, t), {}) != call_key.args_key((t,), {})
    key = call_key.args_key((t, 2, t), {"k": 1.5})
    assert all(not isinstance(x, tuple) or type(x) is not tuple or x == t.stride() for x in key)  # flat


@pytest.mark.parametrize("other", [
    lambda t: t.t(), lambda t: t.to(torch.float16), lambda t: t.reshape(4, 3), lambda t: t.requires_grad_(),
    lambda t: torch.nn.Parameter(t), lambda t: t[:, ::2],
])
def test_what_a_gate_reads_of_a_tensor_changes_the_key(other):
    t = torch.zeros(3, 4)
    assert call_key.args_key((t,), {}) != call_key.args_key((other(torch.zeros(3, 4)),), {})


def test_values_are_keyed_with_their_type_and_keywords_by_name():
    assert call_key.args_key((1,), {}) != call_key.args_key((True,), {})
    assert call_key.args_key((1.0,), {}) != call_key.args_key((1,), {})
    assert call_key.args_key((), {"a": 1}) != call_key.args_key((1,), {})
    assert call_key.args_key((), {"a": 1, "b": 2}) != call_key.args_key((), {"b": 2, "a": 1})


def test_a_key_holds_no_tensor_and_reads_no_data():
    t = torch.zeros(2, 2)
    key = call_key.args_key((t, t), {"x": t})
    flat = [key]
    while flat:
        x = flat.pop()
        assert not isinstance(x, torch.Tensor)
        if isinstance(x, tuple):
            flat += list(x)


@pytest.mark.parametrize("bad", [[1], {"a": 1}, object(), torch.zeros(1).as_subclass(type("Sub", (torch.Tensor,), {}))])
def test_anything_else_is_unkeyable(bad):
    with pytest.raises(call_key.Unkeyable):
        call_key.args_key((bad,), {})
    with pytest.raises(call_key.Unkeyable):
        call_key.args_key((), {"k": bad})


def test_no_key_under_torch_compile_tracing(monkeypatch):
    monkeypatch.setattr(call_key, "_compiling", lambda: True)
    with pytest.raises(call_key.Unkeyable):
        call_key.args_key((1,), {})


def test_a_nan_float_hits_its_kept_verdict_and_signed_zeros_do_not_meet():
    """NaN != NaN: keyed by value, every call with a fresh NaN would miss and keep a dead entry."""
    nan = lambda: float("nan") * 1.0  # noqa: E731 - a new float object per call
    verdicts = call_key.GuardedVerdicts("t")
    for make in (lambda v: ((v,), {}), lambda v: ((), {"x": v})):
        k = call_key.args_key(*make(nan()))
        verdicts.put(k, (), "kept")
        for _ in range(5):
            assert verdicts.get(call_key.args_key(*make(nan())), ()) == "kept"
    assert len(verdicts) == 2
    assert call_key.args_key((0.0,), {}) != call_key.args_key((-0.0,), {})
    assert call_key.value_key(-0.0) != call_key.value_key(0.0)
    assert call_key.args_key((1.5,), {}) == flat((1.5,))


def test_past_the_keyer_limit_no_code_is_generated(monkeypatch):
    monkeypatch.setattr(call_key, "_KEYERS", {(i,): False for i in range(call_key.MAX_KEYERS)})
    monkeypatch.setattr(call_key, "exec", lambda *a: pytest.fail("code generated past the limit"), raising=False)
    t = torch.zeros(2)
    assert call_key._keyer((torch.Tensor, int)) is False
    assert call_key.args_key((t, 3), {}) == flat((t, 3))
    assert len(call_key._KEYERS) == call_key.MAX_KEYERS


# ---------------------------------------------------------------- split keys and tensor guards

def verdict_of(args, kwargs, verdicts):
    key, tensors = call_key.split_key(args, kwargs)
    return verdicts.get(key, tensors)


def remember(args, kwargs, verdicts, verdict):
    key, tensors = call_key.split_key(args, kwargs)
    verdicts.put(key, tensors, verdict)


@pytest.fixture(params=["native", "python"])
def guards(request, monkeypatch):
    """Both guards: torch's TensorGuards (where this torch passes the self test) and the Python one."""
    if request.param == "native":
        if call_key.native_guards() is None:
            pytest.skip("this torch's TensorGuards did not pass the self test")
    else:
        monkeypatch.setattr(call_key, "_NATIVE", [None])
    return request.param


@pytest.mark.parametrize("other", [
    lambda t: t.t().contiguous().t(), lambda t: t.to(torch.float16), lambda t: t.reshape(4, 3),
    lambda t: t.requires_grad_(), lambda t: torch.nn.Parameter(t), lambda t: t[:, ::2],
    lambda t: t.to("meta"), lambda t: t.as_subclass(type("Sub", (torch.Tensor,), {})),
])
@pytest.mark.parametrize("where", ["positional", "keyword"])
def test_a_split_key_and_its_guard_tell_apart_what_a_gate_reads_of_a_tensor(guards, other, where):
    """Exactly what args_key tells apart (type, shape, strides, dtype, device, requires_grad), now
    split between the key (type, shape) and the guard (the rest)."""
    verdicts = call_key.GuardedVerdicts("t")
    call = (lambda t: ((t, 7), {})) if where == "positional" else (lambda t: ((7,), {"x": t}))
    remember(*call(torch.zeros(3, 4)), verdicts, "kept")
    assert verdict_of(*call(torch.ones(3, 4)), verdicts) == "kept"  # other values, same metadata: the verdict
    try:
        changed = call(other(torch.zeros(3, 4)))
        got = verdict_of(*changed, verdicts)
    except call_key.Unkeyable:  # a tensor subclass: no key at all, as args_key
        return
    assert got is None
    remember(*changed, verdicts, "other")
    assert verdict_of(*changed, verdicts) == "other" and verdict_of(*call(torch.ones(3, 4)), verdicts) == "kept"


def test_a_split_key_tells_apart_the_layout_and_the_values(guards):
    t = torch.zeros(3, 4)
    pairs = [
        (((t, "x", 1), {}), ((t,), {"x": 1})),
        (((t, 1), {}), ((t, True), {})),
        (((t, 1.0), {}), ((t, 1), {})),
        (((t, 0.0), {}), ((t, -0.0), {})),
        (((), {"a": 1, "b": 2}), ((), {"b": 2, "a": 1})),
        (((None, t), {}), ((t, None), {})),
        (((t, t), {}), ((t,), {})),
        (((t, Mode.A), {}), ((t, 1), {})),
    ]
    for a, b in pairs:
        verdicts = call_key.GuardedVerdicts("t")
        remember(*a, verdicts, "a")
        assert verdict_of(*b, verdicts) is None, (a, b)
        assert verdict_of(*a, verdicts) == "a"
    verdicts = call_key.GuardedVerdicts("t")
    remember((t, t), {}, verdicts, "twice")  # torch's guard fails one tensor given twice: the Python guard
    assert verdict_of((t, t), {}, verdicts) == "twice"
    assert verdict_of((t, torch.zeros(3, 4)), {}, verdicts) == "twice"
    nan = lambda: float("nan") * 1.0  # noqa: E731 - a new float object per call
    verdicts = call_key.GuardedVerdicts("t")
    remember((t, nan()), {}, verdicts, "nan")
    assert verdict_of((t, nan()), {}, verdicts) == "nan"


def test_guarded_verdicts_hold_no_tensor(guards):
    import gc
    import weakref

    t = torch.zeros(3, 4)
    alive = weakref.ref(t)
    verdicts = call_key.GuardedVerdicts("t")
    remember((t, 2), {"k": t}, verdicts, "kept")
    del t
    gc.collect()
    assert alive() is None, "a kept key or guard holds the call's tensor"
    assert verdict_of((torch.zeros(3, 4), 2), {"k": torch.zeros(3, 4)}, verdicts) == "kept"


def test_guarded_verdicts_bound_their_keys_and_their_guards_per_key():
    verdicts = call_key.GuardedVerdicts("t", limit=3)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    for dt in dtypes:  # one key (same layout and shape), a guard per dtype, up to the limit
        remember((torch.zeros(2, dtype=dt),), {}, verdicts, dt)
    assert len(verdicts) == 3
    assert [verdict_of((torch.zeros(2, dtype=dt),), {}, verdicts) for dt in dtypes] == [*dtypes[:3], None]
    per_key = call_key.GuardedVerdicts("t")
    for i in range(call_key.GuardedVerdicts.MAX_PER_KEY + 3):
        remember((torch.zeros(2, dtype=dtypes[i % 4]).requires_grad_(i >= 4),), {}, per_key, i)
    assert len(per_key) == call_key.GuardedVerdicts.MAX_PER_KEY  # the 9th put on is dropped: the first kept answers
    assert verdict_of((torch.zeros(2, dtype=dtypes[0]).requires_grad_(),), {}, per_key) == 4
    per_key.clear()
    assert len(per_key) == 0 and per_key.hits == per_key.misses == 0


def test_split_key_refuses_what_args_key_refuses(monkeypatch):
    for bad in ([1], {"a": 1}, object(), torch.zeros(1).as_subclass(type("Sub", (torch.Tensor,), {}))):
        with pytest.raises(call_key.Unkeyable):
            call_key.split_key((bad,), {})
        with pytest.raises(call_key.Unkeyable):
            call_key.split_key((), {"k": bad})
    monkeypatch.setattr(call_key, "_compiling", lambda: True)
    with pytest.raises(call_key.Unkeyable):
        call_key.split_key((1,), {})


def test_past_the_layout_limit_the_call_is_keyed_in_full(monkeypatch):
    monkeypatch.setattr(call_key, "_SPLITTERS", {(i,): False for i in range(call_key.MAX_KEYERS)})
    t = torch.zeros(2)
    key, tensors = call_key.split_key((t, 3), {})
    assert key == call_key.args_key((t, 3), {}) and tensors == ()


def test_native_guards_self_test_refuses_a_guard_that_misses_a_field(monkeypatch):
    """A torch whose TensorGuards does not tell some field apart (here: one ignoring strides) gets the Python guard."""
    import torch._C._dynamo.guards as g

    real = g.TensorGuards

    class Blind:
        def __init__(self, *tensors, dynamic_dims_sizes, dynamic_dims_strides):
            self._g = real(*tensors, dynamic_dims_sizes=dynamic_dims_sizes,
                           dynamic_dims_strides=[[None] * len(s) for s in dynamic_dims_strides])
            self.check = self._g.check

    monkeypatch.setattr(g, "TensorGuards", Blind)
    monkeypatch.setattr(call_key, "_NATIVE", [])
    assert call_key.native_guards() is None
    check = call_key.tensor_guard((torch.zeros(3, 4),))
    assert check(torch.ones(3, 4)) and not check(torch.zeros(4, 3).t())


@pytest.mark.gpu
def test_on_a_gpu_the_guard_tells_devices_apart_and_a_capture_keeps_nothing(guards):
    import gc
    import weakref

    t = torch.zeros(3, 4, device="cuda")
    check = call_key.tensor_guard((t,))
    assert check(torch.ones(3, 4, device="cuda")) and not check(torch.zeros(3, 4))
    verdicts = call_key.GuardedVerdicts("t")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        made = torch.empty(3, 4, device="cuda")  # a tensor of the capture's pool
        remember((made, 1), {}, verdicts, "kept")
        alive = weakref.ref(made)
        del made
    torch.cuda.synchronize()
    gc.collect()
    assert alive() is None, "a guard made during the capture holds its tensor"
    assert verdict_of((torch.zeros(3, 4, device="cuda"), 1), {}, verdicts) == "kept"
    del graph


def test_keyword_names_are_never_code(monkeypatch):
    """A keyword name reaches the generated code as a constant, never as text; a str subclass as a name
    (its own repr, hash or eq) is keyed, by split or by args_key, without raising."""
    class Name(str):
        def __repr__(self):
            return "'not_' + " + str.__repr__(self)

    class Odd(str):
        def __hash__(self):
            return 1

        __eq__ = str.__eq__

    sources = []
    real_exec = exec
    monkeypatch.setattr(call_key, "exec", lambda src, ns: sources.append(src) or real_exec(src, ns), raising=False)
    t = torch.zeros(2)
    for first in ("plain", "subclass"):
        monkeypatch.setattr(call_key, "_SPLITTERS", {})
        calls = [{"x": t}, {Name("x"): t}, {Odd("x"): t}]
        for kwargs in (calls if first == "plain" else calls[::-1]):
            key, tensors = call_key.split_key((), kwargs)
            assert (key, tensors) == (call_key.args_key((), kwargs), ()) or tensors == (t,)
    assert sources and not any("x" in src or "not_" in src for src in sources), sources


def test_the_self_test_makes_only_cpu_and_meta_tensors(monkeypatch):
    """Run lazily it may meet a CUDA-graph capture or a server's default device: its tensors are explicit
    CPU and meta ones (on a default device of meta, implicit ones would compare equal to its meta case)."""
    monkeypatch.setattr(call_key, "_NATIVE", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA branch would fail on this machine
    torch.set_default_device("meta")
    try:
        got = call_key.native_guards()
    finally:
        torch.set_default_device(None)
    if got is None:
        monkeypatch.setattr(call_key, "_NATIVE", [])
        assert call_key.native_guards() is None, "the self test passes on its own but not under a meta default"


def test_applying_the_patches_decides_the_guard(stub, monkeypatch):
    import aiter_patches

    monkeypatch.setattr(call_key, "_NATIVE", [])
    aiter_patches.apply(["moe_sort_mx_quant", "gemm_out_zeroed"])
    assert call_key._NATIVE, "the self test was left to the first put (maybe inside a capture)"


@pytest.mark.gpu
def test_on_a_gpu_a_self_test_met_inside_a_capture_records_nothing(monkeypatch):
    """Where no apply ran first, the self test may run at a first put inside a server's CUDA-graph capture:
    it must add no kernel to the graph (torch warns that a graph captured with no work is empty)."""
    import warnings

    monkeypatch.setattr(call_key, "_NATIVE", [])
    t = torch.zeros(3, 4, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            check = call_key.tensor_guard((t,))
    assert call_key._NATIVE and check(torch.ones(3, 4, device="cuda"))
    assert any("empty" in str(w.message) for w in seen), [str(w.message) for w in seen]


def test_pybind11_enum_members_are_keyed_by_type_and_value(guards):
    """Real AITER's ActivationType and QuantType are pybind11 enums (built in C++), and servers pass them to
    fused_moe: a call with one is keyed (not run in full every call), one member apart from another."""
    from torch.profiler import ProfilerActivity  # a pybind11 enum at hand in every torch

    cpu, other = ProfilerActivity.CPU, next(m for m in ProfilerActivity.__members__.values() if m != ProfilerActivity.CPU)
    assert call_key.value_key(cpu) == (type(cpu), cpu)
    assert call_key.is_pybind_enum(type(cpu)) and not call_key.is_pybind_enum(Mode) and not call_key.is_pybind_enum(int)
    t = torch.zeros(3, 4)
    assert call_key.args_key((t, cpu), {"a": cpu}) == call_key.args_key((t, cpu), {"a": cpu})
    assert call_key.args_key((t, cpu), {}) != call_key.args_key((t, other), {})
    assert call_key.args_key((t, cpu), {}) != call_key.args_key((t, int(cpu.value)), {})
    verdicts = call_key.GuardedVerdicts("t")
    remember((t,), {"activation": cpu}, verdicts, "cpu")
    assert verdict_of((torch.ones(3, 4),), {"activation": cpu}, verdicts) == "cpu"
    assert verdict_of((t,), {"activation": other}, verdicts) is None


def test_a_meta_key_holds_a_tensors_type_shape_dtype_and_device_and_every_value():
    """meta_key (the fold's plan lookup): other strides or requires_grad meet one key; anything else read of a
    tensor, and the values and layout as args_key keys them, do not. It holds no tensor."""
    from torch.profiler import ProfilerActivity

    t = torch.zeros(3, 4)
    key = call_key.meta_key((t, 1), {"a": Mode.A, "b": ProfilerActivity.CPU})
    assert key == call_key.meta_key((torch.ones(4, 3).t(), 1), {"a": Mode.A, "b": ProfilerActivity.CPU})
    assert key == call_key.meta_key((torch.ones(3, 4, requires_grad=True), 1), {"a": Mode.A, "b": ProfilerActivity.CPU})
    others = [((torch.zeros(4, 3), 1), {"a": Mode.A, "b": ProfilerActivity.CPU}),
              ((t.to(torch.float16), 1), {"a": Mode.A, "b": ProfilerActivity.CPU}),
              ((torch.nn.Parameter(torch.zeros(3, 4)), 1), {"a": Mode.A, "b": ProfilerActivity.CPU}),
              ((t, True), {"a": Mode.A, "b": ProfilerActivity.CPU}),
              ((t, 1.0), {"a": Mode.A, "b": ProfilerActivity.CPU}),
              ((t, 1), {"b": ProfilerActivity.CPU, "a": Mode.A}),
              ((t,), {"a": Mode.A, "b": ProfilerActivity.CPU}),
              ((t, 1), {"a": Mode.A, "b": ProfilerActivity.CUDA}),
              ((t, 1), {"a": Mode.A, "b": ProfilerActivity.CPU, "c": None})]
    for a, k in others:
        assert call_key.meta_key(a, k) != key, (a, k)
    assert torch.device("meta") != torch.device("cpu")
    assert call_key.meta_key((torch.zeros(3, 4, device="meta"), 1), {"a": Mode.A, "b": ProfilerActivity.CPU}) != key
    assert not any(isinstance(x, torch.Tensor) for x in key)
    for bad in ([1], object()):
        with pytest.raises(call_key.Unkeyable):
            call_key.meta_key((bad,), {})


def test_the_fold_plan_of_a_call_with_an_unhashable_enum_is_found_by_its_plan_key(monkeypatch):
    """An Enum with __eq__ and no __hash__ keys by type and value but does not hash: the fold's plan lookup
    falls back to the plan key (which the call then shares) instead of raising out of fused_moe."""
    import enum

    from aiter_patches import self_check
    from aiter_patches.patches.moe import pipeline
    from aiter_patches.patches.moe_addend_fold import first_calls

    class Act(enum.Enum):
        A = 1

        def __eq__(self, other):
            return self is other

    monkeypatch.setenv(self_check.ENV, "1")
    monkeypatch.setattr(self_check, "_plans_made", {})
    monkeypatch.setattr(first_calls, "_PLANS", {})
    monkeypatch.setattr(first_calls, "_BY_CALL", {})
    x = torch.empty(3, 8)

    def step():
        return pipeline.FusedMoeStep({"hidden_states": x, "activation": Act.A}, {}, (None, (x,), {"activation": Act.A}),
                                     None)

    first = first_calls.plan_for("t", step(), x)
    assert first is not None and first_calls.plan_for("t", step(), x) is first
    assert len(first_calls._PLANS) == 1 and not first_calls._BY_CALL
