"""`scripts/check_code_objects.py` on hostile input: one line per bad file, the documented exit status, no traceback.

Exit status (the script's docstring): 0 every listed kernel accepted; 1 some refused (a code
object that does not match, cannot be read, or is malformed); 2 nothing to check (no tree or
arch, no kernel list, or a kernel list that cannot be read, is malformed or lists no kernel).
AITER's real code objects are read from the fixture at test time (skipped when absent).
"""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import code_object_files as cof
from helpers.aiter_tree import code_object_root, gemm_kernel_dir

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_code_objects.py"
CSV = "fp8gemm_bf16_blockscale.csv"
CO_64 = "fp8gemm_bf16_blockscale_BpreShuffle_64x128.co"


@pytest.fixture(scope="module")
def aiter_root(tmp_path_factory):
    return code_object_root(tmp_path_factory.mktemp("aiter_hsa"))


@pytest.fixture(scope="module")
def cc():
    spec = importlib.util.spec_from_file_location("check_code_objects", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def csv_text(aiter_root) -> str:
    return (gemm_kernel_dir(aiter_root, "gfx942") / CSV).read_text()


def replace_line(text: str, n: int, new: str) -> str:
    lines = text.splitlines()
    lines[n - 1] = new
    return "\n".join(lines) + "\n"


# name: (the kernel list's new text from the real one, what the line says)
BAD_LISTS = {
    "missing column": (lambda t: "\n".join(",".join(c for i, c in enumerate(ln.split(",")) if i != 2)
                                           for ln in t.splitlines()),
                       "line 1: no column splitK"),
    "non-integer tile": (lambda t: replace_line(t, 3, t.splitlines()[2].replace("32,", "3x,", 1)),
                         "line 3: tile_m='3x' is not an integer"),
    "short row": (lambda t: replace_line(t, 2, "128,128,1"), "line 2: no bpreshuffle"),
    "path as co_name": (lambda t: replace_line(t, 2, t.splitlines()[1].rsplit(",", 1)[0] + ",../../x.co"),
                        "line 2: co_name='../../x.co' is not a file name in the kernel folder"),
    "header only": (lambda t: t.splitlines()[0] + "\n", "lists no kernel"),
    "empty": (lambda t: "", "no header line"),
    "not UTF-8": (lambda t: t.encode() + b"\xff\xfe\n", "cannot be read ("),
}


def bad_tree(aiter_root, tmp_path, name):
    """A copy of the gfx942 kernel folder under the arch folder `name`, its kernel list altered."""
    alter, _ = BAD_LISTS[name]
    d = gemm_kernel_dir(tmp_path, name)
    shutil.copytree(gemm_kernel_dir(aiter_root, "gfx942"), d)
    new = alter(csv_text(aiter_root))
    (d / CSV).write_bytes(new if isinstance(new, bytes) else new.encode())
    return d


@pytest.mark.parametrize("name", sorted(BAD_LISTS))
def test_a_bad_kernel_list_is_one_line_and_exit_2(cc, aiter_root, tmp_path, name):
    d = bad_tree(aiter_root, tmp_path, name)
    code, lines = cc.check(str(tmp_path), name)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{name}: kernel list {d / CSV}: ") and BAD_LISTS[name][1] in lines[0], lines


def test_every_bad_input_in_one_run_no_traceback(aiter_root, tmp_path):
    """Through the command line: the good arch's rows, one line per bad list, exit 2 (the worst), no traceback."""
    shutil.copytree(gemm_kernel_dir(aiter_root, "gfx942"), gemm_kernel_dir(tmp_path, "gfx942"))
    for name in BAD_LISTS:
        bad_tree(aiter_root, tmp_path, name)
    r = run("--root", tmp_path, "--arch", ",".join(["gfx942", *BAD_LISTS]))
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out, out
    assert out.count("| accepted |") == 6
    for name, (_, says) in BAD_LISTS.items():
        [line] = [ln for ln in out.splitlines() if ln.startswith(f"{name}: kernel list ")]
        assert says in line, line


def test_malformed_code_objects_are_refused_rows_and_exit_1(aiter_root, tmp_path):
    """The .co of issue 35 item 4 (an `.args` that is an integer, a `.symbol` that is one) and a
    truncated file: each one row naming the file and the field, exit 1, no traceback."""
    d = gemm_kernel_dir(tmp_path, "gfx942")
    shutil.copytree(gemm_kernel_dir(aiter_root, "gfx942"), d)

    def rewrite(name, change):
        data = (d / name).read_bytes()
        meta = cof.metadata(data)
        change(meta["amdhsa.kernels"][0])
        (d / name).write_bytes(cof.with_metadata(data, meta))

    rewrite(CO_64, lambda k: k.update({".args": 5}))
    rewrite(CO_64.replace("64x", "32x"), lambda k: k.update({".symbol": 7}))
    rewrite(CO_64.replace("64x", "48x"), lambda k: k[".args"][0].update({".name": ["C"]}))
    truncated = d / CO_64.replace("64x", "96x")
    truncated.write_bytes(truncated.read_bytes()[:700])
    r = run("--root", tmp_path, "--arch", "gfx942")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out, out
    refused = [ln for ln in out.splitlines() if "REFUSED" in ln]
    assert len(refused) == 4 and out.count("| accepted |") == 2, out
    assert f"REFUSED: {CO_64}: kernel '_ZN5aiter42fp8gemm_bf16_blockscale_BpreShuffle_64x128E': .args is an " \
           f"integer (5), expected a list |" in out
    assert ".symbol is an integer (7), expected a string |" in out
    assert ".args[0].name is a list (['C']), expected a string |" in out
    assert "96x128.co: truncated" in out


def test_nothing_to_check_is_exit_2(tmp_path):
    r = run("--root", tmp_path, "--arch", "gfx942")
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    assert f"gfx942: no kernel list at {gemm_kernel_dir(tmp_path, 'gfx942') / CSV}" in r.stdout
    r = run("--root", tmp_path, "--arch", ",")
    assert r.returncode == 2 and "cannot check" in r.stdout and "Traceback" not in r.stdout + r.stderr
