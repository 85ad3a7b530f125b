"""``AITER_PATCHES_AUTO=1``: the patches in every Python process of an environment, without wrapping the command.

For setups that start the server in a way no one can prefix with
``aiter-patches run`` (a platform's entry point, a notebook kernel, a job
scheduler). ``aiter-patches install-auto`` writes ``aiter_patches_auto.pth``
into site-packages; Python executes its one line at start-up in every process
of that interpreter. The line reads one environment variable and does nothing
more unless ``AITER_PATCHES_AUTO`` is ``1`` (or true/yes/on). It is not
written by ``pip install``: a package that changes every Python process of an
environment should be asked for.

Risks, also in docs/servers.md: with the variable set, every Python process of
the environment imports ``aiter_patches`` (about 0.1 s, no torch) and registers
import hooks for AITER, including tools that have nothing to do with serving;
``pip uninstall`` does not remove the file (``install-auto --remove`` does; a
stale file with the variable set prints an import error at each start-up); and
``python -S`` skips ``.pth`` files altogether.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

from .env_flags import TRUE_WORDS

PTH_NAME = "aiter_patches_auto.pth"
# The words spelled into the line: Python runs it in every process, before anything of aiter_patches is imported.
PTH_LINE = (
    f'import os; os.environ.get("AITER_PATCHES_AUTO", "").strip().lower() in {TRUE_WORDS!r} '
    'and __import__("aiter_patches.bootstrap").bootstrap.start("auto")\n'
)


def site_packages() -> Path:
    """This interpreter's (or venv's) pure-Python site-packages: where ``pip install`` puts packages."""
    return Path(sysconfig.get_paths()["purelib"])


def install(directory: str | os.PathLike | None = None) -> Path:
    """Write the ``.pth`` file (replacing an older one); returns its path."""
    path = Path(directory or site_packages()) / PTH_NAME
    path.write_text(PTH_LINE, encoding="utf-8")
    return path


def remove(directory: str | os.PathLike | None = None) -> Path | None:
    """Delete the ``.pth`` file; returns its path, or None if there was none."""
    path = Path(directory or site_packages()) / PTH_NAME
    if not path.exists():
        return None
    path.unlink()
    return path


def _cmd_install_auto(args: argparse.Namespace) -> int:
    if args.remove:
        gone = remove(args.dir)
        print(f"removed {gone}" if gone else f"no {PTH_NAME} in {args.dir or site_packages()}")
        return 0
    path = install(args.dir)
    print(f"wrote {path}\nthe patches now apply in every Python process of this environment "
          f"started with AITER_PATCHES_AUTO=1")
    return 0


def add_parser(sub) -> None:
    a = sub.add_parser(
        "install-auto",
        help=f"write {PTH_NAME} into site-packages: AITER_PATCHES_AUTO=1 then applies the patches in every process",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a.add_argument("--remove", action="store_true", help="delete the file instead")
    a.add_argument("--dir", default=None, help="the site-packages folder (default: this interpreter's)")
    a.set_defaults(func=_cmd_install_auto)
