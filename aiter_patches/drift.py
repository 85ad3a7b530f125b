"""Static drift check: do the pins still describe an AITER release, before a server finds out?

Every AITER release can move a parameter under a patch. This module reads
AITER's Python source as text (an unpacked tree, a wheel or sdist, or the
installed package's files) with ``ast``: nothing is imported, so it runs on any
CI machine without ROCm or a GPU. For each patch and target it finds the
function's ``def`` (following re-exports such as ``from aiter import f`` and
``from .ops.quant import *`` to the definition; for custom-op wrapped functions
the ``def`` carries the real parameters that ``inspect`` cannot see) and
compares its signature with the target's pins. Functions a patch relies on
without wrapping them are pinned by a source hash (:func:`source_hash`); a
changed hash is a warning: the patch still applies, but a maintainer must
re-read the logic it mirrors.

Exit codes of ``aiter-patches drift``: 0 every target matches a pin, 1 some
target drifted or is missing, 2 the source cannot be read.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import sys
import tarfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Sequence

from . import text_table
from .signatures import Pin, Signature, from_ast, match

MATCH, DRIFT, MISSING = "match", "drift", "missing"
UNCHANGED, CHANGED = "unchanged", "changed"


class SourceUnreadable(Exception):
    """The AITER source cannot be read; the message says why (exit code 2)."""


def source_hash(lines: Sequence[str]) -> str:
    """sha256 of a function's source: its lines (decorators included), each right-stripped, joined by "\\n"."""
    text = "\n".join(line.rstrip() for line in lines)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def live_source_reason(fn, pin) -> str | None:
    """The apply-time gate of a relied-on function: None when the live ``fn``'s source hashes to
    ``pin`` (a :class:`SourcePin`: its ``sha256`` or one of ``also``), else why not."""
    import inspect

    try:
        lines, _ = inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        return f"cannot read its source to check the relied-on hash: {exc}"
    found = source_hash(lines)
    if found != pin.sha256 and found not in pin.also:
        return f"source changed (hash {found[:12]} != pinned {pin.sha256[:12]}, {pin.source}): re-read it"
    return None


# ---------------------------------------------------------------- reading files


def assigned_version(tree: ast.Module) -> str | None:
    """The string a module assigns to ``__version__`` or ``version`` at its top level, if any."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets
        ):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(value, str):
                return value
    return None


class SourceTree:
    """The files of one AITER source, addressed by POSIX paths relative to the directory holding ``aiter/``."""

    def __init__(self, files: dict[str, str] | None, root: Path | None, description: str):
        self._files = files  # archive contents, or None to read from ``root``
        self._root = root
        self.description = description
        self._modules: dict[str, _Module | None] = {}
        if not self.exists("aiter/__init__.py"):
            raise SourceUnreadable(f"{description}: no aiter/__init__.py (not an AITER source)")

    def exists(self, rel: str) -> bool:
        if self._files is not None:
            return rel in self._files
        assert self._root is not None
        return (self._root / rel).is_file()

    def read(self, rel: str) -> str:
        try:
            if self._files is not None:
                return self._files[rel]
            assert self._root is not None
            return (self._root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, KeyError) as exc:
            raise SourceUnreadable(f"{self.description}: cannot read {rel}: {exc}") from None

    def version(self) -> str | None:
        """AITER's version as its ``aiter/_version.py`` spells it, without importing it."""
        if not self.exists("aiter/_version.py"):
            return None
        try:
            tree = ast.parse(self.read("aiter/_version.py"))
        except SyntaxError:
            return None
        return assigned_version(tree)

    def module(self, name: str) -> _Module | None:
        """The parsed module ``name`` (``aiter.fused_moe`` -> ``aiter/fused_moe.py`` or its package)."""
        if name not in self._modules:
            self._modules[name] = self._load(name)
        return self._modules[name]

    def _load(self, name: str) -> _Module | None:
        base = name.replace(".", "/")
        for rel, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            if self.exists(rel):
                text = self.read(rel)
                try:
                    tree = ast.parse(text, filename=rel)
                except SyntaxError as exc:
                    raise SourceUnreadable(f"{self.description}: {rel}:{exc.lineno}: {exc.msg}") from None
                return _Module(name, rel, is_package, text.splitlines(), tree)
        return None


