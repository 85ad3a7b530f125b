"""Copy a few files of a release wheel into a small zip, reading the wheel over HTTP ranges (or from a local file).

Why: the vLLM wheel is over 300 MB, and the drift check and the vLLM integration tests read six of
its Python files. A wheel is a zip: its central directory sits at the end, and each member can be
read on its own, so ``zipfile`` over a file object that fetches byte ranges reads a few hundred KB.
Each member is checked against its CRC in the wheel's central directory (``zipfile`` does that);
the pins the files are read for (signatures, source hashes) check the rest.

    python .ci/wheel_members.py vllm==0.33.0 vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl OUT.zip FILE...
    python .ci/wheel_members.py --local WHEEL OUT.zip FILE...

Every ``__init__.py`` above each FILE, and the package's ``version.py`` / ``_version.py``, come too.
The wheel's URL is found in PyPI's simple index. An OUT.zip that already holds every FILE is kept (the CI
cache); one that lacks a FILE (the list grew) is fetched again. Exit status 0 with OUT.zip there, else 1 and why.
"""

from __future__ import annotations

import io
import re
import sys
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath

INDEX = "https://pypi.org/simple/{name}/"
TIMEOUT = 60


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a URL that fetches what is read with HTTP range requests."""

    def __init__(self, url: str):
        self.url, self.pos = url, 0
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            self.size = int(r.headers["Content-Length"])
            if r.headers.get("Accept-Ranges", "").lower() != "bytes":
                raise OSError(f"{url}: the server does not serve byte ranges")

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, b):
        n = min(len(b), self.size - self.pos)
        if n <= 0:
            return 0
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            if r.status != 206:
                raise OSError(f"{self.url}: asked for a byte range, got HTTP {r.status}")
            data = r.read()
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def wheel_url(requirement: str, filename: str) -> str:
    name = requirement.split("==")[0].strip().lower().replace("_", "-")
    with urllib.request.urlopen(INDEX.format(name=name), timeout=TIMEOUT) as r:
        page = r.read().decode("utf-8")
    for href in re.findall(r'href="([^"]+)"', page):
        url = href.split("#", 1)[0]
        if url.rsplit("/", 1)[-1] == filename:
            return url
    raise OSError(f"{filename} is not in {INDEX.format(name=name)}")


def wanted(files: list[str]) -> list[str]:
    out = dict.fromkeys(files)
    for f in files:
        parts = PurePosixPath(f).parts
        for i in range(1, len(parts)):
            out.setdefault("/".join(parts[:i]) + "/__init__.py")
        out.setdefault(f"{parts[0]}/version.py")
        out.setdefault(f"{parts[0]}/_version.py")
    return list(out)


def copy_members(wheel, out: Path, files: list[str]) -> list[str]:
    """Write the members of ``wheel`` (a path or a file object) named by ``wanted(files)`` into ``out``; return them."""
    with zipfile.ZipFile(wheel) as src:
        names = set(src.namelist())
        missing = [f for f in files if f not in names]
        if missing:
            raise OSError(f"not in the wheel: {', '.join(missing)}")
        taken = [m for m in wanted(files) if m in names]
        tmp = out.with_suffix(out.suffix + ".part")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for m in taken:
                dst.writestr(m, src.read(m))
    tmp.replace(out)
    return taken


def holds(out: Path, files: list[str]) -> bool:
    try:
        with zipfile.ZipFile(out) as z:
            return set(files) <= set(z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def main(argv: list[str]) -> int:
    try:
        out, files = Path(argv[2]), argv[3:]
        if holds(out, files):
            print(f"wheel_members: {out} holds every file (cached)")
            return 0
        if argv[:1] == ["--local"]:
            wheel = argv[1]
        else:
            requirement, filename = argv[0], argv[1]
            wheel = io.BufferedReader(RangeFile(wheel_url(requirement, filename)), buffer_size=1 << 16)
        out.parent.mkdir(parents=True, exist_ok=True)
        taken = copy_members(wheel, out, files)
    except (OSError, ValueError, IndexError, zipfile.BadZipFile) as exc:
        print(f"wheel_members: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"wheel_members: {len(taken)} files into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
