"""The check: every target of every patch against its pins, every relied-on function against its source hash.

Why the patches come from the registry: a new patch (or server integration) is
checked the moment it is declared, with nothing to list here; which of them a
source answers for follows from the source's package (AITER's targets against an
AITER source, SGLang's against an SGLang source), so one check serves ``drift``
and ``drift --server``. A drifted or missing target is exit 1; a changed relied-on
source is a warning only (the patch still applies; a maintainer must re-read the
logic it mirrors).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence, TypeVar

from ..signatures import Pin, match
from .files import SourceUnreadable
from .hashes import source_hash
from .resolve import NotFound, resolve, signature_of
from .tree import SourceTree

MATCH, DRIFT, MISSING = "match", "drift", "missing"
UNCHANGED, CHANGED = "unchanged", "changed"

T = TypeVar("T")


@dataclass
class TargetResult:
    patch: str
    target: str  # module.attr
    status: str  # match | drift | missing
    pins: list[dict[str, str]]  # label, text
    found: str | None = None
    pin: str | None = None
    differences: list[str] = field(default_factory=list)
    reason: str = ""
    defined_at: str | None = None
    via: list[str] = field(default_factory=list)


@dataclass
class SourceResult:
    patch: str
    module: str
    qualname: str
    status: str  # unchanged | changed | missing
    why: str
    expected_sha256: str
    found_sha256: str | None = None
    defined_at: str | None = None
    reason: str = ""


@dataclass
class Report:
    source: str
    version: str | None
    targets: list[TargetResult]
    relied_on: list[SourceResult]
    library: str = "AITER"  # what was read: AITER, or a server package (`drift --server`)

    @property
    def exit_code(self) -> int:
        return 0 if all(t.status == MATCH for t in self.targets) else 1

    @property
    def warnings(self) -> list[str]:
        """One line per relied-on function whose source changed or is gone."""
        by_function: dict[tuple[str, str], list[SourceResult]] = {}
        for r in self.relied_on:
            if r.status != UNCHANGED:
                by_function.setdefault((r.module, r.qualname), []).append(r)
        return [
            f"{m}.{q} {rs[0].status} (relied on by {', '.join(r.patch for r in rs)}): {rs[0].reason}"
            for (m, q), rs in by_function.items()
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "aiter": {"source": self.source, "version": self.version},
            "exit_code": self.exit_code,
            "targets": [asdict(t) for t in self.targets],
            "relied_on": [asdict(r) for r in self.relied_on],
            "warnings": self.warnings,
        }


def _readable(tree: SourceTree, what: str, read: Callable[[], T]) -> T:
    """``read()``; a hostile source that defeats the reader (nesting past the recursion limit, a literal
    too large to print) is unreadable, not a traceback."""
    try:
        return read()
    except RecursionError:
        raise SourceUnreadable(f"{tree.description}: {what}: nested too deeply to read (RecursionError)") from None
    except (MemoryError, ValueError, OverflowError) as exc:
        raise SourceUnreadable(f"{tree.description}: {what}: cannot read it: {type(exc).__name__}: {exc}") from None


def check_target(tree: SourceTree, patch: str, module: str, attr: str, pins: Sequence[Pin]) -> TargetResult:
    res = TargetResult(patch, f"{module}.{attr}", MISSING, [{"label": p.label, "text": p.text} for p in pins])
    try:
        d = _readable(tree, res.target, lambda: resolve(tree, module, attr))
    except NotFound as exc:
        res.reason = str(exc)
        return res
    res.defined_at, res.via = d.location, d.via
    if not d.is_function:
        res.status = DRIFT
        res.reason = f"bound to a {type(d.node).__name__} at {d.location}, not a def: no signature to read"
        return res
    sig = _readable(tree, d.location, lambda: signature_of(d))
    res.found = str(sig)
    pin, differences = match(sig, pins)
    if pin is not None:
        res.status, res.pin = MATCH, pin.label
    else:
        res.status, res.differences = DRIFT, differences
        res.reason = "; ".join(differences)
    return res


def check_source(tree: SourceTree, patch: str, sp: Any) -> SourceResult:
    res = SourceResult(patch, sp.module, sp.qualname, MISSING, sp.why, sp.sha256)
    try:
        d = _readable(tree, f"{sp.module}.{sp.qualname}", lambda: resolve(tree, sp.module, sp.qualname))
    except NotFound as exc:
        res.reason = str(exc)
        return res
    res.defined_at = d.location
    res.found_sha256 = source_hash(d.module.segment(d.node))
    if res.found_sha256 == sp.sha256 or res.found_sha256 in getattr(sp, "also", ()):
        res.status = UNCHANGED
    else:
        res.status = CHANGED
        res.reason = f"source hash {res.found_sha256[:12]} != pinned {sp.sha256[:12]} ({d.location}): re-read it"
    return res


def in_package(module: str, package: str) -> bool:
    """Whether ``module`` belongs to ``package`` (a server's targets are checked against that server's source)."""
    return module == package or module.startswith(package + ".")


def check(tree: SourceTree, patch_list: Sequence[Any] | None = None) -> Report:
    """Compare every target of every patch (default: the registered ones) that lives in ``tree``'s package."""
    if patch_list is None:
        from ..registry import patches

        patch_list = patches()
    targets = [check_target(tree, p.name, t.module, t.attr, t.pins)
               for p in patch_list for t in p.targets if in_package(t.module, tree.package)]
    relied = [check_source(tree, p.name, sp)
              for p in patch_list for sp in p.relies_on if in_package(sp.module, tree.package)]
    return Report(tree.description, tree.version(), targets, relied, library=tree.library)
