"""The static reader and the `drift` command on small synthetic AITER trees."""

import ast
import json
import sys
import tarfile
import zipfile

import pytest

from aiter_patches import cli, drift
from aiter_patches.registry import Patch, SourcePin, Target, patches
from aiter_patches.signatures import Pin, match

from .trees import tree_from_builtin_pins, write_tree


def one_patch(module, attr, *pin_texts, relies_on=()):
    pins = tuple(Pin(f"p{i}", t) for i, t in enumerate(pin_texts))
    return Patch("p", "test", (Target(module, attr, pins, lambda fn, site: fn),), relies_on=relies_on)


def run_cli(capsys, *argv):
    code = cli.main(["drift", *argv])
    return code, capsys.readouterr()


QUANT = """
    import functools
    BLOCK = 32
    NOT_CONST = BLOCK * 2

    def compile_ops(name):
        return lambda f: f

    @compile_ops("module_quant")
    def helper(x: "Tensor", block=BLOCK, mode=QuantType.No, dt=dtypes.fp4x2, *args, **kwargs) -> None: ...

    def other(x, n=NOT_CONST):
        return x
"""
INIT = """
    import os
    if os.environ.get("X"):
        pass
    else:
        from .ops.quant import *
"""
FUSED = """
    from aiter import helper
    from aiter import other as renamed
"""


@pytest.fixture
def tree(tmp_path):
    write_tree(tmp_path, {"aiter/__init__.py": INIT, "aiter/ops/__init__.py": "", "aiter/ops/quant.py": QUANT,
                          "aiter/fused_moe.py": FUSED})
    return drift.open_source(tmp_path)


def test_match_follows_reexports_to_the_def_and_resolves_constants(tree):
    pin = "(x, block=32, mode=QuantType.No, dt=torch.float4_e2m1fn_x2, *args, **kwargs)"
    r = drift.check(tree, [one_patch("aiter.fused_moe", "helper", "(x)", pin)])
    (t,) = r.targets
    assert (t.status, t.pin, t.found) == ("match", "p1", pin)
    assert t.defined_at == "aiter/ops/quant.py:10"  # the def line, below its decorator
    assert t.via == ["aiter/fused_moe.py:2 from aiter import helper", "aiter/__init__.py from aiter.ops.quant import *"]
    assert r.exit_code == 0


def test_non_literal_constant_stays_source_text_and_aliases_resolve(tree):
    r = drift.check(tree, [one_patch("aiter.fused_moe", "renamed", "(x, n=NOT_CONST)")])
    assert r.targets[0].status == "match"


def test_drift_reports_the_exact_difference(tree):
    r = drift.check(tree, [one_patch("aiter.fused_moe", "helper", "(x, block=32, mode=QuantType.No, *args, **kwargs)")])
    (t,) = r.targets
    assert t.status == "drift"
    assert t.differences == ["vs pin p0: extra parameter 'dt=torch.float4_e2m1fn_x2' at position 3"]
    assert t.reason == t.differences[0]
    assert r.exit_code == 1


def test_default_change_is_drift(tree):
    r = drift.check(tree, [one_patch("aiter.ops.quant", "helper",
                                     "(x, block=64, mode=QuantType.No, dt=torch.float4_e2m1fn_x2, *args, **kwargs)")])
    assert r.targets[0].differences == ["vs pin p0: default of 'block' changed: 64 -> 32"]


def test_missing_function_and_missing_module(tree):
    r = drift.check(tree, [one_patch("aiter.fused_moe", "nope", "(x)"), one_patch("aiter.gone", "f", "(x)")])
    a, b = r.targets
    assert (a.status, a.reason) == ("missing", "nope is not defined in aiter/fused_moe.py")
    assert (b.status, b.reason) == ("missing", "module aiter.gone not found (aiter/gone.py or aiter/gone/__init__.py)")
    assert a.found is None and r.exit_code == 1


def test_non_function_binding_is_drift(tmp_path):
    t = drift.open_source(write_tree(tmp_path, {"aiter/__init__.py": "f = make_op('f')\n"}))
    (r,) = drift.check(t, [one_patch("aiter", "f", "(x)")]).targets
    assert r.status == "drift" and "Assign at aiter/__init__.py:1, not a def" in r.reason


def test_binding_precedence(tmp_path):
    t = drift.open_source(write_tree(tmp_path, {
        "aiter/__init__.py": """
            from .a import *
            from .b import *
            try:
                from .c import g
            except ImportError:
                def g(fallback): ...
        """,
        "aiter/a.py": "def f(from_a): ...\ndef h(from_a): ...\n",
        "aiter/b.py": "__all__ = ['f']\ndef f(from_b): ...\ndef h(from_b): ...\n",
        "aiter/c.py": "def g(from_c): ...\n",
    }))
    found = {a: drift.check(t, [one_patch("aiter", a, "()")]).targets[0].found for a in "fgh"}
    # the last star import wins; __all__ hides b.h; the try body beats the except fallback
    assert found == {"f": "(from_b)", "h": "(from_a)", "g": "(from_c)"}


