"""The registry: the only code that changes AITER's namespaces.

A patch is declared (its targets, the signatures it accepts, a wrapper factory);
the registry performs it: all or nothing per patch, only when every target's
signature matches a pin, at once or the moment AITER's module is imported, on
every module-level alias of the original, chained with other patches on the
same target in declared order, idempotent, thread-safe, and exactly revertible.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from . import foreign_layers, runtime
from .runtime import PatchCounters
from .signatures import Binder, Pin, SignatureUnavailable, from_callable, match

log = logging.getLogger("aiter_patches")

APPLIED, SKIPPED, PENDING, DISABLED, INACTIVE = "applied", "skipped", "pending", "disabled", "inactive"


class PatchSkipped(RuntimeError):
    """Raised in strict mode when a patch cannot be applied; the message says why."""


@dataclass(frozen=True)
class SourcePin:
    """A function a patch relies on without wrapping it: its source hash is watched by the drift check."""

    module: str
    qualname: str
    sha256: str  # of the function's source text with trailing whitespace stripped per line
    why: str
    source: str = ""
    also: tuple[str, ...] = ()  # hashes of other releases whose change was read and found irrelevant


@dataclass(frozen=True)
class Target:
    module: str
    attr: str
    pins: tuple[Pin, ...]
    wrap: Callable[[Callable, "Site"], Callable]
    why: str = ""

    @property
    def location(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass(frozen=True)
class Patch:
    name: str
    summary: str
    targets: tuple[Target, ...]
    kernel_module: str | None = None
    order: int = 50  # among patches on one target: lower is outer (asked first)
    relies_on: tuple[SourcePin, ...] = ()
    check: str | None = None  # "module:function" of the equivalence check `aiter-patches verify` runs
    # a patch of a server's code: stays inactive (not pending) where that top-level package is not installed
    requires: str | None = None
    # a further gate after a target's pin matched (e.g. a source hash): a reason skips the patch
    precheck: Callable[[Target, Callable], str | None] | None = None


@dataclass
class Site:
    """What a wrapper factory gets: which pin matched, a binder for it, and the patch's counters."""

    patch: Patch
    target: Target
    pin: Pin
    binder: Binder
    counters: PatchCounters


@dataclass
class _Layer:
    patch: Patch
    target: Target
    site: Site


@dataclass
class _Chain:
    module: str
    attr: str
    original: Callable
    layers: list[_Layer] = field(default_factory=list)
    current: Callable | None = None
    locations: set[tuple[str, str]] = field(default_factory=set)


@dataclass
class _State:
    state: str = INACTIVE
    reason: str = ""
    targets: list[dict[str, Any]] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)


_lock = threading.RLock()
_patches: dict[str, Patch] = {}
_states: dict[str, _State] = {}
_counters: dict[str, PatchCounters] = {}
_chains: dict[tuple[str, str], _Chain] = {}
_builtins_loaded = False


# ---------------------------------------------------------------- declaration

def register(patch: Patch) -> Patch:
    """Declare a patch. Re-registering the same name replaces an inactive declaration."""
    with _lock:
        old = _states.get(patch.name)
        if old is not None and old.state in (APPLIED, PENDING):
            raise ValueError(f"patch '{patch.name}' is {old.state}; revert it before re-registering")
        _patches[patch.name] = patch
        _states[patch.name] = _State()
        _counters.setdefault(patch.name, PatchCounters(patch.name))
    return patch


def unregister(name: str) -> None:
    with _lock:
        if name in _states and _states[name].state in (APPLIED, PENDING):
            _revert_one(name)
        _patches.pop(name, None)
        _states.pop(name, None)
        _counters.pop(name, None)


def _ensure_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    from .patches import BUILTIN_PATCHES  # imports nothing of AITER

    with _lock:
        if _builtins_loaded:
            return
        for p in BUILTIN_PATCHES:
            if p.name not in _patches:
                register(p)
        _builtins_loaded = True


def patches() -> list[Patch]:
    _ensure_builtins()
    with _lock:
        return sorted(_patches.values(), key=lambda p: (p.order, p.name))


# ---------------------------------------------------------------- environment

def _env_flag_off(value: str) -> bool:
    return value.strip().lower() in ("0", "false", "no", "off")


def _env_disabled(known: Sequence[str]) -> tuple[set[str], str]:
    """Names disabled by the environment, and the reason text; raises on unknown names."""
    if _env_flag_off(os.environ.get("AITER_PATCHES", "1")):
        return set(known), "AITER_PATCHES=0"
    raw = os.environ.get("AITER_PATCHES_DISABLE", "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(
            f"AITER_PATCHES_DISABLE names unknown patch(es) {', '.join(unknown)}; "
            f"known patches: {', '.join(known)}"
        )
    return names, "AITER_PATCHES_DISABLE"


