"""Check every block-scale GEMM code object of an AITER install against the `.co` launcher's argument layout.

The GEMM patch launches AITER's `.co` only when its `NT_AMDGPU_METADATA` note matches the
launcher's packing (`aiter_patches.kernels.hip_blockscale_asm.KERNEL_ARGS`); this prints the
verdict for each kernel AITER lists, so a user sees before serving whether the patch will run.

    python scripts/check_code_objects.py                            # the imported AITER, this GPU's arch
    python scripts/check_code_objects.py --root /src/aiter --arch gfx942,gfx950   # any tree, no GPU needed

Exit status: 0 every listed kernel accepted; 1 some refused; 2 no kernel list found.
"""

from __future__ import annotations

import argparse
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


def check(root: str, arch: str) -> tuple[int, list[str]]:
    csv_path = os.path.join(hb.kernel_dir(root, arch), hb.KERNEL_CSV)
    if not os.path.isfile(csv_path):
        return 2, [f"{arch}: no kernel list at {csv_path}"]
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
    if not root or not arch:
        print("cannot check: need an AITER tree (--root) and an arch (--arch, or a ROCm GPU)")
        return 2
    rc = 0
    print("| arch | code object | verdict |\n|---|---|---|")
    for a in arch.split(","):
        code, lines = check(root, a.strip())
        print("\n".join(lines))
        rc = max(rc, code)
    return rc


if __name__ == "__main__":
    sys.exit(main())
