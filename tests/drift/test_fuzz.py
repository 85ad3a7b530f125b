"""A seeded fuzz pass over the drift reader (issue 35): whatever the source, exit 0, 1 or 2 and never a traceback.

The base is a small real source, the stand-in AITER's ``aiter/`` package (every
target matches there), and for ``--server`` a tree holding each SGLang target's
pinned ``def``. Each run applies a few random mutations to its files (bytes
flipped, inserted, cut; lines swapped, re-indented; hostile lines: deep nesting,
huge expressions, self star imports, odd encodings and versions), packs the result
as a directory, a wheel, a tar.gz, tar.xz or tar.bz2, sometimes damages the archive's
bytes too, and runs ``aiter-patches drift`` on it in-process.

Kept small for CI (a few seconds); ``AITER_PATCHES_DRIFT_FUZZ_RUNS`` and
``AITER_PATCHES_DRIFT_FUZZ_SEED`` run a longer or another pass. A failure names
the run, the seed and the mutations, so it replays exactly.
"""

from __future__ import annotations

import os
import random
import re
import traceback
from pathlib import Path

import pytest

from aiter_patches import cli
from aiter_patches.registry import patches
from aiter_patches_standin import ROOT as STUB_ROOT

from .trees import pack_tar, pack_wheel, write_tree

RUNS = int(os.environ.get("AITER_PATCHES_DRIFT_FUZZ_RUNS", "60"))
SEED = int(os.environ.get("AITER_PATCHES_DRIFT_FUZZ_SEED", "35"))

HOSTILE_LINES = [
    "x = " + "(" * 300 + "1" + ")" * 300,
    "x = " + "+".join(["1"] * 30_000),
    "x = " + "[" * 120 + "]" * 120,
    "__all__ = " + "[" * 400 + "]" * 400,
    "__all__ = {[]: 1}",
    "__all__ = 7",
    "BLOCK_SIZE_M = {[]: 1}",
    "BLOCK_SIZE_M = 0x" + "f" * 5000,
    "__version__ = {[]: 1}",
    "__version__ = b'1.0'",
    "__version__ = version = '1.2.3'",
    "from .fused_moe import *",
    "from . import *",
    "from .. import fused_moe",
    "from aiter.fused_moe import fused_moe",
    "from aiter.nowhere import _moe_sorting_impl",
    "fused_moe = 1",
    "class fused_moe:\n    def m(self): ...",
    "try:\n    from .ops.quant import *\nexcept ImportError:\n    def moe_sorting(x): ...",
    "def fused_moe(x=" + "-" * 400 + "1): ...",
    "async def _moe_sorting_impl(*, a=lambda: (yield)): ...",
    "# -*- coding: latin-1 -*-",
    "# -*- coding: no-such-codec -*-",
    "\tdef f(): ...",
    "def f(:",
    "'''",
    "x = '" + "\\" * 3,
]
INSERTS = [b"\x00", b"\xef\xbb\xbf", b"\xff\xfe", b"\x0c", "\u2028".encode(), b"\r", b"\t", b"(", b")", b":", b"\\",
           b"'''", b"\n    ", b"\n\n", b"def ", b"import *", "\u00e9".encode("latin-1")]


def _stand_in_files() -> dict[str, bytes]:
    root = Path(STUB_ROOT)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted((root / "aiter").rglob("*.py"))}


def _server_files() -> dict[str, bytes]:
    """An SGLang tree holding each SGLang target's pinned ``def`` (methods grouped in their classes)."""
    modules: dict[str, dict[str, list[str]]] = {}  # module -> class ("" for functions) -> defs
    for p in patches():
        for t in p.targets:
            if t.module.startswith("sglang."):
                cls, _, fn = t.attr.rpartition(".")
                indent = "    " if cls else ""
                modules.setdefault(t.module, {}).setdefault(cls, []).append(f"{indent}def {fn}{t.pins[-1].text}: ...\n")
    files = {"sglang/__init__.py": b"", "sglang/version.py": b"__version__ = '0.5.23'\n"}
    for module, classes in modules.items():
        parts = module.split(".")
        for i in range(1, len(parts)):
            files.setdefault("/".join(parts[:i]) + "/__init__.py", b"")
        text = "".join(("" if not cls else f"class {cls}:\n") + "".join(defs) for cls, defs in classes.items())
        files["/".join(parts) + ".py"] = text.encode()
    return files