def _check_names(names: Iterable[str] | None, known: Sequence[str], what: str) -> list[str]:
    if names is None:
        return list(known)
    if isinstance(names, str):
        names = [names]
    names = list(names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{what}: unknown patch(es) {', '.join(unknown)}; known patches: {', '.join(known)}")
    return names


# ---------------------------------------------------------------- apply

class ApplyReport(dict):
    """``{patch name: status record}`` for the patches an ``apply()`` call was about."""

    def _names(self, state: str) -> list[str]:
        return [n for n, r in self.items() if r["state"] == state]

    @property
    def applied(self) -> list[str]:
        return self._names(APPLIED)

    @property
    def skipped(self) -> list[str]:
        return self._names(SKIPPED)

    @property
    def pending(self) -> list[str]:
        return self._names(PENDING)

    @property
    def disabled(self) -> list[str]:
        return self._names(DISABLED)


def apply(names: Iterable[str] | None = None, *, strict: bool | None = None) -> ApplyReport:
    """Apply patches (all by default) now, or when AITER's modules get imported.

    Returns the status record of each requested patch. Unknown names, in
    ``names`` or in ``AITER_PATCHES_DISABLE``, raise ``ValueError``.
    """
    all_patches = patches()
    known = [p.name for p in all_patches]
    requested = _check_names(names, known, "apply()")
    disabled, why = _env_disabled(known)
    if strict is not None:
        runtime.set_strict(strict)
    with _lock:
        for p in all_patches:
            if p.name not in requested:
                continue
            st = _states[p.name]
            if p.name in disabled:
                if st.state in (APPLIED, PENDING):
                    _revert_one(p.name)
                st.state, st.reason = DISABLED, f"disabled by {why}"
                continue
            if st.state in (APPLIED, PENDING):
                continue  # idempotent: nothing stacks
            _apply_or_defer(p)
        report = ApplyReport((n, _record(n)) for n in known if n in requested)
    from .process_report import log_if_changed

    log_if_changed()
    return report


def _apply_or_defer(p: Patch) -> None:
    if p.requires is not None and not _installed(p.requires):
        st = _states[p.name]
        st.state, st.reason, st.targets = INACTIVE, f"{p.requires} is not installed", []
        return
    missing = [m for m in _target_modules(p) if m not in sys.modules]
    if not missing:
        _try_apply(p)
        return
    st = _states[p.name]
    st.state, st.reason = PENDING, f"waiting for import of {', '.join(missing)}"
    st.targets = []
    import wrapt

    for mod in missing:
        hook = _Hook(p.name)
        st.hooks.append((mod, hook))
        wrapt.register_post_import_hook(hook, mod)


def _installed(package: str) -> bool:
    if package in sys.modules:
        return True
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


class _Hook:
    """A post-import hook that applies one patch once all its modules are imported; inert once cancelled."""

    def __init__(self, name: str):
        self.name = name
        self.active = True

    def __call__(self, module: Any) -> None:
        if not self.active:
            return
        with _lock:
            if not self.active:
                return
            st = _states.get(self.name)
            p = _patches.get(self.name)
            if st is None or p is None or st.state != PENDING:
                return
            missing = [m for m in _target_modules(p) if m not in sys.modules]
            if missing:
                st.reason = f"waiting for import of {', '.join(missing)}"
                return
            _cancel_hooks(st)
            _try_apply(p)
            from .process_report import log_if_changed

            log_if_changed()


def _cancel_hooks(st: _State) -> None:
    try:
        import wrapt.importer as wi
    except ImportError:  # pragma: no cover
        wi = None
    for mod, hook in st.hooks:
        hook.active = False
        if wi is not None:
            try:
                with wi._post_import_hooks_lock:
                    lst = wi._post_import_hooks.get(mod)
                    if lst and hook in lst:
                        lst.remove(hook)
            except AttributeError:  # private API moved: the hook is inert anyway
                pass
    st.hooks = []


def _target_modules(p: Patch) -> list[str]:
    seen: list[str] = []
    for t in p.targets:
        if t.module not in seen:
            seen.append(t.module)
    return seen


_MISSING = object()


def _try_apply(p: Patch) -> None:
    """All or nothing: check every target, then install every layer."""
    st = _states[p.name]
    found: list[tuple[Target, Callable, Pin]] = []
    records: list[dict[str, Any]] = []
    problem: str | None = None
    for t in p.targets:
        mod = sys.modules.get(t.module)
        obj = getattr(mod, t.attr, _MISSING) if mod is not None else _MISSING
        chain = _chains.get((t.module, t.attr))
        original = chain.original if chain is not None else obj
        rec: dict[str, Any] = {"location": t.location, "signature": None, "pin": None, "aliases": []}
        records.append(rec)
        if original is _MISSING:
            problem = f"{t.location} is missing"
            break
        if not callable(original):
            problem = f"{t.location} is not callable ({type(original).__name__})"
            break
        try:
            sig = from_callable(original)
        except SignatureUnavailable as exc:
            problem = f"{t.location}: cannot read its signature: {exc}"
            break
        rec["signature"] = str(sig)
        pin, differences = match(sig, t.pins)
        if pin is None:
            accepted = ", ".join(x.label for x in t.pins)
            problem = f"{t.location} signature drifted ({'; '.join(differences)}); accepted pins: {accepted}"
            break
        rec["pin"] = pin.label
        if p.precheck is not None:
            try:
                problem = p.precheck(t, original)
            except Exception as exc:  # a gate that cannot decide does not apply the patch
                problem = f"its precheck raised {type(exc).__name__}: {exc}"
            if problem is not None:
                problem = f"{t.location}: {problem}"
                break
        found.append((t, original, pin))
    if problem is not None:
        st.state, st.reason, st.targets = SKIPPED, problem, records
        log.warning("aiter_patches: skipped patch '%s': %s", p.name, problem)
        if runtime.strict():
            raise PatchSkipped(f"patch '{p.name}' skipped: {problem}")
        return
    counters = _counters[p.name]
    for (t, original, pin), rec in zip(found, records):
        site = Site(p, t, pin, Binder(pin.signature), counters)
        chain = _chains.get((t.module, t.attr))
        if chain is None:
            chain = _chains[(t.module, t.attr)] = _Chain(t.module, t.attr, original)
        chain.layers.append(_Layer(p, t, site))
        _rebuild(chain)
        rec["aliases"] = sorted(f"{m}.{a}" for m, a in chain.locations if (m, a) != (t.module, t.attr))
    st.state, st.reason, st.targets = APPLIED, "", records
    pins = ", ".join(f"{r['location']} @ {r['pin']}" for r in records)
    log.info("aiter_patches: applied '%s' (%s) to %s", p.name, p.summary, pins)


# ---------------------------------------------------------------- chains and aliases

def _rebuild(chain: _Chain) -> None:
    """Rebuild the wrapper chain from the original in declared order and rebind every alias."""
    fn = chain.original
    for layer in sorted(chain.layers, key=lambda l: (l.patch.order, l.patch.name), reverse=True):
        wrapped = layer.target.wrap(fn, layer.site)
        _mark(wrapped, layer.patch.name, fn)
        fn = wrapped
    old = {id(chain.original)}
    if chain.current is not None:
        old.add(id(chain.current))
    new = fn if chain.layers else chain.original
    chain.locations |= _rebind(old, new, chain)
    chain.current = None if not chain.layers else new
    if not chain.layers:
        _chains.pop((chain.module, chain.attr), None)


def _mark(wrapper: Callable, patch_name: str, inner: Callable) -> None:
    try:
        wrapper.__aiter_patches__ = patch_name  # type: ignore[attr-defined]
        if not hasattr(wrapper, "__wrapped__"):
            wrapper.__wrapped__ = inner  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass


def _rebind(old_ids: set[int], new: Callable, chain: _Chain) -> set[tuple[str, str]]:
    """Point every module-level binding of an old object (original or previous chain) at ``new``."""
    changed: set[tuple[str, str]] = set()
    home = sys.modules.get(chain.module)
    if home is not None:
        setattr(home, chain.attr, new)
        changed.add((chain.module, chain.attr))
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name.startswith("aiter_patches.") and not mod_name.startswith("aiter_patches.stub_aiter"):
            continue
        try:
            d = vars(mod)
        except TypeError:
            continue
        try:
            items = [(k, v) for k, v in list(d.items()) if id(v) in old_ids]
        except RuntimeError:  # dict changed size under a concurrent import
            continue
        for k, v in items:
            if d.get(k) is v:
                d[k] = new
                changed.add((mod_name, k))
    return changed


# ---------------------------------------------------------------- revert

def revert(names: Iterable[str] | None = None) -> list[str]:
    """Take patches off (all by default), in reverse of declared order; cancel pending hooks.

    Every binding the registry changed gets its exact original object back.
    Returns the names that were reverted.
    """
    all_patches = patches()
    known = [p.name for p in all_patches]
    requested = _check_names(names, known, "revert()")
    done: list[str] = []
    with _lock:
        for p in reversed(all_patches):
            if p.name in requested and _states[p.name].state in (APPLIED, PENDING):
                _revert_one(p.name)
                done.append(p.name)
    return done


def _revert_one(name: str) -> None:
    st = _states[name]
    _cancel_hooks(st)
    if st.state == APPLIED:
        for key, chain in list(_chains.items()):
            before = len(chain.layers)
            chain.layers = [l for l in chain.layers if l.patch.name != name]
            if len(chain.layers) == before:
                continue
            home = sys.modules.get(chain.module)
            if home is not None and getattr(home, chain.attr, None) is not chain.current:
                log.warning(
                    "aiter_patches: %s.%s was rebound by someone else after aiter_patches; "
                    "restoring the locations aiter_patches changed only", chain.module, chain.attr,
                )
            _restore_or_rebuild(chain)
        log.info("aiter_patches: reverted '%s'", name)
    st.state, st.reason, st.targets = INACTIVE, "reverted", []


def _restore_or_rebuild(chain: _Chain) -> None:
    if chain.layers:
        _rebuild(chain)
        return
    for mod_name, attr in chain.locations:
        mod = sys.modules.get(mod_name)
        if mod is None:
            continue
        if getattr(mod, attr, None) is chain.current:
            setattr(mod, attr, chain.original)
    # modules imported after apply() that copied the wrapper get the original too
    if chain.current is not None:
        _rebind({id(chain.current)}, chain.original, chain)
    _chains.pop((chain.module, chain.attr), None)


# ---------------------------------------------------------------- reporting

def _aiter_info() -> dict[str, Any]:
    mod = sys.modules.get("aiter")
    info: dict[str, Any] = {"imported": mod is not None, "version": None, "location": None}
    if mod is not None:
        info["version"] = getattr(mod, "__version__", None)
        info["location"] = os.path.dirname(getattr(mod, "__file__", "") or "") or None
        info["stand_in"] = bool(getattr(mod, "IS_AITER_PATCHES_STAND_IN", False))
    if info["version"] is None:
        try:
            from importlib.metadata import PackageNotFoundError, version

            info["version"] = version("amd-aiter")
        except (PackageNotFoundError, ValueError):
            pass
    return info


def _record(name: str) -> dict[str, Any]:
    p, st = _patches[name], _states[name]
    return {
        "name": name,
        "summary": p.summary,
        "state": st.state,
        "reason": st.reason,
        "kernel_module": p.kernel_module,
        "order": p.order,
        "targets": [dict(t) for t in st.targets]
        or [{"location": t.location, "signature": None, "pin": None, "aliases": []} for t in p.targets],
        "pins": {t.location: [pin.label for pin in t.pins] for t in p.targets},
        "foreign_layers": foreign_layers.records(name) if st.state == APPLIED else [],
    }


def status() -> dict[str, Any]:
    """Machine-readable state of every registered patch, and which AITER is loaded."""
    all_patches = patches()
    with _lock:
        return {
            "aiter": _aiter_info(),
            "strict": runtime.strict(),
            "patches": [_record(p.name) for p in all_patches],
        }


def state(name: str) -> str:
    """One patch's state (applied, skipped, pending, disabled, inactive): cheap enough for a call path."""
    patches()
    return _states[name].state


def stats() -> dict[str, dict[str, Any]]:
    """Per patch: fast-path hits, fallbacks by reason, fast-path errors. Host counters only."""
    patches()
    with _lock:
        out = {name: c.snapshot() for name, c in _counters.items()}
        for name, snap in out.items():  # the key appears only when a foreign layer is seen
            if _states[name].state == APPLIED and (layers := foreign_layers.records(name)):
                snap["foreign_layers"] = [layer["text"] for layer in layers]
        return out


def reset_stats() -> None:
    with _lock:
        for c in _counters.values():
            c.reset()


def counters(name: str) -> PatchCounters:
    patches()
    return _counters[name]


def unwrap_foreign(module: str, attr: str, is_layer: Callable[[Any], bool]) -> list[str]:
    """Take foreign wrappers that sit directly over our chain off its bindings, by identity only.

    A binding is restored to our outermost wrapper only when it holds a Python
    function ``is_layer`` accepts whose ``__wrapped__`` is exactly that wrapper.
    Returns the locations restored.
    """
    with _lock:
        chain = _chains.get((module, attr))
        if chain is None or chain.current is None:
            return []
        restored = []
        for mod_name, mod in list(sys.modules.items()):
            try:
                d = vars(mod)
                names = [attr] if mod_name == module else list(d)
            except (TypeError, RuntimeError):
                continue
            for k in names:
                v = d.get(k)
                if not isinstance(v, types.FunctionType) or v is chain.current or not is_layer(v):
                    continue
                if getattr(v, "__wrapped__", None) is chain.current:
                    d[k] = chain.current
                    chain.locations.add((mod_name, k))
                    restored.append(f"{mod_name}.{k}")
        return sorted(restored)