def _archive_files(path: Path) -> dict[str, str]:
    """The ``aiter`` package's Python files inside a wheel/zip or an sdist tarball, keyed from ``aiter/``."""
    raw: dict[str, bytes] = {}
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                for n in zf.namelist():
                    if n.endswith(".py") and "/aiter/" in f"/{n}":
                        raw[n] = zf.read(n)
        elif tarfile.is_tarfile(path):
            with tarfile.open(path) as tf:
                for m in tf.getmembers():
                    if m.isfile() and m.name.endswith(".py") and "/aiter/" in f"/{m.name}":
                        f = tf.extractfile(m)
                        if f is not None:
                            raw[m.name] = f.read()
        else:
            raise SourceUnreadable(f"{path}: neither a wheel/zip nor a tar archive")
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise SourceUnreadable(f"{path}: {exc}") from None
    inits = sorted((n for n in raw if PurePosixPath(n).parts[-2:] == ("aiter", "__init__.py")), key=len)
    if not inits:
        raise SourceUnreadable(f"{path}: no aiter/__init__.py inside (not an AITER wheel or sdist)")
    prefix = inits[0][: -len("aiter/__init__.py")]
    files: dict[str, str] = {}
    for n, data in raw.items():
        if n.startswith(prefix + "aiter/"):
            try:
                files[n[len(prefix):]] = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SourceUnreadable(f"{path}: {n} is not UTF-8: {exc}") from None
    return files


def open_source(aiter_src: str | Path | None = None, wheel: str | Path | None = None) -> SourceTree:
    """The AITER source to check: a directory, a wheel/sdist file, or else the installed ``aiter``'s files.

    A directory may be a checkout (holding ``aiter/``) or the ``aiter`` package itself.
    """
    if wheel is not None:
        path = Path(wheel)
        if not path.is_file():
            raise SourceUnreadable(f"{path}: no such file")
        return SourceTree(_archive_files(path), None, f"wheel {path}")
    if aiter_src is not None:
        root = Path(aiter_src)
        if not root.is_dir():
            raise SourceUnreadable(f"{root}: not a directory")
        if not (root / "aiter" / "__init__.py").is_file() and root.name == "aiter":
            root = root.parent
        return SourceTree(None, root, f"source tree {root}")
    spec = importlib.util.find_spec("aiter")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SourceUnreadable("no 'aiter' package is installed; pass --aiter-src DIR or --wheel FILE")
    pkg = Path(list(spec.submodule_search_locations)[0])
    if not (pkg / "jit").is_dir():
        raise SourceUnreadable(
            f"the installed 'aiter' at {pkg} is not AMD's AITER (no aiter/jit/); PyPI's 'aiter' is an "
            "unrelated package: install amd-aiter or pass --aiter-src / --wheel"
        )
    return SourceTree(None, pkg.parent, f"installed aiter {pkg}")


# ---------------------------------------------------------------- resolving names


@dataclass(frozen=True)
class _Binding:
    kind: str  # "def", "import" (from X import name), "other"
    node: ast.AST
    fallback: bool  # bound in an ``except`` handler: used only when nothing else binds the name
    source_module: str | None = None  # for "import"
    source_name: str | None = None


