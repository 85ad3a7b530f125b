"""Damaged and hostile sources: exit 2 and one line naming the file, never a traceback (issue 35 item 5).

A traceback exits 1, which the README reserves for "a target drifted": a CI job
gating on ``aiter-patches drift`` would read a partial download as drift. And a
source Python imports (a UTF-8 BOM, a coding cookie) must be read, not refused.
"""

from __future__ import annotations

import importlib.util
import json
import zipfile

import pytest

from aiter_patches import cli, drift

from .trees import builtin_pin_files, pack_tar, pack_wheel, tree_from_builtin_pins, write_tree


def run(capsys, *argv):
    code = cli.main(["drift", *argv])
    return code, capsys.readouterr()


def assert_unreadable(capsys, argv, *names):
    """Exit 2, exactly one line on stderr that names each of ``names``; the same with ``--json``."""
    code, out = run(capsys, *argv)
    assert code == 2, out.out + out.err
    lines = out.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    assert all(n in lines[0] for n in names), lines[0]
    code, out = run(capsys, *argv, "--json")
    assert code == 2 and json.loads(out.out)["exit_code"] == 2
    return lines[0]


def test_a_wheel_member_with_corrupt_deflate_data(tmp_path, capsys):
    whl = pack_wheel(tmp_path / "amd_aiter-9-py3-none-any.whl", builtin_pin_files())
    with zipfile.ZipFile(whl) as zf:
        info = zf.getinfo("aiter/fused_moe.py")
    data = bytearray(whl.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for i in range(start + 4, start + info.compress_size - 4):
        data[i] ^= 0x5A
    whl.write_bytes(bytes(data))
    line = assert_unreadable(capsys, ["--wheel", str(whl)], str(whl), "aiter/fused_moe.py")
    assert "cannot read member" in line


def test_a_tar_xz_cut_in_half(tmp_path, capsys):
    full = pack_tar(tmp_path / "full.tar.xz", builtin_pin_files(), blob=200_000)
    half = tmp_path / "amd-aiter-9.9.9.tar.xz"
    half.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    line = assert_unreadable(capsys, ["--wheel", str(half)], str(half))
    assert "truncated" in line


def test_a_100000_term_expression(tmp_path, capsys):
    files = builtin_pin_files()
    files["aiter/fused_moe.py"] += "x = " + "+".join(["1"] * 100_000) + "\n"
    src = write_tree(tmp_path, files)
    assert_unreadable(capsys, ["--aiter-src", str(src)], "aiter/fused_moe.py", "nested too deeply")


def test_a_default_nested_past_the_recursion_limit_of_the_signature_reader(tmp_path, capsys):
    """The parser takes it; reading the default back as text recurses deeper than Python allows."""
    files = builtin_pin_files()
    assert "output=None): ..." in files["aiter/fused_moe.py"]
    files["aiter/fused_moe.py"] = files["aiter/fused_moe.py"].replace("output=None): ...", "output=" + "-" * 600 + "1): ...", 1)
    src = write_tree(tmp_path, files)
    assert_unreadable(capsys, ["--aiter-src", str(src)], "aiter/fused_moe.py")


def test_a_version_that_cannot_be_evaluated(tmp_path, capsys):
    src = tree_from_builtin_pins(tmp_path)
    (src / "aiter" / "_version.py").write_text("__version__ = {[]: 1}\n")
    assert_unreadable(capsys, ["--aiter-src", str(src)], "aiter/_version.py:1", "unhashable")


def test_a_version_file_that_does_not_parse_is_unreadable_for_aiter_too(tmp_path, capsys):
    src = tree_from_builtin_pins(tmp_path)
    (src / "aiter" / "_version.py").write_text("__version__ = (\n")
    assert_unreadable(capsys, ["--aiter-src", str(src)], "aiter/_version.py:1")


@pytest.mark.parametrize("text", ["__version__ = (\n", "__version__ = {[]: 1}\n"])
def test_server_version_py_that_does_not_parse_or_evaluate(tmp_path, capsys, text):
    root = write_tree(tmp_path / "srv", {"sglang/__init__.py": "", "sglang/version.py": text})
    line = assert_unreadable(capsys, ["--server", str(root)], "sglang/version.py:1")
    assert "cannot read server source" in line


def test_a_non_literal_version_is_no_version_not_an_error(tmp_path, capsys):
    src = tree_from_builtin_pins(tmp_path)
    (src / "aiter" / "_version.py").write_text("__version__ = get_version()\n")
    code, out = run(capsys, "--aiter-src", str(src), "--json")
    assert code == 0 and json.loads(out.out)["aiter"]["version"] is None


@pytest.mark.parametrize("prefix", [b"\xef\xbb\xbf", b"# -*- coding: latin-1 -*-\n# caf\xe9\n", b"\r\n"],
                         ids=["utf8-bom", "latin1-cookie", "crlf"])
@pytest.mark.parametrize("packed", ["tree", "wheel", "sdist"])
def test_what_python_imports_is_read(tmp_path, capsys, prefix, packed):
    files = builtin_pin_files()
    text = files["aiter/fused_moe.py"].encode()
    files["aiter/fused_moe.py"] = prefix + (text.replace(b"\n", b"\r\n") if prefix == b"\r\n" else text)
    if packed == "tree":
        argv = ["--aiter-src", str(write_tree(tmp_path, files))]
    elif packed == "wheel":
        argv = ["--wheel", str(pack_wheel(tmp_path / "a.whl", files))]
    else:
        argv = ["--wheel", str(pack_tar(tmp_path / "a.tar.gz", files))]
    code, out = run(capsys, *argv, "--json")
    assert code == 0, out.out + out.err
    assert {t["status"] for t in json.loads(out.out)["targets"]} == {"match"}


def test_a_form_feed_in_a_function_hashes_as_the_live_function_does(tmp_path):
    """``ast`` and ``inspect`` split lines at newlines only; ``str.splitlines`` also at \\f, \\x1c, U+2028..."""
    body = "def f(x):\n    s = 'a\u2028b'  # \x0c\n    return x\n\n\ndef g(y):\n    return y\n"
    src = write_tree(tmp_path, {"aiter/__init__.py": "", "aiter/ff.py": body.encode()})
    spec = importlib.util.spec_from_file_location("drift_form_feed", src / "aiter" / "ff.py")
    ff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ff)  # the live functions, for inspect
    tree = drift.open_source(src)
    for fn in (ff.f, ff.g):
        d = drift.resolve(tree, "aiter.ff", fn.__name__)
        pin = drift.source_hash(d.module.segment(d.node))
        assert drift.live_source_reason(fn, type("P", (), {"sha256": pin, "also": (), "source": "t"})) is None
