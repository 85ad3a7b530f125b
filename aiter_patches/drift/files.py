"""Where a source's Python files come from: a directory, a wheel/zip, or a tarball, read without importing anything.

Why a module of its own: an archive is damaged in more ways than a directory (a
member whose deflate data is corrupt, a tar.xz cut short by a partial download,
an encrypted or unsupported member), and ``zipfile``, ``tarfile``, ``zlib`` and
``lzma`` each raise their own exception types for them. Every one becomes
:class:`SourceUnreadable` here, naming the file and the problem, so that
``aiter-patches drift`` exits 2 ("the source cannot be read") with one line, not a
traceback that exits 1 ("drift"). Files are decoded as Python's import decodes
them (a UTF-8 BOM, a coding cookie, any newline convention): a file that imports
is read.

A zip is read lazily, member by member (the vLLM wheel is over 300 MB; a check
reads a few files of it). A tarball is read in one pass over its ``.py`` members
under the package: a compressed tar has no random access, so reading members one
at a time would decompress it again for each.
"""

from __future__ import annotations

import importlib.util
import lzma
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

# What reading a damaged archive can raise besides its own errors: truncated compressed streams
# (EOFError), corrupt deflate data (zlib.error), xz/bz2 data errors (LZMAError, OSError), an
# encrypted member (RuntimeError), an unsupported compression method (NotImplementedError), a
# malformed header field (ValueError).
ARCHIVE_ERRORS = (
    OSError, EOFError, RuntimeError, NotImplementedError, ValueError, OverflowError,
    zlib.error, lzma.LZMAError, tarfile.TarError, zipfile.BadZipFile, zipfile.LargeZipFile,
)


class SourceUnreadable(Exception):
    """The source cannot be read; the message says which file and why (exit code 2)."""


def decode(data: bytes, where: str) -> str:
    """The text of a Python file as import decodes it: BOM and coding cookie honoured, newlines made ``\\n``."""
    try:
        return importlib.util.decode_source(data)
    except (SyntaxError, UnicodeDecodeError, LookupError, ValueError) as exc:
        raise SourceUnreadable(f"{where}: cannot decode it as Python source: {exc}") from None


class DirectoryFiles:
    """The files under a directory (the one holding the package)."""

    def __init__(self, root: Path):
        self.root = root

    def exists(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def read(self, rel: str) -> str:
        try:
            data = (self.root / rel).read_bytes()
        except OSError as exc:
            raise SourceUnreadable(f"{self.root / rel}: cannot read it: {exc}") from None
        return decode(data, str(self.root / rel))


class ArchiveFiles:
    """The ``.py`` members of ``package`` inside a wheel/zip or a tarball, keyed from the package's directory.

    An sdist nests the package under a directory of its own (``amd-aiter-0.1.7/aiter/``); the shortest
    path ending in ``<package>/__init__.py`` fixes that prefix.
    """

    def __init__(self, path: Path, package: str):
        self.path, self.package = path, package
        self._zip: zipfile.ZipFile | None = None
        self._data: dict[str, bytes] = {}  # tar: the members' bytes, read in one pass
        self._text: dict[str, str] = {}
        try:
            if zipfile.is_zipfile(path):
                self._zip = zipfile.ZipFile(path)
                names = [i.filename for i in self._zip.infolist() if not i.is_dir()]
            elif tarfile.is_tarfile(path):
                names = self._read_tar(path, package)
            else:
                raise SourceUnreadable(f"{path}: neither a wheel/zip nor a tar archive")
        except ARCHIVE_ERRORS as exc:
            raise SourceUnreadable(f"{path}: damaged or truncated archive: {_why(exc)}") from None
        inits = sorted((n for n in names if PurePosixPath(n).parts[-2:] == (package, "__init__.py")), key=len)
        if not inits:
            raise SourceUnreadable(f"{path}: no {package}/__init__.py inside")
        prefix = inits[0][: -len(f"{package}/__init__.py")]
        self._members = {n[len(prefix):]: n for n in names
                         if n.startswith(prefix + package + "/") and n.endswith(".py")}

    def _read_tar(self, path: Path, package: str) -> list[str]:
        names = []
        with tarfile.open(path) as tf:
            for m in tf:
                if not m.isfile():
                    continue
                names.append(m.name)
                if m.name.endswith(".py") and f"/{package}/" in f"/{m.name}":
                    f = tf.extractfile(m)
                    self._data[m.name] = f.read() if f is not None else b""
        return names

    def exists(self, rel: str) -> bool:
        return rel in self._members

    def read(self, rel: str) -> str:
        if rel not in self._text:
            if rel not in self._members:
                raise SourceUnreadable(f"{self.path}: no member {rel}")
            member = self._members[rel]
            if self._zip is None:
                data = self._data[member]
            else:
                try:
                    data = self._zip.read(member)
                except ARCHIVE_ERRORS as exc:
                    raise SourceUnreadable(f"{self.path}: cannot read member {member}: {_why(exc)}") from None
            self._text[rel] = decode(data, f"{self.path}: {member}")
        return self._text[rel]


def _why(exc: BaseException) -> str:
    """``zlib.error: Error -3 while decompressing data: ...``: the exception's type, qualified, and its text."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name}: {exc}" if str(exc) else name