class _Module:
    def __init__(self, name: str, path: str, is_package: bool, lines: list[str], tree: ast.Module):
        self.name = name
        self.path = path
        self.package = name if is_package else name.rpartition(".")[0]
        self.lines = lines
        self.bindings: dict[str, list[_Binding]] = {}
        self.star_imports: list[str] = []
        self.all_names: list[str] | None = None
        self.constants: dict[str, Any] = {}
        self._collect(tree.body, fallback=False, top=True)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package.split(".")
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))

    def _bind(self, name: str, binding: _Binding) -> None:
        self.bindings.setdefault(name, []).append(binding)

    def _collect(self, body: Iterable[ast.stmt], fallback: bool, top: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._bind(node.name, _Binding("def", node, fallback))
            elif isinstance(node, ast.ClassDef):
                self._bind(node.name, _Binding("other", node, fallback))
            elif isinstance(node, ast.ImportFrom):
                src = self._absolute(node)
                for alias in node.names:
                    if alias.name == "*":
                        self.star_imports.append(src)
                    else:
                        self._bind(alias.asname or alias.name, _Binding("import", node, fallback, src, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self._bind(alias.asname or alias.name.partition(".")[0], _Binding("other", node, fallback))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        self._bind(t.id, _Binding("other", node, fallback))
                        self._note_constant(t.id, node.value, top)
            elif isinstance(node, ast.If):
                self._collect(node.body, fallback, False)
                self._collect(node.orelse, fallback, False)
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                self._collect(node.body, fallback, False)
                self._collect(node.orelse, fallback, False)
                self._collect(node.finalbody, fallback, False)
                for handler in node.handlers:
                    self._collect(handler.body, True, False)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                self._collect(node.body, fallback, False)

    def _note_constant(self, name: str, value: ast.expr | None, top: bool) -> None:
        if value is None:
            return
        if name == "__all__" and top:
            try:
                self.all_names = [str(x) for x in ast.literal_eval(value)]
            except (ValueError, TypeError, SyntaxError):
                pass
            return
        if not top:
            return
        try:
            self.constants[name] = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self.constants.pop(name, None)

    def binding(self, name: str) -> _Binding | None:
        found = self.bindings.get(name, [])
        primary = [b for b in found if not b.fallback]
        chosen = primary or found
        return chosen[-1] if chosen else None

    def exports(self, name: str) -> bool:
        """Whether ``from <this module> import *`` could bind ``name``."""
        if self.all_names is not None:
            return name in self.all_names
        return not name.startswith("_")

    def segment(self, node: ast.AST) -> list[str]:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return self.lines[first - 1 : node.end_lineno]


@dataclass
class Definition:
    """Where a name resolved to: the ``def`` (or other binding) and the re-exports followed to it."""

    module: _Module
    node: ast.AST
    via: list[str]

    @property
    def location(self) -> str:
        return f"{self.module.path}:{self.node.lineno}"

    @property
    def is_function(self) -> bool:
        return isinstance(self.node, (ast.FunctionDef, ast.AsyncFunctionDef))


class _NotFound(Exception):
    pass


def resolve(tree: SourceTree, module: str, qualname: str) -> Definition:
    """Find what ``module.qualname`` is bound to, following re-exports to the definition.

    Raises ``_NotFound`` with the reason when the module or the name does not exist.
    """
    head, _, rest = qualname.partition(".")
    d = _resolve_name(tree, module, head, [], set())
    for part in rest.split(".") if rest else []:
        if not isinstance(d.node, ast.ClassDef):
            raise _NotFound(f"{module}.{qualname}: {head} is not a class")
        inner = [n for n in d.node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == part]
        if not inner:
            raise _NotFound(f"{module}.{qualname}: no {part} in class {d.node.name} ({d.location})")
        d = Definition(d.module, inner[-1], d.via)
    return d


def _resolve_name(tree: SourceTree, module: str, name: str, via: list[str], seen: set) -> Definition:
    key = (module, name)
    if key in seen:
        raise _NotFound(f"circular re-export of {name} through {module}")
    seen = seen | {key}
    mod = tree.module(module)
    if mod is None:
        where = module.replace(".", "/")
        raise _NotFound(f"module {module} not found ({where}.py or {where}/__init__.py)")
    b = mod.binding(name)
    if b is not None:
        if b.kind == "import":
            assert b.source_module is not None and b.source_name is not None
            step = f"{mod.path}:{b.node.lineno} from {b.source_module} import {b.source_name}"
            package = getattr(tree, "package", "aiter")  # a server's tree (integrations.server_drift) follows its own
            if b.source_module.split(".")[0] != package:
                raise _NotFound(f"{module}.{name} is imported from {b.source_module}, outside {package.upper() if package == 'aiter' else package} ({step})")
            return _resolve_name(tree, b.source_module, b.source_name, via + [step], seen)
        return Definition(mod, b.node, via)
    for star in reversed(mod.star_imports):  # the last star import that binds the name wins
        src = tree.module(star)
        if src is None or not src.exports(name):
            continue
        try:
            return _resolve_name(tree, star, name, via + [f"{mod.path} from {star} import *"], seen)
        except _NotFound:
            continue
    raise _NotFound(f"{name} is not defined in {mod.path}")


def signature_of(d: Definition) -> Signature:
    assert isinstance(d.node, (ast.FunctionDef, ast.AsyncFunctionDef))
    return from_ast(d.node, constants=d.module.constants)


# ---------------------------------------------------------------- the check


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


def _check_target(tree: SourceTree, patch: str, module: str, attr: str, pins: Sequence[Pin]) -> TargetResult:
    res = TargetResult(patch, f"{module}.{attr}", MISSING, [{"label": p.label, "text": p.text} for p in pins])
    try:
        d = resolve(tree, module, attr)
    except _NotFound as exc:
        res.reason = str(exc)
        return res
    res.defined_at, res.via = d.location, d.via
    if not d.is_function:
        res.status = DRIFT
        res.reason = f"bound to a {type(d.node).__name__} at {d.location}, not a def: no signature to read"
        return res
    sig = signature_of(d)
    res.found = str(sig)
    pin, differences = match(sig, pins)
    if pin is not None:
        res.status, res.pin = MATCH, pin.label
    else:
        res.status, res.differences = DRIFT, differences
        res.reason = "; ".join(differences)
    return res


def _check_source(tree: SourceTree, patch: str, sp: Any) -> SourceResult:
    res = SourceResult(patch, sp.module, sp.qualname, MISSING, sp.why, sp.sha256)
    try:
        d = resolve(tree, sp.module, sp.qualname)
    except _NotFound as exc:
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


def _in_aiter(module: str) -> bool:
    """Targets of a server's code (the SGLang take-over) are checked against that server's source, not AITER's."""
    return module == "aiter" or module.startswith("aiter.")


def check(tree: SourceTree, patch_list: Sequence[Any] | None = None) -> Report:
    """Compare every target of every patch (default: the registered ones) with ``tree``."""
    if patch_list is None:
        from .registry import patches

        patch_list = patches()
    targets = [
        _check_target(tree, p.name, t.module, t.attr, t.pins) for p in patch_list for t in p.targets
        if _in_aiter(t.module)
    ]
    relied = [_check_source(tree, p.name, sp) for p in patch_list for sp in p.relies_on if _in_aiter(sp.module)]
    return Report(tree.description, tree.version(), targets, relied)


# ---------------------------------------------------------------- output


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    return text_table.lines(header, rows)


def _short(t: TargetResult, width: int = 100) -> str:
    text = t.reason
    if t.differences:
        prefix = t.differences[0].split(": ", 1)[0] + ": "
        if all(d.startswith(prefix) for d in t.differences):
            text = prefix + "; ".join(d[len(prefix):] for d in t.differences)
    if len(text) <= width:
        return text
    return text[: width - 30].rstrip() + f"... ({len(t.differences)} differences, below)"


def render_table(report: Report) -> str:
    out = [f"{report.library}: {report.source}" + (f" (version {report.version})" if report.version else ""), ""]
    rows = []
    for t in report.targets:
        rows.append([t.patch, t.target, t.status, f"pin {t.pin}" if t.status == MATCH else _short(t)])
    out += _table(rows, ["patch", "target", "status", "detail"])
    out += ["", "Signatures:"]
    seen: set[str] = set()
    for t in report.targets:
        if t.target in seen:
            continue
        seen.add(t.target)
        where = f" at {t.defined_at}" if t.defined_at else ""
        out.append(f"  {t.target}: {t.status}{where}")
        for v in t.via:
            out.append(f"    via    {v}")
        for p in t.pins:
            mark = "=" if p["label"] == t.pin else " "
            out.append(f"    pin {mark} {p['label']}: {p['text']}")
        out.append(f"    found    {t.found if t.found is not None else '-'}")
        out += [f"    diff     {d}" for d in t.differences]
    if report.relied_on:
        out += ["", "Relied-on source (sha256 of the function's source):"]
        rows = [
            [r.patch, f"{r.module}.{r.qualname}", r.status, r.reason or (r.defined_at or "")]
            for r in report.relied_on
        ]
        out += ["  " + line for line in _table(rows, ["patch", "function", "status", "detail"])]
    for w in report.warnings:
        out.append(f"WARNING: {w}")
    verdict = "every target matches a pin" if report.exit_code == 0 else "DRIFT: some targets do not match"
    out += ["", verdict]
    return "\n".join(out)


def render_propose(report: Report, label: str) -> str:
    """The found signatures and source hashes in pin syntax, to review and paste into pins.py / relied_on.py."""
    out = [f"# Found in {report.source}; review each against the patch before pasting."]
    seen: set[str] = set()
    for t in report.targets:
        if t.target in seen:
            continue
        seen.add(t.target)
        if t.found is None:
            out.append(f"# {t.target}: {t.status}: {t.reason}")
            continue
        note = f"matches pin {t.pin}" if t.pin else "drift"
        out.append(f"# {t.target} ({note})")
        out.append(f"Pin({label!r}, {t.found!r}, {f'ROCm/aiter {label} {t.defined_at}'!r}),")
    for r in report.relied_on:
        if r.found_sha256 is None:
            out.append(f"# {r.module}.{r.qualname}: missing: {r.reason}")
            continue
        out.append(f"# {r.module}.{r.qualname} ({r.status}, relied on by {r.patch})")
        out.append(
            f"SourcePin({r.module!r}, {r.qualname!r}, {r.found_sha256!r}, {r.why!r}, "
            f"{f'ROCm/aiter {label} {r.defined_at}'!r}),"
        )
    return "\n".join(out)


# ---------------------------------------------------------------- command line


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "drift",
        help="check the pins against an AITER source statically (no import, no ROCm)",
        description="Exit 0: every target matches a pin; 1: drift or missing; 2: the source cannot be read.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--aiter-src", metavar="DIR", help="an AITER checkout (holding aiter/) or the aiter package")
    src.add_argument("--wheel", metavar="FILE", help="an AITER wheel or sdist file")
    src.add_argument("--server", metavar="PATH",
                     help="instead: the server integrations' targets in an SGLang/vLLM wheel, sdist or source directory")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("--propose", action="store_true", help="print the found signatures in pin syntax")
    p.add_argument("--label", default=None, help="pin label for --propose (default: the source's version)")
    p.set_defaults(func=run_command)
    return p


def run_command(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "server", None):
            from .integrations import server_drift

            tree = server_drift.open_server(args.server)
            report = server_drift.check(tree)
        else:
            tree = open_source(args.aiter_src, args.wheel)
            report = check(tree)
    except SourceUnreadable as exc:
        if args.json:
            print(json.dumps({"error": str(exc), "exit_code": 2}, indent=2))
        else:
            print(f"aiter-patches drift: cannot read AITER source: {exc}", file=sys.stderr)
        return 2
    if args.propose:
        print(render_propose(report, args.label or report.version or "LABEL"))
    elif args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(render_table(report))
    return report.exit_code
