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
    verdicts = call_key.Verdicts("t")
    for make in (lambda v: ((v,), {}), lambda v: ((), {"x": v})):
        k = call_key.args_key(*make(nan()))
        verdicts.put(k, "kept")
        for _ in range(5):
            assert verdicts.get(call_key.args_key(*make(nan()))) == "kept"
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
