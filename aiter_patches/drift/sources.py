"""Which source to read: AITER (a checkout, a wheel or sdist, the installed package) or a server's release.

Why the servers are not named here: the packages a ``--server`` source may hold
are the ones the registered patches have targets in, besides ``aiter``
(``sglang``, ``vllm`` today). A new integration for another server is checked by
``drift --server`` as soon as its patch is declared, and this reader imports no
integration.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Sequence

from .files import ArchiveFiles, DirectoryFiles, SourceUnreadable
from .tree import SourceTree


def open_source(aiter_src: str | Path | None = None, wheel: str | Path | None = None) -> SourceTree:
    """The AITER source to check: a directory, a wheel/sdist file, or else the installed ``aiter``'s files.

    A directory may be a checkout (holding ``aiter/``) or the ``aiter`` package itself.
    """
    if wheel is not None:
        path = Path(wheel)
        if not path.is_file():
            raise SourceUnreadable(f"{path}: no such file")
        return SourceTree("aiter", ArchiveFiles(path, "aiter"), f"wheel {path}")
    if aiter_src is not None:
        root = Path(aiter_src)
        if not root.is_dir():
            raise SourceUnreadable(f"{root}: not a directory")
        if not (root / "aiter" / "__init__.py").is_file() and root.name == "aiter":
            root = root.parent
        return SourceTree("aiter", DirectoryFiles(root), f"source tree {root}")
    try:
        spec = importlib.util.find_spec("aiter")  # finds the package without importing it
    except (ImportError, ValueError) as exc:
        raise SourceUnreadable(f"cannot locate the installed 'aiter': {exc}") from None
    if spec is None or not spec.submodule_search_locations:
        raise SourceUnreadable("no 'aiter' package is installed; pass --aiter-src DIR or --wheel FILE")
    pkg = Path(list(spec.submodule_search_locations)[0])
    if not (pkg / "jit").is_dir():
        raise SourceUnreadable(
            f"the installed 'aiter' at {pkg} is not AMD's AITER (no aiter/jit/); PyPI's 'aiter' is an "
            "unrelated package: install amd-aiter or pass --aiter-src / --wheel"
        )
    return SourceTree("aiter", DirectoryFiles(pkg.parent), f"installed aiter {pkg}")


def server_packages(patch_list: Sequence[Any] | None = None) -> tuple[str, ...]:
    """The top-level packages other than ``aiter`` that the patches (default: the registered ones) target."""
    if patch_list is None:
        from ..registry import patches

        patch_list = patches()
    modules = [t.module for p in patch_list for t in p.targets] + [sp.module for p in patch_list for sp in p.relies_on]
    return tuple(sorted({m.partition(".")[0] for m in modules} - {"aiter"}))


def open_server(path: str | Path, packages: Sequence[str] | None = None) -> SourceTree:
    """A server's source: a wheel/sdist file (named after its package) or a directory holding the package
    (or the package directory itself). ``packages``: the servers to look for (default: :func:`server_packages`)."""
    servers = tuple(packages) if packages is not None else server_packages()
    p = Path(path)
    if p.is_dir():
        for package in servers:
            if (p / package / "__init__.py").is_file():
                return SourceTree(package, DirectoryFiles(p), str(p))
            if p.name == package and (p / "__init__.py").is_file():
                return SourceTree(package, DirectoryFiles(p.parent), str(p))
        raise SourceUnreadable(f"{p}: no {' or '.join(s + '/' for s in servers)} package in it")
    if not p.is_file():
        raise SourceUnreadable(f"{p} does not exist")
    name = p.name.lower()
    package = next((s for s in servers if name.startswith(s)), None)
    if package is None:
        names = f"neither {servers[0]} nor {servers[1]}" if len(servers) == 2 else f"none of {', '.join(servers)}"
        raise SourceUnreadable(f"{p}: the file name names {names}")
    return SourceTree(package, ArchiveFiles(p, package), str(p))
