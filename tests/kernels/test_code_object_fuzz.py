"""A seeded fuzz pass over the `.co` metadata reader and `scripts/check_code_objects.py` (issue 35).

The inputs are AITER's real GEMM code objects (both archs, read from the fixture at test time),
mutated three ways: the decoded metadata (a field's value replaced by one of another type or
out of range, a field dropped, a container emptied, truncated or nested), the msgpack bytes of
the note (flipped, inserted, deleted bytes; cut short), and the file's own bytes (the ELF and
program headers overwritten with extreme values, random bytes flipped, the file cut short).
Every mutant must be accepted or refused with `CodeObjectError`, nothing else; an accepted one
must be compared with the launcher's layout without raising. The script must print no
traceback on mutated code objects and kernel lists, and exit as its docstring says.

Small enough for CI (a few seconds); ``AITER_PATCHES_FUZZ_SEED`` and ``AITER_PATCHES_FUZZ_N``
(mutants per kind) run it longer or elsewhere. A failure names the seed and the mutant.
"""

import copy
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from aiter_patches.kernels import code_object as co
from aiter_patches.kernels import hip_blockscale_asm as hb
from helpers import code_object_files as cof
from helpers.aiter_tree import ARCHS, code_object_root, gemm_kernel_dir

SEED = int(os.environ.get("AITER_PATCHES_FUZZ_SEED", "35"))
N = int(os.environ.get("AITER_PATCHES_FUZZ_N", "400"))
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_code_objects.py"

HOSTILE = [0, 1, -1, 7, 256, 2**31, 2**63, 2**64 - 1, -2**63, True, False, None, 0.5, float("nan"), "", "C", "pad",
           "by_value", "global_buffer", "x" * 300, b"", b"\xff\x00", [], [0], [256, 1, 1], [256, 1], ["256", 1, 1],
           [[[[]]]], {}, {".name": "C"}, {1: 2}, [{}], [None]]


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = code_object_root(tmp_path_factory.mktemp("aiter_hsa"))
    files = {}
    for gfx in ARCHS:
        for cfg in hb.load_kernel_list(str(root), gfx):
            files[(gfx, cfg.knl_name)] = (gemm_kernel_dir(root, gfx) / cfg.co_name).read_bytes()
    assert len(files) == 12
    return root, files


# ---------------------------------------------------------------- the mutators


def _containers(value, path=()):
    """Every (path, container) inside `value`, the value itself first."""
    yield path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from _containers(v, path + (k,))


def mutate_metadata(meta, rng: random.Random):
    """1-3 changes at random places of the decoded metadata."""
    meta = copy.deepcopy(meta)
    for _ in range(rng.randint(1, 3)):
        places = list(_containers(meta))
        # favour the first kernel and its arguments, where the reader looks
        weighted = [p for p in places if p[0][:2] == ("amdhsa.kernels", 0)] or places
        _, node = rng.choice(weighted if rng.random() < 0.8 else places)
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        op = rng.choice(("replace", "replace", "replace", "drop", "add", "shrink"))
        if op == "add" or not keys:
            if isinstance(node, dict):
                node[rng.choice([".name", ".args", ".offset", ".symbol", "x", 3])] = rng.choice(HOSTILE)
            else:
                node.insert(rng.randint(0, len(node)), copy.deepcopy(rng.choice(HOSTILE)))
            continue
        key = rng.choice(keys)
        if op == "replace":
            node[key] = copy.deepcopy(rng.choice(HOSTILE))
        elif op == "drop":
            del node[key]
        elif isinstance(node[key], list):  # shrink a list
            del node[key][rng.randint(0, len(node[key])):]
        elif isinstance(node[key], str):
            node[key] = node[key][:rng.randint(0, len(node[key]))]
        else:
            node[key] = copy.deepcopy(rng.choice(HOSTILE))
    return meta


def mutate_bytes(data: bytes, rng: random.Random, hot: int | None = None) -> bytes:
    """Flip, insert or delete a few bytes (within the first `hot` bytes when given), or cut short."""
    b = bytearray(data)
    if rng.random() < 0.25:
        return bytes(b[:rng.randint(0, len(b))])
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(max(1, min(len(b), hot or len(b))))
        op = rng.random()
        if op < 0.6 and b:
            b[at] = rng.randrange(256)
        elif op < 0.8:
            b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            del b[at:at + rng.randint(1, 8)]
    return bytes(b)


