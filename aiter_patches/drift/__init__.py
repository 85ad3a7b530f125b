"""Static drift check: do the pins still describe an AITER release, before a server finds out?

Every AITER release can move a parameter under a patch. This package reads
AITER's Python source as text (an unpacked tree, a wheel or sdist, or the
installed package's files) with ``ast``: nothing is imported, so it runs on any
CI machine without ROCm or a GPU. For each patch and target it finds the
function's ``def`` (following re-exports such as ``from aiter import f`` and
``from .ops.quant import *`` to the definition; for custom-op wrapped functions
the ``def`` carries the real parameters that ``inspect`` cannot see) and
compares its signature with the target's pins. Functions a patch relies on
without wrapping them are pinned by a source hash (:func:`source_hash`); a
changed hash is a warning: the patch still applies, but a maintainer must
re-read the logic it mirrors. ``--server PATH`` does the same for the targets
the integrations have in a server's release (SGLang, vLLM).

Exit codes of ``aiter-patches drift``: 0 every target matches a pin, 1 some
target drifted or is missing, 2 the source cannot be read.

The modules, each one job: ``files`` (a directory's or an archive's files, every
read failure a :class:`SourceUnreadable`), ``modules`` (one parsed module's
bindings), ``tree`` (one package's source), ``sources`` (which source: AITER or a
server), ``resolve`` (a name to its ``def``), ``hashes`` (the source-hash pin,
also used at apply time), ``check`` (the report), ``render`` (its text),
``command`` (the sub-command).
"""

from .check import CHANGED, DRIFT, MATCH, MISSING, UNCHANGED, Report, SourceResult, TargetResult, check
from .command import add_parser, run_command
from .files import SourceUnreadable
from .hashes import live_source_reason, source_hash
from .render import render_propose, render_table
from .resolve import Definition, NotFound, resolve, signature_of
from .sources import open_server, open_source, server_packages
from .tree import SourceTree, assigned_version

__all__ = [
    "CHANGED", "DRIFT", "MATCH", "MISSING", "UNCHANGED", "Definition", "NotFound", "Report", "SourceResult",
    "SourceTree", "SourceUnreadable", "TargetResult", "add_parser", "assigned_version", "check",
    "live_source_reason", "open_server", "open_source", "render_propose", "render_table", "resolve",
    "run_command", "server_packages", "signature_of", "source_hash",
]
