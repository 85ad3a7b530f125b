"""Check every block-scale GEMM code object of an AITER install against the `.co` launcher's argument layout.

The GEMM patch launches AITER's `.co` only when its `NT_AMDGPU_METADATA` note matches the
launcher's packing (`aiter_patches.kernels.hip_blockscale_asm.KERNEL_ARGS`); this prints the
verdict for each kernel AITER lists, so a user sees before serving whether the patch will run.

    python scripts/check_code_objects.py                            # the imported AITER, this GPU's arch
    python scripts/check_code_objects.py --root /src/aiter --arch gfx942,gfx950   # any tree, no GPU needed

Exit status:
    0  every listed kernel accepted;
    1  some refused (a code object that does not match the launcher, cannot be read, or whose
       metadata is malformed: one table row each, naming the file and the field);
    2  nothing to check: no AITER tree or arch, no kernel list, or a kernel list that cannot be
       read, is malformed (a missing column, a non-integer tile, a code object named by a path)
       or lists no kernel; one line names the file, the line and the rule. No traceback.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiter_patches.kernels import hip_blockscale_asm as hb  # noqa: E402


def detected() -> tuple[str | None, str | None, str]:
    """(AITER root, arch, how they were found)."""
    notes = []
    root = arch = None
    try:
        import aiter

        root = hb.aiter_root_of(aiter)
        notes.append(f"AITER {getattr(aiter, '__version__', '?')} at {os.path.dirname(aiter.__file__)}")
    except Exception as exc:  # noqa: BLE001 - report any import failure
        notes.append(f"import aiter failed: {type(exc).__name__}: {exc}")
    try:
        import torch

        if torch.cuda.is_available():
            arch = hb.gfx_of(torch.device("cuda", 0))
    except Exception as exc:  # noqa: BLE001
        notes.append(f"no GPU arch: {exc}")
    return root, arch, "; ".join(notes)


def kernel_list_problem(text: str) -> str | None:
    """Why `fp8gemm_bf16_blockscale.csv`'s text is not a kernel list the launcher can read, or None.

    The columns are the fields of `hb.AsmKernel` (integers where the field is one); lines are
    numbered as in the file (blank and comment lines are skipped as the launcher skips them)."""
    fields = dataclasses.fields(hb.AsmKernel)
    kept = [(n, ln) for n, ln in enumerate(text.splitlines(), 1)
            if ln.strip() and not ln.lstrip().startswith(("#", "//", ";"))]
    if not kept:
        return "no header line"
    reader = csv.reader([ln for _, ln in kept])
    header = next(reader)  # as the launcher's csv.DictReader keys its rows: unstripped
    missing = [f.name for f in fields if f.name not in header]
    if missing:
        return f"line {kept[0][0]}: no column {', '.join(missing)} (the header has {', '.join(header)})"
    rows = 0
    for row in reader:
        line = kept[min(reader.line_num, len(kept)) - 1][0]
        rec = dict(zip(header, row))
        for f in fields:
            value = rec.get(f.name)
            if value is None or not value.strip():
                return f"line {line}: no {f.name}"
            if f.type in (int, "int"):
                try:
                    int(value)
                except ValueError:
                    return f"line {line}: {f.name}={value.strip()!r} is not an integer"
        name = rec["co_name"].strip()
        if os.path.basename(name) != name or name in (".", ".."):
            return f"line {line}: co_name={name!r} is not a file name in the kernel folder"
        rows += 1
    return None if rows else "lists no kernel"


def check(root: str, arch: str) -> tuple[int, list[str]]:
    csv_path = os.path.join(hb.kernel_dir(root, arch), hb.KERNEL_CSV)
    if not os.path.isfile(csv_path):
        return 2, [f"{arch}: no kernel list at {csv_path}"]
    try:
        with open(csv_path, encoding="utf-8-sig") as f:
            problem = kernel_list_problem(f.read())
    except (OSError, UnicodeDecodeError) as exc:
        problem = f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    except csv.Error as exc:
        problem = f"not CSV ({exc})"
    if problem is not None:
        return 2, [f"{arch}: kernel list {csv_path}: {problem}"]
    lines, refused = [], 0
    for cfg in hb.load_kernel_list(root, arch):
        reason = hb.code_object_reason(root, arch, cfg)
        refused += reason is not None
        lines.append(f"| {arch} | {cfg.co_name} | {'accepted' if reason is None else 'REFUSED: ' + reason} |")
    return (1 if refused else 0), lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", help="folder holding AITER's hsa/ (default: where the imported AITER keeps it)")
    p.add_argument("--arch", help="comma-separated gfx names (default: this GPU's)")
    args = p.parse_args(argv)
    root, arch, how = (args.root, None, "given") if args.root else detected()
    arch = args.arch or arch
    print(f"AITER code objects: root {root or '?'} ({how}); arch {arch or '?'}")
    archs = [a for a in (x.strip() for x in (arch or "").split(",")) if a]
    if not root or not archs:
        print("cannot check: need an AITER tree (--root) and an arch (--arch, or a ROCm GPU)")
        return 2
    rc = 0
    print("| arch | code object | verdict |\n|---|---|---|")
    for a in archs:
        code, lines = check(root, a)
        print("\n".join(lines))
        rc = max(rc, code)
    return rc


if __name__ == "__main__":
    sys.exit(main())