def _mutate(rng: random.Random, data: bytes, log: list[str]) -> bytes:
    kind = rng.choice(["flip", "insert", "delete", "duplicate", "truncate", "swap", "indent", "hostile",
                       "append", "append", "rename", "parameter", "default"])
    n = len(data)
    at = rng.randrange(n + 1)
    log.append(f"{kind}@{at}")
    if kind == "flip" and n:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == "insert":
        return data[:at] + rng.choice(INSERTS) + data[at:]
    if kind == "delete":
        return data[:at] + data[at + rng.randint(1, 400):]
    if kind == "duplicate":
        return data[:at] + data[at:at + rng.randint(1, 2000)] + data[at:]
    if kind == "truncate":
        return data[:at]
    defs = [m for m in re.finditer(rb"def (\w+)\(", data)]
    if kind in ("rename", "parameter", "default") and defs:  # still Python: the resolver and the pins get to work
        m = rng.choice(defs)
        log[-1] += f":{m.group(1).decode()}"
        if kind == "rename":
            return data[:m.end(1)] + b"_" + data[m.end(1):]
        if kind == "parameter":
            return data[:m.end()] + b"inserted=None, " + data[m.end():]
        eq = data.find(b"=", m.end())
        return data if eq < 0 else data[:eq + 1] + rng.choice([b"7 or ", b"-", b"not ", b"X."]) + data[eq + 1:]
    if kind == "append":
        line = rng.choice(HOSTILE_LINES)
        log[-1] += f":{line[:24]!r}"
        return data + b"\n" + line.encode("utf-8") + b"\n"
    lines = data.split(b"\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    if kind == "swap":
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == "indent":
        lines[i] = b" " * rng.choice([1, 2, 4, 8]) + lines[i]
    else:
        line = rng.choice(HOSTILE_LINES)
        log[-1] += f":{line[:24]!r}"
        lines.insert(i, line.encode("utf-8"))
    return b"\n".join(lines)


def _one_run(rng: random.Random, tmp: Path, log: list[str]) -> list[str]:
    server = rng.random() < 0.25
    files = _server_files() if server else _stand_in_files()
    names = sorted(files)
    weights = [8 if n.endswith(("fused_moe.py", "deepseek_v2.py")) else 1 for n in names]
    for _ in range(rng.randint(1, 4)):
        name = rng.choices(names, weights)[0]
        log.append(name)
        files[name] = _mutate(rng, files[name], log)
    if rng.random() < 0.15:
        version = "sglang/version.py" if server else "aiter/_version.py"
        files[version] = rng.choice(HOSTILE_LINES[8:11]).encode() + b"\n"
        log.append(f"version: {files[version][:20]!r}")
    package = "sglang" if server else "amd_aiter"
    container = rng.choice(["tree", "wheel", "tar.gz", "tar.xz", "tar.bz2"])
    log.append(container)
    if container == "tree":
        path = write_tree(tmp / "src", files)
    elif container == "wheel":
        path = pack_wheel(tmp / f"{package}-9-py3-none-any.whl", files)
    else:
        path = pack_tar(tmp / f"{package}-9.{container}", files, top=f"{package}-9/")
    if container != "tree" and rng.random() < 0.3:
        raw = bytearray(path.read_bytes())
        if rng.random() < 0.5:
            raw = raw[: rng.randrange(len(raw))]
            log.append(f"archive cut at {len(raw)}")
        else:
            for _ in range(rng.randint(1, 6)):
                raw[rng.randrange(len(raw))] ^= 0xFF
            log.append("archive bytes flipped")
        path.write_bytes(bytes(raw))
    if server:
        return ["--server", str(path)]
    return ["--aiter-src", str(path)] if container == "tree" else ["--wheel", str(path)]


@pytest.mark.parametrize("chunk", range(3))
def test_mutated_sources_exit_0_1_or_2_and_never_print_a_traceback(tmp_path, capsys, chunk):
    seen = set()
    for run in range(chunk, RUNS, 3):
        rng = random.Random(f"{SEED}-{run}")
        log: list[str] = []
        where = tmp_path / str(run)
        where.mkdir()
        argv = _one_run(rng, where, log)
        extra = ["--json"] if rng.random() < 0.3 else []
        try:
            code = cli.main(["drift", *argv, *extra])
        except BaseException:  # noqa: BLE001 - the point: nothing may escape
            pytest.fail(f"run {run} (seed {SEED}; mutations {log}) raised:\n{traceback.format_exc()}")
        out = capsys.readouterr()
        replay = f"run {run} (seed {SEED}; mutations {log})"
        assert code in (0, 1, 2), replay
        assert "Traceback" not in out.err and "Traceback" not in out.out, replay
        if code == 2 and not extra:
            assert len(out.err.splitlines()) == 1, f"{replay}: {out.err}"
        seen.add(code)