# ELF64 header fields the reader uses: e_ident class/data/OSABI, e_machine, e_phoff, e_flags, e_phentsize, e_phnum
HEADER_FIELDS = [(4, "B"), (5, "B"), (7, "B"), (18, "H"), (32, "Q"), (48, "I"), (54, "H"), (56, "H")]
EXTREMES = {"B": (0, 1, 2, 64, 255), "H": (0, 1, 56, 57, 0xFFFF), "I": (0, 0x4C, 0x4F, 0xFFFFFFFF),
            "Q": (0, 8, 64, 2**63, 2**64 - 1)}


def mutate_headers(data: bytes, rng: random.Random) -> bytes:
    """An ELF header field, or a field of a program header, set to an extreme value."""
    b = bytearray(data)
    if rng.random() < 0.5:
        at, fmt = rng.choice(HEADER_FIELDS)
    else:  # a program header's type, offset, filesz or align
        phoff, = struct.unpack_from("<Q", data, 32)
        phnum, = struct.unpack_from("<H", data, 56)
        at, fmt = phoff + 56 * rng.randrange(phnum), "I"
        field, fmt = rng.choice([(0, "I"), (8, "Q"), (32, "Q"), (48, "Q")])
        at += field
    value = rng.choice(EXTREMES[fmt]) if rng.random() < 0.7 else rng.randrange(256 ** struct.calcsize(fmt))
    struct.pack_into("<" + fmt, b, at, value)
    return bytes(b)


def mutants(files, rng: random.Random, n: int):
    """(what, gfx, kernel name, bytes): n of each kind, the originals first."""
    keys = sorted(files)
    for gfx, knl in keys:
        yield "original", gfx, knl, files[(gfx, knl)]
    for kind in ("metadata", "msgpack", "headers", "bytes"):
        for _ in range(n):
            gfx, knl = rng.choice(keys)
            data = files[(gfx, knl)]
            if kind == "metadata":
                out = cof.with_metadata(data, mutate_metadata(cof.metadata(data), rng))
            elif kind == "msgpack":
                start, end = cof.note_span(data)
                out = cof.with_metadata_bytes(data, mutate_bytes(data[start:end], rng))
            elif kind == "headers":
                out = mutate_headers(data, rng)
            else:
                out = mutate_bytes(data, rng, hot=1024 if rng.random() < 0.5 else None)
            yield kind, gfx, knl, out


def verdict(data: bytes, gfx: str, knl: str) -> str | None:
    """The launcher's verdict on a mutant: None accepted, else the reason. Raises only what the reader raises."""
    try:
        obj = co.parse_code_object(data, "fuzz.co")
    except co.CodeObjectError as exc:
        assert str(exc) and exc.path == "fuzz.co"
        return str(exc)
    for k in obj.kernels:  # each kernel it lists, by name and by symbol, compares without raising
        for name in (k.name, (k.symbol or "").removesuffix(".kd")):
            assert isinstance(co.layout_mismatch(obj, name, gfx, hb.LAUNCH_LAYOUT), (str, type(None)))
    reason = co.layout_mismatch(obj, knl, gfx, hb.LAUNCH_LAYOUT)
    assert isinstance(reason, (str, type(None)))
    return reason


# ---------------------------------------------------------------- the reader


def test_the_reader_accepts_or_refuses_every_mutant(originals):
    _, files = originals
    rng = random.Random(SEED)
    seen: dict[str, dict[str, int]] = {}
    for i, (kind, gfx, knl, data) in enumerate(mutants(files, rng, N)):
        try:
            reason = verdict(data, gfx, knl)
        except Exception as exc:  # noqa: BLE001 - the point: name the mutant that broke the reader
            raise AssertionError(f"seed {SEED}, mutant {i} ({kind}, {gfx}): {type(exc).__name__}: {exc}") from exc
        counts = seen.setdefault(kind, {"accepted": 0, "refused": 0})
        counts["accepted" if reason is None else "refused"] += 1
        if kind == "original":
            assert reason is None, reason
    # the mutators reach both outcomes (a mutant of an unused field, or a byte in padding, is still accepted)
    for kind in ("metadata", "msgpack", "headers", "bytes"):
        assert seen[kind]["refused"] > N // 4, seen
    assert seen["metadata"]["accepted"] > 0 and seen["bytes"]["accepted"] > 0, seen