def test_import_from_outside_aiter_is_missing(tmp_path):
    t = drift.open_source(write_tree(tmp_path, {"aiter/__init__.py": "from torch import f\n"}))
    (r,) = drift.check(t, [one_patch("aiter", "f", "(x)")]).targets
    assert r.status == "missing" and "outside AITER" in r.reason


def test_source_hash_strips_trailing_whitespace_only():
    assert drift.source_hash(["def f():  ", "    return 1\t"]) == drift.source_hash(["def f():", "    return 1"])
    assert drift.source_hash(["def f():", "    return 1"]) != drift.source_hash(["def f():", "    return 2"])
    import hashlib

    assert drift.source_hash(["a ", "b"]) == hashlib.sha256(b"a\nb").hexdigest()


def test_changed_source_hash_is_a_warning_not_drift(tree, tmp_path):
    d = drift.resolve(tree, "aiter.ops.quant", "helper")
    good = drift.source_hash(d.module.segment(d.node))
    assert d.module.segment(d.node)[0] == '@compile_ops("module_quant")'  # decorators are hashed too
    pins = (SourcePin("aiter.ops.quant", "helper", good, "why"), SourcePin("aiter.ops.quant", "other", "0" * 64, "w"),
            SourcePin("aiter.ops.quant", "gone", "0" * 64, "w"))
    r = drift.check(tree, [one_patch("aiter.fused_moe", "helper",
                                     "(x, block=32, mode=QuantType.No, dt=torch.float4_e2m1fn_x2, *args, **kwargs)",
                                     relies_on=pins)])
    assert [x.status for x in r.relied_on] == ["unchanged", "changed", "missing"]
    assert r.exit_code == 0
    assert len(r.warnings) == 2 and r.warnings[0].startswith("aiter.ops.quant.other changed (relied on by p)")


def test_a_hash_listed_in_also_counts_as_unchanged(tree):
    d = drift.resolve(tree, "aiter.ops.quant", "helper")
    good = drift.source_hash(d.module.segment(d.node))
    pins = (SourcePin("aiter.ops.quant", "helper", "0" * 64, "why", also=("1" * 64, good)),
            SourcePin("aiter.ops.quant", "helper", "0" * 64, "why", also=("1" * 64,)))
    r = drift.check(tree, [one_patch("aiter.fused_moe", "helper",
                                     "(x, block=32, mode=QuantType.No, dt=torch.float4_e2m1fn_x2, *args, **kwargs)",
                                     relies_on=pins)])
    assert [x.status for x in r.relied_on] == ["unchanged", "changed"]


def test_class_method_qualname(tmp_path):
    t = drift.open_source(write_tree(tmp_path, {"aiter/__init__.py": "class C:\n    def m(self, x): ...\n"}))
    d = drift.resolve(t, "aiter", "C.m")
    assert d.location == "aiter/__init__.py:2"


# ---------------------------------------------------------------- the command


def test_cli_exit_0_when_everything_matches(tmp_path, capsys):
    code, out = run_cli(capsys, "--aiter-src", str(tree_from_builtin_pins(tmp_path)))
    assert code == 0, out.out
    assert "every target matches a pin" in out.out
    assert "WARNING: aiter.fused_moe.moe_sorting changed" in out.out  # the stand-in bodies hash differently


def test_cli_accepts_the_aiter_package_dir_itself(tmp_path, capsys):
    code, _ = run_cli(capsys, "--aiter-src", str(tree_from_builtin_pins(tmp_path) / "aiter"))
    assert code == 0


def test_cli_exit_1_and_json(tmp_path, capsys):
    write_tree(tmp_path, {"aiter/__init__.py": ""})
    code, out = run_cli(capsys, "--aiter-src", str(tmp_path), "--json")
    assert code == 1
    rep = json.loads(out.out)
    assert rep["exit_code"] == 1
    assert {t["status"] for t in rep["targets"]} == {"missing"}
    assert {t["patch"] for t in rep["targets"]} == {p.name for p in patches() if p.name != "sglang_takeover"}


