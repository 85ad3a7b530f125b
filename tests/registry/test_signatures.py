"""Signature normal form: pins, live functions, custom-op schemas and source read statically agree."""

import ast
import enum

import pytest
import torch

from aiter_patches import signatures as S


class Act(enum.IntEnum):
    Silu = 0
    Gelu = 1


def live(a, b=None, c=Act.Silu, *, d="separated", e=torch.bfloat16, **kw):
    pass


LIVE_PIN = "(a, b=None, c=Act.Silu, *, d='separated', e=torch.bfloat16, **kw)"


def test_live_function_equals_its_pin_and_annotations_are_ignored():
    def annotated(a: int, b: "torch.Tensor | None" = None, c: Act = Act.Silu, *, d: str = "separated",
                  e: torch.dtype = torch.bfloat16, **kw: object) -> None:
        pass

    pin = S.Signature.parse(LIVE_PIN)
    assert S.from_callable(live) == pin
    assert S.from_callable(annotated) == pin
    assert str(pin) == LIVE_PIN


def test_source_defaults_normalize_like_runtime_values():
    src = "def f(a, b=BLOCK, gate=GateMode.SEPARATED.value, q=dtypes.fp4x2, act=ActivationType.Silu): pass"
    sig = S.from_ast(ast.parse(src).body[0], constants={"BLOCK": 32})
    assert str(sig) == "(a, b=32, gate='separated', q=torch.float4_e2m1fn_x2, act=ActivationType.Silu)"


def test_opaque_wrapper_reads_registered_schema():
    lib = torch.library.Library("aiter_patches_sigtest", "FRAGMENT")
    lib.define("gemm_op(Tensor A, Tensor B, Tensor(a!) out, Tensor? bias=None, int splitK=-1, str? kernelName=None) -> ()")

    def gemm_op(*args, **kwargs):
        pass

    sig = S.from_callable(gemm_op, schema_namespaces=("aiter_patches_sigtest",))
    assert str(sig) == "(A, B, out, bias=None, splitK=-1, kernelName=None)"


def test_opaque_wrapper_without_schema_is_declined():
    def mystery_op(*args, **kwargs):
        pass

    with pytest.raises(S.SignatureUnavailable, match="custom-op wrapper"):
        S.from_callable(mystery_op)


def test_match_reports_closest_pin():
    found = S.Signature.parse("(a, b, output=None)")
    pin, diffs = S.match(found, [S.Pin("old", "(a)"), S.Pin("new", "(a, b)")])
    assert pin is None
    assert diffs == ["vs pin new: extra parameter 'output=None' at position 2"]
    pin, diffs = S.match(found, [S.Pin("new", "(a, b, output=None)")])
    assert pin.label == "new" and diffs == []


def test_binder_flags_what_the_pin_does_not_know():
    b = S.Binder(S.Signature.parse("(a, b, c=1, *, d=2)"))
    assert b.bind((1, 2), {"d": 3}) == ({"a": 1, "b": 2, "d": 3}, [])
    _, problems = b.bind((1,), {"output": 5})
    assert problems == ["unknown keyword 'output'"]
    _, problems = b.bind((1, 2, 3, 4), {})
    assert problems and "positional" in problems[0]
    _, problems = b.bind((1,), {"a": 2})
    assert problems == ["'a' given twice"]
    _, problems = b.bind((1,), {"a": 2, "zz": 0})  # both kinds, each named
    assert problems == ["unknown keyword 'zz'", "'a' given twice"]
    assert b.bind((), {"a": 1, "b": 2, "c": 3}) == ({"a": 1, "b": 2, "c": 3}, [])


def test_binder_names_required_arguments_not_given():
    """The function itself raises TypeError for these: a gate hands the call back instead of reading a
    KeyError out of the bound arguments."""
    b = S.Binder(S.Signature.parse("(a, b, c=1, *, d=2)"))
    assert b.bind((), {"a": 1, "c": 3}) == ({"a": 1, "c": 3}, ["required argument not given: b"])
    assert b.bind((), {})[1] == ["required arguments not given: a, b"]
    assert b.bind((1,), {"c": 3})[1] == ["required argument not given: b"]
    assert b.bind((), {"b": 1, "a": 2})[1] == []
    k = S.Binder(S.Signature.parse("(a, *, e, f=0)"))  # a keyword-only parameter without a default
    assert k.bind((1,), {})[1] == ["required argument not given: e"]
    assert k.bind((1,), {"e": 2}) == ({"a": 1, "e": 2}, [])
    assert S.Binder(S.Signature.parse("(a=1, *args, **kw)")).bind((), {}) == ({}, [])


def test_bad_pin_text_is_an_error():
    with pytest.raises(ValueError, match="not a parameter list"):
        S.Signature.parse("(a, b=")


def test_torch_op_schema_is_read_by_name_or_through_wrapped_and_declines_what_it_cannot_read():
    lib = torch.library.Library("aiter_patches_schematest", "FRAGMENT")
    lib.define("plain_op(Tensor x, int n=2) -> Tensor")
    lib.define("only_out.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)")  # no default overload

    def plain_op(*args, **kwargs):
        pass

    def outer(*args, **kwargs):
        pass

    outer.__wrapped__ = plain_op
    ns = ("aiter_patches_nosuch_ns", "aiter_patches_schematest")
    assert str(S.from_schema(S.torch_op_schema(plain_op, ns))) == "(x, n=2)"
    assert str(S.from_schema(S.torch_op_schema(outer, ns))) == "(x, n=2)"

    def only_out(*args, **kwargs):
        pass

    def unknown_op(*args, **kwargs):
        pass

    assert S.torch_op_schema(only_out, ns) is None
    assert S.torch_op_schema(unknown_op, ns) is None
    assert S.torch_op_schema(object(), ns) is None  # no __name__ at all


def test_no_other_module_reads_torchs_private_op_schema():
    import pathlib

    import aiter_patches

    root = pathlib.Path(aiter_patches.__file__).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "._schema" in p.read_text(encoding="utf-8"))
    assert readers == ["signatures.py"]
