"""Small AITER (and server) source trees for the drift tests, on disk and packed as a wheel or a tarball."""

from __future__ import annotations

import io
import random
import tarfile
import textwrap
import zipfile
from pathlib import Path

from aiter_patches.registry import patches


def write_tree(root: Path, files: dict) -> Path:
    """``files``: relative path -> text (dedented) or bytes (written as they are)."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(textwrap.dedent(content))
    return root


def builtin_pin_files() -> dict[str, str]:
    """A tree whose targets are exactly the builtin pins (the latest of each target)."""
    defs: dict[str, dict[str, str]] = {}
    for p in patches():
        for t in p.targets:
            defs.setdefault(t.module, {})[t.attr] = f"def {t.attr}{t.pins[-1].text}: ...\n"
        for sp in p.relies_on:
            defs.setdefault(sp.module, {}).setdefault(sp.qualname, f"def {sp.qualname}(): ...\n")
    files = {"aiter/__init__.py": "", "aiter/ops/__init__.py": ""}
    for mod, fns in defs.items():
        if mod.split(".")[0] == "aiter":
            files[mod.replace(".", "/") + ".py"] = "".join(fns.values())
    return files


def tree_from_builtin_pins(root: Path) -> Path:
    return write_tree(root, builtin_pin_files())


def _data(content) -> bytes:
    return content if isinstance(content, bytes) else textwrap.dedent(content).encode("utf-8")


def pack_wheel(path: Path, files: dict) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, content in files.items():
            zf.writestr(rel, _data(content))
    return path


def pack_tar(path: Path, files: dict, top: str = "amd-aiter-9.9.9/", blob: int = 0) -> Path:
    """An sdist-like tarball (compression from the suffix); ``blob`` bytes of seeded noise in a member
    after ``aiter/__init__.py``, so that cutting the file short cuts inside the members, not the header."""
    mode = {".xz": "w:xz", ".gz": "w:gz", ".bz2": "w:bz2"}.get(path.suffix, "w")
    items = list(files.items())
    if blob:
        items.insert(1, ("aiter/blob.dat", random.Random(0).randbytes(blob)))
    with tarfile.open(path, mode) as tf:
        for rel, content in items:
            data = _data(content)
            info = tarfile.TarInfo(top + rel)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path