@pytest.mark.parametrize("case", ["no-dir", "no-aiter", "syntax", "not-archive", "archive-without-aiter"])
def test_cli_exit_2_when_the_source_cannot_be_read(tmp_path, capsys, case):
    if case == "no-dir":
        argv = ["--aiter-src", str(tmp_path / "nothing")]
    elif case == "no-aiter":
        argv = ["--aiter-src", str(tmp_path)]
    elif case == "syntax":
        write_tree(tmp_path, {"aiter/__init__.py": "", "aiter/fused_moe.py": "def fused_moe(:\n"})
        argv = ["--aiter-src", str(tmp_path)]
    elif case == "not-archive":
        (tmp_path / "x.whl").write_text("not a wheel")
        argv = ["--wheel", str(tmp_path / "x.whl")]
    else:
        with zipfile.ZipFile(tmp_path / "x.whl", "w") as zf:
            zf.writestr("other/__init__.py", "")
        argv = ["--wheel", str(tmp_path / "x.whl")]
    code, out = run_cli(capsys, *argv)
    assert code == 2
    assert "cannot read AITER source" in out.err
    code, out = run_cli(capsys, *argv, "--json")
    assert code == 2 and json.loads(out.out)["exit_code"] == 2
    if case == "syntax":
        assert "aiter/fused_moe.py:1" in out.out


def test_wheel_and_sdist_read_like_the_tree(tmp_path, capsys):
    src = tree_from_builtin_pins(tmp_path / "src")
    files = [p for p in src.rglob("*.py")]
    whl = tmp_path / "a.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for p in files:
            zf.write(p, p.relative_to(src).as_posix())
        zf.writestr("aiter/_version.py", "__version__ = '9.9.9'\n")
    sdist = tmp_path / "a.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for p in files:
            tf.add(p, "amd-aiter-9.9.9/" + p.relative_to(src).as_posix())
    reports = [drift.check(drift.open_source(src)), drift.check(drift.open_source(wheel=whl)),
               drift.check(drift.open_source(wheel=sdist))]
    strip = lambda r: [(t.patch, t.target, t.status, t.found, t.defined_at) for t in r.targets]  # noqa: E731
    assert strip(reports[0]) == strip(reports[1]) == strip(reports[2])
    assert reports[1].version == "9.9.9"


def test_default_reads_the_installed_aiter_without_importing_it(tmp_path, monkeypatch, capsys):
    tree_from_builtin_pins(tmp_path)
    (tmp_path / "aiter" / "jit").mkdir()
    (tmp_path / "aiter" / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out = run_cli(capsys)
    assert code == 0, out.err
    assert f"installed aiter {tmp_path / 'aiter'}" in out.out
    assert "aiter" not in sys.modules or getattr(sys.modules["aiter"], "__file__", "") != str(tmp_path / "aiter")


def test_default_refuses_pypis_unrelated_aiter(tmp_path, monkeypatch, capsys):
    write_tree(tmp_path, {"aiter/__init__.py": "async def aiter(x): ...\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out = run_cli(capsys)
    assert code == 2 and "not AMD's AITER" in out.err


def test_propose_round_trips_through_pin(tmp_path, capsys):
    src = write_tree(tmp_path, {"aiter/__init__.py": "", "aiter/fused_moe.py": """
        BLOCK_SIZE_M = 32
        def fused_moe(x, block=BLOCK_SIZE_M, act=ActivationType.Silu, *, output=None): ...
        def moe_sorting(x):
            return x
    """})
    patch = one_patch("aiter.fused_moe", "fused_moe", "(x)",
                      relies_on=(SourcePin("aiter.fused_moe", "moe_sorting", "0" * 64, "routing"),))
    report = drift.check(drift.open_source(src), [patch])
    text = drift.render_propose(report, "v9")
    calls = [ast.parse(line.rstrip(",")).body[0].value for line in text.splitlines() if not line.startswith("#")]
    assert [c.func.id for c in calls] == ["Pin", "SourcePin"]
    pin = Pin(*[ast.literal_eval(a) for a in calls[0].args])
    assert pin == Pin("v9", "(x, block=32, act=ActivationType.Silu, *, output=None)",
                      "ROCm/aiter v9 aiter/fused_moe.py:3")
    found, _ = match(drift.signature_of(drift.resolve(drift.open_source(src), "aiter.fused_moe", "fused_moe")), [pin])
    assert found is pin
    sp = SourcePin(*[ast.literal_eval(a) for a in calls[1].args])
    again = drift.check(drift.open_source(src), [one_patch("aiter.fused_moe", "fused_moe", pin.text, relies_on=(sp,))])
    assert again.exit_code == 0 and [r.status for r in again.relied_on] == ["unchanged"] and sp.why == "routing"


def test_propose_cli_uses_the_version_as_label(tmp_path, capsys):
    src = tree_from_builtin_pins(tmp_path)
    (src / "aiter" / "_version.py").write_text("__version__ = '1.2.3'\n")
    code, out = run_cli(capsys, "--aiter-src", str(src), "--propose")
    assert code == 0
    assert "Pin('1.2.3', " in out.out