# ---------------------------------------------------------------- the script


def run_script(root, archs):
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--arch", ",".join(archs)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_the_script_on_mutated_code_objects(originals, tmp_path):
    """Every gfx942 `.co` replaced by a mutant: a row per file, exit 1 if any is refused (else 0), no traceback."""
    root, files = originals
    rng = random.Random(SEED + 1)
    d = gemm_kernel_dir(tmp_path, "gfx942")
    shutil.copytree(gemm_kernel_dir(root, "gfx942"), d)
    refused = 0
    for i, cfg in enumerate(hb.load_kernel_list(str(root), "gfx942")):
        data = files[("gfx942", cfg.knl_name)]
        kind = ("metadata", "msgpack", "headers", "bytes")[i % 4]
        if kind == "metadata":
            data = cof.with_metadata(data, mutate_metadata(cof.metadata(data), rng))
        elif kind == "msgpack":
            start, end = cof.note_span(data)
            data = cof.with_metadata_bytes(data, mutate_bytes(data[start:end], rng))
        else:
            data = mutate_headers(data, rng) if kind == "headers" else mutate_bytes(data, rng)
        (d / cfg.co_name).write_bytes(data)
        refused += verdict(data, "gfx942", cfg.knl_name) is not None
    r = run_script(tmp_path, ["gfx942"])
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    assert r.returncode == (1 if refused else 0), out
    assert out.count("| REFUSED: ") == refused and out.count("| accepted |") == 6 - refused, out


CELLS = ["", "x", "-1", "0", "1e3", "0x20", " 32 ", "3.5", '"', "a,b", "\x00", "٣", "../x.co", "/etc/passwd"]


def mutate_csv(text: str, rng: random.Random) -> bytes:
    lines = text.splitlines()
    op = rng.randrange(8)
    if op == 0:  # a column dropped from the header
        header = lines[0].split(",")
        del header[rng.randrange(len(header))]
        lines[0] = ",".join(header)
    elif op in (1, 2, 3):  # a cell replaced
        n = rng.randrange(1, len(lines))
        cells = lines[n].split(",")
        cells[rng.randrange(len(cells))] = rng.choice(CELLS)
        lines[n] = ",".join(cells)
    elif op == 4:  # a row cut short
        n = rng.randrange(1, len(lines))
        lines[n] = ",".join(lines[n].split(",")[:rng.randrange(6)])
    elif op == 5:  # comments, blank lines, a BOM
        lines.insert(rng.randrange(len(lines) + 1), rng.choice(["", "# x", "// y", "   "]))
        lines[0] = "\ufeff" + lines[0] if rng.random() < 0.5 else lines[0]
    elif op == 6:  # cut anywhere
        return "\n".join(lines).encode()[:rng.randrange(len(text))]
    else:  # a byte that is not UTF-8
        raw = bytearray("\n".join(lines).encode())
        raw[rng.randrange(len(raw))] = 0xFF
        return bytes(raw)
    return ("\n".join(lines) + "\n").encode()


def test_the_script_on_mutated_kernel_lists(originals, tmp_path):
    """Eight mutated kernel lists (one arch folder each): exit 0, 1 or 2 as documented, no traceback;
    each folder gives either one line naming its list or its table rows."""
    root, _ = originals
    rng = random.Random(SEED + 2)
    text = (gemm_kernel_dir(root, "gfx942") / hb.KERNEL_CSV).read_text()
    archs = [f"gfx942-csv{i}" for i in range(8)]
    for arch in archs:
        d = gemm_kernel_dir(tmp_path, arch)
        shutil.copytree(gemm_kernel_dir(root, "gfx942"), d)
        (d / hb.KERNEL_CSV).write_bytes(mutate_csv(text, rng))
    r = run_script(tmp_path, archs)
    out = r.stdout + r.stderr
    assert "Traceback" not in out and r.returncode in (0, 1, 2), out
    bad_lists = [a for a in archs if f"\n{a}: kernel list " in out or f"\n{a}: no kernel list" in out]
    assert (r.returncode == 2) == bool(bad_lists), out
    for a in archs:
        assert (a in bad_lists) != (f"| {a} | " in out), (a, out)  # one or the other, never both
