"""`aiter-patches compile` on bad arguments (issue 35 item 8): one line on stderr naming the argument
and its rule, exit 2, no traceback, nothing captured; nothing to compile is an error too.

Exit status (amd/command.py): 0 clean, 1 a kernel failed, 2 the command could not do what was
asked (an argument against its rule, an unwritable --json, nothing to compile unless
--count-only). Most cases run in-process: the arguments are checked before Triton is imported.
"""

import os
import subprocess
import sys
import types

import pytest

from aiter_patches import cli
from aiter_patches.amd import command, presets


@pytest.fixture
def no_capture(monkeypatch):
    """A bad argument must be refused before anything is captured."""
    monkeypatch.setattr(command, "capture_all", lambda *a, **kw: pytest.fail("captured despite a bad argument"))


def compile_(capsys, *argv):
    rc = cli.main(["compile", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return f


# (arguments, what the one line says); paths are made under tmp_path
BAD_ARGUMENTS = {
    "topk=0": (["--shapes", "experts=8,topk=0,hidden=64"], "--shapes: topk=0: each topk must be an integer >= 1"),
    "experts=0": (["--shapes", "experts=0,topk=1,hidden=64"],
                  "--shapes: experts=0: each experts must be an integer >= 1"),
    "topk over experts": (["--shapes", "experts=8/16,topk=9/2,hidden=64"],
                          "--shapes: topk 9 > 8 experts (each topk at most its experts)"),
    "hidden=0": (["--shapes", "experts=8,topk=2,hidden=0"], "--shapes: hidden=0: hidden must be an integer >= 1"),
    "two hiddens": (["--shapes", "experts=8,topk=2,hidden=64/128"], "--shapes: hidden=64/128 takes one value"),
    "tokens=0": (["--shapes", "experts=8,topk=2,hidden=64,tokens=0"],
                 "--shapes: tokens=0: tokens must be an integer in 1..16777215"),
    "blocks=48": (["--shapes", "experts=8,topk=2,hidden=64,blocks=32/48"],
                  "--shapes: blocks=48: each block must be one of 16/32/64/128"),
    "shared=-1": (["--shapes", "experts=8,topk=2,hidden=64,shared=-1"],
                  "--shapes: shared=-1: shared must be an integer >= 0"),
    "shared=x": (["--shapes", "experts=8,topk=2,hidden=64,shared=x"],
                 "--shapes: shared='x' is not an integer (shared must be an integer >= 0)"),
    # gemm= went with the stand-in GEMM's compile preset (issue 31): an unknown key now
    "gemm": (["--shapes", "experts=8,topk=2,hidden=64,gemm=256:512"], "--shapes: unknown key(s) gemm; known: "),
    "a key twice": (["--shapes", "experts=8,topk=2,hidden=64,topk=4"], "--shapes: topk given twice"),
    "an empty value": (["--shapes", "experts=8,topk=2,hidden= "], "--shapes: 'hidden=' is not key=value"),
    "--tokens -5": (["--tokens", "-5"], "--tokens -5: the largest token count must be an integer in 1..16777215"),
    "--tokens 0": (["--tokens", "0"], "--tokens 0: the largest token count must be an integer in 1..16777215"),
    "--tokens 2**24": (["--tokens", str(2**24)], f"--tokens {2**24}: the largest token count must be an integer in"),
    "--arch ''": (["--arch", ""], "--arch '': name one or more of gfx942, gfx950, comma-separated"),
    "--arch ,": (["--arch", " , "], "--arch ' , ': name one or more of gfx942, gfx950"),
    "--arch gfx90a": (["--arch", "gfx942,gfx90a"], "--arch gfx90a: supported gfx942, gfx950"),
    "--jobs 0": (["--jobs", "0"], "--jobs 0: must be an integer >= 1"),
    "--max-variants 0": (["--max-variants", "0"], "--max-variants 0: must be an integer >= 1"),
    "--model unknown": (["--model", "Llama"], "unknown model 'Llama'"),
    "--cache-dir a file": (lambda t: ["--cache-dir", str(a_file(t))], "is a file, not a directory"),
    "--cache-dir under a file": (lambda t: ["--cache-dir", str(a_file(t) / "sub" / "cache")],
                                 "lies under {t}/a_file, which is a file"),
    "--json into a missing directory": (lambda t: ["--json", str(t / "missing" / "out.json")],
                                        "its directory {t}/missing does not exist"),
    "--json under a file": (lambda t: ["--json", str(a_file(t) / "out.json")],
                            "lies under {t}/a_file, which is a file"),
    "--json a directory": (lambda t: ["--json", str(t)], "{t}: is a directory"),
}


@pytest.mark.parametrize("what", sorted(BAD_ARGUMENTS))
def test_a_bad_argument_is_one_line_and_exit_2(what, tmp_path, capsys, no_capture):
    argv, says = BAD_ARGUMENTS[what]
    argv = argv(tmp_path) if callable(argv) else argv
    rc, out, err = compile_(capsys, *argv, "--count-only")
    assert rc == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and says.format(t=tmp_path) in err, err
    assert out == ""


def test_a_bad_shape_names_its_field_in_the_parser():
    """The rules live in the parser (``presets.parse_shapes``), which the command and tests share."""
    for spec, says in [("experts=8,topk=0,hidden=64", "topk=0"), ("experts=8,topk=2,hidden=64,blocks=0", "blocks=0"),
                       ("experts=8,topk=2,hidden=64,tokens=-5", "tokens=-5")]:
        with pytest.raises(ValueError, match=says):
            presets.parse_shapes(spec)
    ok = presets.parse_shapes("experts=257,topk=9,hidden=7168,tokens=16777215,blocks=16/128,shared=0")
    assert ok.routing == ((257, 9),) and ok.max_tokens == 2**24 - 1


def test_through_the_command_line_no_traceback(tmp_path):
    """The installed entry point's path: stderr is the one line, exit 2."""
    for argv in (["--shapes", "experts=8,topk=0,hidden=64"], ["--json", str(tmp_path / "missing" / "x.json")]):
        r = subprocess.run([sys.executable, "-m", "aiter_patches", "compile", *argv], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, (argv, r.stderr)
        assert r.stderr.startswith(f"error: {argv[0]}"), r.stderr


# ---------------------------------------------------------------- nothing to compile


def fake_capture(variants=(), idle_shapes=(), before=None):
    """A capture_all that returns `variants` and reports `idle_shapes` (runs `before` first)."""
    def capture_all(shapes, archs, tokens=None, idle=None):
        if before is not None:
            before()
        if idle is not None:
            idle.extend(idle_shapes)
        return list(variants), []
    return capture_all


def variant(arch="gfx942"):
    return types.SimpleNamespace(arch=arch, configs={"custom E8/k2 quant=none ep=off buf=zero"}, qualname="k",
                                 module="m", params={}, tokens={1}, ident=("m", "k", arch, "key"),
                                 specialization_data="{}")


def test_a_shape_the_kernel_refuses_is_an_error_unless_count_only(monkeypatch, capsys):
    spec = "experts=100,topk=65,hidden=64"
    monkeypatch.setattr(command, "capture_all", fake_capture(idle_shapes=[(0, "gfx942", "topk outside 1..64")]))
    monkeypatch.setitem(sys.modules, "aiter_patches.amd.compile",
                        types.SimpleNamespace(compile_all=lambda *a, **kw: pytest.fail("compiled")))
    rc, out, err = compile_(capsys, "--arch", "gfx942", "--shapes", spec)
    assert rc == 2 and err == (f"error: --shapes {spec}: nothing to compile for gfx942: the kernel takes none of "
                               f"its calls (topk outside 1..64)\n"), err
    rc, out, err = compile_(capsys, "--arch", "gfx942", "--shapes", spec, "--count-only")
    assert rc == 0 and err.startswith(f"note: --shapes {spec}: nothing to compile") and "captured 0 variants" in out


def test_no_variant_at_all_is_an_error_unless_count_only(monkeypatch, capsys):
    monkeypatch.setattr(command, "capture_all", fake_capture())
    rc, out, err = compile_(capsys, "--arch", "gfx942", "--model", "Kimi-K3")
    assert rc == 2 and err == "error: nothing to compile: the calls launch no kernel variant\n", err
    rc, out, err = compile_(capsys, "--arch", "gfx942", "--model", "Kimi-K3", "--count-only")
    assert rc == 0 and err == ""


def test_the_sweep_refuses_on_meta_tensors_and_allocates_nothing():
    """A call the kernel refuses (here: 16M tokens x hidden 32768, a 1 TiB CPU tensor) costs no allocation;
    the reason is handed to the caller. A shape with an accepted call still yields it."""
    from aiter_patches.amd import sweep

    shape = presets.parse_shapes("experts=8,topk=2,hidden=32768,quant=fp8,ep=off,buf=zero,blocks=32")
    refused = []
    assert list(sweep.sort_quant_calls(shape, "gfx942", tokens=[2**24 - 1], refused=refused)) == []
    assert refused and "int32" in refused[0], refused
    [call] = sweep.sort_quant_calls(shape, "gfx942", tokens=[4])
    assert call.tokens == 4


def test_json_that_cannot_be_written_at_the_end_is_exit_2(monkeypatch, tmp_path, capsys):
    """The folder checked at the start and removed during the run: one line, exit 2, no traceback."""
    folder = tmp_path / "out"
    folder.mkdir()
    monkeypatch.setattr(command, "capture_all", fake_capture(variants=[variant()], before=folder.rmdir))
    rc, out, err = compile_(capsys, "--arch", "gfx942", "--model", "Kimi-K3", "--count-only",
                            "--json", str(folder / "x.json"))
    assert rc == 2 and err == f"error: --json {folder / 'x.json'}: cannot be written (No such file or directory)\n"


def test_a_cache_dir_taken_by_a_file_during_the_run_is_exit_2(monkeypatch, tmp_path, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setattr(command, "capture_all", fake_capture(variants=[variant()], before=lambda: cache.write_text("")))
    monkeypatch.setitem(sys.modules, "aiter_patches.amd.compile",
                        types.SimpleNamespace(compile_all=lambda *a, **kw: pytest.fail("compiled")))
    rc, out, err = compile_(capsys, "--arch", "gfx942", "--model", "Kimi-K3", "--cache-dir", str(cache))
    assert rc == 2 and err == f"error: --cache-dir {cache}: cannot be created (File exists)\n", err


def test_nothing_to_compile_end_to_end(run_python):
    """The real capture (a subprocess: Triton's interpreter off): the kernel takes no call of the shape."""
    r = run_python(["-m", "aiter_patches", "compile", "--arch", "gfx942", "--shapes",
                    "experts=3000,topk=8,hidden=7168,quant=none,ep=off,buf=zero"], timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: --shapes experts=3000,topk=8,hidden=7168,quant=none,ep=off,buf=zero: nothing to compile for "
        "gfx942: the kernel takes none of its calls (num_experts outside 1..2048)"), r.stderr


@pytest.mark.parametrize("path, ok", [("new/deeper/cache", True), ("a_file", False), ("a_file/x", False)])
def test_cache_dir_rule(tmp_path, path, ok):
    a_file(tmp_path)
    assert (command._path_problem(os.path.join(tmp_path, path), want_dir=True) is None) == ok


# ---------------------------------------------------------------- a seeded fuzz of the arguments

# gemm (the stand-in GEMM's field, gone) and colour: unknown keys
KEYS = ["experts", "topk", "hidden", "tokens", "blocks", "quant", "ep", "buf", "shared", "gemm", "name", "colour", ""]
VALUES = ["0", "1", "-1", "8", "9", "64", "65", "128", "256", "2048", "3000", "7168", "16777215", "16777216",
          "99999999999999", "1e3", "x", "", " ", "8/16", "8/", "/", "32/64", "48", "fp4", "fp8/none", "int4",
          "on+nlt", "keep/addend", "256:512", "256:100", "0:0", "1:2:3", ":", "١٢٨", "1_024", "+8", "0x10"]


VALID = {"experts": ["8", "64", "256", "257/9"], "topk": ["1", "2", "8"], "hidden": ["64", "7168"],
         "tokens": ["1", "512", "16777215"], "blocks": ["32", "16/128"], "quant": ["fp4", "none/fp8"],
         "ep": ["off", "on/on+nlt"], "buf": ["zero", "keep/addend"], "shared": ["0", "1"], "name": ["m"]}


def random_spec(rng) -> str:
    """Mostly valid fields (each 85% from its valid pool), the rest anything."""
    def value(key):
        return rng.choice(VALID[key]) if key in VALID and rng.random() < 0.85 else rng.choice(VALUES)

    parts = [f"{k}={value(k)}" for k in ("experts", "topk", "hidden") if rng.random() < 0.97]
    parts += [f"{k}={value(k)}" for k in rng.sample(KEYS, rng.randint(0, 3)) if k not in ("experts", "topk", "hidden")]
    parts += [rng.choice(["", "junk", "=", "a=b=c"])] if rng.random() < 0.1 else []
    rng.shuffle(parts)
    return ",".join(parts)


def test_fuzzed_arguments_give_a_valid_shape_or_one_line(monkeypatch, capsys):
    """400 random specs and numbers: the parser returns a shape inside every rule or raises ValueError;
    the command exits 0 or 2 (one line), never a traceback. Capture is faked: the rules are the subject."""
    import random

    rng = random.Random(int(os.environ.get("AITER_PATCHES_FUZZ_SEED", "35")))
    monkeypatch.setattr(command, "capture_all", fake_capture(variants=[variant()]))
    for i in range(400):
        spec = random_spec(rng)
        try:
            shape = presets.parse_shapes(spec)
        except ValueError as exc:
            assert str(exc).startswith("--shapes"), (spec, exc)
        else:
            assert all(1 <= k <= e for e, k in shape.routing) and shape.hidden >= 1, spec
            assert 1 <= shape.max_tokens < 2**24 and set(shape.blocks_for("fp4")) <= {16, 32, 64, 128}, spec
            for _, topk in shape.routing:
                presets.token_counts(min(shape.max_tokens, 4096), topk)
        argv = ["--shapes", spec, "--count-only"]
        for flag in ("--tokens", "--jobs", "--max-variants"):
            if rng.random() < 0.3:
                argv += [flag, rng.choice(["-5", "0", "1", "16", "16777216"])]
        if rng.random() < 0.2:
            argv += ["--arch", rng.choice(["", ",", "gfx942", "gfx942,gfx950", "gfx90a", " gfx950 "])]
        rc, out, err = compile_(capsys, *argv)
        assert rc in (0, 2), (i, argv, out, err)
        if rc == 2:
            assert err.count("\n") == 1 and err.startswith("error: "), (i, argv, err)
