"""``aiter-patches drift --server PATH``: the server integrations' targets read statically from an SGLang/vLLM release.

The integrations patch a server's own functions; a server release can move
them as an AITER release can move AITER's. This reads the server's Python files
as text (a wheel, an sdist tarball, or a source directory; nothing is imported)
and reports, for every target of every patch whose module belongs to that
server, ``match``/``drift``/``missing`` against its pins, and each relied-on
function's source hash, with the same machinery and table as the AITER check.
Files are read from the archive only when a target needs them (the vLLM wheel
is over 300 MB; its sdist, or only the few files the targets live in, is enough).
"""

from __future__ import annotations

import tarfile
import zipfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Sequence

from .. import drift

SERVERS = ("sglang", "vllm")


class _ArchiveFiles(Mapping):
    """The ``.py`` members of one package inside a wheel or sdist, keyed from the package directory, read lazily."""

    def __init__(self, path: Path, package: str):
        self._path, self._package = path, package
        self._cache: dict[str, str] = {}
        try:
            if zipfile.is_zipfile(path):
                self._zip: zipfile.ZipFile | None = zipfile.ZipFile(path)
                self._tar = None
                names = self._zip.namelist()
            elif tarfile.is_tarfile(path):
                self._zip, self._tar = None, tarfile.open(path)
                names = [m.name for m in self._tar.getmembers() if m.isfile()]
            else:
                raise drift.SourceUnreadable(f"{path}: neither a wheel/zip nor a tar archive")
        except (OSError, zipfile.BadZipFile, tarfile.TarError) as exc:
            raise drift.SourceUnreadable(f"{path}: {exc}") from None
        inits = sorted((n for n in names if PurePosixPath(n).parts[-2:] == (package, "__init__.py")), key=len)
        if not inits:
            raise drift.SourceUnreadable(f"{path}: no {package}/__init__.py inside")
        prefix = inits[0][: -len(f"{package}/__init__.py")]
        self._members = {n[len(prefix):]: n for n in names if n.startswith(prefix + package + "/")
                         and n.endswith(".py")}

    def __getitem__(self, rel: str) -> str:
        if rel not in self._cache:
            member = self._members[rel]
            if self._zip is not None:
                data = self._zip.read(member)
            else:
                f = self._tar.extractfile(member)
                data = f.read() if f is not None else b""
            self._cache[rel] = data.decode("utf-8")
        return self._cache[rel]

    def __contains__(self, rel: object) -> bool:
        return rel in self._members

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)


class ServerTree(drift.SourceTree):
    """One server's source (``package`` is ``sglang`` or ``vllm``): imports inside it are followed, others are not."""

    def __init__(self, package: str, files: Mapping | None, root: Path | None, description: str):
        self._files, self._root, self.description, self._modules = files, root, description, {}
        self.package = package
        if not self.exists(f"{package}/__init__.py"):
            raise drift.SourceUnreadable(f"{description}: no {package}/__init__.py (not a {package} source)")

    def version(self) -> str | None:
        for rel in (f"{self.package}/version.py", f"{self.package}/_version.py"):
            if self.exists(rel):
                import ast

                found = drift.assigned_version(ast.parse(self.read(rel)))
                if found is not None:
                    return found
        return None


def open_server(path: str | Path) -> ServerTree:
    """A wheel/sdist file or a directory (holding ``sglang/`` or ``vllm/``, or the package directory itself)."""
    p = Path(path)
    if p.is_dir():
        for package in SERVERS:
            if (p / package / "__init__.py").is_file():
                return ServerTree(package, None, p, str(p))
            if p.name == package and (p / "__init__.py").is_file():
                return ServerTree(package, None, p.parent, str(p))
        raise drift.SourceUnreadable(f"{p}: no sglang/ or vllm/ package in it")
    if not p.is_file():
        raise drift.SourceUnreadable(f"{p} does not exist")
    name = p.name.lower()
    package = next((s for s in SERVERS if name.startswith(s)), None)
    if package is None:
        raise drift.SourceUnreadable(f"{p}: the file name names neither sglang nor vllm")
    return ServerTree(package, _ArchiveFiles(p, package), None, str(p))


def _ours(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def check(tree: ServerTree, patch_list: Sequence[Any] | None = None) -> drift.Report:
    """Every target and relied-on function of the patches (default: registered) that lives in ``tree``'s server."""
    if patch_list is None:
        from ..registry import patches

        patch_list = patches()
    targets = [drift._check_target(tree, p.name, t.module, t.attr, t.pins)
               for p in patch_list for t in p.targets if _ours(t.module, tree.package)]
    relied = [drift._check_source(tree, p.name, sp)
              for p in patch_list for sp in p.relies_on if _ours(sp.module, tree.package)]
    return drift.Report(tree.description, tree.version(), targets, relied, library=tree.package)
